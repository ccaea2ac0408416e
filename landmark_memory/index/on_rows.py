"""Kinds that search the landmark key rows where they lie (``rows.KeyRows``: a memory-mapped
file in a saved memory), so a memory's state file keeps nothing of them and opening one reads
no key:

- ``flat``: exact, FAISS's brute-force inner products over the range (the same results, bit for
  bit, as an IndexFlatIP with an IDSelectorRange);
- ``flat-gpu``: the same on a GPU (``faiss.knn_gpu`` over the range's rows, where faiss-gpu and a
  GPU are present);
- ``ivf-rows`` (the default): exact the same way until ``train_size`` keys, then lists of block
  ids over the rows (``lists.ListIndex``, in files beside them): a search costs about the same
  however many blocks a memory holds, and a commit writes only what it appends.
"""

from pathlib import Path

import faiss
import numpy as np

from .base import IndexFile, LandmarkIndex
from .faiss_kinds import gpu_resources
from .lists import ListIndex, level_files, stale_files, summary
from .rows import KeyRows


class RowsIndex(LandmarkIndex):
    """``flat``: exact search over ``rows`` (default: rows of its own, in memory), which it
    appends to."""

    def __init__(self, kind: str, dim: int, *, rows: KeyRows | None = None, **options):
        super().__init__(kind, dim, **options)
        self.rows = rows if rows is not None else KeyRows(dim)

    @property
    def ntotal(self) -> int:
        return self.rows.n

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def add(self, xb: np.ndarray) -> None:
        self.rows.append(self._check(xb, "xb"))

    def to_bytes(self) -> np.ndarray:
        """The rows as a serialised IndexFlatIP (what ``verify`` and older memories read)."""
        index = faiss.IndexFlatIP(self.dim)
        index.add(self.rows.array())
        return faiss.serialize_index(index)

    def restore(self, index) -> None:
        self.rows.append(index.reconstruct_n(0, index.ntotal))

    def _search(self, xq, k, lo, hi):
        D, I = faiss.knn(xq, self.rows.array()[lo:hi], k, metric=faiss.METRIC_INNER_PRODUCT)
        I[I >= 0] += lo
        return D, I

    @classmethod
    def search_words(cls, n, train_size, nprobe):
        return "exact"


class GpuRowsIndex(RowsIndex):
    """``flat-gpu``: ``flat``'s exact search over the range's rows, on a GPU (its selector
    would be ignored there: the rows of the range are searched, as ``flat`` searches them)."""

    def _search(self, xq, k, lo, hi):
        D, I = faiss.knn_gpu(gpu_resources(), xq, self.rows.array()[lo:hi], k, metric=faiss.METRIC_INNER_PRODUCT)
        I[I >= 0] += lo
        return D, I


class ListsIndex(RowsIndex):
    """``ivf-rows``: ``flat`` until its rows reach ``train_size``, then lists over them."""

    def __init__(self, kind: str, dim: int, **options):
        super().__init__(kind, dim, **options)
        self.lists = ListIndex(self.rows, self.train_size)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.lists.nbytes

    def follow(self, n: int) -> None:
        """Map the lists of the level the first ``n`` rows reach."""
        self.lists.follow(n)

    def add(self, xb: np.ndarray) -> None:
        n_before = self.rows.n
        super().add(xb)
        self.lists.add(n_before)

    def _search(self, xq, k, lo, hi):
        if self.lists.level:
            return self.lists.search(xq, k, lo, hi, self.nprobe)
        return super()._search(xq, k, lo, hi)

    def files(self) -> list[IndexFile]:
        """Its level's centroids (written once) and lists (a row per block); none untrained."""
        return [IndexFile(f, per_block=f is self.lists.lists) for f in self.lists.files()]

    @classmethod
    def saved_files(cls, key_file, n, train_size, dim):
        return level_files(key_file, n, train_size, dim)

    @classmethod
    def stale_files(cls, folder: Path, indexes) -> list[Path]:
        levels = {ix.lists.level for ix in indexes}  # every index trains at the same count: one level
        return stale_files(folder, levels.pop()) if len(levels) == 1 else []

    @classmethod
    def search_words(cls, n, train_size, nprobe):
        return summary(n, train_size, nprobe)
