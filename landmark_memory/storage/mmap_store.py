"""The ``mmap`` store: one memory-mapped file per (stream, layer), grown by doubling."""

import errno
import os
from pathlib import Path

import numpy as np

from ..core.fileio import open_nofollow, reserve
from .base import BlockStore, DiskFullError, StoreDamagedError


class MmapStore(BlockStore):
    """One file ``s{stream}_l{layer}.blocks`` per (stream, layer) under ``path``, grown by
    doubling with space reserved on the device (a full disk is an error, never a SIGBUS)."""

    def __init__(self, shape, path, store_dtype="float16", readonly=False, checksums=False):
        super().__init__(shape, store_dtype, checksums)
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
