"""Landmark key search by inner product, one index per (stream, layer, key/value head), of a
kind from the registry ``KINDS``.

Kinds, by module: ``on_rows.py`` (``ivf-rows``, the default, ``flat``, ``flat-gpu`` and ``flat-torch``: over the key
rows where they lie, nothing in a memory's state file), ``faiss_kinds.py`` (``hnsw``, ``ivf``, ``ivfpq`` and their GPU
variants: FAISS's own indexes, serialised into the state file). Ids are block numbers: blocks are added in order, so a
search restricted to a block range is a range of ids. Adding a kind is a class (in one of those modules or one of its
own), a line in ``KINDS`` and its name in ``core/names.py`` (which the command line reads without importing FAISS); a
kind that keeps files beside the key files says which through its class (``base.py``), and the memory asks it, never
its module.
"""

from dataclasses import dataclass

import faiss
import numpy as np

from ..core.names import TRAIN_SIZES
from .base import IndexFile, LandmarkIndex
from .faiss_kinds import FaissIndex, gpu_available
from .on_rows import GpuRowsIndex, ListsIndex, RowsIndex, TorchRowsIndex


@dataclass(frozen=True)
class IndexKind:
    """What a kind of landmark index is.

    make : the ``LandmarkIndex`` class that makes it, called ``make(kind, dim, **options)``;
        its ``files``, ``saved_files``, ``stale_files`` and ``search_words`` say what the kind
        keeps on disk beside the key files and how it searches (``base.py``).
    train_size : keys it needs before it trains, unless told (8-bit PQ codebooks want about
        10K points; what ``info`` reports for kinds that never train).
    in_state : a memory's state file keeps it; else it searches the key rows where they lie.
    gpu : it needs faiss-gpu and a GPU.
    """

    make: type[LandmarkIndex]
    train_size: int = 4096
    in_state: bool = True
    gpu: bool = False

    @property
    def on_rows(self) -> bool:
        """It searches the memory's key rows where they lie (``new_index(..., rows=)``)."""
        return issubclass(self.make, RowsIndex)


KINDS: dict[str, IndexKind] = {
    "ivf-rows": IndexKind(ListsIndex, TRAIN_SIZES["ivf-rows"], in_state=False),
    "flat": IndexKind(RowsIndex, in_state=False),
    "hnsw": IndexKind(FaissIndex),
    "ivf": IndexKind(FaissIndex, TRAIN_SIZES["ivf"]),
    "ivfpq": IndexKind(FaissIndex, TRAIN_SIZES["ivfpq"]),
    "flat-gpu": IndexKind(GpuRowsIndex, in_state=False, gpu=True),
    "flat-torch": IndexKind(TorchRowsIndex, in_state=False),
    "ivf-gpu": IndexKind(FaissIndex, TRAIN_SIZES["ivf"], gpu=True),
    "ivfpq-gpu": IndexKind(FaissIndex, TRAIN_SIZES["ivfpq"], gpu=True),
}


def new_index(kind: str, dim: int, *, train_size: int | None = None, **options) -> LandmarkIndex:
    """An empty index of ``kind`` over keys of ``dim`` dimensions.

    Parameters
    ----------
    kind : str, one of ``KINDS``.
    dim : int, key dimension (the model's head dim).
    train_size : int, keys an IVF kind needs before it trains (default ``default_train_size``).
    options : nprobe (IVF lists visited per query, default ``core.names.NPROBE``), ef_search
        (HNSW search breadth); ``rows`` (kinds ``on_rows``: the ``KeyRows`` it searches and
        appends to, default its own in memory); ``refine`` (FAISS kinds: IVF-PQ candidates
        re-ranked exactly per result, default 4).

    ``ValueError`` for an unknown kind, a GPU kind without a GPU; ``TypeError`` for an option
    the kind does not take.
    """
    spec = KINDS.get(kind)
    if spec is None:
        raise ValueError(f"unknown index kind {kind!r}; choose one of {tuple(KINDS)}")
    if spec.gpu and not gpu_available():
        raise ValueError(f"index {kind!r} needs faiss-gpu and a GPU; install the 'gpu' extra on a GPU "
                         f"machine or use {kind.removesuffix('-gpu')!r}")
    return spec.make(kind, dim, train_size=train_size or spec.train_size, **options)


def index_from_bytes(kind: str, dim: int, data: np.ndarray, **options) -> LandmarkIndex:
    """An index of ``kind`` restored from ``to_bytes()`` output ``data`` (uint8 (n,))."""
    ix = new_index(kind, dim, **options)
    index = faiss.deserialize_index(np.ascontiguousarray(data, dtype=np.uint8))
    if index.d != dim:
        raise ValueError(f"serialised index has dimension {index.d}, expected {dim}")
    ix.restore(index)
    return ix


def default_train_size(kind: str) -> int:
    """Keys an index of ``kind`` needs before it trains, unless told."""
    return KINDS[kind].train_size


def derived_from_rows(kind: str) -> bool:
    """Whether an index of ``kind`` keeps nothing in a memory's state file: one that searches
    the key rows where they lie (``on_rows``; ``ivf-rows`` keeps its lists in files beside them)."""
    return not KINDS[kind].in_state


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


__all__ = ["KINDS", "IndexFile", "IndexKind", "LandmarkIndex", "new_index", "index_from_bytes", "default_train_size",
           "derived_from_rows", "gpu_available", "recall_at_k"]
