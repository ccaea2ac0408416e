"""Block store: the keys and values of every memory block (the hot-block cache over it is
``hot_cache.HotCache``).

A block entry is keyed by (stream, layer, block) and holds the un-rotated keys and values of
all heads, a (2, H, block_size + 1, D) tensor (landmark row last). Backends, a module each,
named in ``STORE_KINDS``:

- ``memory`` (``in_memory.py``): a dict (nothing on disk);
- ``lmdb`` (``lmdb_store.py``): one LMDB environment (the default on disk); every
  ``put``/``get`` call is one transaction, so a chunk's blocks land together or not at all;
- ``mmap`` (``mmap_store.py``): one memory-mapped file per (stream, layer), grown by doubling.

Stored dtype is float32, float16, bfloat16 or int8 (``store_dtype``). An int8 store keeps each block
quantized with its scales (``quant.py``); ``read`` gives blocks in their stored form (what the
hot cache holds and the kernels read), ``get`` as floats (int8 dequantized to float32). With
``checksums`` every on-disk record ends with the CRC-32 of its bytes (the scales included),
checked on every read: a damaged block raises ``CorruptBlockError`` instead of turning into
wrong keys.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.names import STORES
from .base import (
    DTYPE_NAMES,
    DTYPES,
    SCALE_DTYPE,
    BlockStore,
    CorruptBlockError,
    DiskFullError,
    OverlayStore,
    StoreDamagedError,
    StoreWriteError,
    stored_nbytes,
)
from .hot_cache import HotCache
from .in_memory import MemoryStore
from .lmdb_store import LmdbStore
from .mmap_store import MmapStore

__all__ = ["BlockStore", "CorruptBlockError", "DTYPES", "DTYPE_NAMES", "DiskFullError", "HotCache", "LmdbStore",
           "MemoryStore", "MmapStore", "OverlayStore", "SCALE_DTYPE", "STORES", "STORE_KINDS", "StoreDamagedError",
           "StoreKind", "StoreWriteError", "open_store", "stored_nbytes"]


@dataclass(frozen=True)
class StoreKind:
    """A backend: ``opens(shape, folder, store_dtype, readonly, checksums, sealed)`` gives its store
    (``folder`` None for one in memory), ``files(n_layer)`` the descriptors one open store
    of a saved memory holds (a corpus opens many: ``sharded.open_budget``)."""

    opens: Callable[..., BlockStore]
    on_disk: bool
    files: Callable[[int], int]


STORE_KINDS = {  # core.names.STORES and DISK_STORES name them for a command line that imports no torch
    "memory": StoreKind(lambda shape, folder, store_dtype, **_: MemoryStore(shape, store_dtype), False,
                        lambda n_layer: 0),
    "lmdb": StoreKind(lambda shape, folder, store_dtype, *, readonly, checksums, sealed: LmdbStore(
        shape, folder, store_dtype, readonly=readonly, checksums=checksums, sealed=sealed), True, lambda n_layer: 1),
    "mmap": StoreKind(lambda shape, folder, store_dtype, *, readonly, checksums, sealed: MmapStore(
        shape, folder, store_dtype, readonly=readonly, checksums=checksums), True, lambda n_layer: n_layer),
}


def open_store(kind: str, shape: tuple[int, ...], path: str | Path | None = None, store_dtype: str = "float16",
               readonly: bool = False, checksums: bool = False, sealed: bool = False) -> BlockStore:
    """A block store of ``kind`` (one of ``STORES``); on-disk kinds need ``path`` (the store
    lives in its subfolder ``kind``), may be opened ``readonly`` (``sealed``: no writer will
    ever come, so LMDB takes no reader lock) and keep a CRC-32 per block with ``checksums``."""
    if kind not in STORE_KINDS:
        raise ValueError(f"unknown store {kind!r}; choose one of {STORES}")
    k = STORE_KINDS[kind]
    if k.on_disk and path is None:
        raise ValueError(f"store {kind!r} keeps blocks on disk: pass a path")
    return k.opens(shape, Path(path) / kind if k.on_disk else None, store_dtype, readonly=readonly, checksums=checksums,
                   sealed=sealed)
