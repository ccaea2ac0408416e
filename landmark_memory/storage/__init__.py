"""Block store: the keys and values of every memory block, and a hot-block cache.

A block entry is keyed by (stream, layer, block) and holds the un-rotated keys and values of
all heads, a (2, H, block_size + 1, D) tensor (landmark row last). Backends:

- ``memory``: a dict (nothing on disk);
- ``lmdb``: one LMDB environment (the default on disk); every ``put``/``get`` call is one
  transaction, so a chunk's blocks land together or not at all;
- ``mmap``: one memory-mapped file per (stream, layer), grown by doubling.

Stored dtype is float32, float16 or bfloat16 (``dtype``); tensors come back in that dtype.
With ``checksums`` every on-disk record ends with the CRC-32 of its bytes, checked on every
read: a damaged block raises ``CorruptBlockError`` instead of turning into wrong keys.
"""

import errno
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..fileio import open_nofollow
from ..names import STORE_DTYPES, STORES


DTYPES = {name: getattr(torch, name) for name in STORE_DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class StoreDamagedError(ValueError):
    """A store whose files cannot be read as a store."""


class CorruptBlockError(StoreDamagedError):
    """A stored block whose bytes fail their checksum (or have the wrong length)."""

    def __init__(self, key, where=""):
        super().__init__(f"block {key[2]} of layer {key[1]} (stream {key[0]}){where} is corrupted")
        self.key = key


class DiskFullError(OSError):
    """The device ran out of space while the store was writing."""


class StoreWriteError(OSError):
    """A store's write failed for another reason the device gave (LMDB aborts the whole
    transaction: nothing of it was written)."""


class BlockStore:
    """Common checks and (de)serialisation; subclasses keep bytes."""

    def __init__(self, shape, dtype="float16", checksums=False):
        if dtype not in DTYPES:
            raise ValueError(f"store dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.shape, self.dtype, self.checksums = tuple(shape), DTYPES[dtype], checksums
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize  # one block's keys and values
        self.record_bytes = self.nbytes + (4 if checksums else 0)  # as stored

    def _checked(self, t):
        if tuple(t.shape) != self.shape:
            raise ValueError(f"block tensor must be {self.shape} (2, H, block_size + 1, D), got {tuple(t.shape)}")
        return t.detach().to("cpu", self.dtype).contiguous()

    def _encode(self, t):
        data = self._checked(t).view(torch.uint8).numpy().tobytes()
        return data + zlib.crc32(data).to_bytes(4, "little") if self.checksums else data

    def _decode(self, key, b):
        if b is None:
            raise KeyError(f"block {key} missing in the store")
        if len(b) != self.record_bytes or (self.checksums and zlib.crc32(b[:self.nbytes]).to_bytes(4, "little")
                                           != bytes(b[self.nbytes:])):
            raise CorruptBlockError(key)
        return torch.frombuffer(bytearray(b[:self.nbytes]), dtype=self.dtype).view(self.shape)

    def put(self, items: dict[tuple[int, int, int], torch.Tensor]) -> None:
        """Write ``{(stream, layer, block): tensor (2, H, L, D)}`` in one transaction."""
        self._put({key: self._encode(t) for key, t in items.items()})

    def get(self, keys: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Read blocks ``[(stream, layer, block), ...]`` in one transaction; a list of tensors.
        Raises ``KeyError`` for a missing block and ``CorruptBlockError`` for a damaged one."""
        keys = list(keys)
        return [self._decode(k, b) for k, b in zip(keys, self._get(keys))]

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
    """LMDB environment at ``path``; the map grows by doubling when full, and a reader follows
    a map that a writer grew. Stores of one path in one process share the environment."""

    def __init__(self, shape, path, dtype="float16", map_size=1 << 28, readonly=False, checksums=False, sealed=False):
        import lmdb

        super().__init__(shape, dtype, checksums)
        if not readonly:
            Path(path).mkdir(parents=True, exist_ok=True)
        self.key = os.path.realpath(path)
        shared = _LMDB_ENVS.get(self.key)
        if shared is None:
            if readonly and not os.path.isfile(os.path.join(path, "data.mdb")):
                raise StoreDamagedError(f"the LMDB store {path} is missing its data.mdb")
            try:
                # readers take LMDB's reader lock where they may (safe beside a writer), none on read-only
                # media or where no writer will come (``sealed``: a corpus's merged documents)
                env = lmdb.open(str(path), map_size=map_size, readonly=readonly, max_dbs=0,
                                lock=not readonly or (not sealed and os.access(path, os.W_OK)))
            except lmdb.Error as e:
                if "No space left" in str(e):
                    raise DiskFullError(errno.ENOSPC, str(e)) from None
                raise StoreDamagedError(f"the LMDB store {path} cannot be opened ({e})") from None
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

        try:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        for k, b in items.items():
                            txn.put(self._key(k), b)
                    return
                except lmdb.MapFullError:  # the whole transaction was aborted: grow and redo it
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
        except lmdb.Error as e:  # at a put, at the commit (a full tmpfs gives EIO there) or growing the map
            if "No space left" in str(e) or "Disk quota" in str(e):
                raise DiskFullError(errno.ENOSPC, str(e)) from None
            raise StoreWriteError(errno.EIO, f"writing the LMDB store {self.key} failed ({e})") from None

    def _get(self, keys):
        import lmdb

        try:
            with self.env.begin(buffers=False) as txn:
                return [txn.get(self._key(k)) for k in keys]
        except lmdb.MapResizedError:  # a writer grew the map past ours: adopt its size, read again
            self.env.set_mapsize(0)
            return self._get(keys)
        except lmdb.Error as e:  # pages that fail LMDB's own checks
            raise StoreDamagedError(f"the LMDB store {self.key} cannot be read ({e})") from None

    def close(self):
        shared = _LMDB_ENVS.get(self.key)
        if shared is None or shared[0] is not self.env:
            return
        shared[1] -= 1
        if shared[1] == 0:
            del _LMDB_ENVS[self.key]
            self.env.close()


class MmapStore(BlockStore):
    """One file ``s{stream}_l{layer}.blocks`` per (stream, layer) under ``path``, grown by
    doubling with space reserved on the device (a full disk is an error, never a SIGBUS)."""

    def __init__(self, shape, path, dtype="float16", readonly=False, checksums=False):
        super().__init__(shape, dtype, checksums)
        self.path, self.readonly = Path(path), readonly
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self._maps = {}

    def _map(self, stream, layer, need=0):
        key = (stream, layer)
        f = self.path / f"s{stream}_l{layer}.blocks"
        mm = self._maps.get(key)
        capacity = f.stat().st_size // self.record_bytes if f.exists() else 0
        if need > capacity:
            if self.readonly:
                raise PermissionError(f"{f} is open read-only")
            if mm is not None:
                mm.flush()
            fd = open_nofollow(f, os.O_RDWR | os.O_CREAT)
            try:
                os.posix_fallocate(fd, 0, max(need, 2 * capacity, 16) * self.record_bytes)  # ENOSPC now, not SIGBUS later
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(e.errno, f"no space left to grow {f}") from None
                raise
            finally:
                os.close(fd)
            mm = None
        if mm is None and f.exists():
            with os.fdopen(open_nofollow(f, os.O_RDONLY if self.readonly else os.O_RDWR),
                           "rb" if self.readonly else "rb+") as fh:
                mm = np.memmap(fh, dtype=np.uint8, mode="r" if self.readonly else "r+").reshape(-1, self.record_bytes)
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
               readonly: bool = False, checksums: bool = False, sealed: bool = False) -> BlockStore:
    """A block store of ``kind`` (one of ``STORES``); on-disk kinds need ``path``, may be
    opened ``readonly`` (``sealed``: no writer will ever come, so LMDB takes no reader lock)
    and keep a CRC-32 per block with ``checksums``."""
    if kind not in STORES:
        raise ValueError(f"unknown store {kind!r}; choose one of {STORES}")
    if kind == "memory":
        return MemoryStore(shape, dtype)
    if path is None:
        raise ValueError(f"store {kind!r} keeps blocks on disk: pass a path")
    if kind == "lmdb":
        return LmdbStore(shape, Path(path) / kind, dtype, readonly=readonly, checksums=checksums, sealed=sealed)
    return MmapStore(shape, Path(path) / kind, dtype, readonly=readonly, checksums=checksums)


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

    def pool(self, keys: list[tuple[int, int, int]]) -> tuple[torch.Tensor, np.ndarray]:
        """``(pool, slots)``: a tensor (n, *shape) holding the blocks and int64 (len(keys),)
        positions of each key in it (host bookkeeping, so a numpy array). Valid until the next
        call."""
        resident = self._slots
        wanted = list(dict.fromkeys(keys))
        missing = [k for k in wanted if k not in resident]
        self.hits += len(wanted) - len(missing)
        self.misses += len(missing)
        if len(wanted) > self.capacity:  # cannot all be resident at once
            pool = self._fetch(wanted)
            pos = {k: i for i, k in enumerate(wanted)}
            return pool, np.array([pos[k] for k in keys], np.int64)
        if self.arena is None:
            self.arena = torch.empty((self.capacity, *self.store.shape), device=self.device, dtype=self.dtype)
        for k in wanted:
            if k in resident:
                resident.move_to_end(k)
        if missing:
            slots = []
            for k in missing:  # the least recent blocks are never this request's: those were just touched
                slot = len(resident) if len(resident) < self.capacity else resident.popitem(last=False)[1]
                resident[k] = slot
                slots.append(slot)
            self.arena[torch.tensor(slots, device=self.device)] = self._fetch(missing)
        return self.arena, np.array([resident[k] for k in keys], np.int64)

    def get(self, keys):
        """The blocks themselves, a list of tensors (views into the pool)."""
        pool, slots = self.pool(keys)
        return [pool[i] for i in slots.tolist()]
