"""Grouped-softmax landmark attention, written as the paper's equations 1-4 (section 3.1).

Plain PyTorch with autograd and O(T^2) memory: the slow, obviously-right definition that every
fast kernel is tested against.

Notation (per query ``i`` and key ``j`` of a landmarked sequence of length T):
    p_j   position of the landmark closing j's block (T for the trailing incomplete block;
          p_j = j exactly when j is a landmark)
    G_ij  group of key j for query i (eq. 2), -1 when j is ignored
    S_ij  GroupedSoftmax of the scaled scores over G_i (eq. 1)
    W_ij  final attention weight (eqs. 3-4)

Equation 3 compares G_ij with G_ii to find the query's own group. For a landmark query
G_ii = -1 (its own landmark is ignored), so we compare with p_i, the query's group id, which
is the same thing for normal queries and places a landmark query's own block tokens and the
earlier landmarks in one softmax group, as docs/design/inference.md specifies.

Context Miss Token (appendix D, equations 5-6): one more key at position -1, in every query's
own group. Landmarks of the blocks flagged as CMT-controlled leave the query's group for a
group of their own, and their blocks' tokens are gated twice: by their landmark's share of
that group and by the CMT's share of the query's group. The CMT and the landmarks themselves
get weight 0.
"""

import torch

from ..core.layout import landmark_mask


def landmark_positions(T, block_size, device=None):
    """(T,) int64: p_j, the landmark position of each position's block (eq. 2 notation)."""
    j = torch.arange(T, device=device)
    p = (j // (block_size + 1)) * (block_size + 1) + block_size
    return torch.where(p < T, p, T)


def landmark_groups(T, block_size, device=None):
    """(T, T) int64: G_ij of equation 2 under a causal mask; -1 marks ignored keys."""
    p = landmark_positions(T, block_size, device)
    i, j = p.new_tensor(range(T))[:, None], p.new_tensor(range(T))[None, :]
    pi, pj = p[:, None], p[None, :]
    is_lm_j = pj == j
    G = torch.where(~is_lm_j, pj, pi.expand(T, T))  # normal tokens: own block; landmarks: i's group
    G = torch.where(is_lm_j & (pi == j), -1, G)  # the query's own block landmark is ignored
    return torch.where(j > i, -1, G)  # causal


def grouped_softmax(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Softmax of ``x`` taken separately within each group (eq. 1).

    Parameters
    ----------
    x : Tensor (..., N) scores.
    g : LongTensor (..., N) broadcastable to x, group ids in [-1, N]; -1 entries are excluded
        and get weight 0.

    Returns
    -------
    Tensor (..., N): each group's entries sum to 1.
    """
    g = (g + 1).expand_as(x)  # 0 = excluded
    keep = g > 0
    x = x.masked_fill(~keep, float("-inf"))
    # the per-group max only stabilises exp(); softmax is invariant to it, so no gradient
    per_group = x.new_full((*x.shape[:-1], x.shape[-1] + 2), float("-inf"))  # (..., N + 2) group slots
    m = per_group.scatter_reduce(-1, g, x.detach(), "amax").gather(-1, g)
    e = torch.where(keep, torch.exp(x - torch.where(keep, m, 0)), 0)
    z = torch.zeros_like(per_group).scatter_add(-1, g, e).gather(-1, g)
    return torch.where(keep, e / torch.where(keep, z, 1), 0)


def _gated_weights(scores, G, own, gate_col, zero_col):
    """Equations 3-4 from scores and groups, for any key layout.

    scores, G : (..., T_q, N); own : (T_q,) the query's own group id; gate_col : (N,) column of
    each key's landmark (ignored where unused); zero_col : (..., N) bool, keys whose final
    weight is 0 (landmarks)."""
    S = grouped_softmax(scores, G)
    gate = S.gather(-1, gate_col.expand_as(S))  # S_{i, p_j}
    return torch.where(zero_col, 0, torch.where(G == own[:, None], S, S * gate))


def landmark_weights(q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float | None = None,
                     cmt_k: torch.Tensor | None = None, cmt_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, T, T) final attention weights W of equations 3-4 (rows sum to 1), or of
    equations 5-6 when ``cmt_k`` (B, H, 1, D), the rotated CMT key, and ``cmt_blocks``
    (B, T // (block_size + 1)) bool, the CMT-controlled landmarks, are given (rows then sum
    to 1 once a controlled landmark is visible, else to 1 minus the CMT's share)."""
    T = q.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = landmark_positions(T, block_size, q.device)
    G = landmark_groups(T, block_size, q.device)  # (T, T)
    zero = landmark_mask(T, block_size, q.device)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if cmt_k is None:
        return _gated_weights(s, G, p, p.clamp(max=T - 1), zero)
    B = q.shape[0]
    blk = torch.arange(T, device=q.device) // (block_size + 1)
    ctrl = torch.nn.functional.pad(cmt_blocks, (0, 1))[:, blk]  # (B, T): position j's block is controlled
    G_ctrl = torch.where((ctrl & zero)[:, None, None, :] & (G >= 0), T + 1, G)  # (B, 1, T, T): group "-2" = T + 1
    G_all = torch.cat([p[:, None].expand(B, 1, T, 1), G_ctrl], -1)  # (B, 1, T, 1 + T): the CMT in i's group
    S = grouped_softmax(torch.cat([(q @ cmt_k.transpose(-2, -1)) * scale, s], -1), G_all)
    S_cmt, S = S[..., :1], S[..., 1:]  # (B, H, T, 1), (B, H, T, T)
    gate = S.gather(-1, p.clamp(max=T - 1).expand_as(S))  # S_{i, p_j}
    W = torch.where(G == p[:, None], S, S * gate * torch.where(ctrl[:, None, None, :], S_cmt, 1.0))
    return torch.where(zero, 0, W)


def landmark_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                                 scale: float | None = None, cmt_k: torch.Tensor | None = None,
                                 cmt_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Landmark attention by the paper's equations. See ``landmark_attention``."""
    return landmark_weights(q, k, block_size, scale, cmt_k, cmt_blocks) @ v


def landmark_inference_reference(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope=10000.0,
                                 scale=None, cmt_k=None):
    """Chunk attention over local keys plus retrieved memory blocks, by the same equations.

    Every retrieved block is laid out in front of the local keys as one more earlier block:
    its landmark joins the query's own group and gates its normal tokens. With a CMT key the
    retrieved landmarks are the CMT-controlled ones (appendix D) and local landmarks are free.
    See ``landmark_attention_inference`` for the arguments."""
    from ..core.rope import as_rotary

    B, H, T_q, D = q.shape
    Tk, K, L = k.shape[-2], block_table.shape[-1], block_size + 1
    scale = D ** -0.5 if scale is None else scale
    i = torch.arange(Tk - T_q, Tk, device=q.device)  # query positions in the local layout
    p_loc = landmark_positions(Tk, block_size, q.device)
    own = p_loc[i]  # (T_q,)

    heads = torch.arange(H, device=q.device)[None, :, None,
                                             None] // (H // pool_k.shape[1])  # pool head of each query head
    rows = block_table.clamp(min=0).long()  # (B, H, T_q, K)
    # <R(p_q) q, R(P + t) k> = <R(-P) R(p_q) q, R(t) k>: rotate the query back by the block's
    # start instead of every gathered key forward (RoPE scores depend only on differences)
    qb = as_rotary(rope, D)(q[:, :, :, None, :], -block_pos)  # (B, H, T_q, K, D)
    s_ret = torch.einsum("bhqkd,bhqkld->bhqkl", qb, pool_k[rows, heads]).flatten(-2) * scale  # (B, H, T_q, K * L)
    rv = pool_v[rows, heads]  # (B, H, T_q, K, L, D)
    s_loc = (q @ k.transpose(-2, -1)) * scale  # (B, H, T_q, Tk)

    slot = torch.arange(K, device=q.device)[:, None]
    t = torch.arange(L, device=q.device)[None, :]
    ctrl_group = Tk + 1 + K  # group "-2" of the CMT-controlled (retrieved) landmarks
    lm_group = own[:, None, None] if cmt_k is None else torch.full_like(own[:, None, None], ctrl_group)
    G_ret = torch.where(t == block_size, lm_group, Tk + 1 + slot)  # (T_q, K, L): unique group per slot
    G_ret = torch.where((block_table < 0)[..., None], -1, G_ret).flatten(-2)  # (B, H, T_q, K * L)
    G_loc = landmark_groups(Tk, block_size, q.device)[i].expand(B, H, T_q, Tk)
    gate_col = torch.cat([(slot * L + block_size).expand(K, L).flatten(), K * L + p_loc.clamp(max=Tk - 1)])
    zero_col = torch.cat([(t == block_size).expand(K, L).flatten(), landmark_mask(Tk, block_size, q.device)])
    scores, G = torch.cat([s_ret, s_loc], -1), torch.cat([G_ret, G_loc], -1)
    if cmt_k is None:
        W = _gated_weights(scores, G, own, gate_col, zero_col)
    else:  # the CMT as a last column in the query's group; retrieved tokens gated by it too
        S = grouped_softmax(torch.cat([scores, (q @ cmt_k.transpose(-2, -1)) * scale], -1),
                            torch.cat([G, own[:, None].expand(B, H, T_q, 1)], -1))
        S, S_cmt = S[..., :-1], S[..., -1:]
        gate = S.gather(-1, gate_col.expand_as(S)) * torch.cat([S_cmt.expand_as(s_ret), torch.ones_like(s_loc)], -1)
        W = torch.where(zero_col, 0, torch.where(G == own[:, None], S, S * gate))
    return (torch.einsum("bhqn,bhqnd->bhqd", W[..., :K * L], rv.flatten(3, 4))
            + W[..., K * L:] @ v)
