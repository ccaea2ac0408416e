"""Landmark key search by inner product, one FAISS index per (stream, layer, head).

Kinds: ``ivf-rows`` (the default: exact as ``flat`` until ``train_size`` keys, then an IVF whose
lists hold block ids over the key rows where they lie, ``lists.ListIndex``: a search costs about
the same however many blocks a memory holds, and a commit writes only what it appends),
``flat`` (exact: FAISS's brute-force inner products over the key rows where they lie,
``rows.KeyRows``, a memory-mapped file in a saved memory; the same results, bit for bit, as an
IndexFlatIP with an IDSelectorRange), ``hnsw`` (HNSW32), ``ivf`` (IVF-Flat), ``ivfpq`` (IVF-PQ,
whose ``refine`` x k best candidates are re-ranked exactly by FAISS's IndexRefineFlat: PQ codes
alone lose too much inner-product precision on landmark keys), and ``flat-gpu``, ``ivf-gpu``,
``ivfpq-gpu`` where faiss-gpu and a GPU are present. Ids are
block numbers: blocks are added in order, so FAISS's sequential ids are the block index, and a
search restricted to a block range is an ``IDSelectorRange`` (how ``max_blocks`` and the
exact-scored recent blocks are kept out of the approximate search).

FAISS's IVF kinds need training: they search an exact flat index until ``train_size`` keys exist, then
train on all keys seen so far and move them over. They train again, on all their keys, each time
they have grown ``RETRAIN_GROWTH`` times (at ``train_size`` x 4, x 16, ...), so their lists keep
about the same length and a search costs about the same however large the memory grows. The
points of training follow from the key count alone, so a saved index resumes exactly.
"""

import math
import time

import faiss
import numpy as np

from ..core.names import INDEX_KINDS
from .lists import ListIndex, level_of
from .rows import KeyRows

KINDS = INDEX_KINDS
ON_ROWS = ("flat", "ivf-rows")  # kinds that search the key rows where they lie


def default_train_size(kind: str) -> int:
    """Keys an IVF index of ``kind`` needs before it trains, unless told (8-bit PQ codebooks want
    about 10K points)."""
    return {"ivfpq": 16384, "ivf-rows": 1024}.get(kind.removesuffix("-gpu"), 4096)


def derived_from_rows(kind: str) -> bool:
    """Whether an index of ``kind`` keeps nothing in a memory's state file: one that searches
    the key rows where they lie (``ON_ROWS``; ``ivf-rows`` keeps its lists in files beside them),
    or an exact flat index on a GPU, a copy of the rows made when the memory opens."""
    return kind in ON_ROWS or kind == "flat-gpu"


def gpu_available() -> bool:
    """True when faiss-gpu is installed and sees a GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class LandmarkIndex:
    """Inner-product search over the landmark keys of one (stream, layer, head).

    Parameters
    ----------
    kind : str, one of ``KINDS``.
    dim : int, key dimension (the model's head dim).
    train_size : int, keys needed before an IVF index is trained (exact search until then);
        default 1024 for ivf-rows, 4096 for ivf, 16384 for ivfpq (8-bit PQ codebooks need ~10K
        points).
    nprobe : int, IVF lists visited per query.
    ef_search : int, HNSW search breadth.
    refine : int, IVF-PQ candidates re-ranked exactly per result (0: PQ scores only).
    rows : KeyRows, optional, ``ON_ROWS`` kinds only: the rows it searches and appends to
        (default its own, in memory).
    """

    NPROBE = 16  # IVF lists a query visits unless told

    def __init__(self, kind: str, dim: int, *, train_size: int | None = None, nprobe: int = NPROBE, ef_search: int = 128,
                 refine: int = 4, rows: KeyRows | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown index kind {kind!r}; choose one of {KINDS}")
        if kind.endswith("-gpu") and not gpu_available():
            raise ValueError(f"index {kind!r} needs faiss-gpu and a GPU; install the 'gpu' extra on a GPU "
                             f"machine or use {kind[:-4]!r}")
        self.kind, self.dim = kind, dim
        self.base = kind.removesuffix("-gpu")
        self.train_size = train_size or default_train_size(kind)
        if self.base == "ivfpq" and self.train_size < 16:
            raise ValueError(f"ivfpq needs train_size >= 16 (its smallest PQ codebooks have 16 centroids), "
                             f"got {self.train_size}")
        self.nprobe, self.ef_search, self.refine = nprobe, ef_search, refine
        self.trained = self.base in ("flat", "hnsw")
        # CPU IVF indexes hold their keys exactly (IVF-Flat, or IVF-PQ's refinement), so they can retrain
        self.retrains = (self.base == "ivf" or (self.base == "ivfpq" and refine > 0)) and not kind.endswith("-gpu")
        self.searches, self.search_seconds = 0, 0.0  # calls to search() and time spent in FAISS
        self._params_for = (None, None, None)  # ((lo, hi), index, search parameters) of the last search
        # a CPU flat index is its rows, searched where they lie, and ivf-rows lists over them;
        # every other kind has a FAISS index
        self.rows = (rows if rows is not None else KeyRows(dim)) if kind in ON_ROWS else None
        self.lists = ListIndex(self.rows, self.train_size) if kind == "ivf-rows" else None
        self.index = None if kind in ON_ROWS else self._build("HNSW32" if self.base == "hnsw" else "Flat")

    def _build(self, factory):
        index = faiss.index_factory(self.dim, factory, faiss.METRIC_INNER_PRODUCT)
        if self.kind.endswith("-gpu") and self.trained:
            self._res = getattr(self, "_res", None) or faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._res, 0, index)
        return index

    def to_bytes(self) -> np.ndarray:
        """The index in FAISS's own serialisation, uint8 (n,) (a flat one as an IndexFlatIP)."""
        if self.rows is not None:
            index = faiss.IndexFlatIP(self.dim)
            index.add(self.rows.array())
        else:
            index = faiss.index_gpu_to_cpu(self.index) if self.kind.endswith("-gpu") else self.index
        return faiss.serialize_index(index)

    @classmethod
    def from_bytes(cls, kind: str, dim: int, data: np.ndarray, **options) -> "LandmarkIndex":
        """An index of ``kind`` restored from ``to_bytes()`` output ``data`` (uint8 (n,))."""
        ix = cls(kind, dim, **options)
        index = faiss.deserialize_index(np.ascontiguousarray(data, dtype=np.uint8))
        if index.d != dim:
            raise ValueError(f"serialised index has dimension {index.d}, expected {dim}")
        if ix.rows is not None:
            ix.rows.append(index.reconstruct_n(0, index.ntotal))
            return ix
        ix.trained = ix.trained or not isinstance(index, faiss.IndexFlat)  # IVF kinds search flat until trained
        ix.index = index
        if kind.endswith("-gpu") and ix.trained:
            ix._res = faiss.StandardGpuResources()
            ix.index = faiss.index_cpu_to_gpu(ix._res, 0, index)
        return ix

    @property
    def ntotal(self) -> int:
        return self.rows.n if self.rows is not None else self.index.ntotal

    @property
    def nbytes(self) -> int:
        """Bytes of the index: its rows and lists, or FAISS's serialisation (what it takes in
        memory, near enough)."""
        if self.rows is not None:
            return self.rows.nbytes + (self.lists.nbytes if self.lists is not None else 0)
        return len(self.to_bytes())

    def follow(self, n: int) -> None:
        """Count the first ``n`` keys of its rows, which a saved memory's commit counts (the rows
        followed already): an ``ivf-rows`` index maps the lists of their level."""
        if self.lists is not None:
            self.lists.follow(n)

    def _check(self, x, what):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{what} must be (n, {self.dim}) float32, got shape {x.shape}")
        return x

    def add(self, xb: np.ndarray) -> None:
        """Append keys ``xb`` (n, dim); their ids continue from ``ntotal``."""
        xb = self._check(xb, "xb")
        if self.rows is not None:
            n_before = self.rows.n
            self.rows.append(xb)
            if self.lists is not None:
                self.lists.add(n_before)
            return
        n_before = self.ntotal
        self.index.add(xb)
        if not self.trained and self.ntotal >= self.train_size:
            self._train()
        elif self.trained and self.retrains and level_of(self.ntotal, self.train_size) > level_of(n_before, self.train_size):
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
        if self.lists is not None and self.lists.level:
            D, I = self.lists.search(xq, k, lo, hi, self.nprobe)
        elif self.rows is not None:  # brute force over the range, as IndexFlatIP with an IDSelectorRange
            D, I = faiss.knn(xq, self.rows.array()[lo:hi], k, metric=faiss.METRIC_INNER_PRODUCT)
            I[I >= 0] += lo
        else:
            D, I = self.index.search(xq, k, params=self._params(lo, hi))
        self.searches += 1
        self.search_seconds += time.perf_counter() - t0
        D[I < 0] = -np.inf
        return D, I


def recall_at_k(I: np.ndarray, I_exact: np.ndarray) -> float:
    """Mean fraction of the exact top-k ids found by an approximate search.

    Parameters
    ----------
    I, I_exact : int (nq, k) ids from the approximate and the exact search; -1 entries of the
        exact search (fewer than k candidates) are not counted.
    """
    I, I_exact = np.asarray(I), np.asarray(I_exact)
    if I.shape[0] != I_exact.shape[0]:
        raise ValueError(f"I has {I.shape[0]} queries, I_exact {I_exact.shape[0]}")
    hits = total = 0
    for row, exact in zip(I, I_exact):
        exact = set(exact[exact >= 0].tolist())
        hits += len(exact & set(row.tolist()))
        total += len(exact)
    return hits / total if total else 1.0
