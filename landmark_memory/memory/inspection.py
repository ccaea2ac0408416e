"""What experiments and tests look at inside a memory, past its door: ``LandmarkMemory.inspection``.

A decoding step, the bytes a memory holds, its hot cache's counts, every block choice (to observe
or replace it), its stored blocks as read and its indexes. Nothing here changes what a memory has
read; ``choosing`` changes only what is chosen inside its ``with`` block.
"""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..index import LandmarkIndex
from .blocks import BlockMemory
from .decoding import Decoder


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes a memory holds: ``fast``, what must sit near the compute (block keys, indexes,
    resident hot blocks, the open chunk's keys and values, the sliding-window layers' windows);
    ``store``, every block's keys and values wherever the store keeps them."""

    fast: int
    store: int


@dataclass(frozen=True)
class CacheCounts:
    """The hot cache's lookups since the memory opened, and the dtype its resident blocks are kept
    in (``None``: nothing was fetched yet, or the cache has no room)."""

    hits: int
    misses: int
    arena_dtype: torch.dtype | None


class MemoryInspection:
    """A memory's insides for experiments and tests, over its blocks and decoder; ``forward`` is
    the memory's own (``LandmarkMemory.forward``)."""

    def __init__(self, blocks: BlockMemory, decoder: Decoder, forward: Callable[[torch.Tensor], object]):
        self._blocks, self._decoder, self._forward = blocks, decoder, forward

    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """Append one token per stream, ``idx`` (B,) or (B, 1); returns its logits (B, vocab)."""
        return self._forward(idx.reshape(-1, 1)).logits[:, -1]

    def usage(self) -> MemoryUsage:
        fast, store = self._blocks.usage()
        return MemoryUsage(fast + self._decoder.usage(), store)

    def cache(self) -> CacheCounts:
        c = self._blocks.cache
        return CacheCounts(c.hits, c.misses, None if c.arena is None else c.arena.dtype)

    @contextmanager
    def choosing(self, wrap: Callable[[Callable], Callable]):
        """Every block choice inside the ``with`` block made by ``wrap(choose)``, ``choose`` the
        memory's own (``BlockLookup.choose``, whose arguments and results it takes and gives)."""
        own = self._decoder.choose
        self._decoder.choose = wrap(own)
        try:
            yield self
        finally:
            self._decoder.choose = own

    def stored(self, keys: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The blocks ``keys`` (stream, layer, block) from the store: (2, H_kv, L, D) each, keys
        not rotated, as the model's dtype reads them."""
        return self._blocks.store.get(keys)

    def stores_opened(self) -> tuple[int, float]:
        """A read-only corpus's document stores opened so far, and the seconds that took."""
        shards = self._blocks.store.base  # (a reader's overlay over the documents' stores)
        return shards.opens, shards.open_seconds

    def indexes(self) -> list[LandmarkIndex]:
        """Every block key index, by stream, layer and key/value head (an attached session's after):
        their contents, searches and search time."""
        return self._blocks.all_indexes()
