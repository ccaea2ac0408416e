"""Fused grouped-softmax landmark attention in Triton: forward and parallel backward.

The grouped softmax is a plain softmax over *effective* scores. For query i and a normal token
j of an earlier block c, with landmark score s_ic and the block's log-sum-exp
lse_ic = log sum_{j' in c} exp(s_ij'),

    s'_ij = s_ij + s_ic - lse_ic            (earlier block: gated by its landmark)
    s'_ij = s_ij                            (normal token of i's own block, j <= i)
    s'_ij = -inf                            (landmarks, later positions)

Block c's tokens then carry exp(s_ic) in total, exactly the landmark's share of the local
group, so softmax(s') equals equations 1-4 and the FlashAttention online softmax applies
unchanged. The only new work is the per-block log-sum-exp, which is tile-local: every key tile
holds BPT whole blocks, each padded from L = block_size + 1 to LP (a power of two) slots, so
any block size works and no block straddles two tiles. Nothing T x T is ever stored.

Backward: with dS' the usual softmax gradient of s', for an earlier block c
    ds_ij = dS'_ij - pc_ij * G_ic,  ds_ic(landmark) = G_ic,  G_ic = sum_{j in c} dS'_ij,
where pc is the within-block softmax; own-block tokens pass dS' through.
"""

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_empty_like = torch.empty_like  # every element of an output is written; tests poison this


@triton.jit
def _effective_scores(s, offs_m, tile, T, BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """Effective scores s' (BLOCK_M, BPT * LP) of one key tile, plus what backward needs:
    the within-block softmax pc, and masks of gated (earlier-block) tokens and their landmarks."""
    L: tl.constexpr = BS + 1
    BLOCK_N: tl.constexpr = BPT * LP
    slot = tl.arange(0, LP)[None, None, :]  # (1, 1, LP) offset inside a block
    blk = tile * BPT + tl.arange(0, BPT)[None, :, None]  # (1, BPT, 1) block index
    pos = blk * L + slot  # (1, BPT, LP) key position
    exists = (slot < L) & (pos < T)
    normal = exists & (slot < BS)
    qpos = offs_m[:, None, None]  # (BLOCK_M, 1, 1)
    earlier = blk < qpos // L  # block completed before the query's block
    own = (blk == qpos // L) & normal & (pos <= qpos)

    s3 = tl.reshape(s, (BLOCK_M, BPT, LP))
    s_norm = tl.where(normal, s3, float("-inf"))
    mc = tl.max(s_norm, axis=2)
    mc = tl.where(mc == float("-inf"), 0.0, mc)
    e = tl.exp(s_norm - mc[:, :, None])
    zc = tl.sum(e, axis=2)
    zc = tl.where(zc == 0.0, 1.0, zc)
    pc = e / zc[:, :, None]  # within-block softmax
    s_lm = tl.sum(tl.where(slot == BS, s3, 0.0), axis=2)  # landmark score per block
    gate = s_lm - mc - tl.log(zc)  # (BLOCK_M, BPT)
    gated = earlier & normal
    s_eff = tl.where(gated, s3 + gate[:, :, None], tl.where(own, s3, float("-inf")))
    lm_gate = earlier & exists & (slot == BS)
    return (tl.reshape(s_eff, (BLOCK_M, BLOCK_N)), tl.reshape(pc, (BLOCK_M, BLOCK_N)),
            tl.reshape(gated, (BLOCK_M, BLOCK_N)), tl.reshape(lm_gate, (BLOCK_M, BLOCK_N)))


@triton.jit
def _raw_score_grad(dse, pc, gated, lm_gate, BLOCK_M: tl.constexpr, BPT: tl.constexpr, LP: tl.constexpr):
    """Gradient w.r.t. the raw scores from the gradient w.r.t. the effective scores."""
    BLOCK_N: tl.constexpr = BPT * LP
    g = tl.sum(tl.reshape(tl.where(gated, dse, 0.0), (BLOCK_M, BPT, LP)), axis=2)  # (BLOCK_M, BPT)
    g = tl.reshape(tl.broadcast_to(g[:, :, None], (BLOCK_M, BPT, LP)), (BLOCK_M, BLOCK_N))
    return tl.where(gated, dse - pc * g, tl.where(lm_gate, g, dse))


@triton.jit
def _load_kv_tile(K, V, base, tile, T, BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr,
                  HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Keys and values (BPT * LP, HEAD_DIM) of key tile ``tile``: BPT whole blocks, each padded
    to LP rows (padding rows load as 0), with their positions and validity."""
    n = tl.arange(0, BPT * LP)
    pos = (tile * BPT + n // LP) * (BS + 1) + n % LP
    valid = (n % LP < BS + 1) & (pos < T)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + base + pos[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(V + base + pos[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
    if UPCAST:  # the interpreter computes bf16 arithmetic on raw bits: work in fp32 there
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v, pos, valid


@triton.jit
def _load_q_tile(Q, DO, LSE, DELTA, base, bh, offs_m, T, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Queries, output gradients, log-sum-exps and rowsum(dO * O) of a query tile."""
    mask_m = offs_m < T
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + d[None, :], mask=mask_m[:, None], other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + d[None, :], mask=mask_m[:, None], other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=mask_m, other=0.0)
    return q, do, lse, delta


@triton.jit
def _tile_score_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS: tl.constexpr, LP: tl.constexpr,
                      BPT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Recomputed probabilities p (BLOCK_M, BLOCK_N) and the raw-score gradient ds of one tile."""
    s = tl.dot(q, tl.trans(k)) * scale
    s_eff, pc, gated, lm_gate = _effective_scores(s, offs_m, tile, T, BS, LP, BPT, BLOCK_M)
    p = tl.where(offs_m[:, None] < T, tl.exp(s_eff - lse[:, None]), 0.0)
    dse = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return p, _raw_score_grad(dse, pc, gated, lm_gate, BLOCK_M, BPT, LP)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, T_q, T_k, scale,
                BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Queries are the last T_q of T_k in-sequence positions (T_q = T_k in training)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base_q, base_k = bh.to(tl.int64) * T_q * HEAD_DIM, bh.to(tl.int64) * T_k * HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qpos = rows + (T_k - T_q)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base_q + rows[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < T_q, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T_q) - 1 + (T_k - T_q)
    for tile in range(0, last // (BPT * (BS + 1)) + 1):  # causal: stop at the last query's tile
        k, v, pos, valid = _load_kv_tile(K, V, base_k, tile, T_k, BS, LP, BPT, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k)) * scale
        s_eff, pc, gated, lm_gate = _effective_scores(s, qpos, tile, T_k, BS, LP, BPT, BLOCK_M)
        m_new = tl.maximum(m_i, tl.max(s_eff, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s_eff - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    mask = rows < T_q
    tl.store(LSE + bh.to(tl.int64) * T_q + rows, m_i + tl.log(l_i), mask=mask)
    o = acc / l_i[:, None]
    tl.store(O + base_q + rows[:, None] * HEAD_DIM + d[None, :], o.to(O.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _retrieved_kernel(Q, PK, PV, TABLE, COS, SIN, O_LOC, LSE_LOC, S_CMT, OUT, T_q, H, GROUP, N_SLOTS, K_STRIDE,
                      V_STRIDE, scale, BS: tl.constexpr, LP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HAS_CMT: tl.constexpr):
    """One query of one head over its retrieved blocks, merged with its local result.

    Pool keys are rotated by their offset inside the block; the query is rotated back by the
    block's start position P (COS/SIN of -P), since RoPE scores depend only on differences.
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
        acc1 = acc1 * alpha + tl.sum(p[:, None] * v1, axis=0)
        acc2 = acc2 * alpha + tl.sum(p[:, None] * v2, axis=0)
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


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, T, scale,
                     BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                     HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * T * HEAD_DIM
    d = tl.arange(0, HEAD_DIM)
    k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
    dk = tl.zeros((BPT * LP, HEAD_DIM), tl.float32)
    dv = tl.zeros((BPT * LP, HEAD_DIM), tl.float32)
    first = (tile * BPT * (BS + 1)) // BLOCK_M  # earlier queries never see this tile
    for start_m in range(first * BLOCK_M, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _load_q_tile(Q, DO, LSE, DELTA, base, bh, offs_m, T, HEAD_DIM, UPCAST)
        p, ds = _tile_score_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS, LP, BPT, BLOCK_M)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    tl.store(DK + base + pos[:, None] * HEAD_DIM + d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=valid[:, None])
    tl.store(DV + base + pos[:, None] * HEAD_DIM + d[None, :], dv.to(DV.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T, scale,
                   BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * T * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q, do, lse, delta = _load_q_tile(Q, DO, LSE, DELTA, base, bh, offs_m, T, HEAD_DIM, UPCAST)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1
    for tile in range(0, last // (BPT * (BS + 1)) + 1):
        k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
        p, ds = _tile_score_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS, LP, BPT, BLOCK_M)
        dq += tl.dot(ds.to(k.dtype), k)
    d = tl.arange(0, HEAD_DIM)
    tl.store(DQ + base + offs_m[:, None] * HEAD_DIM + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=offs_m[:, None] < T)


def _tiling(block_size):
    """(LP, BPT, BLOCK_M): padded block width, whole blocks per key tile, queries per tile."""
    LP = triton.next_power_of_2(block_size + 1)
    BPT = max(1, 64 // LP)
    BLOCK_M = 64
    return LP, BPT, BLOCK_M


class _LandmarkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_size, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, D = q.shape
        LP, BPT, BLOCK_M = _tiling(block_size)
        o = _empty_like(q)
        lse = _empty_like(q[..., 0], dtype=torch.float32, memory_format=torch.contiguous_format)  # (B, H, T)
        meta = dict(BS=block_size, LP=LP, BPT=BPT, BLOCK_M=BLOCK_M, HEAD_DIM=D, UPCAST=_INTERPRET)
        _fwd_kernel[(triton.cdiv(T, BLOCK_M), B * H)](q, k, v, o, lse, T, T, scale, **meta)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.block_size, ctx.scale, ctx.meta = block_size, scale, meta
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        B, H, T, D = q.shape
        meta = ctx.meta
        delta = (do.float() * o.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
        dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        span = meta["BPT"] * (ctx.block_size + 1)
        _bwd_dkdv_kernel[(triton.cdiv(T, span), B * H)](q, k, v, do, lse, delta, dk, dv, T, ctx.scale, **meta)
        _bwd_dq_kernel[(triton.cdiv(T, meta["BLOCK_M"]), B * H)](q, k, v, do, lse, delta, dq, T, ctx.scale, **meta)
        return dq, dk, dv, None, None


def _check_backend(q):
    D = q.shape[-1]
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton backend supports head dims 16, 32, 64, 128 and 256, got {D}; "
                         "use backend='reference'")
    if q.device.type != "cuda" and not _INTERPRET:
        raise ValueError("the Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for testing on CPU); "
                         "use backend='reference' or 'auto'")
    return D ** -0.5


def landmark_attention_triton(q, k, v, block_size, scale=None, cmt_k=None, cmt_blocks=None):
    """Fused landmark attention; same contract as ``landmark_attention``."""
    default_scale = _check_backend(q)
    if cmt_k is not None:
        raise NotImplementedError("the Triton training kernel has no Context Miss Token path yet; "
                                  "use backend='dense' (or 'auto') for CMT models")
    return _LandmarkAttention.apply(q, k, v, block_size, default_scale if scale is None else float(scale))


@torch.no_grad()
def landmark_inference_triton(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope_base=10000.0,
                              scale=None, cmt_k=None):
    """Chunk attention over local keys and retrieved blocks; same contract as
    ``landmark_attention_inference``. Inference only: no autograd."""
    from ..rope import RotaryEmbedding

    scale = _check_backend(q) if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Tq, D = q.shape
    # the pool may be a strided view into the hot-cache arena: only each block must be dense
    pool_k, pool_v = (p if p.stride()[1:] == (p.shape[2] * D, D, 1) else p.contiguous() for p in (pool_k, pool_v))
    Tk, n_slots = k.shape[-2], block_table.shape[-1]
    LP, BPT, BLOCK_M = _tiling(block_size)
    o_loc = _empty_like(q, dtype=torch.float32)
    lse = _empty_like(q[..., 0], dtype=torch.float32, memory_format=torch.contiguous_format)  # (B, H, Tq)
    meta = dict(BS=block_size, LP=LP, BPT=BPT, BLOCK_M=BLOCK_M, HEAD_DIM=D, UPCAST=_INTERPRET)
    _fwd_kernel[(triton.cdiv(Tq, BLOCK_M), B * H)](q, k, v, o_loc, lse, Tq, Tk, scale, **meta)
    s_cmt = None if cmt_k is None else ((q.float() @ cmt_k.float().transpose(-2, -1)) * scale)[..., 0].contiguous()
    if n_slots == 0:  # with a CMT, its share of the group is lost
        return (o_loc if s_cmt is None else o_loc * torch.sigmoid(lse - s_cmt)[..., None]).to(q.dtype)
    cos, sin = RotaryEmbedding(D, rope_base).cos_sin(-block_pos, q.device)  # (B, H, Tq, K, D/2)
    out = _empty_like(q)
    _retrieved_kernel[(Tq, B * H)](q, pool_k, pool_v, block_table.to(torch.int32).contiguous(), cos, sin, o_loc, lse,
                                   lse if s_cmt is None else s_cmt, out, Tq, H, H // pool_k.shape[1], n_slots,
                                   pool_k.stride(0), pool_v.stride(0), scale, BS=block_size, LP=LP, HEAD_DIM=D,
                                   HAS_CMT=s_cmt is not None)
    return out
