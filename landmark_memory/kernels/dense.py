"""Landmark attention as one plain softmax over effective scores, in dense PyTorch.

The same formulation as the Triton kernel (see triton_landmark.py): a normal token of an
earlier block c gets s + s_landmark(c) - logsumexp_c(s), a token of the query's own block
keeps s, everything else is -inf, and a single softmax gives equations 1-4. Per-block
log-sum-exps come from a (..., n_blocks, block_size + 1) view of the scores, so no scatter is
needed: this is the fast path on CPUs, with O(T^2) memory like the reference it is tested
against.

Context Miss Token (appendix D): a controlled block's tokens move by s_cmt - lse_ctrl, where
lse_ctrl is the log-sum-exp of the controlled landmarks the query sees; together they then
carry exp(s_cmt), the CMT's share of the query's group. A query that sees no controlled
landmark gives that share to a value-less sink column instead.
"""

import functools

import torch
import torch.nn.functional as F

from ..rope import rotary

NEG_INF = float("-inf")
GATHER_BELOW = 16  # queries per head under which (decoding) each retrieved slot's block is gathered on its own


def _gated(s, block_size):
    """Effective scores of every key as a token of a complete *earlier* block.

    s : (..., N) scores against keys laid out as whole blocks from position 0 (N a multiple of
    block_size + 1). Returns (..., N): s + s_landmark - logsumexp over the block's normal
    tokens at normal positions, -inf at landmark positions."""
    L = block_size + 1
    blocks = s.unflatten(-1, (-1, L))  # (..., n_blocks, L)
    gate = blocks[..., block_size] - torch.logsumexp(blocks[..., :block_size], -1)  # (..., n_blocks)
    out = torch.cat([blocks[..., :block_size] + gate[..., None], torch.full_like(blocks[..., :1], NEG_INF)], -1)
    return out.flatten(-2)


def local_effective_scores(s, block_size, T_k):
    """Effective scores (..., T_q, T_k) of queries at the last T_q of T_k in-sequence positions."""
    pad = -T_k % (block_size + 1)
    gated = _gated(F.pad(s, (0, pad)), block_size)[..., :T_k]  # padded tail block is never earlier
    T_q = s.shape[-2]
    masks = _small_local_masks if T_q * T_k <= 4096 else _local_masks
    earlier, own = masks(T_k, T_q, block_size, s.device)
    return torch.where(earlier, gated, torch.where(own, s, NEG_INF))


def _local_masks(T_k, T_q, block_size, device):
    """Which keys a query sees as tokens of earlier blocks, and as tokens of its own block:
    two bool (T_q, T_k)."""
    L = block_size + 1
    i = torch.arange(T_k - T_q, T_k, device=device)[:, None]
    j = torch.arange(T_k, device=device)[None, :]
    normal = j % L != block_size
    return normal & (j // L < i // L), normal & (j // L == i // L) & (j <= i)


# a decoding step asks for the masks of the step a chunk before; small ones (8 KB at most) are kept
_small_local_masks = functools.lru_cache(maxsize=1024)(_local_masks)


def _cmt_softmax(eff, s_cmt, lm_s, visible, controlled):
    """Softmax over effective scores with a Context Miss Token.

    eff : (..., N) effective scores without the CMT; s_cmt : (..., 1) the CMT's score;
    lm_s, visible : (..., M) controlled landmark scores and which of them the query sees;
    controlled : (..., N) bool, columns of the controlled blocks the query sees as earlier
    blocks. Returns (..., N) weights."""
    seen = visible.any(-1, keepdim=True)
    # a finite floor, not -inf: a query that sees none must not get NaN gradients through it
    lse = torch.logsumexp(lm_s.masked_fill(~visible, torch.finfo(lm_s.dtype).min), -1, keepdim=True)
    eff = eff + torch.where(controlled, torch.where(seen, s_cmt - lse, 0.0), 0.0)
    sink = torch.where(seen, NEG_INF, s_cmt)  # the CMT's share, lost when nothing is controlled
    return torch.softmax(torch.cat([eff, sink], -1), -1)[..., :-1]


def landmark_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                             scale: float | None = None, cmt_k: torch.Tensor | None = None,
                             cmt_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """In-sequence landmark attention; same contract as ``landmark_attention``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    eff = local_effective_scores(s, block_size, k.shape[-2])
    if cmt_k is None:
        return torch.softmax(eff, -1) @ v
    T, L, n = s.shape[-1], block_size + 1, cmt_blocks.shape[-1]
    j = torch.arange(T, device=q.device)
    earlier = (j // L)[None, :] < (j // L)[:, None]  # (T, T): key j's block ended before query i's
    controlled = (F.pad(cmt_blocks, (0, 1))[:, j // L] & (j % L != block_size))[:, None, None, :] & earlier  # (B, 1, T, T)
    visible = cmt_blocks[:, None, None, :] & (torch.arange(n, device=q.device) < (j // L)[:, None])  # (B, 1, T, n)
    p = _cmt_softmax(eff, (q @ cmt_k.transpose(-2, -1)) * scale, s[..., block_size::L][..., :n], visible, controlled)
    return p @ v


def landmark_inference_dense(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope_base=10000.0,
                             scale=None, cmt_k=None):
    """Local keys plus retrieved blocks; same contract as ``landmark_attention_inference``.

    A retrieved block behaves as a complete earlier block in sequence, so its scores are laid
    before the local ones and one in-sequence rule (``local_effective_scores``) gates both."""
    B, H, T_q, D = q.shape
    K, L = block_table.shape[-1], block_size + 1
    n = K * L  # retrieved columns, first
    scale = D ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if K:
        s_ret, read_values = _retrieved(q, pool_k, pool_v, block_table, block_pos, rope_base, scale)  # (B, H, Tq, K, L)
        s = torch.cat([s_ret.flatten(-2), s], -1)  # (B, H, Tq, K * L + Tk)
    eff = local_effective_scores(s, block_size, s.shape[-1])
    eff[..., :n].unflatten(-1, (K, L)).masked_fill_((block_table < 0)[..., None], NEG_INF)  # empty slots
    if cmt_k is None:
        p = torch.softmax(eff, -1)
    else:  # every retrieved landmark is CMT-controlled, every local one free
        controlled = torch.arange(eff.shape[-1], device=q.device) < n
        p = _cmt_softmax(eff, (q @ cmt_k.transpose(-2, -1)) * scale, s[..., block_size:n:L], block_table >= 0,
                         controlled)
    out = p[..., n:] @ v
    return out + read_values(p[..., :n].unflatten(-1, (K, L))) if K else out


def _retrieved(q, pool_k, pool_v, block_table, block_pos, rope_base, scale):
    """Scores of every (query, slot) against its retrieved block, (B, H, Tq, K, L), and the
    function that turns their weights (B, H, Tq, K, L) into the output (B, H, Tq, D).

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
    rope = rotary(D, float(rope_base))

    def rows(rows_, step, bh_, e):  # the (L, D) rows of pool entry e for flat query head(s) bh_
        return rows_.index_select(0, (e * step + (bh_ % H) // (H // H_kv)).flatten())

    if T_q < GATHER_BELOW:
        bh_all = torch.arange(B * H, device=q.device).view(B, H, 1, 1)
        e = block_table.clamp(min=0).long()  # (B, H, Tq, K)
        qb = rope(q[:, :, :, None, :], -block_pos)  # rotated back to each block's start
        k_g, v_g = (rows(r, st, bh_all, e).view(B, H, T_q, K, L, D) for r, st in ((rows_k, step_k), (rows_v, step_v)))
        s = (qb[..., None, :] @ k_g.transpose(-2, -1))[..., 0, :] * scale  # (B, H, Tq, K, L)
        return s, lambda w: (w.flatten(-2)[..., None, :] @ v_g.flatten(-3, -2))[..., 0, :]  # (B, H, Tq, D)
    slot = (block_table.flatten() >= 0).nonzero()[:, 0]  # the filled slots, flat in (B, H, Tq, K), (N,)
    query = slot // K  # flat in (B, H, Tq)
    entry, pos = block_table.flatten()[slot].long(), block_pos.flatten()[slot].long()
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

    def through_blocks(x, rows_, step, scores):  # per slot (N, D) -> scores (N, L), or weights (N, L) -> (N, D)
        blocks = rows(rows_, step, group_bh, group_entry)  # (P, L, D)
        blocks = blocks.transpose(-2, -1) if scores else blocks
        xb = x.new_zeros((n_rows, x.shape[1])).index_copy_(0, row, x)
        out, r = [], 0
        for a, n, m in runs:
            out.append((xb[r:r + n * m].view(n, m, -1) @ blocks[a:a + n]).flatten(0, 1))  # (n * m, out)
            r += n * m
        return torch.cat(out).index_select(0, row)

    q_slot = rope(q.reshape(-1, D).index_select(0, query)[:, None], -pos[:, None])[:, 0]  # (N, D) rotated to the block
    s_raw = q.new_zeros((B * H * T_q * K, L)).index_copy_(0, slot, through_blocks(q_slot, rows_k, step_k, True) * scale)

    def read_values(w):
        w_slot = w.reshape(-1, L).index_select(0, slot)  # (N, L)
        per_slot = q.new_zeros((B * H * T_q * K, D)).index_copy_(0, slot, through_blocks(w_slot, rows_v, step_v, False))
        return per_slot.view(B, H, T_q, K, D).sum(3)  # each slot's share of the output, summed over slots

    return s_raw.view(B, H, T_q, K, L), read_values


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
