"""The question reader: which memory blocks a question's own tokens point at, by retrieval
queries of the memory layers against the blocks' landmark keys (``uses/answer.py`` asks
through it; ``experiments/exp_reader.py`` measures and trains it).

A query head of layer ``l`` searches with its own query plus a low-rank correction of the
layer's input, ``q + B_l A_l rms(h)`` (a LoRA on the query projection that only retrieval
sees: what the model attends with, and so its language, are untouched; rank 0: none). Each
(layer, key/value head) attends over the blocks by the landmark scores of the question's
tokens (a softmax over the blocks, averaged over the tokens and the head's query heads, as at
stingy's slot 0: the same distance for every block), and the blocks are ranked by the heads'
attention mixed by the weights ``mix``, less the same of the chat template's own tokens around
the question by the model's own queries (a content-free prompt read in the same forward: the
calibration of QRHead and ICR, arXiv 2506.09944 and 2410.02642), so that blocks every prompt
attends to (a book's front matter) do not win by it.

A blended reader (``blend`` > 0) also ranks the blocks by fixed weights ``heads`` of the heads'
attention by the model's own queries, and mixes the two rankings, each standardised over the
blocks. SmolLM2's adapter ships one: its question-reader stage's trained correction and mix (the model and its
keys frozen, the other blocks of a question's memory its negatives) blended, a fifth of it, with
the 8 retrieval heads chosen on development questions (QRHead's recipe,
``experiments/results/heads.md``): trained alone it found planted facts better and natural
questions worse than the heads; blended, planted facts far better and natural questions about as
well (``experiments/results/reader.md``).
"""

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import nn

from ..core.fileio import atomic_write

NULL = "N/A"  # a content-free question: the calibration the experiments compare the template's with


@dataclass(frozen=True)
class ReaderConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_embd: int
    rank: int = 8
    blend: float = 0.0  # the share of the fixed retrieval heads' ranking (``heads``) in the blocks' scores


class QuestionReader(nn.Module):
    def __init__(self, config: ReaderConfig):
        super().__init__()
        c = self.config = config
        self.A = nn.Parameter(torch.randn(c.n_layer, c.rank, c.n_embd) * c.n_embd ** -0.5)  # (L, r, C)
        self.B = nn.Parameter(torch.zeros(c.n_layer, c.n_head * c.head_dim, c.rank))  # (L, H*D, r): starts as q
        self.mix = nn.Parameter(torch.zeros(c.n_layer * c.n_kv_head))  # softmax: every head alike at first
        self.log_temp = nn.Parameter(torch.tensor(5.0))
        if c.blend:  # fixed weights of the retrieval heads, read by the model's own queries
            self.register_buffer("heads", torch.zeros(c.n_layer * c.n_kv_head))  # sums to 1

    def queries(self, q: torch.Tensor, h: torch.Tensor, layers: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """Retrieval queries float32 (..., L, H, T, D) from the raw queries ``q`` (..., L, H, T, D)
        and the inputs ``h`` (..., L, T, C) of the memory layers ``layers`` (default all)."""
        c = self.config
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)  # (..., L, T, C)
        d = torch.einsum("...ltc,lrc->...ltr", hn, self.A[layers])
        d = torch.einsum("...ltr,lor->...lto", d, self.B[layers])  # (..., L, T, H*D)
        return q + d.unflatten(-1, (c.n_head, c.head_dim)).transpose(-3, -2)

    def attention(self, q: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: torch.Tensor,
                  keys: torch.Tensor, scale: float, layers: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """``head_attention`` of the retrieval queries of the memory layers ``layers`` (default
        all: L of them); ``h``: float32 (N, L, T, C), the layers' inputs at the tokens of ``q``."""
        return head_attention(self.queries(q, h, layers), cos, sin, weights, keys, scale)

    def weights(self) -> torch.Tensor:
        """float32 (L, H_kv): the weight of each (layer, key/value head)'s attention by the
        retrieval queries; of its attention by the model's own queries, ``heads`` (where blended)."""
        return self.mix.softmax(0).view(self.config.n_layer, self.config.n_kv_head)

    def scores(self, attention: torch.Tensor, null: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
        """Block logits (N, n) from the heads' ``attention`` (N, L * H_kv, n) and what a
        content-free prompt attends to, ``null`` (N or 1, L * H_kv, n): the mixed attention,
        calibrated, tempered. A blended reader also takes ``own`` (N, L * H_kv, n), the heads'
        attention by the model's own queries, and mixes the two rankings standardised over the
        blocks (a z-score each: neither ranking's scale decides), ``blend`` of the heads'."""
        z = torch.einsum("k,nkb->nb", self.weights().flatten(), attention - null) * self.log_temp.exp()
        if not self.config.blend:
            return z
        base = torch.einsum("k,nkb->nb", self.heads, own - null)
        return (1 - self.config.blend) * standardised(z) + self.config.blend * standardised(base)

    def settings(self) -> dict:
        return asdict(self.config)


def standardised(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., n) less its mean over the last dimension, over its standard deviation there
    (of the n values themselves: one block's is 0, and so is its score)."""
    return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True, correction=0).clamp(min=1e-12)


def blended(reader: QuestionReader, heads: torch.Tensor, blend: float) -> QuestionReader:
    """A copy of ``reader`` whose ranking mixes in, ``blend`` of it, the fixed retrieval heads
    ``heads`` float32 (L * H_kv,) (weights summing to 1) read by the model's own queries."""
    if not 0.0 < blend < 1.0:
        raise ValueError(f"blend must lie between 0 and 1 (exclusive), got {blend}")
    out = QuestionReader(replace(reader.config, blend=float(blend)))
    out.load_state_dict(reader.state_dict(), strict=False)
    with torch.no_grad():
        out.heads.copy_(heads / heads.sum())
    return out.eval()


def head_attention(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Each (layer, key/value head)'s attention over the blocks, float32 (M, N, L * H_kv, n): a
    softmax over the blocks of the landmark scores of each query, averaged over the tokens by
    ``weights`` and over the head's query heads.

    Parameters
    ----------
    q : float32 (N, L, H, T, D), queries of N prompts' tokens (padded to T), not rotated.
    cos, sin : float32 (N, T, D), the rotation to where a token searches older blocks from.
    weights : float32 (M, N, T), M ways to average over the tokens (each row sums to 1).
    keys : float32 (L, H_kv, n, D), the blocks' raw landmark keys.
    """
    x1, x2 = q.chunk(2, -1)
    qr = q * cos[:, None, None] + torch.cat((x2, x1), -1) * sin[:, None, None]  # as ``RoPE.rotate``
    G = q.shape[2] // keys.shape[1]
    s = torch.einsum("nlhtd,lhbd->nlhtb", qr, keys.repeat_interleave(G, 1)) * scale  # (N, L, H, T, n)
    a = torch.einsum("mnt,nlhtb->mnlhb", weights, s.softmax(-1))  # (M, N, L, H, n)
    return a.unflatten(3, (-1, G)).mean(4).flatten(2, 3)


READER_FILE = "reader.safetensors"  # in a landmark adapter's folder, beside its weights
# what a reader's ranking subtracts: the attention of the chat template's own tokens around the question (by the
# model's own queries: a content-free prompt read in the same forward), or nothing
CALIBRATIONS = ("template", "none")


def save_reader(reader: QuestionReader, path: str | Path, calibration: str, **notes: str) -> None:
    """The reader's weights, config and calibration as one safetensors file, written whole or not at all."""
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")
    tensors = {k: v.detach().contiguous() for k, v in reader.state_dict().items()}
    meta = {"config": json.dumps(reader.settings()), "calibration": calibration, **notes}
    atomic_write(path, save(tensors, metadata=meta))


@dataclass(frozen=True)
class Reader:
    """A model's question reader and the calibration its ranking subtracts (``CALIBRATIONS``:
    "template", the chat template's own tokens' attention; "none", nothing)."""

    reader: QuestionReader
    calibration: str


def load_reader(path: str | Path) -> tuple[QuestionReader, str]:
    """(the reader, its calibration) from ``save_reader``'s file; ``ValueError`` saying what is
    wrong with a file that is not one."""
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        config = ReaderConfig(**json.loads(meta["config"]))
        calibration = meta["calibration"]
        reader = QuestionReader(config)
        reader.load_state_dict(tensors)
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:
        raise ValueError(f"{path}: not a question reader ({type(e).__name__}: {e}); restore the adapter's "
                         f"{READER_FILE} or remove it to answer without one") from None
    if calibration not in CALIBRATIONS:
        raise ValueError(f"{path}: unknown calibration {calibration!r}; this version knows {CALIBRATIONS}")
    if not isinstance(config.blend, (int, float)) or not 0.0 <= config.blend < 1.0:
        raise ValueError(f"{path}: blend {config.blend} is no share (0 <= blend < 1); restore the adapter's "
                         f"{READER_FILE}")
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:  # NaN or infinite weights would move the pinned passages silently
        raise ValueError(f"{path}: the question reader's {', '.join(bad)} hold NaN or infinite values; restore the "
                         f"adapter's {READER_FILE} or remove it to answer without one")
    return reader.eval(), calibration
