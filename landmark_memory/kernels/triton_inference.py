"""Fused landmark attention at inference in Triton: a chunk's queries over its local keys (the
grouped-softmax forward of ``triton_landmark.py``) and over the blocks retrieved for each of
them (``_retrieved_kernel``: the blocks gathered through a block table from the hot cache's
arena, re-rotated to their positions, int8 blocks read in place), merged per query."""

import torch
import triton
import triton.language as tl

from .triton_landmark import _INTERPRET, _check_backend, _fwd_kernel, _tiling

_empty_like = torch.empty_like  # every element of an output is written; tests poison this


@triton.jit
def _retrieved_kernel(Q, PK, PV, PS, TABLE, COS, SIN, O_LOC, LSE_LOC, S_CMT, OUT, T_q, H, GROUP, N_SLOTS, K_STRIDE,
                      V_STRIDE, PS_STRIDE, scale, BS: tl.constexpr, LP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HAS_CMT: tl.constexpr, QUANT: tl.constexpr):
    """One query of one head over its retrieved blocks, merged with its local result.

    Pool keys are rotated by their offset inside the block; the query is rotated back by the
    block's start position P (COS/SIN of -P), since RoPE scores depend only on differences.
    An int8 pool (QUANT) is read as it is: its keys' channel scales (PS, per block and head,
    then the values' row scales) multiply the rotated query, its value scales the weights.
    With a Context Miss Token the retrieved blocks together carry exp(s_cmt) instead of the
    sum of their landmarks' exp-scores (equations 5-6), and nothing when no slot is live."""
    r, bh = tl.program_id(0), tl.program_id(1)
    h = (bh % H) // GROUP  # the pool head this query head reads (grouped-query attention)
    row = bh.to(tl.int64) * T_q + r
    HALF: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, HALF)
    q1 = tl.load(Q + row * HEAD_DIM + i).to(tl.float32)
    q2 = tl.load(Q + row * HEAD_DIM + HALF + i).to(tl.float32)
    t = tl.arange(0, LP)
    normal = t < BS
    m = tl.max(tl.full((LP,), float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros((LP,), tl.float32), axis=0)
    acc1, acc2 = tl.zeros((HALF,), tl.float32), tl.zeros((HALF,), tl.float32)
    for slot in range(0, N_SLOTS):
        entry = row * N_SLOTS + slot
        idx = tl.load(TABLE + entry)
        live = idx >= 0  # -1: empty slot
        c = tl.load(COS + entry * HALF + i)
        sn = tl.load(SIN + entry * HALF + i)
        qr1, qr2 = q1 * c - q2 * sn, q2 * c + q1 * sn
        slot_idx = tl.maximum(idx, 0).to(tl.int64)
        if QUANT:
            scales = PS + slot_idx * PS_STRIDE + h * (HEAD_DIM + BS + 1)
            qr1 = qr1 * tl.load(scales + i, mask=live, other=0.0)
            qr2 = qr2 * tl.load(scales + HALF + i, mask=live, other=0.0)
        off = h * (BS + 1) * HEAD_DIM + t[:, None] * HEAD_DIM + i[None, :]  # (LP, HALF) inside a block
        rows_ok = (t < BS + 1)[:, None] & live
        k1 = tl.load(PK + slot_idx * K_STRIDE + off, mask=rows_ok, other=0.0).to(tl.float32)
        k2 = tl.load(PK + slot_idx * K_STRIDE + off + HALF, mask=rows_ok, other=0.0).to(tl.float32)
        s = (tl.sum(qr1[None, :] * k1, axis=1) + tl.sum(qr2[None, :] * k2, axis=1)) * scale  # (LP,)
        s_norm = tl.where(normal, s, float("-inf"))
        mc = tl.max(s_norm, axis=0)
        gate = tl.sum(tl.where(t == BS, s, 0.0), axis=0) - mc - tl.log(tl.sum(tl.exp(s_norm - mc), axis=0))
        s_eff = tl.where(normal & live, s + gate, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_eff, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s_eff - m_safe)
        l = l * alpha + tl.sum(p, axis=0)
        v1 = tl.load(PV + slot_idx * V_STRIDE + off, mask=rows_ok, other=0.0).to(tl.float32)
        v2 = tl.load(PV + slot_idx * V_STRIDE + off + HALF, mask=rows_ok, other=0.0).to(tl.float32)
        pv = p
        if QUANT:
            pv = p * tl.load(scales + HEAD_DIM + t, mask=(t < BS + 1) & live, other=0.0)
        acc1 = acc1 * alpha + tl.sum(pv[:, None] * v1, axis=0)
        acc2 = acc2 * alpha + tl.sum(pv[:, None] * v2, axis=0)
        m = m_new
    # merge with the local part: both are pieces of one softmax over effective scores
    lse = tl.load(LSE_LOC + row)
    if HAS_CMT:
        s_cmt = tl.load(S_CMT + row)
        top = tl.maximum(lse, s_cmt)
        w_loc, w_cmt = tl.exp(lse - top), tl.exp(s_cmt - top)
        w_ret = tl.where(l > 0.0, w_cmt / tl.where(l > 0.0, l, 1.0), 0.0)  # acc / l is the retrieved part's output
        denom = w_loc + w_cmt
    else:
        top = tl.maximum(lse, m)
        w_loc, w_ret = tl.exp(lse - top), tl.exp(m - top)
        denom = w_loc + l * w_ret
    o1 = tl.load(O_LOC + row * HEAD_DIM + i)
    o2 = tl.load(O_LOC + row * HEAD_DIM + HALF + i)
    tl.store(OUT + row * HEAD_DIM + i, ((o1 * w_loc + acc1 * w_ret) / denom).to(OUT.dtype.element_ty))
    tl.store(OUT + row * HEAD_DIM + HALF + i, ((o2 * w_loc + acc2 * w_ret) / denom).to(OUT.dtype.element_ty))


@torch.no_grad()
def landmark_inference_triton(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope=10000.0,
                              scale=None, cmt_k=None, pool_scale=None):
    """Chunk attention over local keys and retrieved blocks; same contract as
    ``landmark_attention_inference``. Inference only: no autograd."""
    from ..core.rope import as_rotary

    scale = _check_backend(q) if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, T_q, D = q.shape
    # the pool may be a strided view into the hot-cache arena: only each block must be dense
    pool_k, pool_v = (p if p.stride()[1:] == (p.shape[2] * D, D, 1) else p.contiguous() for p in (pool_k, pool_v))
    Tk, K = k.shape[-2], block_table.shape[-1]
    LP, BPT, BLOCK_M = _tiling(block_size)
    o_loc = _empty_like(q, dtype=torch.float32)
    lse = _empty_like(q[..., 0], dtype=torch.float32, memory_format=torch.contiguous_format)  # (B, H, T_q)
    meta = dict(BS=block_size, LP=LP, BPT=BPT, BLOCK_M=BLOCK_M, HEAD_DIM=D, UPCAST=_INTERPRET, HAS_CMT=False)
    _fwd_kernel[(triton.cdiv(T_q, BLOCK_M), B * H)](q, k, v, o_loc, lse, lse, lse, lse, lse, T_q, Tk, H, 0, scale,
                                                    **meta)
    s_cmt = None if cmt_k is None else ((q.float() @ cmt_k.float().transpose(-2, -1)) * scale)[..., 0].contiguous()
    if K == 0:  # with a CMT, its share of the group is lost
        return (o_loc if s_cmt is None else o_loc * torch.sigmoid(lse - s_cmt)[..., None]).to(q.dtype)
    cos, sin = as_rotary(rope, D).cos_sin(-block_pos, q.device)  # (B, H, T_q, K, D/2)
    out = _empty_like(q)
    ps = lse if pool_scale is None else pool_scale.contiguous()  # lse: a placeholder the kernel never reads
    _retrieved_kernel[(T_q, B * H)](q, pool_k, pool_v, ps, block_table.to(torch.int32).contiguous(), cos, sin, o_loc,
                                   lse, lse if s_cmt is None else s_cmt, out, T_q, H, H // pool_k.shape[1], K,
                                   pool_k.stride(0), pool_v.stride(0), 0 if pool_scale is None else ps[0].numel(),
                                   scale,
                                   BS=block_size, LP=LP, HEAD_DIM=D, HAS_CMT=s_cmt is not None,
                                   QUANT=pool_scale is not None)
    return out
