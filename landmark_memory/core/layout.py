"""The landmark layout of token sequences: where landmarks sit, how to insert, strip and
shift targets around them (used by the tokenizer side, the models and the kernels alike).

A landmarked sequence is ``block_size`` normal tokens, one landmark, ``block_size`` normal
tokens, one landmark, ...; a trailing incomplete block has no landmark. Position ``j`` is a
landmark exactly when ``j % (block_size + 1) == block_size``.
"""

import torch

IGNORE_INDEX = -100  # target value that carries no loss (torch's cross-entropy default)


def check_block_size(block_size: int) -> None:
    """Raise a clear error unless ``block_size`` is a positive int."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def landmarked_length(n_normal: int, block_size: int) -> int:
    """Length of the sequence after inserting landmarks into ``n_normal`` normal tokens."""
    check_block_size(block_size)
    return n_normal + n_normal // block_size


def landmark_mask(length: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(length,) bool: True at the landmark positions of a landmarked sequence."""
    check_block_size(block_size)
    return torch.arange(length, device=device) % (block_size + 1) == block_size


def normal_positions(n_normal: int, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(n_normal,) int64: where the normal tokens sit in the landmarked sequence."""
    check_block_size(block_size)
    j = torch.arange(n_normal, device=device)
    return j + j // block_size


def insert_landmarks(idx: torch.Tensor, block_size: int, landmark_id: int) -> torch.Tensor:
    """Insert ``landmark_id`` after every ``block_size`` normal tokens.

    Parameters
    ----------
    idx : LongTensor (..., T) of normal token ids.

    Returns
    -------
    LongTensor (..., T + T // block_size).
    """
    T = idx.shape[-1]
    out = idx.new_full((*idx.shape[:-1], landmarked_length(T, block_size)), landmark_id)
    out[..., normal_positions(T, block_size, idx.device)] = idx
    return out


def strip_landmarks(x: torch.Tensor, block_size: int, dim: int = -1) -> torch.Tensor:
    """The normal-token entries of ``x`` along ``dim`` (token ids, logits, hidden states...),
    where ``x`` is laid out as a landmarked sequence along that dimension."""
    n = x.shape[dim]
    keep = ~landmark_mask(n, block_size, x.device)
    return x.index_select(dim, keep.nonzero().squeeze(1))


def lm_targets(x: torch.Tensor, block_size: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets for a landmarked sequence.

    The target of a normal token is the next *normal* token (a target that would fall on a
    landmark moves to the token after it); landmark positions, and the last normal token,
    get ``ignore_index``.

    Parameters
    ----------
    x : LongTensor (..., T') landmarked token ids.

    Returns
    -------
    LongTensor (..., T').
    """
    pos = (~landmark_mask(x.shape[-1], block_size, x.device)).nonzero().squeeze(1)
    y = torch.full_like(x, ignore_index)
    y[..., pos[:-1]] = x[..., pos[1:]]
    return y
