"""Landmark attention of a few queries over local keys and retrieved blocks, compiled for CPUs
with Numba: the kernel of a decoding step.

The same contract and formulation as ``landmark_inference_dense`` (dense.py): one softmax over
effective scores, where a token of an earlier block c gets s + s_landmark(c) - logsumexp_c(s),
a token of the query's own block keeps s, and everything else is -inf; a retrieved block is an
earlier block. The dense path builds that from some sixty small tensor operations per call,
and with one or two queries per head their dispatch, not the arithmetic, is what a decoding
step costs on a CPU. Here one compiled loop nest per query does it all in one call: each
retrieved block's rows are read in place from the pool (no gathered copy; an int8 block's
scales fold into the query and the weights), the query is rotated to the block's position on
the fly, and scores, gates, softmax and output never leave a scratch
row. Loops are serial: a step's work is far too small to pay for threads.

float32 and float64 only, no autograd (``kernels.landmark_attention_inference`` sends other
calls to the dense path). Compiled on first use, and cached on disk where it can be (jit.py).
"""

import math

import numpy as np
import torch

from ..core.jit import njit
from ..core.rope import as_rotary
from .dense import pool_rows

# reductions may be reordered (and so vectorised); infinities and NaN keep their meaning
_FAST = {"reassoc", "contract"}


@njit(fastmath=_FAST)
def _dot(x, y):  # accumulates in the inputs' dtype, as a matrix product would
    acc = x[0] * y[0]
    for d in range(1, x.shape[0]):
        acc += x[d] * y[d]
    return acc


@njit(fastmath=_FAST)
def _axpy(a, x, y):  # y += a * x, in place
    for d in range(x.shape[0]):
        y[d] += a * x[d]


@njit(fastmath=_FAST)
def _logsumexp(x):
    m = -np.inf
    for a in x:
        m = max(m, a)
    if m == -np.inf:
        return m
    z = 0.0
    for a in x:
        z += math.exp(a - m)
    return m + math.log(z)


@njit(fastmath=_FAST)
def _kernel(q, k, v, rows_k, step_k, rows_v, step_v, H_kv, table, pos, inv_freq, block_size, scale, cmt_k, ps, out):
    """q (B, H, T_q, D); k, v (B, H, Tk, D); the pool's (L, D) rows (R, L, D), entry e and head
    g at row ``e * step + g`` (dense.pool_rows), H_kv pool heads; table, pos (B, H, T_q, K);
    inv_freq (D/2,) float64; cmt_k (B, H, 1, D) or (B, H, 0, D) without a CMT; ps the scales
    of an int8 pool (n_pool, H_kv, D + L), or (0, H_kv, D + L) for a float pool; out
    (B, H, T_q, D), written. Every array C-contiguous, so inner loops vectorise."""
    B, H, T_q, D = q.shape
    Tk, K, L, half = k.shape[2], table.shape[3], block_size + 1, D // 2
    G = H // H_kv  # query heads per pool head
    n_ret = K * L  # retrieved columns come first, then the local ones
    eff = np.empty(n_ret + Tk, np.float64)  # one query's effective scores
    qb = np.empty(D, q.dtype)  # the query rotated to a block's start
    acc = np.empty(D, np.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T_q):
                x, i = q[b, h, t], Tk - T_q + t  # the query and its local position
                own = i // L  # its block among the local ones
                # retrieved blocks: scores at the block's own position, gated by its landmark
                lse_ctrl, seen = -np.inf, False
                for j in range(K):
                    e, c0 = table[b, h, t, j], j * L
                    if e < 0:
                        eff[c0:c0 + L] = -np.inf
                        continue
                    p = pos[b, h, t, j]
                    for d in range(half):  # RoPE by -p, rotate-half layout
                        cs, sn = math.cos(p * inv_freq[d]), -math.sin(p * inv_freq[d])
                        qb[d] = x[d] * cs - x[d + half] * sn
                        qb[d + half] = x[d + half] * cs + x[d] * sn
                    if ps.shape[0]:  # int8 keys: their channel scales fold into the query
                        for d in range(D):
                            qb[d] *= ps[e, h // G, d]
                    for r in range(L):
                        eff[c0 + r] = _dot(qb, rows_k[e * step_k + h // G, r]) * scale
                    s_lm = eff[c0 + block_size]
                    gate = s_lm - _logsumexp(eff[c0:c0 + block_size])
                    for r in range(block_size):
                        eff[c0 + r] += gate
                    eff[c0 + block_size] = -np.inf
                    seen = True
                    lse_ctrl = np.logaddexp(lse_ctrl, s_lm)
                # local keys: earlier blocks gated by their landmark, the own block plain, nothing after i
                for c in range(Tk):
                    eff[n_ret + c] = _dot(x, k[b, h, c]) * scale if c <= i else -np.inf
                for blk in range(own):
                    c0 = n_ret + blk * L
                    gate = eff[c0 + block_size] - _logsumexp(eff[c0:c0 + block_size])
                    for r in range(block_size):
                        eff[c0 + r] += gate
                    eff[c0 + block_size] = -np.inf
                if i % L == block_size:  # a landmark query ignores its own landmark
                    eff[n_ret + i] = -np.inf
                sink = -np.inf
                if cmt_k.shape[2]:  # the CMT's share of the query's group gates the retrieved blocks
                    s_cmt = _dot(x, cmt_k[b, h, 0]) * scale
                    if seen:
                        for c in range(n_ret):
                            eff[c] += s_cmt - lse_ctrl
                    else:
                        sink = s_cmt
                m = sink
                for c in range(n_ret + i + 1):
                    m = max(m, eff[c])
                z = math.exp(sink - m)
                acc[:] = 0.0
                for j in range(K):
                    e = table[b, h, t, j]
                    if e < 0:
                        continue
                    for r in range(block_size):
                        w = math.exp(eff[j * L + r] - m)
                        z += w
                        _axpy(w * ps[e, h // G, D + r] if ps.shape[0] else w, rows_v[e * step_v + h // G, r], acc)
                for c in range(i + 1):
                    w = math.exp(eff[n_ret + c] - m)
                    if w > 0.0:
                        z += w
                        _axpy(w, v[b, h, c], acc)
                for d in range(D):
                    out[b, h, t, d] = acc[d] / z


def landmark_inference_numba(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope=10000.0,
                             scale=None, cmt_k=None, pool_scale=None):
    """Local keys plus retrieved blocks, compiled; same contract as ``landmark_attention_inference``
    (float32 or float64 CPU tensors, no autograd; an int8 pool read in place)."""
    B, H, T_q, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    inv_freq = as_rotary(rope, D).inv_freq(q.device).numpy()
    cmt = q.new_empty((B, H, 0, D)) if cmt_k is None else cmt_k
    ps = (pool_scale if pool_scale is not None else
          torch.empty((0, pool_k.shape[1], D + block_size + 1))).contiguous().numpy()
    (rows_k, step_k), (rows_v, step_v) = pool_rows(pool_k.detach()), pool_rows(pool_v.detach())
    q, k, v, table, pos, cmt = (t.detach().contiguous().numpy() for t in (q, k, v, block_table, block_pos, cmt))
    _kernel(q, k, v, rows_k.numpy(), step_k, rows_v.numpy(), step_v, pool_k.shape[1], table, pos, inv_freq,
            block_size, float(scale), cmt, ps, out.numpy())
    return out
