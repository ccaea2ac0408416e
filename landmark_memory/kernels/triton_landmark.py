"""Fused grouped-softmax landmark attention in Triton: forward and parallel backward (the
inference kernel, over local keys and retrieved blocks, is ``triton_inference.py``; it reads
the local keys with this module's forward).

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

Context Miss Token (appendix D): tokens of CMT-controlled blocks move by
shift_i = s_cmt_i - lse_ctrl_i, lse_ctrl_i being the log-sum-exp of the controlled landmarks i
sees, so together they carry exp(s_cmt_i), the CMT's share of i's group. The forward keeps the
controlled blocks in a second online-softmax accumulator, which yields lse_ctrl_i at the end,
and merges the two (a query that sees no controlled block gives the CMT's share up). Backward
adds, for a controlled landmark, -GC_i * exp(s_ic - lse_ctrl_i), where GC_i = sum of dS' over
the controlled tokens = S_cmt_i * (dO_i . o_ctrl_i - delta_i) is also the gradient of s_cmt_i.
"""

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_empty_like = torch.empty_like  # every element of an output is written; tests poison this


@triton.jit
def _effective_scores(s, offs_m, tile, T, CTRL, ctrl_row, n_lm, BS: tl.constexpr, LP: tl.constexpr,
                      BPT: tl.constexpr, BLOCK_M: tl.constexpr, HAS_CMT: tl.constexpr):
    """Effective scores s' (BLOCK_M, BPT * LP) of one key tile, plus what backward needs:
    the within-block softmax pc, masks of gated (earlier-block) tokens and their landmarks,
    and (with a CMT) of the earlier blocks that are CMT-controlled (``CTRL[ctrl_row + c]``)."""
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
    if HAS_CMT:
        ctrl = earlier & exists & (tl.load(CTRL + ctrl_row + blk, mask=blk < n_lm, other=0) != 0)
    else:
        ctrl = earlier & (slot < 0)  # nothing is controlled
    return (tl.reshape(s_eff, (BLOCK_M, BLOCK_N)), tl.reshape(pc, (BLOCK_M, BLOCK_N)),
            tl.reshape(gated, (BLOCK_M, BLOCK_N)), tl.reshape(lm_gate, (BLOCK_M, BLOCK_N)),
            tl.reshape(ctrl, (BLOCK_M, BLOCK_N)))


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
def _load_q_tile(Q, DO, LSE, DELTA, CMT_STATS, base, bh, offs_m, T, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                 HAS_CMT: tl.constexpr):
    """Queries, output gradients, log-sum-exps and rowsum(dO * O) of a query tile, and with a
    CMT (shift, lse_ctrl, GC) per query (three float32 rows per (batch, head) in CMT_STATS)."""
    mask_m = offs_m < T
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + d[None, :], mask=mask_m[:, None], other=0.0)
    do = tl.load(DO + base + offs_m[:, None] * HEAD_DIM + d[None, :], mask=mask_m[:, None], other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=mask_m, other=0.0)
    if HAS_CMT:
        row = CMT_STATS + bh.to(tl.int64) * 3 * T + offs_m
        cmt = (tl.load(row, mask=mask_m, other=0.0), tl.load(row + T, mask=mask_m, other=0.0),
               tl.load(row + 2 * T, mask=mask_m, other=0.0))
    else:
        cmt = (lse, lse, lse)  # unused
    return q, do, lse, delta, cmt


@triton.jit
def _tile_score_grads(q, k, v, do, lse, delta, cmt, offs_m, tile, T, scale, CTRL, ctrl_row, n_lm,
                      BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                      HAS_CMT: tl.constexpr):
    """Recomputed probabilities p (BLOCK_M, BLOCK_N) and the raw-score gradient ds of one tile."""
    s = tl.dot(q, tl.trans(k)) * scale
    s_eff, pc, gated, lm_gate, ctrl = _effective_scores(s, offs_m, tile, T, CTRL, ctrl_row, n_lm, BS, LP, BPT,
                                                        BLOCK_M, HAS_CMT)
    shift, lse_ctrl, gc = cmt
    if HAS_CMT:
        s_eff = tl.where(ctrl, s_eff + shift[:, None], s_eff)
    p = tl.where(offs_m[:, None] < T, tl.exp(s_eff - lse[:, None]), 0.0)
    dse = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    ds = _raw_score_grad(dse, pc, gated, lm_gate, BLOCK_M, BPT, LP)
    if HAS_CMT:  # a controlled landmark also moves lse_ctrl, and so every controlled token
        ds = tl.where(lm_gate & ctrl, ds - gc[:, None] * tl.exp(s - lse_ctrl[:, None]), ds)
    return p, ds


@triton.jit
def _online_softmax(m, l, acc, s, v):
    """One key tile's scores s (BLOCK_M, BLOCK_N) and values v folded into a running softmax:
    max m, sum l and unnormalised output acc (FlashAttention's update; -inf rows stay empty)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _query_tile(Q, base_q, pid_m, T_q, T_k, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Tile ``pid_m`` of the queries, the last T_q of T_k positions: their rows, positions and
    vectors (BLOCK_M, HEAD_DIM), and an empty online softmax (max, sum, output)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base_q + rows[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < T_q, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    return rows, rows + (T_k - T_q), q, m, tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, S_CMT, CTRL, CMT_STATS, O_CTRL, T_q, T_k, H, n_lm, scale,
                BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, HAS_CMT: tl.constexpr):
    """Queries are the last T_q of T_k in-sequence positions (T_q = T_k in training). With a
    CMT (training only), S_CMT holds each query's CMT score; CMT_STATS receives (shift, lse_ctrl,
    0) per query and O_CTRL the controlled blocks' normalised output, for backward."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base_q, base_k = bh.to(tl.int64) * T_q * HEAD_DIM, bh.to(tl.int64) * T_k * HEAD_DIM
    rows, qpos, q, m_i, l_i, acc = _query_tile(Q, base_q, pid_m, T_q, T_k, BLOCK_M, HEAD_DIM, UPCAST)
    d = tl.arange(0, HEAD_DIM)
    m_c, l_c, acc_c = m_i, l_i, acc  # the controlled blocks' accumulator (CMT only)
    ctrl_row = (bh // H).to(tl.int64) * n_lm
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T_q) - 1 + (T_k - T_q)
    for tile in range(0, last // (BPT * (BS + 1)) + 1):  # causal: stop at the last query's tile
        k, v, pos, valid = _load_kv_tile(K, V, base_k, tile, T_k, BS, LP, BPT, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k)) * scale
        s_eff, pc, gated, lm_gate, ctrl = _effective_scores(s, qpos, tile, T_k, CTRL, ctrl_row, n_lm, BS, LP, BPT,
                                                            BLOCK_M, HAS_CMT)
        if HAS_CMT:
            m_c, l_c, acc_c = _online_softmax(m_c, l_c, acc_c, tl.where(ctrl, s_eff, float("-inf")), v)
            s_eff = tl.where(ctrl, float("-inf"), s_eff)
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, s_eff, v)
    mask = rows < T_q
    lse = m_i + tl.log(l_i)
    o = acc / l_i[:, None]
    if HAS_CMT:
        s_cmt = tl.load(S_CMT + bh.to(tl.int64) * T_q + rows, mask=mask, other=0.0)
        seen = l_c > 0.0
        lse_ctrl = tl.where(seen, m_c + tl.log(tl.where(seen, l_c, 1.0)), 0.0)
        o_c = acc_c / tl.where(seen, l_c, 1.0)[:, None]  # 0 where no controlled block is seen
        top = tl.maximum(lse, s_cmt)
        w_free, w_cmt = tl.exp(lse - top), tl.exp(s_cmt - top)
        o = (o * w_free[:, None] + o_c * w_cmt[:, None]) / (w_free + w_cmt)[:, None]
        lse = top + tl.log(w_free + w_cmt)
        stats = CMT_STATS + bh.to(tl.int64) * 3 * T_q + rows
        tl.store(stats, tl.where(seen, s_cmt - lse_ctrl, 0.0), mask=mask)
        tl.store(stats + T_q, lse_ctrl, mask=mask)
        tl.store(O_CTRL + base_q + rows[:, None] * HEAD_DIM + d[None, :], o_c, mask=mask[:, None])
    tl.store(LSE + bh.to(tl.int64) * T_q + rows, lse, mask=mask)
    tl.store(O + base_q + rows[:, None] * HEAD_DIM + d[None, :], o.to(O.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, CMT_STATS, CTRL, DK, DV, T, H, n_lm, scale,
                     BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                     HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, HAS_CMT: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    ctrl_row = (bh // H).to(tl.int64) * n_lm
    base = bh.to(tl.int64) * T * HEAD_DIM
    d = tl.arange(0, HEAD_DIM)
    k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
    dk = tl.zeros((BPT * LP, HEAD_DIM), tl.float32)
    dv = tl.zeros((BPT * LP, HEAD_DIM), tl.float32)
    first = (tile * BPT * (BS + 1)) // BLOCK_M  # earlier queries never see this tile
    for start_m in range(first * BLOCK_M, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, lse, delta, cmt = _load_q_tile(Q, DO, LSE, DELTA, CMT_STATS, base, bh, offs_m, T, HEAD_DIM, UPCAST,
                                              HAS_CMT)
        p, ds = _tile_score_grads(q, k, v, do, lse, delta, cmt, offs_m, tile, T, scale, CTRL, ctrl_row, n_lm, BS, LP,
                                  BPT, BLOCK_M, HAS_CMT)
        dv += tl.dot(tl.trans(p).to(do.dtype), do)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    tl.store(DK + base + pos[:, None] * HEAD_DIM + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=valid[:, None])
    tl.store(DV + base + pos[:, None] * HEAD_DIM + d[None, :], dv.to(DV.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, CMT_STATS, CTRL, DQ, T, H, n_lm, scale,
                   BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, HAS_CMT: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * T * HEAD_DIM
    ctrl_row = (bh // H).to(tl.int64) * n_lm
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q, do, lse, delta, cmt = _load_q_tile(Q, DO, LSE, DELTA, CMT_STATS, base, bh, offs_m, T, HEAD_DIM, UPCAST, HAS_CMT)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1
    for tile in range(0, last // (BPT * (BS + 1)) + 1):
        k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
        p, ds = _tile_score_grads(q, k, v, do, lse, delta, cmt, offs_m, tile, T, scale, CTRL, ctrl_row, n_lm, BS, LP,
                                  BPT, BLOCK_M, HAS_CMT)
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
    def forward(ctx, q, k, v, block_size, scale, cmt_k, cmt_blocks):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, D = q.shape
        LP, BPT, BLOCK_M = _tiling(block_size)
        o = _empty_like(q)
        lse = _empty_like(q[..., 0], dtype=torch.float32, memory_format=torch.contiguous_format)  # (B, H, T)
        meta = dict(BS=block_size, LP=LP, BPT=BPT, BLOCK_M=BLOCK_M, HEAD_DIM=D, UPCAST=_INTERPRET,
                    HAS_CMT=cmt_k is not None)
        if cmt_k is None:
            s_cmt = ctrl = stats = o_ctrl = lse  # placeholders the kernel never reads
            n_lm = 0
        else:
            s_cmt = ((q.float() @ cmt_k.float().transpose(-2, -1)) * scale)[..., 0].contiguous()  # (B, H, T)
            ctrl, n_lm = cmt_blocks.to(torch.int8).contiguous(), cmt_blocks.shape[1]
            stats = torch.zeros(B, H, 3, T, device=q.device)  # shift, lse_ctrl, GC (filled in backward)
            o_ctrl = _empty_like(q, dtype=torch.float32)
        _fwd_kernel[(triton.cdiv(T, BLOCK_M), B * H)](q, k, v, o, lse, s_cmt, ctrl, stats, o_ctrl, T, T, H, n_lm, scale,
                                                      **meta)
        ctx.save_for_backward(q, k, v, o, lse, *((s_cmt, ctrl, stats, o_ctrl, cmt_k) if cmt_k is not None else ()))
        ctx.block_size, ctx.scale, ctx.meta, ctx.n_lm = block_size, scale, meta, n_lm
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *cmt = ctx.saved_tensors
        do = do.contiguous()
        B, H, T, D = q.shape
        meta = ctx.meta
        delta = (do.float() * o.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
        ctrl = stats = lse
        if cmt:
            s_cmt, ctrl, stats, o_ctrl, cmt_k = cmt
            gc = torch.exp(s_cmt - lse) * ((do.float() * o_ctrl).sum(-1) - delta)  # (B, H, T): d s_cmt
            stats = stats.clone()
            stats[:, :, 2] = gc
        dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        span = meta["BPT"] * (ctx.block_size + 1)
        _bwd_dkdv_kernel[(triton.cdiv(T, span), B * H)](q, k, v, do, lse, delta, stats, ctrl, dk, dv, T, H, ctx.n_lm,
                                                        ctx.scale, **meta)
        _bwd_dq_kernel[(triton.cdiv(T, meta["BLOCK_M"]), B * H)](q, k, v, do, lse, delta, stats, ctrl, dq, T, H,
                                                                 ctx.n_lm, ctx.scale, **meta)
        if not cmt:
            return dq, dk, dv, None, None, None, None
        g = (gc * ctx.scale)[..., None]  # (B, H, T, 1)
        dq = (dq.float() + g * cmt_k.float()).to(dq.dtype)
        return dq, dk, dv, None, None, (g * q.float()).sum(2, keepdim=True).to(cmt_k.dtype), None


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
    return _LandmarkAttention.apply(q, k, v, block_size, default_scale if scale is None else float(scale), cmt_k,
                                    cmt_blocks)
