"""The token ids of a memory's blocks, kept as they were added: a chunk, a document merged, the
rows a saved memory opened with (a reader's: a map of its ``tokens.bin``, read where used)."""

import bisect
import os

import numpy as np
import torch

from .manifest import MemoryFileError


class TokenRows:
    """Token ids of blocks ``[0, n_blocks)``, per stream, in the additions that brought them."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.additions: list[np.ndarray] = []  # int32 (B, n * block_size) token ids of each addition
        self.ends: list[int] = []  # the block count after each addition
        self.maps: list[np.memmap] = []  # maps of tokens.bin that additions view

    @property
    def n_blocks(self) -> int:
        return self.ends[-1] if self.ends else 0

    def add(self, ids: torch.Tensor | np.ndarray) -> int:
        """Add the token ids (B, n * block_size) of n blocks; returns n."""
        self.additions.append(ids.to("cpu", torch.int32).numpy() if torch.is_tensor(ids) else
                              ids.astype(np.int32, copy=False))
        n = ids.shape[1] // self.block_size
        self.ends.append(self.n_blocks + n)
        return n

    def watch(self, mm: np.memmap) -> None:
        """Check the map ``mm`` of ``tokens.bin`` (additions view it) at every ``check``."""
        self.maps.append(mm)

    def read(self, stream: int, first: int, last: int) -> np.ndarray:
        """int32 ((last - first) * block_size,): the ids of blocks ``[first, last)``, only the
        additions that hold them read."""
        bs = self.block_size
        if last <= first:
            return np.zeros(0, np.int32)
        i = bisect.bisect_right(self.ends, first)  # the addition that holds block ``first``
        parts, start = [], self.ends[i - 1] if i else 0
        while start < last:
            ids = self.additions[i][stream]
            parts.append(ids[max(first - start, 0) * bs:(min(last, self.ends[i]) - start) * bs])
            start, i = self.ends[i], i + 1
        return np.concatenate(parts).astype(np.int32, copy=False)

    def since(self, first: int) -> np.ndarray:
        """int32 (B, (n_blocks - first) * block_size): the ids of every stream from block ``first``
        on (a commit falls between additions)."""
        tail, n = [], self.n_blocks
        for ids in reversed(self.additions):
            if n <= first:
                break
            tail.append(ids)
            n -= ids.shape[1] // self.block_size
        return np.concatenate(tail[::-1], 1)

    def check(self) -> None:
        """Raise ``MemoryFileError`` where a mapped ``tokens.bin`` was cut since it was mapped."""
        for mm in self.maps:
            if os.stat(mm.filename).st_size < mm.offset + mm.size:
                raise MemoryFileError(f"{mm.filename} is truncated (shorter than its {mm.offset + mm.size:,} committed "
                                      "bytes); the memory is damaged: restore it from a backup or rebuild it")
