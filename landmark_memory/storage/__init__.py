"""Block store: the keys and values of every memory block, and a hot-block cache.

A block entry is keyed by (stream, layer, block) and holds the un-rotated keys and values of
all heads, a (2, H, block_size + 1, D) tensor (landmark row last). Backends:

- ``memory``: a dict (nothing on disk);
- ``lmdb``: one LMDB environment (the default on disk); every ``put``/``get`` call is one
  transaction, so a chunk's blocks land together or not at all;
- ``mmap``: one memory-mapped file per (stream, layer), grown by doubling.

Stored dtype is float32, float16 or bfloat16 (``dtype``); tensors come back in that dtype.
"""

import os
import struct
from collections import OrderedDict
from typing import Callable
from pathlib import Path

import numpy as np
import torch

STORES = ("memory", "lmdb", "mmap")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class BlockStore:
    """Common checks and (de)serialisation; subclasses keep bytes."""

    def __init__(self, shape, dtype="float16"):
        if dtype not in DTYPES:
            raise ValueError(f"store dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.shape, self.dtype = tuple(shape), DTYPES[dtype]
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def _checked(self, t):
        if tuple(t.shape) != self.shape:
            raise ValueError(f"block tensor must be {self.shape} (2, H, block_size + 1, D), got {tuple(t.shape)}")
        return t.detach().to("cpu", self.dtype).contiguous()

    def _encode(self, t):
        return self._checked(t).view(torch.uint8).numpy().tobytes()

    def _decode(self, b):
        if b is None or len(b) != self.nbytes:
            raise KeyError("block missing or truncated in the store")
        return torch.frombuffer(bytearray(b), dtype=self.dtype).view(self.shape)

    def put(self, items: dict[tuple[int, int, int], torch.Tensor]) -> None:
        """Write ``{(stream, layer, block): tensor (2, H, L, D)}`` in one transaction."""
        self._put({key: self._encode(t) for key, t in items.items()})

    def get(self, keys: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Read blocks ``[(stream, layer, block), ...]`` in one transaction; a list of tensors."""
        return [self._decode(b) for b in self._get(list(keys))]

    def close(self):
        pass


class MemoryStore(BlockStore):
    """Tensors in a dict: no serialisation (returned tensors are shared: treat them as read-only)."""

    def __init__(self, shape, dtype="float16"):
        super().__init__(shape, dtype)
        self._data = {}

    def put(self, items):
        self._data.update({key: self._checked(t).clone() for key, t in items.items()})

    def get(self, keys):
        missing = [k for k in keys if k not in self._data]
        if missing:
            raise KeyError(f"blocks {missing[:3]} missing in the store")
        return [self._data[k] for k in keys]


_LMDB_ENVS = {}  # real path -> [environment, users]: LMDB allows one environment per file and process


class LmdbStore(BlockStore):
    """LMDB environment at ``path``; the map grows by doubling when full. Stores of one path in
    one process share the environment."""

    def __init__(self, shape, path, dtype="float16", map_size=1 << 28, readonly=False):
        import lmdb

        super().__init__(shape, dtype)
        if not readonly:
            Path(path).mkdir(parents=True, exist_ok=True)
        self.key = os.path.realpath(path)
        shared = _LMDB_ENVS.get(self.key)
        if shared is None:
            # readers take LMDB's reader lock where they may (safe beside a writer), none on read-only media
            env = lmdb.open(str(path), map_size=map_size, readonly=readonly, max_dbs=0,
                            lock=not readonly or os.access(path, os.W_OK))
            shared = _LMDB_ENVS[self.key] = [env, 0]
        elif not readonly and shared[0].flags()["readonly"]:
            raise ValueError(f"{path} is open read-only in this process; close its readers before writing")
        shared[1] += 1
        self.env = shared[0]

    @staticmethod
    def _key(k):
        return struct.pack(">III", *k)

    def _put(self, items):
        import lmdb

        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, b in items.items():
                        txn.put(self._key(k), b)
                return
            except lmdb.MapFullError:  # the whole transaction was aborted: grow and redo it
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _get(self, keys):
        with self.env.begin(buffers=False) as txn:
            return [txn.get(self._key(k)) for k in keys]

    def close(self):
        shared = _LMDB_ENVS.get(self.key)
        if shared is None or shared[0] is not self.env:
            return
        shared[1] -= 1
        if shared[1] == 0:
            del _LMDB_ENVS[self.key]
            self.env.close()


class MmapStore(BlockStore):
    """One file ``s{stream}_l{layer}.blocks`` per (stream, layer) under ``path``."""

    def __init__(self, shape, path, dtype="float16", readonly=False):
        super().__init__(shape, dtype)
        self.path, self.readonly = Path(path), readonly
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self._maps = {}

    def _map(self, stream, layer, need=0):
        key = (stream, layer)
        f = self.path / f"s{stream}_l{layer}.blocks"
        mm = self._maps.get(key)
        capacity = f.stat().st_size // self.nbytes if f.exists() else 0
        if need > capacity:
            if self.readonly:
                raise PermissionError(f"{f} is open read-only")
            if mm is not None:
                mm.flush()
            with open(f, "ab") as fh:
                fh.truncate(max(need, 2 * capacity, 16) * self.nbytes)
            mm = None
        if mm is None and f.exists():
            mm = np.memmap(f, dtype=np.uint8, mode="r" if self.readonly else "r+").reshape(-1, self.nbytes)
            self._maps[key] = mm
        return mm

    def _put(self, items):
        for (s, l, b), data in items.items():
            self._map(s, l, need=b + 1)[b] = np.frombuffer(data, dtype=np.uint8)
        for mm in self._maps.values():
            mm.flush()

    def _get(self, keys):
        out = []
        for s, l, b in keys:
            mm = self._map(s, l)
            out.append(mm[b].tobytes() if mm is not None and b < len(mm) else None)
        return out

    def close(self):
        if not self.readonly:
            for mm in self._maps.values():
                mm.flush()
        self._maps.clear()


class OverlayStore(BlockStore):
    """A read-only ``base`` store with new blocks kept in memory: a reader of a saved memory
    can feed more text without touching the files."""

    def __init__(self, base):
        super().__init__(base.shape, DTYPE_NAMES[base.dtype])
        self.base, self.new = base, MemoryStore(base.shape, DTYPE_NAMES[base.dtype])

    def put(self, items):
        self.new.put(items)

    def get(self, keys):
        keys = list(keys)
        mine = [k in self.new._data for k in keys]
        old = iter(self.base.get([k for k, m in zip(keys, mine) if not m]))
        return [self.new._data[k] if m else next(old) for k, m in zip(keys, mine)]

    def close(self):
        self.base.close()


def open_store(kind: str, shape: tuple[int, ...], path: str | Path | None = None, dtype: str = "float16",
               readonly: bool = False) -> BlockStore:
    """A block store of ``kind`` (one of ``STORES``); on-disk kinds need ``path`` and may be
    opened ``readonly``."""
    if kind not in STORES:
        raise ValueError(f"unknown store {kind!r}; choose one of {STORES}")
    if kind == "memory":
        return MemoryStore(shape, dtype)
    if path is None:
        raise ValueError(f"store {kind!r} keeps blocks on disk: pass a path")
    return (LmdbStore if kind == "lmdb" else MmapStore)(shape, Path(path) / kind, dtype, readonly=readonly)


class HotCache:
    """The hot blocks on the compute device: an LRU arena within ``budget_bytes``.

    The arena (n_slots, *block shape) is the block pool the attention kernels read through a
    block table (like paged attention): ``pool(keys)`` makes every requested block resident and
    returns the arena with each key's slot, so resident blocks are never copied again. Misses
    are read from the store in one call (on a GPU through pinned host memory) and kept as
    ``prepare(blocks)`` in the compute ``dtype`` (work done once per fetch on a batch (n, *shape)
    of blocks, e.g. RoPE by offset inside the block). A request larger than the arena gets a
    one-off pool."""

    def __init__(self, store: BlockStore, device: torch.device | str, dtype: torch.dtype, budget_bytes: int = 256 << 20,
                 prepare: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.store, self.device, self.dtype, self.budget = store, torch.device(device), dtype, budget_bytes
        self.prepare = prepare or (lambda t: t)
        self.block_bytes = int(np.prod(store.shape)) * dtype.itemsize
        self.capacity = budget_bytes // self.block_bytes
        self.arena = None  # allocated on first use
        self._slots = OrderedDict()  # key -> arena slot, least recently used first
        self.hits = self.misses = 0

    @property
    def bytes(self):
        """Bytes of resident blocks."""
        return len(self._slots) * self.block_bytes

    def _fetch(self, keys):
        """The blocks of ``keys`` read in one store call and prepared in one batch, (n, *shape)."""
        t = torch.stack(self.store.get(keys))
        if self.device.type == "cuda":
            t = t.pin_memory()
        return self.prepare(t.to(self.device, non_blocking=True).to(self.dtype))

    def pool(self, keys: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pool, slots)``: a tensor (n, *shape) holding the blocks and int64 (len(keys),)
        positions of each key in it. Valid until the next call."""
        wanted = list(dict.fromkeys(keys))
        missing = [k for k in wanted if k not in self._slots]
        self.hits += len(wanted) - len(missing)
        self.misses += len(missing)
        if len(wanted) > self.capacity:  # cannot all be resident at once
            pool = self._fetch(wanted)
            pos = {k: i for i, k in enumerate(wanted)}
            return pool, torch.tensor([pos[k] for k in keys], device=self.device)
        if self.arena is None:
            self.arena = torch.empty((self.capacity, *self.store.shape), device=self.device, dtype=self.dtype)
        for k in wanted:
            if k in self._slots:
                self._slots.move_to_end(k)
        if missing:
            slots = []
            for k in missing:  # the least recent blocks are never this request's: those were just touched
                slot = len(self._slots) if len(self._slots) < self.capacity else self._slots.popitem(last=False)[1]
                self._slots[k] = slot
                slots.append(slot)
            self.arena[torch.tensor(slots, device=self.device)] = self._fetch(missing)
        return self.arena, torch.tensor([self._slots[k] for k in keys], device=self.device)

    def get(self, keys):
        """The blocks themselves, a list of tensors (views into the pool)."""
        pool, slots = self.pool(keys)
        return [pool[i] for i in slots.tolist()]
