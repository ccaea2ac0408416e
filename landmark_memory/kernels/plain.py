"""Ordinary softmax attention of a chunk over its local keys and retrieved blocks: a memory
without landmarks (``MemoryOptions.block_keys="mean"``), where a retrieved block's tokens join
the local ones in one softmax, as InfLLM reads its memory (arXiv 2402.04617). Every row of a
block is a token: there is no landmark row to gate it.

``block_inference_reference`` gathers every query's retrieved rows and is the definition;
``block_inference_dense`` scores the retrieved slots with the landmark kernels' ``retrieved``
functions (``dense._retrieved``, or the compiled ``numba_slots.retrieved_compiled``), which read
each block's rows in place from the pool, and merges them with the local scores in one softmax.
The blocks every query of a stream and head reads at one position (the sink and local blocks,
or every block where the retrieval is shared per head: the table's last ``shared`` columns) join
the local keys instead, rotated to their positions once: one matrix product for the whole chunk
instead of a slot per query.
"""

import torch

from ..core.quant import dequantize_kv
from ..core.rope import as_rotary
from .dense import NEG_INF, _retrieved


def _causal(Tk, T_q, device):
    """(T_q, Tk) bool: the local keys each of the last ``T_q`` of ``Tk`` positions sees."""
    return torch.arange(Tk, device=device)[None, :] <= torch.arange(Tk - T_q, Tk, device=device)[:, None]


def block_inference_reference(q, k, v, pool_k, pool_v, block_table, block_pos, rope=10000.0, scale=None):
    """One softmax per query over its retrieved blocks' rows, each at its block's position,
    and the local keys it sees (causal). Arguments as ``block_attention_inference``'s."""
    B, H, T_q, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    heads = torch.arange(H, device=q.device)[None, :, None, None] // (H // pool_k.shape[1])
    rows = block_table.clamp(min=0).long()  # (B, H, T_q, K)
    qb = as_rotary(rope, D)(q[:, :, :, None, :], -block_pos)  # (B, H, T_q, K, D) back to each block's start
    s_ret = torch.einsum("bhqkd,bhqkld->bhqkl", qb, pool_k[rows, heads]) * scale  # (B, H, T_q, K, L)
    s_ret = s_ret.masked_fill((block_table < 0)[..., None], NEG_INF).flatten(-2)
    s_loc = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~_causal(k.shape[-2], T_q, q.device), NEG_INF)
    w = torch.softmax(torch.cat([s_ret, s_loc], -1), -1)
    n = s_ret.shape[-1]
    return torch.einsum("bhqn,bhqnd->bhqd", w[..., :n], pool_v[rows, heads].flatten(3, 4)) + w[..., n:] @ v


def _shared_kv(pool_k, pool_v, table, pos, rope, pool_scale, dtype):
    """Keys at their blocks' positions and values (B, H, S * L, D) each of the blocks ``table``
    (B, H, S) names per stream and query head at ``pos`` (B, H, S), and a bias (B, H, 1, S * L):
    -inf on the rows of an empty (-1) column, else 0."""
    B, H, S = table.shape
    heads = torch.arange(H, device=table.device)[None, :, None] // (H // pool_k.shape[1])  # (1, H, 1)
    e = table.clamp(min=0).long()
    k, v = pool_k[e, heads], pool_v[e, heads]  # (B, H, S, L, D)
    if pool_scale is not None:
        k, v = (t.view(k.shape) for t in dequantize_kv(k.flatten(0, 2)[:, None], v.flatten(0, 2)[:, None],
                                                         pool_scale[e, heads].flatten(0, 2)[:, None], dtype))
    k = as_rotary(rope, k.shape[-1])(k.to(dtype), pos[..., None])  # rows already rotated by their offsets
    bias = torch.zeros(table.shape, dtype=dtype, device=table.device).masked_fill(table < 0, NEG_INF)
    L = k.shape[-2]
    return k.flatten(2, 3), v.to(dtype).flatten(2, 3), bias.repeat_interleave(L, -1)[:, :, None]


def block_inference_dense(q, k, v, pool_k, pool_v, block_table, block_pos, rope=10000.0, scale=None,
                          retrieved=None, pool_scale=None, shared=0):
    """``block_inference_reference``'s result without gathering any block: ``retrieved``
    (``dense._retrieved`` by default, or ``numba_slots.retrieved_compiled``) scores every slot
    against its block's rows in place and reads their values by the softmax's weights; an int8
    pool (``pool_scale``) is read in place too. ``shared``: the table's last ``shared`` columns
    hold, per stream and head, the same blocks at the same positions for every query: they are
    read as keys before the local ones (all in every query's past)."""
    B, H, T_q, D = q.shape
    bias = None
    if shared and block_table.shape[-1] and pool_k.shape[0]:
        sk, sv, bias = _shared_kv(pool_k, pool_v, block_table[:, :, 0, -shared:], block_pos[:, :, 0, -shared:], rope,
                                  pool_scale, q.dtype)
        k, v = torch.cat([sk, k], 2), torch.cat([sv, v], 2)  # (B, H, S * L + Tk, D)
        block_table, block_pos = block_table[..., :-shared], block_pos[..., :-shared]
    q = q * (D ** -0.5 if scale is None else scale)  # scaled once
    s_loc = (q @ k.transpose(-2, -1)).masked_fill(~_causal(k.shape[-2], T_q, q.device), NEG_INF)  # (B, H, T_q, Tk)
    if bias is not None:  # the empty shared columns' rows
        s_loc[..., :bias.shape[-1]] += bias
    if block_table.shape[-1] == 0 or pool_k.shape[0] == 0:
        return torch.softmax(s_loc, -1) @ v
    s_ret, read_values = (retrieved or _retrieved)(q, pool_k, pool_v, block_table, block_pos, rope, pool_scale)
    s_ret = s_ret.masked_fill((block_table < 0)[..., None], NEG_INF)  # (B, H, T_q, K, L)
    # (B, H, T_q, 1), finite: a query sees itself
    top = torch.maximum(s_loc.amax(-1), s_ret.flatten(-2).amax(-1))[..., None]
    p_loc, p_ret = torch.exp(s_loc - top), torch.exp(s_ret - top[..., None])
    total = p_loc.sum(-1, keepdim=True) + p_ret.flatten(-2).sum(-1, keepdim=True)  # (B, H, T_q, 1)
    return (p_loc @ v + read_values(p_ret)) / total
