"""Landmark attention as grouped softmax, in dense PyTorch: the fast path on CPUs.

Equations 1-4 of the paper, grouped as they read: a query's own softmax group holds the
landmark of every earlier block it sees and the keys of its own block it sees; a block's normal
tokens share their landmark's weight by a softmax inside the block. So a token r of an earlier
block c gets P(landmark c) * softmax_c(s)_r, a token of the query's own block P(r), everything
else 0. The same weights as one softmax over effective scores s + s_landmark(c) -
logsumexp_c(s) (the Triton kernel's formulation, triton_landmark.py), computed with a few
passes over the (query, key) scores: scores are viewed as (..., T_q, blocks, block_size + 1).
In sequence, queries go in tiles (``QUERY_TILE``), so a forward without autograd holds
O(T x tile) scores at a time; with autograd the tiles' weights are kept for the backward,
O(T^2) like the reference the kernel is tested against.

Context Miss Token (appendix D): the landmarks of controlled blocks a query sees move by
s_cmt - lse_ctrl, where lse_ctrl is their log-sum-exp; together they then carry exp(s_cmt),
the CMT's share of the query's group. A query that sees no controlled landmark gives that
share to a value-less sink instead.
"""

import functools

import torch
import torch.nn.functional as F

from ..core.rope import as_rotary, rotation_dtype

NEG_INF = float("-inf")
QUERY_TILE = 256  # queries per tile of the in-sequence path (256 measured best on CPUs, T = 512-4096)
GATHER_BELOW = 16  # queries per head under which (decoding) each retrieved slot's block is gathered on its own


# a decoding step (T_q = 1) asks for the layout of the step a chunk before: small ones are kept
@functools.lru_cache(maxsize=1024)
def _local_layout(T_k, T_q, block_size, device):
    """For queries at the last T_q of T_k in-sequence positions, keys laid out as whole blocks
    from position 0: each query's own block (T_q,) long, the keys of it the query sees (T_q, L)
    bool (causal, never its own block's landmark), and the blocks it sees as earlier
    (T_q, n_blocks) bool."""
    L = block_size + 1
    i = torch.arange(T_k - T_q, T_k, device=device)
    r = torch.arange(L, device=device)
    own = i // L
    own_keys = (r <= (i % L)[:, None]) & (r != block_size)
    return own, own_keys, torch.arange(-(-T_k // L), device=device) < own[:, None]


def _as_blocks(s, block_size):
    """(..., N) scores against keys from position 0 -> (..., n_blocks, L), the padded tail -inf."""
    L = block_size + 1
    return F.pad(s, (0, -s.shape[-1] % L), value=NEG_INF).unflatten(-1, (-1, L))


def _group_logits(parts, earlier, own, own_keys, block_size):
    """A query's softmax group (..., T_q, N + L): the landmark scores of the N blocks of
    ``parts`` (-inf where it does not see the block as earlier), then the scores of its own
    block's keys (-inf where it does not see them).

    parts : list of (..., T_q, N_i, L) block scores, N = sum of N_i; the own block is in the last.
    earlier : (..., T_q, N) bool. own : (T_q,) long, index of the own block in the last part.
    own_keys : (T_q, L) bool."""
    lm = torch.cat([s[..., block_size] for s in parts], -1).masked_fill(~earlier, NEG_INF)  # (..., T_q, N)
    s = parts[-1]
    mine = s[..., torch.arange(s.shape[-3], device=s.device), own, :].masked_fill(~own_keys, NEG_INF)  # (..., T_q, L)
    return torch.cat([lm, mine], -1)


def _grouped_weights(parts, earlier, own, own_keys, block_size, s_cmt=None, controlled=None):
    """Attention weights of the normal tokens, one (..., T_q, N_i, block_size) per part of
    ``parts`` (see ``_group_logits``); landmark keys themselves are never attended to.

    s_cmt : (..., T_q, 1), the CMT's scores, with controlled (..., N) bool, the blocks it
    controls (broadcast)."""
    N = earlier.shape[-1]
    group = _group_logits(parts, earlier, own, own_keys, block_size)  # (..., T_q, N + L)
    if s_cmt is not None:
        ctrl = earlier & controlled  # the controlled landmarks each query sees
        seen = ctrl.any(-1, keepdim=True)
        # a finite floor, not -inf: a query that sees none must not get NaN gradients through it
        lse = torch.logsumexp(group[..., :N].masked_fill(~ctrl, torch.finfo(group.dtype).min), -1, keepdim=True)
        shift = torch.where(ctrl & seen, s_cmt - lse, 0.0)
        sink = torch.where(seen, NEG_INF, s_cmt)  # the CMT's share, lost when nothing is controlled
        group = torch.cat([group[..., :N] + shift, group[..., N:], sink], -1)
    P = torch.softmax(group, -1)  # (..., T_q, N + L [+ 1])
    out, n = [], 0
    for s in parts:  # a block's tokens share its landmark's weight by a softmax inside the block
        inside = torch.softmax(s[..., :block_size], -1)  # (..., T_q, N_i, bs)
        P_i = P[..., n:n + s.shape[-2], None]
        # in place where nothing needs the softmax kept for a backward (one pass less over the weights)
        out.append(inside * P_i if inside.requires_grad else inside.mul_(P_i))
        n += s.shape[-2]
    # the own block was not seen as earlier (weight 0 so far): its tokens carry their own weights
    out[-1][..., torch.arange(own.shape[0], device=own.device), own, :] = P[..., N:N + block_size]
    return out


def _normal_rows(x, block_size):
    """(..., T, D) keys or values from position 0 -> (..., n_blocks * block_size, D): the
    normal tokens' rows, laid out as ``_grouped_weights`` weighs them (padded tail zero)."""
    L = block_size + 1
    x = F.pad(x, (0, 0, 0, -x.shape[-2] % L)).unflatten(-2, (-1, L))  # (..., nb, L, D)
    return x[..., :block_size, :].flatten(-3, -2)


def landmark_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                             scale: float | None = None, cmt_k: torch.Tensor | None = None,
                             cmt_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """In-sequence landmark attention; same contract as ``landmark_attention``.

    Queries go in tiles of ``QUERY_TILE``, each against the keys up to its own end: causality
    spares a tile every later key, about half of the T x T work for long sequences."""
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)  # scaled once, not every score
    T = k.shape[-2]
    s_cmt = None if cmt_k is None else q @ cmt_k.transpose(-2, -1)  # (B, H, T, 1)
    values = _normal_rows(v, block_size)  # (B, H, nb * bs, D); a tile reads its blocks' rows
    out = []
    for a in range(0, T, QUERY_TILE):
        b = min(T, a + QUERY_TILE)
        s = _as_blocks(q[..., a:b, :] @ k[..., :b, :].transpose(-2, -1), block_size)  # (B, H, b - a, nb, L)
        own, own_keys, earlier = _local_layout(b, b - a, block_size, q.device)
        controlled = None
        if cmt_k is not None:
            nb, n = s.shape[-2], cmt_blocks.shape[-1]
            controlled = F.pad(cmt_blocks, (0, max(0, nb - n)))[:, None, None, :nb]  # (B, 1, 1, nb)
        w, = _grouped_weights([s], earlier, own, own_keys, block_size, None if s_cmt is None else s_cmt[..., a:b, :],
                              controlled)  # (B, H, b - a, nb, bs)
        out.append(w.flatten(-2) @ values[..., :w.shape[-2] * block_size, :])  # keys past b weigh 0
    return out[0] if len(out) == 1 else torch.cat(out, -2)


def local_group_logsumexp(s, block_size):
    """log of the normaliser of each query's own softmax group, from local scores alone.

    s : (..., T_q, T_k) scores of queries at the last T_q of T_k in-sequence positions.
    Returns (..., T_q)."""
    own, own_keys, earlier = _local_layout(s.shape[-1], s.shape[-2], block_size, s.device)
    return torch.logsumexp(_group_logits([_as_blocks(s, block_size)], earlier, own, own_keys, block_size), -1)


def landmark_inference_dense(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope=10000.0,
                             scale=None, cmt_k=None, retrieved=None, pool_scale=None):
    """Local keys plus retrieved blocks; same contract as ``landmark_attention_inference``.

    A retrieved block behaves as a complete earlier block in sequence, so retrieved and local
    blocks are weighed by one grouped softmax. ``retrieved``: what computes the retrieved
    slots' scores and reads their values, ``_retrieved`` (PyTorch, with autograd) by default
    or ``numba_slots.retrieved_compiled``; an int8 pool (with ``pool_scale``) is read by either
    block by block, each block dequantized as it is read."""
    B, H, T_q, D = q.shape
    K = block_table.shape[-1]
    q = q * (D ** -0.5 if scale is None else scale)  # scaled once, not every score
    s = _as_blocks(q @ k.transpose(-2, -1), block_size)  # (B, H, T_q, nb, L)
    own, own_keys, earlier = _local_layout(k.shape[-2], T_q, block_size, q.device)
    parts = [s]
    if K:
        s_ret, read_values = (retrieved or _retrieved)(q, pool_k, pool_v, block_table, block_pos, rope,
                                                       pool_scale)  # (B, H, T_q, K, L)
        parts.insert(0, s_ret)
        earlier = torch.cat([block_table >= 0, earlier.expand(B, H, -1, -1)], -1)  # empty slots are not seen
    s_cmt = controlled = None
    if cmt_k is not None:  # every retrieved landmark is CMT-controlled, every local one free
        s_cmt = q @ cmt_k.transpose(-2, -1)  # (B, H, T_q, 1)
        controlled = torch.arange(earlier.shape[-1], device=q.device) < K
    w = _grouped_weights(parts, earlier, own, own_keys, block_size, s_cmt, controlled)
    out = w[-1].flatten(-2) @ _normal_rows(v, block_size)  # (B, H, T_q, D)
    return out + read_values(w[0]) if K else out


def _retrieved(q, pool_k, pool_v, block_table, block_pos, rope, pool_scale=None):
    """Scores of every (query, slot) against its retrieved block, (B, H, T_q, K, L), and the
    function that turns the weights of their first rows (B, H, T_q, K, n), n <= L (a landmark
    block's normal tokens, or every row of a block without one), into the output (B, H, T_q, D).
    ``q`` comes scaled; an int8 pool's blocks are dequantized as they
    are read (``pool_scale`` (n_pool, H_kv, D + L)), never the whole pool.

    Copying each slot's block (L, D) out of the pool is what bounds this kernel on CPUs, and a
    chunk's queries share most of their blocks.
    So the slots are grouped by (head, block): each slot's query is rotated to its block's
    position, the group's queries meet the block's rows in one matrix product, and the block is
    read once per group. Groups are padded to a power of two rows and laid out in one buffer
    by size, and each size is one batched product: padding at most doubles the arithmetic.
    With a handful of queries (decoding) every slot is gathered."""
    B, H, T_q, D = q.shape
    K, (n_pool, H_kv, L, _) = block_table.shape[-1], pool_k.shape
    (rows_k, step_k), (rows_v, step_v) = pool_rows(pool_k), pool_rows(pool_v)  # (rows, L, D)
    rope = as_rotary(rope, D)

    scale_rows = None if pool_scale is None else pool_scale.reshape(-1, D + L)  # entry e, head g at row e * H_kv + g

    def rows(rows_, step, bh_, e):  # the (L, D) rows of pool entry e for flat query head(s) bh_, in q's dtype
        g = (bh_ % H) // (H // H_kv)
        out = rows_.index_select(0, (e * step + g).flatten())  # (N, L, D)
        if scale_rows is None:
            return out
        s = scale_rows.index_select(0, (e * H_kv + g).flatten())  # (N, D + L)
        return (out * (s[:, None, :D] if rows_ is rows_k else s[:, D:, None])).to(q.dtype)

    if T_q < GATHER_BELOW:
        bh_all = torch.arange(B * H, device=q.device).view(B, H, 1, 1)
        e = block_table.clamp(min=0).long()  # (B, H, T_q, K)
        qb = rope(q[:, :, :, None, :], -block_pos)  # rotated back to each block's start
        k_g, v_g = (rows(r, st, bh_all, e).view(B, H, T_q, K, L, D) for r, st in ((rows_k, step_k), (rows_v, step_v)))
        s = (qb[..., None, :] @ k_g.transpose(-2, -1))[..., 0, :]  # (B, H, T_q, K, L)
        return s, lambda w: (w.flatten(-2)[..., None, :] @ v_g[..., :w.shape[-1], :].flatten(-3, -2))[..., 0, :]
    flat = block_table.flatten()
    full = bool((flat >= 0).all())  # a chunk's slots are usually all filled: then no scatter is needed
    # flat in (B, H, T_q, K), (N,)
    slot = torch.arange(len(flat), device=q.device) if full else (flat >= 0).nonzero()[:, 0]
    query = slot // K  # flat in (B, H, T_q)
    entry, pos = flat[slot].long(), block_pos.flatten()[slot].long()
    # each slot's query is rotated to its own block position below, so a block's rows serve every
    # slot of its (head, block) whatever the position
    keys, group_of, users = torch.unique((query // T_q) * n_pool + entry, return_inverse=True,
                                        return_counts=True)  # (P,), (N,), (P,): one group per (head, block)
    group_bh, group_entry = keys // n_pool, keys % n_pool
    # each slot's rank among its group's slots: slots sorted by group, minus where the group starts
    order = torch.argsort(group_of, stable=True)
    rank = torch.empty_like(group_of)
    rank[order] = torch.arange(len(slot), device=q.device) - (torch.cumsum(users, 0) - users).repeat_interleave(users)
    # groups padded to a power of two rows and sorted by that size: one buffer holds every group's
    # queries, and each run of equal sizes is one batched matrix product
    cap = torch.ceil(torch.log2(users.double())).long()  # (P,) log2 of a group's padded rows
    by_cap = torch.argsort(cap, stable=True)
    place = torch.empty_like(by_cap)
    place[by_cap] = torch.arange(len(by_cap), device=q.device)
    size = 1 << cap[by_cap]
    row = (torch.cumsum(size, 0) - size)[place[group_of]] + rank  # (N,) each slot's row in the buffer
    caps, counts = torch.unique_consecutive(cap[by_cap], return_counts=True)
    runs, first = [], 0  # (first group, groups, rows per group)
    for c, n in zip(caps.tolist(), counts.tolist()):
        runs.append((first, n, 1 << c))
        first += n
    n_rows, group_bh, group_entry = int(size.sum()), group_bh[by_cap], group_entry[by_cap]

    def through_blocks(x, rows_, step, scores):  # per slot (N, D) -> scores (N, L), or weights (N, n) -> (N, D)
        blocks = rows(rows_, step, group_bh, group_entry)  # (P, L, D)
        blocks = blocks.transpose(-2, -1) if scores else blocks[:, :x.shape[1]]
        xb = x.new_zeros((n_rows, x.shape[1])).index_copy_(0, row, x)
        out, r = x.new_empty((n_rows, blocks.shape[-1])), 0
        for a, n, m in runs:
            torch.matmul(xb[r:r + n * m].view(n, m, -1), blocks[a:a + n], out=out[r:r + n * m].view(n, m, -1))
            r += n * m
        return out.index_select(0, row)

    def per_slot(x, width):  # (N, width) for the filled slots -> (B, H, T_q, K, width), empty slots 0
        return (x if full else x.new_zeros((len(flat), width)).index_copy_(0, slot, x)).view(B, H, T_q, K, width)

    # a chunk's slots sit at a few distinct positions (stingy): angles once per position
    at, which = torch.unique(pos, return_inverse=True)
    cos, sin = rope.angles(-at, dtype=rotation_dtype(q.dtype))  # (U, D) each
    q_slot = rope.rotate((cos.index_select(0, which), sin.index_select(0, which)),
                         q.reshape(-1, D).index_select(0, query))  # (N, D) rotated to each slot's block
    s_ret = per_slot(through_blocks(q_slot, rows_k, step_k, True), L)

    def read_values(w):
        w_slot = w.reshape(-1, w.shape[-1])
        w_slot = w_slot if full else w_slot.index_select(0, slot)  # (N, n)
        return per_slot(through_blocks(w_slot, rows_v, step_v, False), D).sum(3)  # slots' shares summed

    return s_ret, read_values


def pool_rows(pool: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(rows, step)``: the pool's (L, D) rows as one (n, L, D) view of its storage, entry
    ``e``, head ``h`` at row ``e * step + h``. Rows are picked by index_select (several times
    faster than advanced indexing), and a pool that is a view into a larger arena (the hot
    cache's) is not copied."""
    D = pool.shape[-1]
    if pool.stride(0) % pool.stride(1) or pool.stride(2) != D or pool.stride(3) != 1:
        pool = pool.contiguous()
    step = pool.stride(0) // pool.stride(1)
    return pool.as_strided(((pool.shape[0] - 1) * step + pool.shape[1], *pool.shape[2:]), (pool.stride(1), D, 1)), step
