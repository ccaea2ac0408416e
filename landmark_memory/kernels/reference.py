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
earlier landmarks in one softmax group, as DESIGN.md specifies.
"""

import torch

from ..tokenizer import landmark_mask


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


def grouped_softmax(x, g):
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


def landmark_weights(q, k, block_size, scale=None):
    """(B, H, T, T) final attention weights W of equations 3-4 (rows sum to 1)."""
    T = q.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = landmark_positions(T, block_size, q.device)
    G = landmark_groups(T, block_size, q.device)  # (T, T)
    S = grouped_softmax((q @ k.transpose(-2, -1)) * scale, G)  # (B, H, T, T)
    own_group = G == p[:, None]  # G_ij = p_i: the query's own (local) group
    gate = S.gather(-1, p.clamp(max=T - 1).expand_as(S))  # S_{i, p_j}
    is_lm = landmark_mask(T, block_size, q.device)
    return torch.where(is_lm, 0, torch.where(own_group, S, S * gate))


def landmark_attention_reference(q, k, v, block_size, scale=None):
    """Landmark attention by the paper's equations. See ``landmark_attention``."""
    return landmark_weights(q, k, block_size, scale) @ v
