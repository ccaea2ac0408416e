"""Landmark attention as one plain softmax over effective scores, in dense PyTorch.

The same formulation as the Triton kernel (see triton_landmark.py): a normal token of an
earlier block c gets s + s_landmark(c) - logsumexp_c(s), a token of the query's own block
keeps s, everything else is -inf, and a single softmax gives equations 1-4. Per-block
log-sum-exps come from a (..., n_blocks, block_size + 1) view of the scores, so no scatter is
needed: this is the fast path on CPUs, with O(T^2) memory like the reference it is tested
against.

Context Miss Token (appendix D): a controlled block's tokens move by s_cmt - lse_ctrl, where
lse_ctrl is the log-sum-exp of the controlled landmarks the query sees; together they then
carry exp(s_cmt), the CMT's share of the query's group. A query that sees no controlled
landmark gives that share to a value-less sink column instead.
"""

import torch
import torch.nn.functional as F

from ..rope import RotaryEmbedding

NEG_INF = float("-inf")


def _gated(s, block_size):
    """Effective scores of every key as a token of a complete *earlier* block.

    s : (..., N) scores against keys laid out as whole blocks from position 0 (N a multiple of
    block_size + 1). Returns (..., N): s + s_landmark - logsumexp over the block's normal
    tokens at normal positions, -inf at landmark positions."""
    L = block_size + 1
    blocks = s.unflatten(-1, (-1, L))  # (..., n_blocks, L)
    gate = blocks[..., block_size] - torch.logsumexp(blocks[..., :block_size], -1)  # (..., n_blocks)
    out = torch.cat([blocks[..., :block_size] + gate[..., None], torch.full_like(blocks[..., :1], NEG_INF)], -1)
    return out.flatten(-2)


def local_effective_scores(s, block_size, T_k):
    """Effective scores (..., T_q, T_k) of queries at the last T_q of T_k in-sequence positions."""
    L, T_q = block_size + 1, s.shape[-2]
    pad = -T_k % L
    gated = _gated(F.pad(s, (0, pad)), block_size)[..., :T_k]  # padded tail block is never earlier
    i = torch.arange(T_k - T_q, T_k, device=s.device)[:, None]
    j = torch.arange(T_k, device=s.device)[None, :]
    normal = j % L != block_size
    earlier = normal & (j // L < i // L)
    own = normal & (j // L == i // L) & (j <= i)
    return torch.where(earlier, gated, torch.where(own, s, NEG_INF))


def _cmt_softmax(eff, s_cmt, lm_s, visible, controlled):
    """Softmax over effective scores with a Context Miss Token.

    eff : (..., N) effective scores without the CMT; s_cmt : (..., 1) the CMT's score;
    lm_s, visible : (..., M) controlled landmark scores and which of them the query sees;
    controlled : (..., N) bool, columns of the controlled blocks the query sees as earlier
    blocks. Returns (..., N) weights."""
    seen = visible.any(-1, keepdim=True)
    # a finite floor, not -inf: a query that sees none must not get NaN gradients through it
    lse = torch.logsumexp(lm_s.masked_fill(~visible, torch.finfo(lm_s.dtype).min), -1, keepdim=True)
    eff = eff + torch.where(controlled, torch.where(seen, s_cmt - lse, 0.0), 0.0)
    sink = torch.where(seen, NEG_INF, s_cmt)  # the CMT's share, lost when nothing is controlled
    return torch.softmax(torch.cat([eff, sink], -1), -1)[..., :-1]


def landmark_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                             scale: float | None = None, cmt_k: torch.Tensor | None = None,
                             cmt_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """In-sequence landmark attention; same contract as ``landmark_attention``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    eff = local_effective_scores(s, block_size, k.shape[-2])
    if cmt_k is None:
        return torch.softmax(eff, -1) @ v
    T, L, n = s.shape[-1], block_size + 1, cmt_blocks.shape[-1]
    j = torch.arange(T, device=q.device)
    earlier = (j // L)[None, :] < (j // L)[:, None]  # (T, T): key j's block ended before query i's
    controlled = (F.pad(cmt_blocks, (0, 1))[:, j // L] & (j % L != block_size))[:, None, None, :] & earlier  # (B, 1, T, T)
    visible = cmt_blocks[:, None, None, :] & (torch.arange(n, device=q.device) < (j // L)[:, None])  # (B, 1, T, n)
    p = _cmt_softmax(eff, (q @ cmt_k.transpose(-2, -1)) * scale, s[..., block_size::L][..., :n], visible, controlled)
    return p @ v


def landmark_inference_dense(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope_base=10000.0,
                             scale=None, cmt_k=None):
    """Local keys plus retrieved blocks; same contract as ``landmark_attention_inference``."""
    B, H, T_q, D = q.shape
    K = block_table.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    s_loc = local_effective_scores((q @ k.transpose(-2, -1)) * scale, block_size, k.shape[-2])  # (B, H, Tq, Tk)
    s_cmt = None if cmt_k is None else (q @ cmt_k.transpose(-2, -1)) * scale  # (B, H, Tq, 1)
    if K == 0:
        if s_cmt is None:
            return torch.softmax(s_loc, -1) @ v
        return torch.softmax(torch.cat([s_loc, s_cmt], -1), -1)[..., :-1] @ v  # the CMT's share is lost
    H_kv = pool_k.shape[1]
    heads = torch.arange(H, device=q.device)[None, :, None, None] // (H // H_kv)  # pool head of each query head
    slots = block_table.clamp(min=0).long()  # (B, H, Tq, K)

    def gather(pool):
        """Each (query, slot)'s block of its head's pool head, (B, H, Tq, K, L, D): whole (L, D) rows
        picked by index_select (several times faster than broadcast advanced indexing) from a
        view of the pool's storage, so a strided pool (a view into a larger arena) is not copied."""
        if pool.stride(0) % pool.stride(1) or pool.stride(2) != D or pool.stride(3) != 1:
            pool = pool.contiguous()
        step = pool.stride(0) // pool.stride(1)  # storage rows from one pool entry to the next
        rows = pool.as_strided(((pool.shape[0] - 1) * step + H_kv, *pool.shape[2:]), (pool.stride(1), D, 1))
        return rows.index_select(0, (slots * step + heads).flatten()).view(B, H, T_q, K, *pool.shape[2:])

    qb = RotaryEmbedding(D, rope_base)(q[:, :, :, None, :], -block_pos)  # rotated back to each block's start
    s_raw = torch.einsum("bhqkd,bhqkld->bhqkl", qb, gather(pool_k)) * scale  # (B, H, Tq, K, L)
    s_ret = _gated(s_raw, block_size).masked_fill((block_table < 0)[..., None], NEG_INF).flatten(-2)
    if s_cmt is None:
        p = torch.softmax(torch.cat([s_ret, s_loc], -1), -1)
    else:  # every retrieved landmark is CMT-controlled, every local one free
        controlled = torch.arange(s_ret.shape[-1] + s_loc.shape[-1], device=q.device) < s_ret.shape[-1]
        p = _cmt_softmax(torch.cat([s_ret, s_loc], -1), s_cmt, s_raw[..., block_size], block_table >= 0, controlled)
    n = K * (block_size + 1)
    return torch.einsum("bhqkl,bhqkld->bhqd", p[..., :n].unflatten(-1, (K, -1)), gather(pool_v)) + p[..., n:] @ v
