"""Block store: the keys and values of every memory block (the hot-block cache over it is
``hot_cache.HotCache``).

A block entry is keyed by (stream, layer, block) and holds the un-rotated keys and values of
all heads, a (2, H, block_size + 1, D) tensor (landmark row last). Backends:

- ``memory``: a dict (nothing on disk);
- ``lmdb``: one LMDB environment (the default on disk); every ``put``/``get`` call is one
  transaction, so a chunk's blocks land together or not at all;
- ``mmap``: one memory-mapped file per (stream, layer), grown by doubling.

Stored dtype is float32, float16, bfloat16 or int8 (``dtype``). An int8 store keeps each block
quantized with its scales (``quant.py``); ``read`` gives blocks in their stored form (what the
hot cache holds and the kernels read), ``get`` as floats (int8 dequantized to float32). With
``checksums`` every on-disk record ends with the CRC-32 of its bytes (the scales included),
checked on every read: a damaged block raises ``CorruptBlockError`` instead of turning into
wrong keys.
"""

import errno
import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import torch

from ..core.fileio import open_nofollow, reserve
from ..core.names import STORE_DTYPES, STORES
from ..core.quant import dequantize, quantize, scale_shape
from .hot_cache import HotCache  # noqa: F401  (the cache over any store below)


DTYPES = {name: getattr(torch, name) for name in STORE_DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SCALE_DTYPE = torch.float16  # an int8 store's scales on disk


def stored_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes one block entry of ``shape`` (2, H, L, D) takes in a store of ``dtype`` (scales
    included, checksum not)."""
    scales = int(np.prod(scale_shape(shape))) * SCALE_DTYPE.itemsize if dtype == "int8" else 0
    return int(np.prod(shape)) * DTYPES[dtype].itemsize + scales


Stored = tuple[torch.Tensor, torch.Tensor | None]  # one block as stored: data (2, H, L, D), int8 scales (H, D + L)


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
    """Common checks and (de)serialisation; subclasses keep bytes (``_put``, ``_get``) or
    stored blocks (``_blocks``)."""

    def __init__(self, shape, dtype="float16", checksums=False):
        if dtype not in DTYPES:
            raise ValueError(f"store dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.shape, self.dtype, self.checksums = tuple(shape), DTYPES[dtype], checksums
        self.quantized = dtype == "int8"
        self.data_bytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.nbytes = stored_nbytes(self.shape, dtype)  # one block's keys and values (and scales)
        self.record_bytes = self.nbytes + (4 if checksums else 0)  # as stored

    def _stored(self, items: dict) -> dict[tuple[int, int, int], Stored]:
        """``{key: (data, scales)}``: each block (2, H, L, D) in its stored form, all quantized at once."""
        if not items:
            return {}
        t = torch.stack([t.detach() for t in items.values()]).to("cpu")  # (n, 2, H, L, D)
        if t.shape[1:] != self.shape:
            raise ValueError(f"block tensor must be {self.shape} (2, H, block_size + 1, D), got {tuple(t.shape[1:])}")
        data, scales = quantize(t) if self.quantized else (t.to(self.dtype), None)
        return {key: (data[i], None if scales is None else scales[i]) for i, key in enumerate(items)}

    def _encode(self, stored):
        data, scales = stored
        data = data.contiguous().view(torch.uint8).numpy().tobytes()
        if scales is not None:
            data += scales.contiguous().view(torch.uint8).numpy().tobytes()
        return data + zlib.crc32(data).to_bytes(4, "little") if self.checksums else data

    def _decode(self, key, b) -> Stored:
        if b is None:
            raise KeyError(f"block {key} missing in the store")
        if len(b) != self.record_bytes or (self.checksums and zlib.crc32(b[:self.nbytes]).to_bytes(4, "little")
                                           != bytes(b[self.nbytes:])):
            raise CorruptBlockError(key)
        b = bytearray(b[:self.nbytes])
        data = torch.frombuffer(b, dtype=self.dtype, count=self.data_bytes // self.dtype.itemsize).view(self.shape)
        if not self.quantized:
            return data, None
        return data, torch.frombuffer(b, dtype=SCALE_DTYPE, offset=self.data_bytes).view(scale_shape(self.shape))

    def put(self, items: dict[tuple[int, int, int], torch.Tensor]) -> None:
        """Write ``{(stream, layer, block): tensor (2, H, L, D)}`` in one transaction."""
        self._put({key: self._encode(s) for key, s in self._stored(items).items()})

    def _blocks(self, keys: list[tuple[int, int, int]]) -> list[Stored]:
        return [self._decode(k, b) for k, b in zip(keys, self._get(keys))]

    def read(self, keys: list[tuple[int, int, int]]) -> Stored:
        """Blocks ``[(stream, layer, block), ...]`` in one transaction, as stored: ``(data,
        scales)``, data (n, 2, H, L, D) in the store dtype and, for an int8 store, float32 scales
        (n, H, D + L) (else None). Raises ``KeyError`` for a missing block and
        ``CorruptBlockError`` for a damaged one."""
        blocks = self._blocks(list(keys))
        data = torch.stack([d for d, _ in blocks])
        return data, torch.stack([s for _, s in blocks]).float() if self.quantized else None

    def get(self, keys: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Blocks ``[(stream, layer, block), ...]`` in one transaction: a list of tensors (2, H,
        L, D) in the store dtype (an int8 store's dequantized to float32)."""
        keys = list(keys)
        if not keys:
            return []
        data, scales = self.read(keys)
        return list(dequantize(data, scales) if self.quantized else data)

    def check(self):
        """Raise ``StoreDamagedError`` where a file the store maps no longer holds what it
        maps (truncated since it was opened): a mapped page past a file's end is a SIGBUS."""

    def close(self):
        pass


class MemoryStore(BlockStore):
    """Blocks in a dict, in their stored form: no serialisation."""

    def __init__(self, shape, dtype="float16"):
        super().__init__(shape, dtype)
        self._data: dict[tuple[int, int, int], Stored] = {}

    def put(self, items):
        self._data.update(self._stored(items))

    def _blocks(self, keys):
        missing = [k for k in keys if k not in self._data]
        if missing:
            raise KeyError(f"blocks {missing[:3]} missing in the store")
        return [self._data[k] for k in keys]


_LMDB_ENVS = {}  # real path -> [environment, users]: LMDB allows one environment per file and process
_LMDB_ENVS_LOCK = threading.Lock()  # threads (a server's answers) open and close one path's stores at once


def _check_lmdb_size(env, path) -> None:
    """``data.mdb`` holds every page LMDB's last commit uses: LMDB maps the file, and a page
    past its end (a truncated copy) would kill the process with SIGBUS at the first read."""
    f, info = os.path.join(path, "data.mdb"), env.info()
    need, size = (info["last_pgno"] + 1) * env.stat()["psize"], os.stat(f).st_size
    if size < need:
        raise StoreDamagedError(f"the LMDB store's {f} is truncated ({size:,} of {need:,} bytes)")


class LmdbStore(BlockStore):
    """LMDB environment at ``path``; the map grows by doubling when full, and a reader follows
    a map that a writer grew. Stores of one path in one process share the environment.

    A float store keeps one record per (stream, layer, block). An int8 store keeps one per
    (stream, block), its layers' records one after another (a block's layers are written
    together, layers 0..n-1): LMDB gives a large value whole 4 KiB pages, which would add up
    to 16% to a record of some 25 KiB (SmolLM2's) and well under 1% to all layers at once;
    a read copies out only its layer's bytes."""

    def __init__(self, shape, path, dtype="float16", map_size=1 << 28, readonly=False, checksums=False, sealed=False):
        super().__init__(shape, dtype, checksums)
        if not readonly:
            Path(path).mkdir(parents=True, exist_ok=True)
        self.key = os.path.realpath(path)
        with _LMDB_ENVS_LOCK:
            self.env = self._share(path, map_size, readonly, sealed)

    def _share(self, path, map_size, readonly, sealed):
        """The environment of ``path``, opened by the first store of it; the caller holds the lock."""
        import lmdb

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
            try:
                _check_lmdb_size(env, path)
            except StoreDamagedError:
                env.close()
                raise
            shared = _LMDB_ENVS[self.key] = [env, 0]
        elif not readonly and shared[0].flags()["readonly"]:
            raise ValueError(f"{path} is open read-only in this process; close its readers before writing")
        shared[1] += 1
        return shared[0]

    def check(self):
        _check_lmdb_size(self.env, self.key)

    def _key(self, k):
        return struct.pack(">II", k[0], k[2]) if self.quantized else struct.pack(">III", *k)

    def _records(self, items):
        """``{lmdb key: value}`` of ``{(stream, layer, block): record}``."""
        if not self.quantized:
            return {self._key(k): b for k, b in items.items()}
        blocks: dict[tuple[int, int], dict[int, bytes]] = {}
        for (s, layer, b), rec in items.items():
            blocks.setdefault((s, b), {})[layer] = rec
        for (s, b), layers in blocks.items():
            if sorted(layers) != list(range(len(layers))):
                raise ValueError(f"an int8 LMDB store writes every layer of a block together (layers 0..n-1); got "
                                 f"layers {sorted(layers)} of block {b} (stream {s})")
        return {struct.pack(">II", s, b): b"".join(layers[i] for i in range(len(layers)))
                for (s, b), layers in blocks.items()}

    def _put(self, items):
        import lmdb

        records = self._records(items)
        try:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        for k, b in records.items():
                            txn.put(k, b)
                    return
                except lmdb.MapFullError:  # the whole transaction was aborted: grow and redo it
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
        except lmdb.Error as e:  # at a put, at the commit (a full tmpfs gives EIO there) or growing the map
            if "No space left" in str(e) or "Disk quota" in str(e):
                raise DiskFullError(errno.ENOSPC, str(e)) from None
            raise StoreWriteError(errno.EIO, f"writing the LMDB store {self.key} failed ({e})") from None

    def _get(self, keys):
        import lmdb

        n = self.record_bytes
        try:
            with self.env.begin(buffers=self.quantized) as txn:
                if not self.quantized:
                    return [txn.get(self._key(k)) for k in keys]
                out = []
                for k in keys:  # the layer's bytes of the block's record (a length that is no record's is damage)
                    rec = txn.get(self._key(k))
                    missing = rec is None or (len(rec) % n == 0 and len(rec) < (k[1] + 1) * n)
                    out.append(None if missing else bytes(rec[k[1] * n:(k[1] + 1) * n]))
                return out
        except lmdb.MapResizedError:  # a writer grew the map past ours: adopt its size, read again
            self.env.set_mapsize(0)
            return self._get(keys)
        except lmdb.Error as e:  # pages that fail LMDB's own checks
            raise StoreDamagedError(f"the LMDB store {self.key} cannot be read ({e})") from None

    def close(self):
        with _LMDB_ENVS_LOCK:
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
            try:
                reserve(f, max(need, 2 * capacity, 16) * self.record_bytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(e.errno, f"no space left to grow {f}") from None
                raise
            mm = None
        if mm is None and f.exists():
            if f.stat().st_size % self.record_bytes:
                raise StoreDamagedError(f"the mmap store's {f} is truncated or extended ({f.stat().st_size:,} bytes, "
                                        f"not whole records of {self.record_bytes:,})")
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
            if mm is not None and b >= len(mm):  # a writer may have grown the file since it was mapped
                self._maps.pop((s, l))
                mm = self._map(s, l)
            out.append(mm[b].tobytes() if mm is not None and b < len(mm) else None)
        return out

    def check(self):
        for (s, l), mm in self._maps.items():
            f = self.path / f"s{s}_l{l}.blocks"
            size = f.stat().st_size if f.is_file() else 0
            if size < mm.size:
                raise StoreDamagedError(f"the mmap store's {f} is truncated ({size:,} of {mm.size:,} bytes)")

    def close(self):
        if not self.readonly:
            for mm in self._maps.values():
                mm.flush()
        self._maps.clear()


class OverlayStore(BlockStore):
    """A read-only ``base`` store and, past its first ``offset`` blocks, the store of the blocks
    fed since (``attach``): a reader of a saved memory feeds more text without touching its
    files. Blocks are put into the upper store by its own memory, never through this one."""

    def __init__(self, base):
        super().__init__(base.shape, DTYPE_NAMES[base.dtype])
        self.base, self.upper, self.offset = base, None, 0

    def attach(self, upper: BlockStore, offset: int) -> None:
        """Read blocks ``offset`` on from ``upper``, as its blocks ``0`` on."""
        self.upper, self.offset = upper, offset

    def forget(self):
        """Let go of the upper store: this store is its base again."""
        self.upper = None

    def check(self):
        self.base.check()

    def _blocks(self, keys):
        off = self.offset
        mine = [self.upper is not None and k[2] >= off for k in keys]
        new = iter(self.upper._blocks([(b, layer, i - off) for (b, layer, i), m in zip(keys, mine) if m]) if any(mine)
                   else ())
        old = iter(self.base._blocks([k for k, m in zip(keys, mine) if not m]))
        return [next(new) if m else next(old) for m in mine]

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

