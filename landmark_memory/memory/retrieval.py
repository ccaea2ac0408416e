"""The retrieval policy as pure functions: which blocks each query reads (paper Table 2's
granularities) and where the chosen blocks sit (stingy or exact positions, section 3.2.1).

Block ids are memory block numbers; -1 marks an empty slot. ``L = block_size + 1`` rows per
block, the landmark last.
"""

import numpy as np
import torch
import torch.nn.functional as F

from ..core.jit import njit


def select_blocks(S: torch.Tensor, I: torch.Tensor, lo: int, nb: int, top_k: int, retrieval: str) -> torch.Tensor:
    """Top-k block ids per the retrieval mode from candidate scores and ids.

    Parameters
    ----------
    S : float (B, H, T_q, M), landmark scores of the candidates, -inf where none.
    I : int64 (B, H, T_q, M), their block ids (-1 where none); every id is in [lo, nb).
    lo, nb : int, the retrievable blocks are ``[lo, nb)``.
    top_k : int, blocks per query.
    retrieval : {"per_token_head", "per_head", "per_token"}: one set per (token, head), one
        per head for all tokens of the step, or one per token for all heads. The shared sets
        rank blocks by the maximum, over tokens or heads, of the softmaxed landmark scores.

    Returns
    -------
    int64 (B, H, T_q, top_k), -1 where fewer blocks qualify.
    """
    B, H, T_q, M = S.shape
    if retrieval == "per_token_head":
        top = S.topk(min(top_k, M), dim=-1)
        ids = torch.where(top.values == float("-inf"), -1, I.gather(-1, top.indices))
    else:
        logp = S - torch.logsumexp(S, -1, keepdim=True)
        logp = torch.where(I >= 0, logp, float("-inf"))
        if retrieval == "per_token":
            logp, I = logp.transpose(1, 2).flatten(2), I.transpose(1, 2).flatten(2)  # (B, T_q, H * M)
        else:
            logp, I = logp.flatten(2), I.flatten(2)  # (B, H, T_q * M)
        dense = logp.new_full((*logp.shape[:2], nb - lo), float("-inf"))
        dense = dense.scatter_reduce(-1, (I - lo).clamp(min=0), logp, "amax")
        top = dense.topk(min(top_k, nb - lo), dim=-1)
        ids = torch.where(top.values == float("-inf"), -1, top.indices + lo)  # (B, H or T_q, k)
        ids = ids[:, :, None] if retrieval == "per_head" else ids[:, None]
        ids = ids.expand(B, H, T_q, -1)
    if ids.shape[-1] < top_k:
        ids = F.pad(ids, (0, top_k - ids.shape[-1]), value=-1)
    return ids


def block_positions(ids: torch.Tensor, nb: int, reads: int, L: int, mapping: str) -> torch.Tensor:
    """Where each chosen block's first row sits, int64 like ``ids`` (B, H, T_q, reads).

    ``"exact"``: its true position ``block * L``. ``"stingy"``: the prefix has ``reads + 1`` block slots (``reads``:
    the blocks a query reads); the latest ``reads`` memory blocks sit at their own slots (the newest at slot
    ``reads``), older chosen blocks fill slots from 0 in memory order, kept left of the first recent one (several
    share slot 0 when there is no room).
    """
    if mapping == "exact":
        return ids.clamp(min=0) * L
    if ids.device.type != "cpu":
        return stingy_slots(ids, nb, reads) * L
    slots = torch.empty_like(ids, dtype=torch.long)  # on the CPU compiled: one call, not some twenty small ones
    _stingy_slots_rows(ids.reshape(-1, ids.shape[-1]).numpy(), nb, reads, slots.view(-1, ids.shape[-1]).numpy())
    return slots * L


def stingy_slots(ids: torch.Tensor, nb: int, reads: int) -> torch.Tensor:
    """The stingy slot of each chosen block (``block_positions`` / L) as tensor operations on
    any device; the compiled CPU path is tested against it."""
    order = torch.where(ids < 0, torch.iinfo(torch.long).max, ids).sort(-1)
    ids_sorted = ids.gather(-1, order.indices)
    recent = ids_sorted >= nb - reads
    own_slot = recent_slots(ids_sorted, nb, reads)
    first_recent = torch.where(recent, own_slot, reads + 1).min(-1, keepdim=True).values
    old_rank = torch.cumsum(~recent & (ids_sorted >= 0), -1) - 1
    slot = torch.where(recent, own_slot, torch.minimum(old_rank, first_recent - 1)).clamp(min=0)
    return torch.empty_like(slot).scatter_(-1, order.indices, slot)


def with_forced(ids: torch.Tensor, forced: torch.Tensor, width: int) -> torch.Tensor:
    """The chosen ``ids`` (B, H, T_q, k) followed by the ``forced`` blocks every query reads
    (int64 (f,)), padded with -1 to ``width`` columns."""
    B, H, T_q, k = ids.shape
    out = ids.new_full((B, H, T_q, width), -1)
    out[..., :k] = ids
    out[..., k:k + len(forced)] = forced
    return out


def with_pinned(ids: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """The ``pinned`` blocks (int64 (p,)) every query reads first, then its chosen ``ids``
    (B, H, T_q, k), none of them pinned."""
    return torch.cat([pinned.to(ids.device).expand(*ids.shape[:-1], -1), ids], -1)


def top_k_stingy(S_old: np.ndarray, I_old: np.ndarray, S_recent: torch.Tensor, recent: torch.Tensor, nb: int,
                 top_k: int, L: int, forced: np.ndarray | None = None, reads: int | None = None,
                 pinned: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``with_pinned``, ``select_blocks(..., "per_token_head")``, ``with_forced`` and
    ``block_positions(..., "stingy")`` in one compiled pass over CPU rows, from the two candidate
    sets a stingy step has.

    Parameters
    ----------
    S_old, I_old : float32 and int64 (B, H, T_q, m), the index's candidates among the older
        blocks (-inf and -1 where none).
    S_recent : float (B, H, T_q, r), the latest blocks' scores; recent : int64 (r,), their ids.
    nb, L : as for ``block_positions``; top_k : the blocks each query chooses.
    forced : int64 (f,), blocks every query reads after its ``top_k`` (none of them a candidate).
    reads : the blocks a query reads, ``top_k + f`` or more (default ``top_k``): the stingy
        slots' count and the width of the result.
    pinned : int64 (p,), p <= top_k, blocks every query reads as the first of its ``top_k``
        (none of them forced); the query chooses ``top_k - p`` among the other candidates.

    Returns
    -------
    ids, pos : int64 (B, H, T_q, reads), as the three functions give them (equal scores may be
        ordered otherwise).
    """
    B, H, T_q, _ = S_recent.shape
    forced = np.zeros(0, np.int64) if forced is None else forced
    pinned = np.zeros(0, np.int64) if pinned is None else pinned
    reads = top_k if reads is None else reads
    ids, slots = (torch.empty((B, H, T_q, reads), dtype=torch.long) for _ in range(2))
    _top_k_stingy_rows(S_old.reshape(B * H * T_q, -1), I_old.reshape(B * H * T_q, -1),
                       S_recent.float().reshape(B * H * T_q, -1).numpy(), recent.numpy(), nb, top_k, forced, pinned,
                       ids.view(-1, reads).numpy(), slots.view(-1, reads).numpy())
    return ids, slots * L


@njit
def _top_k_stingy_rows(S_old, I_old, S_new, I_new, nb, top_k, forced, pinned, ids, slots):
    """Per row: the pinned blocks, then the ``top_k`` - p best of the old candidates and the
    new ones that are not pinned (the first of equal scores wins; -inf never does), then the
    forced blocks, -1 to the row's end, then their stingy slots. Nothing is allocated per row:
    a chunk has thousands."""
    m, M, reads, p = S_old.shape[1], S_old.shape[1] + len(I_new), ids.shape[1], len(pinned)
    taken = np.zeros(M, np.bool_)
    order = np.empty(reads, np.int64)
    for n in range(S_old.shape[0]):
        taken[:] = False
        for c in range(M if p else 0):  # a pinned block is no candidate
            b = I_old[n, c] if c < m else I_new[c - m]
            for j in range(p):
                taken[c] |= b == pinned[j]
        for j in range(p):
            ids[n, j] = pinned[j]
        for j in range(p, top_k):
            best, arg = -np.inf, -1
            for c in range(M):
                s = S_old[n, c] if c < m else S_new[n, c - m]
                if not taken[c] and s > best:
                    best, arg = s, c
            if arg < 0:
                ids[n, j] = -1
            else:
                taken[arg] = True
                ids[n, j] = I_old[n, arg] if arg < m else I_new[arg - m]
        for j in range(top_k, reads):
            ids[n, j] = forced[j - top_k] if j - top_k < len(forced) else -1
        _stingy_row(ids[n], nb, reads, slots[n], order)


@njit
def _stingy_slots_rows(ids, nb, reads, out):
    """``stingy_slots`` of rows ``ids`` (N, reads) into ``out``."""
    order = np.empty(ids.shape[1], np.int64)
    for n in range(ids.shape[0]):
        _stingy_row(ids[n], nb, reads, out[n], order)


@njit
def _stingy_row(row, nb, reads, out, order):
    """One row's stingy slots: visit the ids in ascending order (empty slots, -1, last), the
    recent ones take their own slots, the older ones the next free slot left of the first
    recent one. ``order``: scratch of the row's length."""
    n = len(row)
    for j in range(n):  # insertion sort of a handful of ids, -1 after every block id
        order[j] = j
        a = j
        while a > 0 and (row[order[a - 1]] < 0 <= row[j] or
                         (row[order[a - 1]] >= 0) == (row[j] >= 0) and row[order[a - 1]] > row[j]):
            order[a] = order[a - 1]
            a -= 1
        order[a] = j
    first_recent = reads + 1
    for j in range(n):
        if row[j] >= nb - reads:
            first_recent = min(first_recent, reads + 1 - (nb - row[j]))
    old_rank = -1
    for a in range(n):
        j = order[a]
        recent = row[j] >= nb - reads
        old_rank += 1 if not recent and row[j] >= 0 else 0
        out[j] = max(0, reads + 1 - (nb - row[j]) if recent else min(old_rank, first_recent - 1))


def recent_slots(recent: torch.Tensor, nb: int, reads: int) -> torch.Tensor:
    """Stingy slots of the latest blocks ``recent`` (int64 (r,)): the newest at slot ``reads``,
    the one before at ``reads - 1``, ..."""
    return reads + 1 - (nb - recent)


def chunk_base(n_blocks: int, reads: int, L: int, mapping: str) -> int:
    """Position of the open chunk's first token: after the ``reads + 1`` stingy slots, or
    after every block in memory (exact)."""
    return (reads + 1) * L if mapping == "stingy" else n_blocks * L
