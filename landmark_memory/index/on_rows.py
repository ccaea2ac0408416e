"""Kinds that search the block key rows where they lie (``rows.KeyRows``: a memory-mapped
file in a saved memory), so a memory's state file keeps nothing of them and opening one reads
no key:

- ``flat``: exact, FAISS's brute-force inner products over the range (the same results, bit for
  bit, as an IndexFlatIP with an IDSelectorRange);
- ``flat-gpu``: the same on a GPU (``faiss.knn_gpu`` over the range's rows, where faiss-gpu and a
  GPU are present);
- ``flat-torch``: the same through PyTorch, on a GPU where CUDA is present (faiss-gpu or not) and
  on the CPU elsewhere: a matrix product and a top-k over slices of the range's rows, which it
  copies to the device once, as they are appended;
- ``ivf-rows`` (the default): exact the same way until ``train_size`` keys, then lists of block
  ids over the rows (``lists.ListIndex``, in files beside them): a search costs about the same
  however many blocks a memory holds, and a commit writes only what it appends.
"""

from pathlib import Path

import faiss
import numpy as np
import torch

from .base import IndexFile, LandmarkIndex
from .faiss_kinds import gpu_resources
from .lists import ListIndex, level_files, lists_files, stale_files, summary
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


class TorchRowsIndex(RowsIndex):
    """``flat-torch``: ``flat``'s exact search by PyTorch on ``device`` (default: CUDA when
    present, else the CPU), the rows copied there as they are appended and scored a slice at a
    time, so that a search holds at most ``SCORES`` float32 scores (256 MiB) whatever the memory's
    size and the number of queries."""

    SCORES = 1 << 26

    def __init__(self, kind: str, dim: int, *, device: str | None = None, **options):
        super().__init__(kind, dim, **options)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._copy = torch.empty(0, dim, device=self.device)  # (capacity, dim): rows [0, _copied) as they are
        self._copied = 0

    def follow(self, n: int, runs: bool = True) -> None:
        super().follow(n)
        self._copied = min(self._copied, n)  # rows past n may be written again

    def _rows_on_device(self, hi: int) -> torch.Tensor:
        """The first ``hi`` rows on the device (those not copied yet go now)."""
        if hi > self._copied:
            if hi > len(self._copy):
                grown = torch.empty(max(hi, 2 * len(self._copy)), self.dim, device=self.device)
                grown[:self._copied] = self._copy[:self._copied]
                self._copy = grown
            self._copy[self._copied:hi] = torch.from_numpy(self.rows.array()[self._copied:hi]).to(self.device)
            self._copied = hi
        return self._copy[:hi]

    @torch.no_grad()
    def _search(self, xq, k, lo, hi):
        xb = self._rows_on_device(hi)
        q = torch.from_numpy(xq).to(self.device)  # (nq, dim)
        D = torch.full((len(xq), k), float("-inf"), device=self.device)
        I = torch.full((len(xq), k), -1, dtype=torch.int64, device=self.device)
        step = max(k, self.SCORES // len(xq))
        for start in range(lo, hi, step):  # each slice's top k merged into the best k so far
            scores = q @ xb[start:min(start + step, hi)].T  # (nq, slice)
            d, i = scores.topk(min(k, scores.shape[1]), dim=1)
            D, order = torch.cat([D, d], 1).topk(k, dim=1)
            I = torch.cat([I, i + start], 1).gather(1, order)
        return D.cpu().numpy(), I.cpu().numpy()


class ListsIndex(RowsIndex):
    """``ivf-rows``: ``flat`` until its rows reach ``train_size``, then lists over them."""

    def __init__(self, kind: str, dim: int, **options):
        super().__init__(kind, dim, **options)
        self.lists = ListIndex(self.rows, self.train_size)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.lists.nbytes

    def follow(self, n: int, runs: bool = True) -> None:
        """Map the lists (and ``runs``, where the commit keeps them) of the level the first ``n`` rows reach."""
        self.lists.follow(n, runs)

    def add(self, xb: np.ndarray) -> None:
        n_before = self.rows.n
        super().add(xb)
        self.lists.add(n_before)

    def _search(self, xq, k, lo, hi):
        if self.lists.level:
            return self.lists.search(xq, k, lo, hi, self.nprobe)
        return super()._search(xq, k, lo, hi)

    def files(self) -> list[IndexFile]:
        """Its level's centroids (written once), lists (a row per block) and runs (rows as runs
        fill); none untrained."""
        return self.lists.files()

    @classmethod
    def saved_files(cls, key_file, n, train_size, dim, runs=True):
        return level_files(key_file, n, train_size, dim, runs)

    @classmethod
    def stale_files(cls, folder: Path, indexes) -> list[Path]:
        levels = {ix.lists.level for ix in indexes}  # every index trains at the same count: one level
        return stale_files(folder, levels.pop()) if len(levels) == 1 else []

    @classmethod
    def own_files(cls, folder: Path) -> list[Path]:
        return list(lists_files(folder))

    @classmethod
    def search_words(cls, n, train_size, nprobe):
        return summary(n, train_size, nprobe)
