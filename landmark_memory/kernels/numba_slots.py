"""The retrieved-block part of a chunk's attention, compiled for CPUs with Numba.

``dense.landmark_inference_dense`` weighs local and retrieved blocks with one grouped softmax;
what it needs of the retrieved blocks is every (query, slot)'s scores against its block's rows
and, given the weights of those rows, their sum of values. The PyTorch way (``dense._retrieved``)
groups a chunk's slots by block so that a block meets its queries in one matrix product, and
that bookkeeping (sorting, index copies, padding, gathered copies of block rows) costs more
than the products once a chunk's queries spread over many blocks. Here each query's slots are
one loop nest that reads its blocks' rows in place from the pool (no copy), rotated back to its
block's position with angles made once per distinct position, and queries run in parallel over
the CPU's threads. Same contract as ``dense._retrieved``; float32 or float64, no autograd
(``kernels.landmark_attention_inference`` takes it for chunks under ``backend="auto"``).
"""

import numpy as np
import torch
from numba import prange

from ..core.jit import njit
from ..core.rope import as_rotary, rotation_dtype
from .dense import pool_rows

# reductions may be reordered (and so vectorised); infinities and NaN keep their meaning
_FAST = {"reassoc", "contract"}


@njit(fastmath=_FAST, parallel=True)
def _scores(q, rows_k, step_k, H, G, T_q, table, which, cos, sin, ps, out):
    """q (N, D) the scaled queries, flat over (B, H, T_q); the pool's (L, D) rows (R, L, D),
    entry e and pool head g at row ``e * step_k + g``; table, which (N, K): pool entry (-1
    empty) and index of its position's rotation in cos, sin (U, D/2); ps the scales of an int8
    pool (n_pool, H_kv, D + L), or (0, H_kv, D + L) for a float pool; out (N, K, L), written:
    the rotated query against each row, 0 for an empty slot."""
    N, K = table.shape
    D, L = q.shape[1], out.shape[2]
    half = D // 2
    for n in prange(N):
        g = (n // T_q) % H // G  # the pool head of query head (n // T_q) % H
        x, qb = q[n], np.empty(D, q.dtype)
        for j in range(K):
            e = table[n, j]
            if e < 0:
                out[n, j, :] = 0.0
                continue
            c, s = cos[which[n, j]], sin[which[n, j]]
            for d in range(half):  # RoPE back to the block's start, rotate-half layout
                qb[d] = x[d] * c[d] - x[d + half] * s[d]
                qb[d + half] = x[d + half] * c[d] + x[d] * s[d]
            if ps.shape[0]:  # int8 keys: their channel scales fold into the query
                for d in range(D):
                    qb[d] *= ps[e, g, d]
            rows = rows_k[e * step_k + g]
            for r in range(L):
                acc = qb[0] * rows[r, 0]
                for d in range(1, D):
                    acc += qb[d] * rows[r, d]
                out[n, j, r] = acc


@njit(fastmath=_FAST, parallel=True)
def _values(w, rows_v, step_v, H, G, T_q, table, ps, out):
    """w (N, K, n) weights of each slot's first n rows (its normal ones); ps as for ``_scores``; out
    (N, D), written: the weighted sum of those rows' values over every filled slot."""
    N, K = table.shape
    bs, D = w.shape[2], out.shape[1]
    for n in prange(N):
        g = (n // T_q) % H // G
        acc = np.zeros(D, out.dtype)
        for j in range(K):
            e = table[n, j]
            if e < 0:
                continue
            rows = rows_v[e * step_v + g]
            for r in range(bs):
                a = w[n, j, r] * ps[e, g, D + r] if ps.shape[0] else w[n, j, r]
                for d in range(D):
                    acc[d] += a * rows[r, d]
        out[n, :] = acc


def retrieved_compiled(q, pool_k, pool_v, block_table, block_pos, rope, pool_scale=None):
    """``dense._retrieved`` compiled: scores (B, H, T_q, K, L) of every (query, slot) against its
    block (``q`` comes scaled), and the function that turns the weights of their normal rows
    (B, H, T_q, K, n) into the output (B, H, T_q, D). An int8 pool is read in place."""
    B, H, T_q, D = q.shape
    K, H_kv, L = block_table.shape[-1], pool_k.shape[1], pool_k.shape[2]
    ps = (pool_scale if pool_scale is not None else torch.empty((0, H_kv, D + L))).contiguous().numpy()
    (rows_k, step_k), (rows_v, step_v) = pool_rows(pool_k.detach()), pool_rows(pool_v.detach())
    table = block_table.reshape(-1, K).contiguous().numpy()
    at, which = torch.unique(block_pos.reshape(-1, K), return_inverse=True)  # a chunk's slots share a few positions
    cos, sin = as_rotary(rope, D).cos_sin(at, dtype=rotation_dtype(q.dtype))  # (U, D/2) each
    s = q.new_empty((B * H * T_q, K, L))
    _scores(q.detach().reshape(-1, D).contiguous().numpy(), rows_k.numpy(), step_k, H, H // H_kv, T_q, table,
            which.numpy(), cos.numpy(), (-sin).numpy(), ps, s.numpy())

    def read_values(w):
        out = q.new_empty((B * H * T_q, D))
        _values(w.detach().reshape(B * H * T_q, K, -1).contiguous().numpy(), rows_v.numpy(), step_v, H, H // H_kv,
                T_q, table, ps, out.numpy())
        return out.view(B, H, T_q, D)

    return s.view(B, H, T_q, K, L), read_values
