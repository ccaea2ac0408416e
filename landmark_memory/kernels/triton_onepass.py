"""Grouped-softmax landmark attention in Triton with one exponential per score: the forward and
backward of ``triton_landmark.py`` (whose tiling, loads and wrapper contract it shares), with
the softmax computed hierarchically instead of over effective scores. Backend
``"triton-onepass"``; docs/design/inference.md ("One pass, one exponential") derives it.

For query i, the members of its softmax group are the landmarks of earlier blocks c (score
g_c = s_ic) and the visible normal tokens of its own block (scores s_ij); an earlier block's
tokens share its landmark's weight by their in-block softmax. With a stabiliser mc per
(query, block), the largest visible normal score of the block, and e_ij = exp(s_ij - mc):

    weight of an earlier block's token   p_ij = e_ij * exp(s_ic - m) / z_c,   z_c = sum_{j in c} e_ij
    weight of an own-block token         p_ij = e_ij * exp(mc - m)

where m is the running maximum over the group scores (landmark scores and own-block maxima)
that the online softmax keeps. Each score is exponentiated once, each block once more; the
group's sum gains exp(s_ic - m) per earlier block and z_c exp(mc - m) for the own block, so the
normaliser never needs the tokens' weights summed. The two-pass formulation takes a log per
block and a second exponential per score (of s_ij + s_ic - lse_c). Backward recomputes e and
z_c per tile and takes m = the row's log-sum-exp. Key tiles that lie wholly before a query
tile's first block need no causal or own-block mask (``DIAG`` False): every block in them is
an earlier block of every query.

No Context Miss Token: a model with one uses ``"triton"``.
"""

import torch
import triton
import triton.language as tl

from .triton_landmark import _INTERPRET, _load_kv_tile, _load_q_tile, _query_tile, _tiling

_empty_like = torch.empty_like  # every element of an output is written; tests poison this


@triton.jit
def _block_terms(s, qpos, tile, T, BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr,
                 BLOCK_M: tl.constexpr, DIAG: tl.constexpr):
    """One key tile's scores s (BLOCK_M, BPT * LP) by block: e = exp(s - mc) over visible normal
    tokens (BLOCK_M, BPT, LP), z_c (BLOCK_M, BPT), the group score g_c (an earlier block's
    landmark score, the own block's mc, -inf for a block the query does not see) and which
    blocks are earlier."""
    L: tl.constexpr = BS + 1
    slot = tl.arange(0, LP)[None, None, :]  # (1, 1, LP) offset inside a block
    blk = tile * BPT + tl.arange(0, BPT)[None, :]  # (1, BPT) block index
    pos = blk[:, :, None] * L + slot
    normal = (slot < BS) & (pos < T)
    s3 = tl.reshape(s, (BLOCK_M, BPT, LP))
    if DIAG:
        qblk = qpos[:, None] // L  # (BLOCK_M, 1)
        earlier, own = blk < qblk, blk == qblk  # (BLOCK_M, BPT)
        visible = normal & (earlier[:, :, None] | (own[:, :, None] & (pos <= qpos[:, None, None])))
    else:  # the whole tile precedes the query tile's first block: every block is earlier
        earlier, own = blk >= 0, blk < 0  # (1, BPT)
        visible = normal
    mc = tl.max(tl.where(visible, s3, float("-inf")), axis=2)
    e = tl.where(visible, tl.exp(s3 - tl.where(mc == float("-inf"), 0.0, mc)[:, :, None]), 0.0)
    z = tl.sum(e, axis=2)  # >= 1 wherever a token is visible (the max term is 1)
    s_lm = tl.sum(tl.where(slot == BS, s3, 0.0), axis=2)
    g = tl.where(earlier, s_lm, tl.where(own, mc, float("-inf")))
    return e, tl.where(z == 0.0, 1.0, z), g, earlier


@triton.jit
def _weights(e, z, g, earlier, m, BLOCK_M: tl.constexpr, BPT: tl.constexpr, LP: tl.constexpr):
    """Weights p (BLOCK_M, BPT * LP) relative to exp(m) per row, and each block's share of the
    group's sum (BLOCK_M, BPT)."""
    w = tl.exp(g - m[:, None])  # 0 for a block the query does not see
    share = tl.where(earlier, w, w * z)
    f = tl.where(earlier, w / z, w)
    return tl.reshape(e * f[:, :, None], (BLOCK_M, BPT * LP)), share


@triton.jit
def _fold_tile(q, m_i, l_i, acc, K, V, base_k, tile, qpos, T_k, scale, BS: tl.constexpr, LP: tl.constexpr,
               BPT: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
               DIAG: tl.constexpr):
    k, v, pos, valid = _load_kv_tile(K, V, base_k, tile, T_k, BS, LP, BPT, HEAD_DIM, UPCAST)
    s = tl.dot(q, tl.trans(k)) * scale
    e, z, g, earlier = _block_terms(s, qpos, tile, T_k, BS, LP, BPT, BLOCK_M, DIAG)
    m_new = tl.maximum(m_i, tl.max(g, axis=1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p, share = _weights(e, z, g, earlier, m_new, BLOCK_M, BPT, LP)
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(share, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, T_q, T_k, scale, BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Queries are the last T_q of T_k in-sequence positions (T_q = T_k in training)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base_q, base_k = bh.to(tl.int64) * T_q * HEAD_DIM, bh.to(tl.int64) * T_k * HEAD_DIM
    rows, qpos, q, m_i, l_i, acc = _query_tile(Q, base_q, pid_m, T_q, T_k, BLOCK_M, HEAD_DIM, UPCAST)
    d = tl.arange(0, HEAD_DIM)
    first = pid_m * BLOCK_M + (T_k - T_q)  # the tile's first query position
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T_q) - 1 + (T_k - T_q)
    before = (first // (BS + 1)) // BPT  # key tiles wholly before every query's block
    for tile in range(0, before):
        m_i, l_i, acc = _fold_tile(q, m_i, l_i, acc, K, V, base_k, tile, qpos, T_k, scale, BS, LP, BPT, BLOCK_M,
                                   HEAD_DIM, UPCAST, False)
    for tile in range(before, last // (BPT * (BS + 1)) + 1):  # causal: stop at the last query's tile
        m_i, l_i, acc = _fold_tile(q, m_i, l_i, acc, K, V, base_k, tile, qpos, T_k, scale, BS, LP, BPT, BLOCK_M,
                                   HEAD_DIM, UPCAST, True)
    mask = rows < T_q
    tl.store(LSE + bh.to(tl.int64) * T_q + rows, m_i + tl.log(l_i), mask=mask)
    o = acc / l_i[:, None]
    tl.store(O + base_q + rows[:, None] * HEAD_DIM + d[None, :], o.to(O.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _tile_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS: tl.constexpr, LP: tl.constexpr,
                BPT: tl.constexpr, BLOCK_M: tl.constexpr, DIAG: tl.constexpr):
    """Recomputed weights p (BLOCK_M, BLOCK_N) and the raw-score gradient ds of one tile: with
    dS = p (dO.v - delta) and G_c its sum over an earlier block's tokens, a token of that block
    gets dS - (e / z_c) G_c, its landmark G_c, an own-block token dS."""
    BLOCK_N: tl.constexpr = BPT * LP
    s = tl.dot(q, tl.trans(k)) * scale
    e, z, g, earlier = _block_terms(s, offs_m, tile, T, BS, LP, BPT, BLOCK_M, DIAG)
    p, share = _weights(e, z, g, earlier, lse, BLOCK_M, BPT, LP)
    p = tl.where(offs_m[:, None] < T, p, 0.0)
    dse = tl.reshape(p * (tl.dot(do, tl.trans(v)) - delta[:, None]), (BLOCK_M, BPT, LP))
    G = tl.where(earlier, tl.sum(dse, axis=2), 0.0)  # (BLOCK_M, BPT)
    slot = tl.arange(0, LP)[None, None, :]
    ds = tl.where(slot == BS, G[:, :, None], dse - e * (G / z)[:, :, None])  # own blocks: G = 0
    return p, tl.reshape(ds, (BLOCK_M, BLOCK_N))


@triton.jit
def _fold_grads(dk, dv, Q, DO, LSE, DELTA, k, v, base, bh, start_m, tile, T, scale, BS: tl.constexpr,
                LP: tl.constexpr, BPT: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                UPCAST: tl.constexpr, DIAG: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q, do, lse, delta, cmt = _load_q_tile(Q, DO, LSE, DELTA, LSE, base, bh, offs_m, T, HEAD_DIM, UPCAST, False)
    p, ds = _tile_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS, LP, BPT, BLOCK_M, DIAG)
    return dk + tl.dot(tl.trans(ds).to(q.dtype), q), dv + tl.dot(tl.trans(p).to(do.dtype), do)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, T, scale, BS: tl.constexpr, LP: tl.constexpr,
                     BPT: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * T * HEAD_DIM
    d = tl.arange(0, HEAD_DIM)
    k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
    dk = tl.zeros((BPT * LP, HEAD_DIM), tl.float32)
    dv = tl.zeros((BPT * LP, HEAD_DIM), tl.float32)
    span: tl.constexpr = BPT * (BS + 1)
    first = (tile * span) // BLOCK_M * BLOCK_M  # earlier queries never see this tile
    after = tl.minimum(tl.cdiv((tile + 1) * span, BLOCK_M) * BLOCK_M, T)  # later ones see it all as earlier blocks
    for start_m in range(first, after, BLOCK_M):
        dk, dv = _fold_grads(dk, dv, Q, DO, LSE, DELTA, k, v, base, bh, start_m, tile, T, scale, BS, LP, BPT, BLOCK_M,
                             HEAD_DIM, UPCAST, True)
    for start_m in range(after, T, BLOCK_M):
        dk, dv = _fold_grads(dk, dv, Q, DO, LSE, DELTA, k, v, base, bh, start_m, tile, T, scale, BS, LP, BPT, BLOCK_M,
                             HEAD_DIM, UPCAST, False)
    tl.store(DK + base + pos[:, None] * HEAD_DIM + d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=valid[:, None])
    tl.store(DV + base + pos[:, None] * HEAD_DIM + d[None, :], dv.to(DV.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T, scale, BS: tl.constexpr, LP: tl.constexpr, BPT: tl.constexpr,
                   BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * T * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q, do, lse, delta, cmt = _load_q_tile(Q, DO, LSE, DELTA, LSE, base, bh, offs_m, T, HEAD_DIM, UPCAST, False)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1
    before = ((pid_m * BLOCK_M) // (BS + 1)) // BPT
    for tile in range(0, before):
        k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
        p, ds = _tile_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS, LP, BPT, BLOCK_M, False)
        dq += tl.dot(ds.to(k.dtype), k)
    for tile in range(before, last // (BPT * (BS + 1)) + 1):
        k, v, pos, valid = _load_kv_tile(K, V, base, tile, T, BS, LP, BPT, HEAD_DIM, UPCAST)
        p, ds = _tile_grads(q, k, v, do, lse, delta, offs_m, tile, T, scale, BS, LP, BPT, BLOCK_M, True)
        dq += tl.dot(ds.to(k.dtype), k)
    d = tl.arange(0, HEAD_DIM)
    tl.store(DQ + base + offs_m[:, None] * HEAD_DIM + d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=offs_m[:, None] < T)


class _OnePass(torch.autograd.Function):
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
        ctx.scale, ctx.meta = scale, meta
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        B, H, T, D = q.shape
        meta = ctx.meta
        delta = (do.float() * o.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
        dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        span = meta["BPT"] * (meta["BS"] + 1)
        _bwd_dkdv_kernel[(triton.cdiv(T, span), B * H)](q, k, v, do, lse, delta, dk, dv, T, ctx.scale, **meta)
        _bwd_dq_kernel[(triton.cdiv(T, meta["BLOCK_M"]), B * H)](q, k, v, do, lse, delta, dq, T, ctx.scale, **meta)
        return dq, dk, dv, None, None


def landmark_attention_onepass(q, k, v, block_size, scale):
    """Fused landmark attention with one exponential per score; ``landmark_attention``'s
    contract without a Context Miss Token (``scale`` already resolved)."""
    return _OnePass.apply(q, k, v, block_size, scale)
