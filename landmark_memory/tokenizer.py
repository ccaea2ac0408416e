"""The shipped byte-level BPE tokenizer and the landmark layout of token sequences.

A landmarked sequence is ``block_size`` normal tokens, one landmark, ``block_size`` normal
tokens, one landmark, ...; a trailing incomplete block has no landmark. Position ``j`` is a
landmark exactly when ``j % (block_size + 1) == block_size``.
"""

from pathlib import Path

import torch

TOKENIZER_PATH = Path(__file__).parent / "assets" / "tokenizer.json"

EOS_TOKEN = "<|endoftext|>"
LANDMARK_TOKEN = "<|landmark|>"
CONTEXT_MISS_TOKEN = "<|context_miss|>"  # reserved for the Context Miss Token (paper appendix D)
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, LANDMARK_TOKEN, CONTEXT_MISS_TOKEN, PAD_TOKEN]

IGNORE_INDEX = -100  # target value that carries no loss (torch's cross-entropy default)


def load_tokenizer(path=None):
    """The byte-level BPE tokenizer shipped with the package (a ``tokenizers.Tokenizer``).

    Its special tokens are ``SPECIAL_TOKENS``; ``tok.token_to_id(LANDMARK_TOKEN)`` is the
    landmark id. ``path`` loads another tokenizer file of the same kind instead."""
    from tokenizers import Tokenizer

    path = Path(path) if path is not None else TOKENIZER_PATH
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} is missing; train one with experiments/train_tokenizer.py")
    tok = Tokenizer.from_file(str(path))
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer {path} lacks the special tokens {missing}; retrain it with experiments/train_tokenizer.py")
    return tok


def check_block_size(block_size):
    """Raise a clear error unless ``block_size`` is a positive int."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def landmarked_length(n_normal, block_size):
    """Length of the sequence after inserting landmarks into ``n_normal`` normal tokens."""
    check_block_size(block_size)
    return n_normal + n_normal // block_size


def landmark_mask(length, block_size, device=None):
    """(length,) bool: True at the landmark positions of a landmarked sequence."""
    check_block_size(block_size)
    return torch.arange(length, device=device) % (block_size + 1) == block_size


def normal_positions(n_normal, block_size, device=None):
    """(n_normal,) int64: where the normal tokens sit in the landmarked sequence."""
    check_block_size(block_size)
    j = torch.arange(n_normal, device=device)
    return j + j // block_size


def insert_landmarks(idx, block_size, landmark_id):
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


def strip_landmarks(x, block_size, dim=-1):
    """The normal-token entries of ``x`` along ``dim`` (token ids, logits, hidden states...),
    where ``x`` is laid out as a landmarked sequence along that dimension."""
    n = x.shape[dim]
    keep = ~landmark_mask(n, block_size, x.device)
    return x.index_select(dim, keep.nonzero().squeeze(1))


def lm_targets(x, block_size, ignore_index=IGNORE_INDEX):
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
