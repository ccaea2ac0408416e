"""Rotary position embedding (RoPE) at arbitrary positions.

Keys are stored without rotation; memory retrieval rotates queries and keys at positions of
its choosing (stingy mapping puts far blocks at made-up positions), so positions here are any
integer (or real) tensor, not only ``arange(T)``. Uses the rotate-half layout of GPT-NeoX and
Llama: dimension ``d`` pairs with ``d + D/2``.
"""

import functools

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates (..., T, D) tensors by position-dependent angles ``pos * inv_freq``, by default
    ``inv_freq[d] = base^(-2d/D)``; a scaled RoPE (Llama 3's, linear, YaRN) passes its own
    ``inv_freq`` (D/2,), as ``models/hf/families.rotary_of`` has transformers compute it. Only a rotation:
    a scaling that also multiplies cos and sin (YaRN's attention factor) belongs in the
    attention's scale.

    Scores are relative: ``<rope(q, m), rope(k, n)>`` depends only on ``m - n``.
    """

    def __init__(self, head_dim, base=10000.0, inv_freq: torch.Tensor | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        if inv_freq is not None and tuple(inv_freq.shape) != (head_dim // 2,):
            raise ValueError(f"inv_freq must have head_dim / 2 = {head_dim // 2} entries, got {tuple(inv_freq.shape)}")
        self.head_dim, self.base = head_dim, base
        d = torch.arange(0, head_dim, 2, dtype=torch.float64)
        self._freq = base ** (-d / head_dim) if inv_freq is None else inv_freq.detach().to("cpu", torch.float64)
        self._inv_freq = {}  # per device, float64 (D/2,): moved once, not at every call

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *more: torch.Tensor):
        """Rotate ``x`` (..., T, D) at ``positions``, any shape that broadcasts to (..., T);
        tensors in ``more`` (same dtype) are rotated at the same positions, and then a tuple of
        all is returned.

        Angles are computed in float64 (not a buffer, so ``model.half()`` cannot degrade them):
        at position 10^6 a float32 angle is already off by ~0.06 rad. The rotation itself runs
        in float32 (float64 for float64 inputs); the result has x's dtype."""
        return self.rotate(self.angles(positions, x.device, rotation_dtype(x.dtype)), x, *more)

    def rotate(self, angles: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, *more: torch.Tensor):
        """``forward`` with the ``angles`` of its positions computed beforehand, for positions
        that many calls share (a step's query positions at every layer)."""
        cos, sin = angles  # (..., T, D)
        out = tuple(self._rotate(t, cos, sin) for t in (x, *more))
        return out if more else out[0]

    @staticmethod
    def _rotate(x, cos, sin):
        xf = x.to(cos.dtype)
        x1, x2 = xf.chunk(2, dim=-1)  # (..., T, D/2) each
        return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)  # (x1 cos - x2 sin, x2 cos + x1 sin)

    def angles(self, positions, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation at ``positions`` in the layout ``rotate`` applies: ``(cos, sin)``, each
        (*positions.shape, D), cos twice and -sin then sin."""
        cos, sin = self.cos_sin(positions, device, dtype)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def cos_sin(self, positions, device=None, dtype=torch.float32):
        """cos and sin of the rotation angles at ``positions``: two (*positions.shape, D/2)
        tensors, angles computed in float64 and then cast to ``dtype``."""
        positions = torch.as_tensor(positions, device=device)
        angles = positions.double()[..., None] * self.inv_freq(positions.device)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def inv_freq(self, device) -> torch.Tensor:
        """float64 (D/2,) the angle per position of each dimension pair, ``base^(-2d/D)``
        unless given."""
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = self._freq.to(device)
        return inv_freq


def rotation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What tensors of ``dtype`` are rotated in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def rotary(head_dim: int, base: float) -> RotaryEmbedding:
    """A shared ``RotaryEmbedding`` for kernels that are handed only the head dim and base (it
    keeps its frequencies per device, so a fresh one per call would compute them again)."""
    return RotaryEmbedding(head_dim, base)


def as_rotary(rope: "RotaryEmbedding | float", head_dim: int) -> RotaryEmbedding:
    """A kernel's ``rope`` argument as a ``RotaryEmbedding``: the model's own, or plain RoPE of
    that base."""
    return rope if isinstance(rope, RotaryEmbedding) else rotary(head_dim, float(rope))
