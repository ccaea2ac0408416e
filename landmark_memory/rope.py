"""Rotary position embedding (RoPE) at arbitrary positions.

Keys are stored without rotation; memory retrieval rotates queries and keys at positions of
its choosing (stingy mapping puts far blocks at made-up positions), so positions here are any
integer (or real) tensor, not only ``arange(T)``. Uses the rotate-half layout of GPT-NeoX and
Llama: dimension ``d`` pairs with ``d + D/2``.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates (..., T, D) tensors by position-dependent angles ``pos * base^(-2d/D)``.

    Scores are relative: ``<rope(q, m), rope(k, n)>`` depends only on ``m - n``.
    """

    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (D/2,)

    def forward(self, x, positions):
        """Rotate ``x`` (..., T, D) at ``positions``, any shape that broadcasts to (..., T).

        Angles are computed in float32 (float64 for float64 inputs); the result has x's dtype."""
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = torch.as_tensor(positions, device=x.device).to(dt)
        angles = pos[..., None] * self.inv_freq.to(dt)  # (..., T, D/2)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.to(dt).chunk(2, dim=-1)  # (..., T, D/2) each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
