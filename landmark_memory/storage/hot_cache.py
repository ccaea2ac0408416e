"""The hot blocks of a memory on the compute device: an LRU arena of stored blocks that the
attention kernels read through a block table, like paged attention's block pool."""

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.quant import dequantize, scale_shape

if TYPE_CHECKING:
    from .base import BlockStore


class HotCache:
    """The hot blocks on the compute device: an LRU arena within ``budget_bytes``.

    The arena (n_slots, *block shape) is the block pool the attention kernels read through a
    block table (like paged attention): ``pool(keys)`` makes every requested block resident and
    returns the arena with each key's slot, so resident blocks are never copied again. Misses
    are read from the store in one call (on a GPU through pinned host memory). Blocks of a
    float store are kept as ``prepare(blocks)`` in the compute ``dtype`` (work done once per
    fetch on a batch (n, *shape) of blocks, e.g. RoPE by offset inside the block); blocks of
    an int8 store are kept as stored, int8 beside a float32 arena of their scales (a quarter
    of float32's bytes, so the same budget holds about four times as many), and their
    preparation was done before they were stored. A request larger than the arena gets a
    one-off pool."""

    def __init__(self, store: "BlockStore", device: torch.device | str, dtype: torch.dtype,
                 budget_bytes: int = 256 << 20,
                 prepare: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if store.quantized and prepare is not None:
            raise ValueError("an int8 store's blocks are held as stored: prepare them before they are stored")
        self.store, self.device, self.dtype, self.budget = store, torch.device(device), dtype, budget_bytes
        self.arena_dtype = store.torch_dtype if store.quantized else dtype
        self.prepare = prepare or (lambda t: t)
        self.scale_shape = scale_shape(store.shape) if store.quantized else None
        self.block_bytes = int(np.prod(store.shape)) * self.arena_dtype.itemsize + (
            int(np.prod(self.scale_shape)) * 4 if store.quantized else 0)
        self.capacity = budget_bytes // self.block_bytes
        self.arena = self.scales = None  # allocated on first use
        self._slots = OrderedDict()  # key -> arena slot, least recently used first
        self._free: list[int] = []  # slots of forgotten blocks, taken before any other
        self.hits = self.misses = 0

    @property
    def bytes(self):
        """Bytes of resident blocks."""
        return len(self._slots) * self.block_bytes

    def _fetch(self, keys):
        """The blocks of ``keys`` read in one store call and prepared in one batch: (n, *shape)
        and, for an int8 store, their scales (n, H, D + L) (else None)."""
        data, scales = self.store.read(keys)
        if self.device.type == "cuda":
            data, scales = data.pin_memory(), None if scales is None else scales.pin_memory()
        data = data.to(self.device, non_blocking=True)
        if scales is not None:
            return data, scales.to(self.device, non_blocking=True)
        return self.prepare(data.to(self.dtype)), None

    def pool(self, keys: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray]:
        """``(pool, scales, slots)``: a tensor (n, *shape) holding the blocks, for an int8
        store their float32 scales (n, H, D + L) (else None), and int64 (len(keys),) positions
        of each key in them (host bookkeeping, so a numpy array). Valid until the next call."""
        resident = self._slots
        wanted = list(dict.fromkeys(keys))
        missing = [k for k in wanted if k not in resident]
        self.hits += len(wanted) - len(missing)
        self.misses += len(missing)
        if len(wanted) > self.capacity:  # cannot all be resident at once
            pool, scales = self._fetch(wanted)
            pos = {k: i for i, k in enumerate(wanted)}
            return pool, scales, np.array([pos[k] for k in keys], np.int64)
        if self.arena is None:
            self.arena = torch.empty((self.capacity, *self.store.shape), device=self.device, dtype=self.arena_dtype)
            if self.scale_shape is not None:
                self.scales = torch.empty((self.capacity, *self.scale_shape), device=self.device)
        for k in wanted:
            if k in resident:
                resident.move_to_end(k)
        if missing:
            slots = []
            for k in missing:  # the least recent blocks are never this request's: those were just touched
                if self._free:
                    slot = self._free.pop()
                else:
                    slot = len(resident) if len(resident) < self.capacity else resident.popitem(last=False)[1]
                resident[k] = slot
                slots.append(slot)
            at = torch.tensor(slots, device=self.device)
            data, scales = self._fetch(missing)
            self.arena[at] = data
            if scales is not None:
                self.scales[at] = scales
        return self.arena, self.scales, np.array([resident[k] for k in keys], np.int64)

    def forget(self, drop: Callable[[tuple[int, int, int]], bool]) -> None:
        """Evict every resident block whose key ``drop`` selects (blocks that no longer exist)."""
        for k in [k for k in self._slots if drop(k)]:
            self._free.append(self._slots.pop(k))

    def get(self, keys):
        """The blocks themselves, a list of tensors (2, H, L, D) in the compute dtype (an int8
        store's dequantized)."""
        pool, scales, slots = self.pool(keys)
        at = torch.from_numpy(slots).to(self.device)
        blocks = pool[at] if scales is None else dequantize(pool[at], scales[at]).to(self.dtype)
        return list(blocks)
