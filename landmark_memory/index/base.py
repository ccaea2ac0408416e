"""What every kind of landmark index does: keys appended in block order (so ids are block
numbers), a top-k inner-product search over a block range, a serialisation of its own, and what
it keeps on disk beside its key file. The registry of kinds is ``index/__init__.py``; a module
per family of kinds implements them (``on_rows.py``: over the key rows where they lie;
``faiss_kinds.py``: FAISS's own indexes).

A saved memory asks a kind, never a kind's module, about its files: ``files`` (those an open
index maps: a commit syncs them and records their CRC-32s, ``refresh`` checks them, ``close``
lets them go), ``saved_files`` (those a commit of n blocks holds: what opening checks and
``verify`` reads), ``stale_files`` (those no reader needs after a commit), ``own_files`` (all
of them, whatever the commit) and ``search_words`` (``info``'s words for its search)."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.names import EF_SEARCH, NPROBE
from .rows import KeyRows


@dataclass(frozen=True)
class IndexFile:
    """A file an index keeps beside its key file: its rows, and, where it grows with the blocks
    (appended as they come, its CRC-32 carried on by a commit), the rows it held at a commit of
    n blocks (``rows_at``; None: written whole once)."""

    rows: KeyRows
    rows_at: Callable[[int], int] | None


class LandmarkIndex:
    """Inner-product search over the block keys of one (stream, layer, key/value head).

    Made by ``index.new_index`` (or ``index.index_from_bytes``), which picks the class of its
    kind.

    Parameters
    ----------
    kind : str, its name among ``index.KINDS``.
    dim : int, key dimension (the model's head dim).
    train_size : int, keys an IVF kind needs before it trains (exact search until then).
    nprobe : int, IVF lists visited per query.
    ef_search : int, HNSW search breadth.
    """

    rows = None  # the ``rows.KeyRows`` it searches where they lie (``on_rows.py``); None: it holds its own keys
    lists = None  # the ``lists.ListIndex`` over those rows (ivf-rows)

    def __init__(self, kind: str, dim: int, *, train_size: int, nprobe: int = NPROBE, ef_search: int = EF_SEARCH):
        self.kind, self.dim, self.train_size = kind, dim, train_size
        self.nprobe, self.ef_search = nprobe, ef_search
        self.searches, self.search_seconds = 0, 0.0  # calls to search() and time spent searching

    @property
    def ntotal(self) -> int:
        """Keys held."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes it takes in memory, near enough."""
        raise NotImplementedError

    def add(self, xb: np.ndarray) -> None:
        """Append keys ``xb`` float32 (n, dim); their ids continue from ``ntotal``."""
        raise NotImplementedError

    def to_bytes(self) -> np.ndarray:
        """The index in FAISS's own serialisation, uint8 (n,)."""
        raise NotImplementedError

    def restore(self, index) -> None:
        """Take the contents of ``index``, a FAISS index read from ``to_bytes()`` output."""
        raise NotImplementedError

    def follow(self, n: int, runs: bool = True) -> None:
        """Count the first ``n`` keys of its rows, which a saved memory's commit counts (kinds
        over the key rows; nothing to do for the others); ``runs``: the commit is of a format
        that keeps an ``ivf-rows`` level's runs (8 on)."""

    def files(self) -> list[IndexFile]:
        """The files it keeps beside its key file now (none: it keeps nothing on disk, or only
        in a memory's state file)."""
        return []

    @classmethod
    def saved_files(cls, key_file: str, n: int, train_size: int, dim: int, runs: bool = True) -> dict[str, int]:
        """``{file: committed bytes}`` that an index of this kind over ``key_file`` (a name
        relative to the memory) keeps beside it at a commit of ``n`` blocks (``runs``: of a
        format that keeps an ``ivf-rows`` level's runs)."""
        return {}

    @classmethod
    def stale_files(cls, folder: Path, indexes: list["LandmarkIndex"]) -> list[Path]:
        """The files of this kind in ``folder`` (a memory's ``keys/``) that no reader needs once
        a commit of ``indexes`` (every index of the memory) is made."""
        return []

    @classmethod
    def own_files(cls, folder: Path) -> list[Path]:
        """Every file of this kind in ``folder`` (a memory's ``keys/``), whatever commit it
        belongs to (what goes when the key files it lies beside go)."""
        return []

    @classmethod
    def search_words(cls, n: int, train_size: int, nprobe: int) -> str:
        """How an index of this kind over ``n`` keys searches, in words (``info``)."""
        return "approximate (FAISS)"

    def _search(self, xq: np.ndarray, k: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _check(self, x, what):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{what} must be (n, {self.dim}) float32, got shape {x.shape}")
        return x

    def search(self, xq: np.ndarray, k: int, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` inner products among ids in ``[lo, hi)``.

        Returns
        -------
        D : float32 (nq, k), scores, ``-inf`` where fewer than k ids qualify.
        I : int64 (nq, k), block ids, ``-1`` there.
        """
        xq = self._check(xq, "xq")
        hi = self.ntotal if hi is None else min(hi, self.ntotal)
        if k <= 0 or hi <= lo:
            return np.full((len(xq), max(k, 0)), -np.inf, np.float32), np.full((len(xq), max(k, 0)), -1, np.int64)
        t0 = time.perf_counter()
        D, I = self._search(xq, k, lo, hi)
        self.searches += 1
        self.search_seconds += time.perf_counter() - t0
        D[I < 0] = -np.inf
        return D, I
