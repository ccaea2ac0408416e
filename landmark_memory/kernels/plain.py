"""Ordinary softmax attention of a chunk over its local keys and retrieved blocks: a memory
without landmarks (``MemoryOptions.block_keys="mean"``), where a retrieved block's tokens join
the local ones in one softmax, as InfLLM reads its memory (arXiv 2402.04617). Every row of a
block is a token: there is no landmark row to gate it.

``block_inference_reference`` gathers every query's retrieved rows and is the definition;
``block_inference_dense`` scores the retrieved slots with the landmark kernels' ``retrieved``
functions (``dense._retrieved``, or the compiled ``numba_slots.retrieved_compiled``), which read
each block's rows in place from the pool, and merges them with the local scores in one softmax.
The blocks every query of a stream reads at one position (the sink and local blocks: the table's
last ``shared`` columns) join the local keys instead, rotated to their positions once: one matrix
product for the whole chunk instead of a slot per query.
"""

import torch

from ..core.quant import dequantize_kv
from ..core.rope import as_rotary
from .dense import NEG_INF, _retrieved


def _causal(Tk, Tq, device):
    """(Tq, Tk) bool: the local keys each of the last ``Tq`` of ``Tk`` positions sees."""
    return torch.arange(Tk, device=device)[None, :] <= torch.arange(Tk - Tq, Tk, device=device)[:, None]


def block_inference_reference(q, k, v, pool_k, pool_v, block_table, block_pos, rope=10000.0, scale=None):
    """One softmax per query over its retrieved blocks' rows, each at its block's position,
    and the local keys it sees (causal). Arguments as ``block_attention_inference``'s."""
    B, H, Tq, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    heads = torch.arange(H, device=q.device)[None, :, None, None] // (H // pool_k.shape[1])
    rows = block_table.clamp(min=0).long()  # (B, H, Tq, K)
    qb = as_rotary(rope, D)(q[:, :, :, None, :], -block_pos)  # (B, H, Tq, K, D) back to each block's start
    s_ret = torch.einsum("bhqkd,bhqkld->bhqkl", qb, pool_k[rows, heads]) * scale  # (B, H, Tq, K, L)
    s_ret = s_ret.masked_fill((block_table < 0)[..., None], NEG_INF).flatten(-2)
    s_loc = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~_causal(k.shape[-2], Tq, q.device), NEG_INF)
    w = torch.softmax(torch.cat([s_ret, s_loc], -1), -1)
    n = s_ret.shape[-1]
    return torch.einsum("bhqn,bhqnd->bhqd", w[..., :n], pool_v[rows, heads].flatten(3, 4)) + w[..., n:] @ v


def _shared_kv(pool_k, pool_v, table, pos, rope, pool_scale, group, dtype):
    """Keys at their blocks' positions and values (B, H, n * L, D) each of the blocks ``table``
    (B, S) at ``pos`` (B, S) names per stream, its -1 columns left out (they are -1 for every
    stream alike: streams hold as many blocks)."""
    keep = table[0] >= 0
    e, at = table[:, keep].long(), pos[:, keep]  # (B, n)
    k, v = pool_k[e], pool_v[e]  # (B, n, H_kv, L, D)
    if pool_scale is not None:
        k, v = (t.view(k.shape) for t in dequantize_kv(k.flatten(0, 1), v.flatten(0, 1), pool_scale[e].flatten(0, 1),
                                                         dtype))
    k = as_rotary(rope, k.shape[-1])(k.to(dtype), at[:, :, None, None])  # rows already rotated by their offsets
    k, v = (t.to(dtype).permute(0, 2, 1, 3, 4).flatten(2, 3) for t in (k, v))  # (B, H_kv, n * L, D)
    return (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def block_inference_dense(q, k, v, pool_k, pool_v, block_table, block_pos, rope=10000.0, scale=None,
                          retrieved=None, pool_scale=None, shared=0):
    """``block_inference_reference``'s result without gathering any block: ``retrieved``
    (``dense._retrieved`` by default, or ``numba_slots.retrieved_compiled``) scores every slot
    against its block's rows in place and reads their values by the softmax's weights; an int8
    pool (``pool_scale``) is read in place too. ``shared``: the table's last ``shared`` columns
    hold, per stream, the same blocks at the same positions for every query (or -1 for all):
    they are read as keys before the local ones (all in every query's past)."""
    B, H, Tq, D = q.shape
    if shared and block_table.shape[-1] and pool_k.shape[0]:
        sk, sv = _shared_kv(pool_k, pool_v, block_table[:, 0, 0, -shared:], block_pos[:, 0, 0, -shared:], rope,
                            pool_scale, H // pool_k.shape[1], q.dtype)
        k, v = torch.cat([sk, k], 2), torch.cat([sv, v], 2)  # (B, H, n * L + Tk, D)
        block_table, block_pos = block_table[..., :-shared], block_pos[..., :-shared]
    q = q * (D ** -0.5 if scale is None else scale)  # scaled once
    s_loc = (q @ k.transpose(-2, -1)).masked_fill(~_causal(k.shape[-2], Tq, q.device), NEG_INF)  # (B, H, Tq, Tk)
    if block_table.shape[-1] == 0 or pool_k.shape[0] == 0:
        return torch.softmax(s_loc, -1) @ v
    s_ret, read_values = (retrieved or _retrieved)(q, pool_k, pool_v, block_table, block_pos, rope, pool_scale)
    s_ret = s_ret.masked_fill((block_table < 0)[..., None], NEG_INF)  # (B, H, Tq, K, L)
    # (B, H, Tq, 1), finite: a query sees itself
    top = torch.maximum(s_loc.amax(-1), s_ret.flatten(-2).amax(-1))[..., None]
    p_loc, p_ret = torch.exp(s_loc - top), torch.exp(s_ret - top[..., None])
    total = p_loc.sum(-1, keepdim=True) + p_ret.flatten(-2).sum(-1, keepdim=True)  # (B, H, Tq, 1)
    return (p_loc @ v + read_values(p_ret)) / total
