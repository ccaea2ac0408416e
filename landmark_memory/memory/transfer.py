"""A memory's blocks handed from one process to another: ``LandmarkMemory.transfer``.

A served corpus's shares each search their range of its saved blocks and send what they find,
as stored, to the front, which then searches through them and reads its saved blocks from them
(``app/served.py``); a document read in RAM sends its blocks, as stored, to its corpus
(``jobs/reading.py``).
"""

from collections.abc import Callable

import numpy as np
import torch

from ..storage import BlockStore
from .blocks import BlockMemory


class BlockTransfer:
    """What of a memory's blocks (its ``blocks``; ``readonly`` as it was opened) goes between
    processes: searches of a range, blocks as their store keeps them, and a front's rewiring."""

    def __init__(self, blocks: BlockMemory, readonly: bool):
        self._blocks, self._readonly = blocks, readonly

    def search(self, layer: int, xq: np.ndarray, need: np.ndarray | None, k: int, lo: int, hi: int,
               group: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The top ``k`` of the blocks ``[lo, hi)`` for the queries ``xq`` (B, H, T_q, D) of
        ``layer`` (``BlockMemory.search``): scores D, ids I, layer-heads skipped."""
        return self._blocks.search(layer, xq, need, k, lo, hi, group)

    def raw_blocks(self, keys: list[tuple[int, int, int]]) -> list[tuple[torch.Tensor, ...]]:
        """The blocks ``keys`` (stream, layer, block) as their store keeps them
        (``BlockStore.read_stored``), a read-only memory's saved ones."""
        store = self._blocks.store
        return (store.base if self._readonly else store).read_stored(keys)

    def check_files(self) -> None:
        """``MemoryFileError`` where a file this memory maps was cut short since it was mapped (a read
        there would be a SIGBUS): what a served corpus's front and shares ask before each answer."""
        self._blocks.check_files()

    def serve_from(self, shares, store: Callable[[BlockStore], BlockStore]) -> None:
        """Make this read-only corpus a front: its saved blocks searched by ``shares.search`` and
        read through ``store(its own store)``; its own store is closed."""
        own = self._blocks.store.base
        self._blocks.remote, self._blocks.store.base = shares, store(own)
        own.close()
