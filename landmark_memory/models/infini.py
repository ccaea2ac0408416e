"""Infini-attention (Munkhdalai et al. 2024, papers/infini-attention.md section 2): the rival
design we compare against. Each head keeps a bounded compressive memory of everything before
the current segment and mixes what it reads there with causal attention inside the segment.

Per head, with sigma = ELU + 1 and segments of N tokens:
    A_mem = sigma(Q) M / (sigma(Q) z)                                  (eq. 3)
    M <- M + sigma(K)^T V,  z <- z + sum_t sigma(K_t)                  (eq. 4, "linear")
    M <- M + sigma(K)^T (V - sigma(K) M / (sigma(K) z))                (eq. 5, "linear+delta")
    A = sigmoid(beta) A_mem + (1 - sigmoid(beta)) A_dot                (eq. 6)
The memory reads un-rotated queries and keys; local attention rotates them (RoPE) by their
offset inside the segment. Before any memory exists (z = 0) A_mem is 0.

The state (M, z per layer and head, plus the open segment's keys and values) does not grow
with the input: a text can be read in one call or streamed in pieces with the same result.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

UPDATES = ("linear", "linear+delta")


def sigma(x):
    return F.elu(x) + 1


def memory_read(q, M, z):
    """Eq. 3: (B, H, T, Dv) read with raw queries q (B, H, T, D) from M (B, H, D, Dv), z (B, H, D)."""
    sq = sigma(q.to(M.dtype))  # the memory's precision (float32 under bf16 autocast)
    den = sq @ z.unsqueeze(-1)  # (B, H, T, 1), > 0 once anything was written (sigma > 0)
    return torch.where(den > 0, (sq @ M) / den.clamp_min(torch.finfo(den.dtype).tiny), 0.0).to(q.dtype)


def memory_update(k, v, M, z, update):
    """Eq. 4 or 5 for one segment's raw keys k and values v (B, H, N, D); returns new (M, z)."""
    sk, v = sigma(k.to(M.dtype)), v.to(M.dtype)
    if update == "linear+delta":
        v = v - memory_read(k, M, z)
    return M + sk.transpose(-2, -1) @ v, z + sk.sum(-2)


@dataclass
class LayerState:
    M: torch.Tensor  # (B, H, D, D) float32 associative memory
    z: torch.Tensor  # (B, H, D) float32 normalisation term
    k: torch.Tensor  # (B, H, n, D) raw keys of the open segment (n < N)
    v: torch.Tensor  # (B, H, n, D) its values


class InfiniState:
    """What a stream has read so far, per layer: pass the same object to successive
    ``LandmarkGPT(..., state=state)`` calls to continue a text."""

    def __init__(self):
        self.layers: dict[int, LayerState] = {}
        self.tokens = 0

    def layer(self, i: int, like: torch.Tensor) -> LayerState:
        """Layer ``i``'s state, created empty for tensors shaped like ``like`` (B, H, T, D)."""
        if i not in self.layers:
            B, H, _, D = like.shape
            zeros = like.new_zeros
            self.layers[i] = LayerState(zeros((B, H, D, D), dtype=torch.float32), zeros((B, H, D), dtype=torch.float32),
                                        zeros((B, H, 0, D)), zeros((B, H, 0, D)))
        return self.layers[i]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers.values() for t in (s.M, s.z, s.k, s.v))


def infini_attention(q, k, v, st, segment, gate, rope, update):
    """Infini-attention of new positions after the open segment held in ``st``.

    q, k, v : (B, H, T, D) raw (un-rotated) projections of T new tokens.
    st : LayerState, updated in place (memory folded in at each segment end).
    segment : int, N. gate : (H,) beta of eq. 6. rope : RotaryEmbedding. update : one of UPDATES.
    Returns (B, H, T, D).
    """
    outs, t, N = [], 0, segment
    mix = torch.sigmoid(gate.to(st.M.dtype)).view(1, -1, 1, 1)
    while t < q.shape[2]:
        n0 = st.k.shape[2]  # tokens of the open segment already read
        n = min(N - n0, q.shape[2] - t)
        qs = q[:, :, t:t + n]
        ks = torch.cat([st.k.to(k.dtype), k[:, :, t:t + n]], 2)  # (B, H, n0 + n, D)
        vs = torch.cat([st.v.to(v.dtype), v[:, :, t:t + n]], 2)
        pos = torch.arange(n0 + n, device=q.device)
        qr, kr = rope(qs, pos[n0:]), rope(ks, pos)
        causal = pos[n0:, None] >= pos[None, :]  # (n, n0 + n)
        a_dot = F.scaled_dot_product_attention(qr, kr, vs, attn_mask=causal)
        a_mem = memory_read(qs, st.M, st.z)
        outs.append((mix * a_mem.to(st.M.dtype) + (1 - mix) * a_dot.to(st.M.dtype)).to(q.dtype))
        if n0 + n == N:  # the segment is complete: fold it into memory
            st.M, st.z = memory_update(ks, vs, st.M, st.z, update)
            ks, vs = ks[:, :, :0], vs[:, :, :0]
        st.k, st.v = ks, vs
        t += n
    return torch.cat(outs, 2)
