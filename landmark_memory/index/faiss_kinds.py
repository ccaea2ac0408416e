"""FAISS's own indexes, kept whole in a memory's state file: ``hnsw`` (HNSW32), ``ivf``
(IVF-Flat), ``ivfpq`` (IVF-PQ, whose ``refine`` x k best candidates are re-ranked exactly by
FAISS's IndexRefineFlat: PQ codes alone lose too much inner-product precision on landmark
keys), and ``ivf-gpu``, ``ivfpq-gpu`` where faiss-gpu and a GPU are present (``flat-gpu``
searches the key rows: ``on_rows.py``). A search restricted to a block range is an
``IDSelectorRange`` (how ``max_blocks`` and the exact-scored recent blocks are kept out of it).
Classic faiss-gpu ignores the selector (only its cuVS backend honours it: FAISS issues #3114,
#3924), so a GPU index searches for as many more results as ids lie outside the range and keeps
the first ``k`` inside it: the range's top-k among the lists it visits, as on the CPU.

The IVF kinds need training: they search an exact flat index until ``train_size`` keys exist,
then train on all keys seen so far and move them over. They train again, on all their keys,
each time they have grown ``RETRAIN_GROWTH`` times (at ``train_size`` x 4, x 16, ...), so their
lists keep about the same length and a search costs about the same however large the memory
grows. The points of training follow from the key count alone, so a saved index resumes exactly.
"""

import functools
import math

import faiss
import numpy as np

from .base import LandmarkIndex
from .lists import level_of

GPU_MAX_K = 2048  # the most results a faiss-gpu search returns per query


def gpu_available() -> bool:
    """True when faiss-gpu is installed and sees a GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


@functools.cache
def gpu_resources():
    """The one ``faiss.StandardGpuResources`` every GPU index of this process shares (its
    temporary memory is reserved once)."""
    return faiss.StandardGpuResources()


def in_range(D: np.ndarray, I: np.ndarray, k: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` results of each row of a search (``D`` float32, ``I`` int64 (nq, k'), best
    first) whose ids lie in ``[lo, hi)``, in their order; -inf and -1 where fewer are."""
    keep = (I >= lo) & (I < hi)
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # kept first, each in its place
    D, I, keep = (np.take_along_axis(a, order, 1) for a in (D, I, keep))
    return np.where(keep, D, -np.inf).astype(np.float32), np.where(keep, I, -1)


class FaissIndex(LandmarkIndex):
    """A FAISS index of ``kind``; ``refine`` : int, IVF-PQ candidates re-ranked exactly per
    result (0: PQ scores only)."""

    def __init__(self, kind: str, dim: int, *, refine: int = 4, **options):
        super().__init__(kind, dim, **options)
        self.base = kind.removesuffix("-gpu")
        if self.base == "ivfpq" and self.train_size < 16:
            raise ValueError(f"ivfpq needs train_size >= 16 (its smallest PQ codebooks have 16 centroids), "
                             f"got {self.train_size}")
        self.refine = refine
        self.trained = self.base in ("flat", "hnsw")
        # CPU IVF indexes hold their keys exactly (IVF-Flat, or IVF-PQ's refinement), so they can retrain
        self.retrains = (self.base == "ivf" or (self.base == "ivfpq" and refine > 0)) and not kind.endswith("-gpu")
        self._params_for = (None, None, None)  # ((lo, hi), index, search parameters) of the last search
        self.index = self._build("HNSW32" if self.base == "hnsw" else "Flat")

    def _build(self, factory):
        index = faiss.index_factory(self.dim, factory, faiss.METRIC_INNER_PRODUCT)
        if self.kind.endswith("-gpu") and self.trained:
            index = faiss.index_cpu_to_gpu(gpu_resources(), 0, index)
        return index

    def to_bytes(self) -> np.ndarray:
        index = faiss.index_gpu_to_cpu(self.index) if self.kind.endswith("-gpu") else self.index
        return faiss.serialize_index(index)

    def restore(self, index) -> None:
        self.trained = self.trained or not isinstance(index, faiss.IndexFlat)  # IVF kinds search flat until trained
        self.index = index
        if self.kind.endswith("-gpu") and self.trained:
            self.index = faiss.index_cpu_to_gpu(gpu_resources(), 0, index)

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    @property
    def nbytes(self) -> int:
        return len(self.to_bytes())

    def add(self, xb: np.ndarray) -> None:
        xb = self._check(xb, "xb")
        n_before = self.ntotal
        self.index.add(xb)
        grown = level_of(self.ntotal, self.train_size) > level_of(n_before, self.train_size)
        if (not self.trained and self.ntotal >= self.train_size) or (self.trained and self.retrains and grown):
            self._train()

    def _keys(self):
        """Every key, float32 (ntotal, dim), exactly as added."""
        if not self.trained or self.base not in ("ivf", "ivfpq"):
            return self.index.reconstruct_n(0, self.ntotal)  # an exact flat index until trained
        if self.base == "ivfpq":
            return faiss.downcast_index(self.index).refine_index.reconstruct_n(0, self.ntotal)
        ivf = faiss.extract_index_ivf(self.index)
        if ivf.direct_map.type == faiss.DirectMap.NoMap:
            ivf.make_direct_map()
        return self.index.reconstruct_n(0, self.ntotal)

    def _train(self):
        xb = self._keys()
        n = len(xb)
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))  # FAISS wants >= 39 points per list
        nbits = 8 if n >= 39 * 256 else 4  # PQ codebooks want >= 39 points per centroid too
        if self.base == "ivf":
            factory = f"IVF{nlist},Flat"
        else:  # 8-bit codes on pairs of dims once codebooks can be trained, else 4-bit per dim
            factory = f"IVF{nlist},PQ{self.dim // (2 if nbits == 8 else 1)}x{nbits}" + (",RFlat" if self.refine else "")
        self.trained = True
        index = self._build(factory)
        if not self.kind.endswith("-gpu"):
            # the list and codebook sizes above already follow the data; FAISS's k-means would
            # still print a warning per index for small PQ codebooks trained on a few hundred keys
            ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
            ivf.cp.min_points_per_centroid = 1
            if hasattr(ivf, "pq"):
                ivf.pq.cp.min_points_per_centroid = 1
        index.train(xb)
        index.add(xb)
        self.index = index

    def _params(self, lo, hi):
        """Search parameters restricted to ids ``[lo, hi)``, made once per range and index (a
        decoding step searches the same range as the step before, and making them costs as
        much as a small search)."""
        if self._params_for[0] != (lo, hi) or self._params_for[1] is not self.index:  # training makes a new index
            sel = faiss.IDSelectorRange(lo, hi)
            if not self.trained or self.base == "flat":
                params = faiss.SearchParameters(sel=sel)
            elif self.base == "hnsw":
                params = faiss.SearchParametersHNSW(sel=sel, efSearch=self.ef_search)
            else:
                params = faiss.SearchParametersIVF(sel=sel, nprobe=self.nprobe)
                if self.base == "ivfpq" and self.refine:
                    params = faiss.IndexRefineSearchParameters(k_factor=self.refine, base_index_params=params)
            self._params_for = ((lo, hi), self.index, params)
        return self._params_for[2]

    def _search(self, xq, k, lo, hi):
        if not (self.kind.endswith("-gpu") and self.trained):  # (untrained, a GPU kind searches a CPU flat index)
            return self.index.search(xq, k, params=self._params(lo, hi))
        wide = k + self.ntotal - (hi - lo)  # enough that the range's top k survive whatever lies outside it
        if wide > GPU_MAX_K:
            raise ValueError(f"{self.kind} cannot restrict a search to blocks [{lo}, {hi}) of {self.ntotal}: "
                             f"faiss-gpu ignores a range, and the {wide:,} results that would make up for it are over "
                             f"its {GPU_MAX_K:,}; use {self.base!r} (on the CPU) or ivf-rows")
        D, I = self.index.search(xq, min(wide, self.ntotal), params=self._params(lo, hi))
        return in_range(D, I, k, lo, hi)
