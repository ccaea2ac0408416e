"""Which blocks each query reads: a memory's part (``LandmarkMemory.lookup``) that scores the
landmarks (the index for the older blocks, exactly for the latest ones), applies the retrieval
policy (``retrieval.py``: top-k, sink and local blocks, centring) and says where the chosen
blocks sit. It reads the blocks it is given and keeps caches of what changes only when a chunk
enters memory."""

import numpy as np
import torch

from ..core.rope import RotaryEmbedding
from ..format.options import MemoryOptions
from .blocks import BlockMemory
from .outputs import RetrievalStats
from .retrieval import block_positions, recent_slots, select_blocks, top_k_stingy, with_forced, with_pinned


class BlockLookup:
    """The blocks each query of a memory reads.

    Parameters
    ----------
    blocks : BlockMemory, whose block keys and indexes it scores.
    options : MemoryOptions, resolved: top_k, sink and local blocks, retrieval, position mapping,
        max_blocks, centre (``use`` changes them).
    key_row : int, the row of a block its key is scored at (``ModelShape.key_row``).
    group : int, query heads per key/value head.
    rope : RotaryEmbedding, scale : float, the model's.
    stats : RetrievalStats, counted into.

    Attributes
    ----------
    pinned : int64 (p,), blocks every query reads first among its top-k (``LandmarkMemory.reading``).
    """

    def __init__(self, blocks: BlockMemory, options: MemoryOptions, *, key_row: int, group: int,
                 rope: RotaryEmbedding, scale: float, stats: RetrievalStats):
        self.blocks, self.options, self.key_row, self.group = blocks, options, key_row, group
        self.rope, self.scale, self.stats = rope, scale, stats
        self.pinned = np.zeros(0, np.int64)
        self._forced = None  # ((lo, n_blocks), the sink and local blocks every query reads: numpy, tensor)
        self._mean_keys = {}  # per layer ((lo, n_blocks), the mean block key per query head (B, H, 1, D))
        self._recent_keys = {}  # per layer ((lo, n_blocks), the latest blocks' ids (r,), their keys at their slots)

    def use(self, options: MemoryOptions) -> None:
        """Read by ``options`` from now on (what the caches hold depends on them)."""
        if options != self.options:
            self.options = options
            self.forget()

    def forget(self) -> None:
        """Let the caches go: the blocks were rewound."""
        self._forced = None
        self._recent_keys.clear()
        self._mean_keys.clear()

    def choose(self, layer: int, q: torch.Tensor, qr: torch.Tensor, at_search: tuple, skip: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids (B, H, T_q, reads') each query reads (-1 = none): its ``top_k`` (the pinned
        blocks, ``pinned``, then its own choice), then ``reads - top_k`` columns of the sink and
        local blocks every query reads; and the positions their first rows sit at. The chosen
        columns are fewer than ``top_k`` where fewer blocks are candidates (a ``top_k`` over the
        memory's size, every block read to prove it exact, would make every step's tables that
        wide): reads' = reads - top_k + the chosen columns. ``at_search``:
        ``rope.angles`` of the positions the raw queries ``q`` search older blocks from;
        ``skip`` (B, H, T_q) bool: queries that retrieve nothing."""
        B, H, T_q, D = q.shape
        o, L, r, nb, device = self.options, self.blocks.L, self.key_row, self.blocks.n_blocks, self.blocks.device
        lo = max(0, nb - o.max_blocks) if o.max_blocks else 0
        empty = q.new_full((B, H, T_q, o.reads), -1, dtype=torch.long)
        if nb == lo:
            return empty, torch.zeros_like(empty)
        # the retrievable blocks [lo, nb): the first sink_blocks and the last local_blocks are read by
        # every query; the top-k are chosen among the candidates [c_lo, c_hi) between them
        c_lo = min(lo + o.sink_blocks, nb)
        c_hi = max(c_lo, nb - o.local_blocks)
        if self._forced is None or self._forced[0] != (lo, nb):  # changes only when a chunk enters memory
            ids = np.array(sorted({*range(lo, c_lo), *range(c_hi, nb)}), np.int64)
            self._forced = (lo, nb), ids, torch.from_numpy(ids).to(device)
        _, forced_np, forced = self._forced
        pinned_np = self.pinned[(self.pinned >= c_lo) & (self.pinned < c_hi)]  # a sink or local block is read anyway
        pinned = torch.from_numpy(pinned_np).to(device)
        stats = self.stats
        stats.queries += B * H * T_q
        if skip is not None:
            stats.skipped_queries += int(skip.sum())
            if skip.all():  # nothing to search, score or fetch
                stats.skipped_searches += B * H if o.position_mapping == "stingy" and nb - o.reads > c_lo else 0
                return empty, torch.zeros_like(empty)
        scale, rope = self.scale, self.rope
        centre = self._mean_key(layer, lo, nb) if o.centre else None  # (B, H, 1, D) or None

        def landmarks(blocks):  # (B, H, n, D): key/value head h // G serves query head h
            lms = self.blocks.block_keys(layer, blocks)
            lms = lms.repeat_interleave(self.group, 1) if self.group > 1 else lms
            return lms if centre is None else lms - centre

        if o.position_mapping == "exact":
            ids = torch.arange(c_lo, c_hi, device=device)
            S = (qr @ rope(landmarks(ids), ids * L + r).transpose(-2, -1)) * scale  # (B, H, T_q, m)
            S[..., pinned - c_lo] = float("-inf")
            I = ids.expand(B, H, T_q, -1)
        else:
            first = min(max(c_lo, nb - o.reads), c_hi)  # the latest candidates, scored exactly at their own slots
            cached = self._recent_keys.get(layer)
            if cached is None or cached[0] != (lo, nb):  # they change only when a chunk enters memory
                recent = torch.arange(first, c_hi, device=device)
                at = recent_slots(recent, nb, o.reads) * L + r
                cached = (lo, nb), recent, rope(landmarks(recent), at).transpose(-2, -1)
                self._recent_keys[layer] = cached
            _, recent, keys = cached
            S = (qr @ keys) * scale  # (B, H, T_q, r)
            if first > c_lo:  # older blocks all sit at slot 0: one RoPE-adjusted query searches them
                xq = rope.rotate(at_search, q).to("cpu", torch.float32).numpy()  # (B, H, T_q, D)
                need = None if skip is None else ~skip.cpu().numpy()
                S_old, I_old, skipped = self.blocks.search(layer, xq, need, o.top_k, c_lo, first, self.group)
                if centre is not None:  # the index holds raw keys: q . (k - mean) = q . k - q . mean
                    S_old -= np.einsum("bhtd,bhd->bht", xq, centre[:, :, 0].to("cpu", torch.float32).numpy())[..., None]
                S_old *= scale
                stats.searches += B * H - skipped
                stats.skipped_searches += skipped
            else:
                S_old, I_old = np.full((B, H, T_q, 0), -np.inf, np.float32), np.full((B, H, T_q, 0), -1, np.int64)
            # the steps below in one compiled call (a head's choice for one query, a decoding step's, is that query's)
            if device.type == "cpu" and (o.retrieval == "per_token_head" or o.retrieval == "per_head" and T_q == 1):
                if skip is not None:  # (skipped queries searched nothing: their S_old is -inf already)
                    S = S.masked_fill(skip[..., None], float("-inf"))
                return top_k_stingy(S_old, I_old, S, recent, nb, o.top_k, L, forced_np, o.reads, pinned_np)
            S = torch.cat([torch.from_numpy(S_old).to(device, S.dtype), S], -1)
            I = torch.cat([torch.from_numpy(I_old).to(device), recent.expand(B, H, T_q, -1)], -1)
            S = S.masked_fill(torch.isin(I, pinned), float("-inf"))
        if skip is not None:
            S, I = S.masked_fill(skip[..., None], float("-inf")), I.masked_fill(skip[..., None], -1)
        n_chosen = min(o.top_k, c_hi - c_lo)  # no wider than the candidates
        chosen = select_blocks(S, I, c_lo, max(c_lo, c_hi), n_chosen - len(pinned_np), o.retrieval)
        ids = with_forced(with_pinned(chosen, pinned), forced, o.reads - o.top_k + n_chosen)
        if skip is not None:  # shared selections (per head, per token) and forced blocks must not reach skipped queries
            ids = ids.masked_fill(skip[..., None], -1)
        return ids, block_positions(ids, nb, o.reads, L, o.position_mapping)

    def _mean_key(self, layer, lo, nb):
        """The mean block key of blocks ``[lo, nb)`` of ``layer`` per query head, (B, H, 1, D):
        what every query's landmark scores share, which ``centre`` takes out of them (from the
        running sums, ``BlockMemory.sums``: the cost of the blocks since it was last asked)."""
        cached = self._mean_keys.get(layer)
        if cached is None or cached[0] != (lo, nb):
            mean = torch.from_numpy(self.blocks.mean_key(layer, lo, nb))[:, :, None]
            mean = mean.to(self.blocks.device, self.blocks.dtype)
            cached = (lo, nb), (mean.repeat_interleave(self.group, 1) if self.group > 1 else mean)
            self._mean_keys[layer] = cached
        return cached[1]
