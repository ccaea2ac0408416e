"""The ``lmdb`` store: one LMDB environment (the default on disk); every ``put``/``get`` call
is one transaction, so a chunk's blocks land together or not at all."""

import errno
import os
import struct
import threading
from pathlib import Path

from ..core.fileio import hard_linked
from .base import BlockStore, DiskFullError, StoreDamagedError, StoreWriteError

_LMDB_ENVS = {}  # real path -> [environment, users]: LMDB allows one environment per file and process
_LMDB_ENVS_LOCK = threading.Lock()  # threads (a server's answers) open and close one path's stores at once


def _check_lmdb_size(env, path) -> None:
    """``data.mdb`` holds every page LMDB's last commit uses: LMDB maps the file, and a page
    past its end (a truncated copy) would kill the process with SIGBUS at the first read."""
    f, info = os.path.join(path, "data.mdb"), env.info()
    need, size = (info["last_pgno"] + 1) * env.stat()["psize"], os.stat(f).st_size
    if size < need:
        raise StoreDamagedError(f"the LMDB store's {f} is truncated ({size:,} of {need:,} bytes)")


def _open_env(path, map_size, readonly, sealed):
    """An LMDB environment at ``path``, its data file checked to hold every page it uses."""
    import lmdb

    # readers take LMDB's reader lock where they may (safe beside a writer), none on read-only
    # media or where no writer will come (``sealed``: a corpus's merged documents)
    lock = not readonly or (not sealed and os.access(path, os.W_OK))
    written = ([] if readonly else ["data.mdb"]) + (["lock.mdb"] if lock else [])  # by LMDB itself
    for name in written:
        f = os.path.join(path, name)
        if os.path.isfile(f) and (links := os.stat(f).st_nlink) > 1:
            raise hard_linked(f, links)
    try:
        env = lmdb.open(str(path), map_size=map_size, readonly=readonly, max_dbs=0, lock=lock)
    except lmdb.Error as e:
        if "No space left" in str(e):
            raise DiskFullError(errno.ENOSPC, str(e)) from None
        raise StoreDamagedError(f"the LMDB store {path} cannot be opened ({e})") from None
    try:
        _check_lmdb_size(env, path)
    except StoreDamagedError:
        env.close()
        raise
    return env


class LmdbStore(BlockStore):
    """LMDB environment at ``path``; the map grows by doubling when full, and a reader follows
    a map that a writer grew. Stores of one path in one process share the environment.

    A float store keeps one record per (stream, layer, block). An int8 store keeps one per
    (stream, block), its layers' records one after another (a block's layers are written
    together, layers 0..n-1): LMDB gives a large value whole 4 KiB pages, which would add up
    to 16% to a record of some 25 KiB (SmolLM2's) and well under 1% to all layers at once;
    a read copies out only its layer's bytes."""

    def __init__(self, shape, path, store_dtype="float16", map_size=1 << 28, readonly=False, checksums=False,
                 sealed=False):
        super().__init__(shape, store_dtype, checksums)
        if not readonly:
            Path(path).mkdir(parents=True, exist_ok=True)
        self.key = os.path.realpath(path)
        with _LMDB_ENVS_LOCK:
            self._shared = self._share(path, map_size, readonly, sealed)

    @property
    def env(self):
        """The path's environment in this process (the writer's once one opens it), shared by
        every store of the path: setting it sets theirs."""
        return self._shared[0]

    @env.setter
    def env(self, env):
        self._shared[0] = env

    def _share(self, path, map_size, readonly, sealed):
        """``[environment, users]`` of ``path``, opened by the first store of it; a writer after
        readers reopens it writable for all of them (a corpus's reader and its build in one
        process: LMDB allows one environment per file). The caller holds the lock."""
        shared = _LMDB_ENVS.get(self.key)
        if shared is None:
            if readonly and not os.path.isfile(os.path.join(path, "data.mdb")):
                raise StoreDamagedError(f"the LMDB store {path} is missing its data.mdb")
            shared = _LMDB_ENVS[self.key] = [_open_env(path, map_size, readonly, sealed), 0]
        elif not readonly and shared[0].flags()["readonly"]:
            shared[0].close()
            shared[0] = _open_env(path, max(map_size, os.path.getsize(os.path.join(path, "data.mdb"))), False, False)
        shared[1] += 1
        return shared

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
            if shared is None or shared is not self._shared:
                return
            shared[1] -= 1
            if shared[1] == 0:
                del _LMDB_ENVS[self.key]
                self.env.close()
