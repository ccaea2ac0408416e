"""Landmark keys as rows: the float32 keys (n, dim) of one (stream, layer, key/value head), in
block order, in memory or in a file of their own that is appended in place and memory-mapped
(and, with another dtype, any per-block rows kept the same way: an ``ivf-rows`` index's list of
each block, its centroids).

A saved memory's rows are its one copy of the block keys: an exact flat index searches them
where they lie (``LandmarkIndex`` over ``rows``), so opening a memory maps its key files and
reads nothing. A writer maps its files read-write and grows them by doubling with the space
reserved first (a full disk is ``ENOSPC`` at the growth, never a SIGBUS later); rows past the
committed count are scratch, ignored and overwritten. A reader maps the committed rows only,
after checking that the file holds them, so a missing page is an error, never a SIGBUS.

A writer's file notes its status when taken and after each change the writer makes to it
(``watch``, a ``core.fileio.FileWatch``): a change that finds another status than the last noted
was preceded by another's, and its seals (``format/seals.py``) then never vouch for the file.
"""

import contextlib
import os
import zlib
from pathlib import Path

import numpy as np

from ..core.fileio import FileWatch, cut, open_nofollow, reserve

MIN_ROWS = 64  # the least a file or a buffer grows to


class KeyFileError(ValueError):
    """A key file shorter than the rows it must hold, or one that cannot be grown."""


class KeyRows:
    """Rows (n, dim) of one (stream, layer, key/value head), float32 unless ``dtype`` says.

    Parameters
    ----------
    dim : int, key dimension (values per row).
    path : Path, optional, the file; without it the rows live in memory.
    writable : bool, rows may be appended to the file (a writer); a reader maps ``n`` rows.
    n : int, the rows that count (committed); the file must hold them.
    dtype : numpy dtype of the values (float32 keys; int32 list ids).

    Attributes
    ----------
    watch : FileWatch of a writer's file (None: rows that are no writer's file); every change
        this object makes to the file is made within ``watch.change()``.
    """

    def __init__(self, dim: int, path: Path | None = None, *, writable: bool = True, n: int = 0,
                 dtype: type = np.float32):
        self.dim, self.path, self.writable, self.n, self.dtype = dim, path, writable, 0, np.dtype(dtype)
        self._rows = np.empty((0 if path is not None else MIN_ROWS, dim), self.dtype)
        self._synced = 0  # rows made durable by this object's last sync (a sync with none since does nothing)
        self.watch = FileWatch(path) if writable and path is not None else None
        self.follow(n)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows that count."""
        return self.n * self.dim * self.dtype.itemsize

    def array(self) -> np.ndarray:
        """(n, dim) of ``dtype``, C-contiguous, the rows that count (a view: valid until they grow)."""
        return self._rows[:self.n]

    def _changing(self):
        """A change made to the file (noted by ``watch``), or to rows that are no writer's file."""
        return self.watch.change() if self.watch is not None else contextlib.nullcontext()

    def follow(self, n: int) -> None:
        """Count ``n`` rows: a reader maps them (its file must hold them), a writer checks its
        file holds them (a writer opening a memory; the rows after them are scratch)."""
        if n > len(self._rows):
            if self.path is None:
                raise KeyFileError(f"{n} rows asked of {len(self._rows)} held in memory")
            self._map(n, grow=False)
        self.n = n

    def append(self, xb: np.ndarray) -> None:
        """Append rows ``xb`` float32 (m, dim)."""
        m = len(xb)
        with self._changing():
            if self.n + m > len(self._rows):
                want = max(self.n + m, 2 * len(self._rows), MIN_ROWS)
                if self.path is None:
                    grown = np.empty((want, self.dim), self.dtype)
                    grown[:self.n] = self._rows[:self.n]
                    self._rows = grown
                else:
                    self._map(want, grow=True)
            self._rows[self.n:self.n + m] = xb
        self.n += m

    def crc32(self, first: int, crc: int = 0) -> int:
        """CRC-32 of rows ``[first, n)``, carried on from ``crc`` (that of the rows before)."""
        return zlib.crc32(np.ascontiguousarray(self._rows[first:self.n]).tobytes(), crc)

    def sync(self) -> None:
        """Make the rows durable (a writer's file: its map written back, the file synced)."""
        if self.path is None or not self.writable or not len(self._rows) or self._synced == self.n:
            return
        with self._changing():
            self._rows.flush()
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._synced = self.n

    def check(self) -> None:
        """Raise ``KeyFileError`` if the file was cut below what is mapped of it."""
        if isinstance(self._rows, np.memmap):
            size = os.stat(self.path).st_size
            if size < self._rows.nbytes:
                raise KeyFileError(f"{self.path} is truncated ({size:,} of {self._rows.nbytes:,} bytes)")

    def close(self) -> None:
        """Release the map; a writer's file is cut to the rows that count (the room it grew
        into is given back)."""
        if self.path is not None and len(self._rows):
            with self._changing():
                if self.writable:
                    self._rows.flush()
                self._rows = np.empty((0, self.dim), self.dtype)  # the map goes with its last array
                if self.writable:
                    cut(self.path, self.nbytes)

    def _map(self, rows: int, grow: bool) -> None:
        """Map the file, at least ``rows`` rows of it; ``grow``: a writer makes room first."""
        f, row = Path(self.path), self.dim * self.dtype.itemsize
        if os.path.islink(f):
            raise KeyFileError(f"{f} is a symbolic link: a memory reads and writes only its own files; remove the link")
        size = f.stat().st_size if f.is_file() else -1
        have = size // row if size >= 0 else -1
        if have < rows and not grow:
            raise KeyFileError(f"{f} is missing" if have < 0 else
                               f"{f} is truncated ({size:,} of at least {rows * row:,} bytes)")
        if grow:
            f.parent.mkdir(exist_ok=True)
            reserve(f, rows * row)
            have = rows
        mapped = have if self.writable else rows  # a reader maps the rows that count, no further
        fd = open_nofollow(f, os.O_RDWR if self.writable else os.O_RDONLY)
        if self.writable and isinstance(self._rows, np.memmap):
            self._rows.flush()  # the old map's writes, before the new one reads the file
        with os.fdopen(fd, "rb+" if self.writable else "rb") as fh:
            self._rows = np.memmap(fh, dtype=self.dtype, mode="r+" if self.writable else "r", shape=(mapped, self.dim))
