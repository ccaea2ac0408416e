"""One block store over many: the blocks of a corpus memory, a large document's in its own
store, small documents' packed into the corpus's own.

Shard ``i`` holds global blocks ``[start_i, start_i + blocks_i)`` as its own blocks ``0 ..
blocks_i - 1``; shards follow each other in order, and the blocks between them (packed
documents') are the corpus's own store's, under their global numbers. A store opens when a
block of it is first read (opening a corpus costs nothing per document), and at most
``max_open`` shards stay open, the least recently used closed first: as many as the process's
file descriptors allow (its soft limit is raised to the hard one), since a corpus of thousands
of documents would otherwise hold thousands of LMDB environments or memory maps at once.
"""

import bisect
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .base import BlockStore, CorruptBlockError

RESERVED_FDS = 512  # descriptors left for everything else the process opens
FD_CEILING = 1 << 16  # the soft limit is raised at most this far
PACK_BATCH = 64  # blocks copied per transaction when a document is packed


@dataclass(frozen=True)
class Shard:
    """A document's blocks: ``blocks`` of them from global block ``start``, in the store that
    ``open_shard(name)`` opens."""

    start: int
    blocks: int
    name: str


def open_budget(fds_per_store: int) -> int:
    """How many stores of ``fds_per_store`` file descriptors each may be open at once, after
    raising this process's soft limit on descriptors towards its hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else FD_CEILING, FD_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    soft = FD_CEILING if soft == resource.RLIM_INFINITY else soft
    return max(8, (soft - RESERVED_FDS) // fds_per_store)


class ShardedStore(BlockStore):
    """Union of ``shards`` (``Shard``, in order from block 0), read-only, and of the blocks
    packed between them into the corpus's own store, which ``open_own(readonly)`` opens when
    first needed (written only by ``pack``); ``open_shard(name)`` opens a shard's own store
    read-only, at most ``max_open`` at once; ``add`` appends a shard, ``follow`` a commit's."""

    def __init__(self, shape: tuple[int, ...], shards: list[Shard], store_dtype: str, checksums: bool,
                 open_shard: Callable[[str], BlockStore], max_open: int = 64,
                 open_own: Callable[[bool], BlockStore] | None = None):
        super().__init__(shape, store_dtype, checksums)
        self.open_shard, self.max_open, self.open_own = open_shard, max_open, open_own
        self.opens, self.open_seconds = 0, 0.0  # shard stores opened, and the time it took
        self.shards: list[Shard] = []
        self._starts: list[int] = []
        self._open: OrderedDict[int, BlockStore] = OrderedDict()  # shard number -> its store, least recent first
        self._own: BlockStore | None = None
        self._own_writable = False
        self.n_blocks = 0
        for s in shards:
            self.add(s)

    def add(self, shard: Shard) -> None:
        """Append ``shard``; it must start where the store's blocks end."""
        if shard.start != self.n_blocks:
            raise ValueError(f"shard at block {shard.start} does not follow the store's {self.n_blocks} blocks")
        self.shards.append(shard)
        self._starts.append(shard.start)
        self.n_blocks = shard.start + shard.blocks

    def pack(self, source: BlockStore, blocks: int, streams: int, n_layer: int) -> None:
        """Copy the first ``blocks`` blocks of ``source`` (a document's store, same shape and
        dtype) into the corpus's own store, as its next blocks: as stored, checked on the way."""
        if self._own is None or not self._own_writable:
            if self._own is not None:
                self._own.close()
            self._own, self._own_writable = self.open_own(False), True
        start = self.n_blocks
        for first in range(0, blocks, PACK_BATCH):  # a batch of blocks per transaction: bounded memory
            keys = [(s, layer, b) for s in range(streams) for layer in range(n_layer)
                    for b in range(first, min(first + PACK_BATCH, blocks))]
            self._own._put({(s, layer, start + b): self._own._encode(stored)
                            for (s, layer, b), stored in zip(keys, source.read_stored(keys))})
        self.n_blocks = start + blocks

    def follow(self, shards: list[Shard], n_blocks: int) -> None:
        """The union as a commit has it (a reader's): ``shards`` (those it holds first, then
        new ones) and ``n_blocks`` blocks in all, the rest packed by the writer into the
        corpus's own store, which opens now (as a memory's store opens with it)."""
        for s in shards[len(self.shards):]:
            self._packed(s.start)
            self.add(s)
        self._packed(n_blocks)

    def _packed(self, end: int) -> None:
        if end > self.n_blocks:
            if self._own is None:
                self._own = self.open_own(True)
            self.n_blocks = end

    def _store(self, i: int) -> BlockStore:
        store = self._open.get(i)
        if store is None:
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)[1].close()
            t0 = time.perf_counter()
            store = self._open[i] = self.open_shard(self.shards[i].name)
            self.opens, self.open_seconds = self.opens + 1, self.open_seconds + time.perf_counter() - t0
        self._open.move_to_end(i)
        return store

    def put(self, items):
        raise PermissionError("a corpus memory keeps its blocks in its documents' stores: add text as documents "
                              "(`landmark-memory build`), or open the memory read-only to read on after it")

    def read_stored(self, keys):
        by_shard: dict[int, list[int]] = {}  # shard number (-1: the corpus's own store) -> the keys' places
        for n, (s, layer, b) in enumerate(keys):
            if not 0 <= b < self.n_blocks:
                raise KeyError(f"block {(s, layer, b)} missing in the store")
            i = bisect.bisect_right(self._starts, b) - 1
            inside = i >= 0 and b < self.shards[i].start + self.shards[i].blocks
            by_shard.setdefault(i if inside else -1, []).append(n)
        out = [None] * len(keys)
        for i, ns in by_shard.items():
            if i < 0:
                if self._own is None:
                    self._own = self.open_own(True)
                got = self._own.read_stored([keys[n] for n in ns])
            else:
                start = self.shards[i].start
                try:
                    got = self._store(i).read_stored([(keys[n][0], keys[n][1], keys[n][2] - start) for n in ns])
                except CorruptBlockError as e:  # name the block as the corpus numbers it, and where it lies
                    s, layer, b = e.key
                    raise CorruptBlockError((s, layer, b + start), f" (block {b} of {self.shards[i].name})") from None
            for n, t in zip(ns, got):
                out[n] = t
        return out

    def check(self):
        for store in [*self._open.values(), *([self._own] if self._own is not None else [])]:
            store.check()

    def close(self):
        while self._open:
            self._open.popitem()[1].close()
        if self._own is not None:
            self._own.close()
            self._own = None
