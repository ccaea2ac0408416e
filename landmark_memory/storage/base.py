"""What every block store shares: the stored dtypes, checks and (de)serialisation of a block
(``BlockStore``), the errors a store raises, and ``OverlayStore`` (a read-only store and the
blocks fed since, one store to their memory). The backends are modules of their own, the
registry is the package's ``__init__``."""

import zlib

import numpy as np
import torch

from ..core.names import STORE_DTYPES
from ..core.quant import dequantize, quantize, scale_shape

DTYPES = {name: getattr(torch, name) for name in STORE_DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SCALE_DTYPE = torch.float16  # an int8 store's scales on disk


def stored_nbytes(shape: tuple[int, ...], store_dtype: str) -> int:
    """Bytes one block entry of ``shape`` (2, H, L, D) takes in a store of ``store_dtype`` (scales
    included, checksum not)."""
    scales = int(np.prod(scale_shape(shape))) * SCALE_DTYPE.itemsize if store_dtype == "int8" else 0
    return int(np.prod(shape)) * DTYPES[store_dtype].itemsize + scales


Stored = tuple[torch.Tensor, torch.Tensor | None]  # one block as stored: data (2, H, L, D), int8 scales (H, D + L)


class StoreDamagedError(ValueError):
    """A store whose files cannot be read as a store."""


class CorruptBlockError(StoreDamagedError):
    """A stored block whose bytes fail their checksum (or have the wrong length)."""

    def __init__(self, key, where=""):
        super().__init__(f"block {key[2]} of layer {key[1]} (stream {key[0]}){where} is corrupted")
        self.key = key


class DiskFullError(OSError):
    """The device ran out of space while the store was writing."""


class StoreWriteError(OSError):
    """A store's write failed for another reason the device gave (LMDB aborts the whole
    transaction: nothing of it was written)."""


class BlockStore:
    """Common checks and (de)serialisation; subclasses keep bytes (``_put``, ``_get``) or
    stored blocks (``read_stored``)."""

    def __init__(self, shape, store_dtype="float16", checksums=False):
        if store_dtype not in DTYPES:
            raise ValueError(f"store dtype must be one of {sorted(DTYPES)}, got {store_dtype!r}")
        self.shape, self.store_dtype, self.checksums = tuple(shape), store_dtype, checksums
        self.torch_dtype = DTYPES[store_dtype]  # (the store_dtype's tensors)
        self.quantized = store_dtype == "int8"
        self.data_bytes = int(np.prod(self.shape)) * self.torch_dtype.itemsize
        self.nbytes = stored_nbytes(self.shape, store_dtype)  # one block's keys and values (and scales)
        self.record_bytes = self.nbytes + (4 if checksums else 0)  # as stored

    def _stored(self, items: dict) -> dict[tuple[int, int, int], Stored]:
        """``{key: (data, scales)}``: each block (2, H, L, D) in its stored form, all quantized at once."""
        if not items:
            return {}
        t = torch.stack([t.detach() for t in items.values()]).to("cpu")  # (n, 2, H, L, D)
        if t.shape[1:] != self.shape:
            raise ValueError(f"block tensor must be {self.shape} (2, H, block_size + 1, D), got {tuple(t.shape[1:])}")
        data, scales = quantize(t) if self.quantized else (t.to(self.torch_dtype), None)
        return {key: (data[i], None if scales is None else scales[i]) for i, key in enumerate(items)}

    def _encode(self, stored):
        data, scales = stored
        data = data.contiguous().view(torch.uint8).numpy().tobytes()
        if scales is not None:
            data += scales.contiguous().view(torch.uint8).numpy().tobytes()
        return data + zlib.crc32(data).to_bytes(4, "little") if self.checksums else data

    def _decode(self, key, b) -> Stored:
        if b is None:
            raise KeyError(f"block {key} missing in the store")
        if len(b) != self.record_bytes or (self.checksums and zlib.crc32(b[:self.nbytes]).to_bytes(4, "little")
                                           != bytes(b[self.nbytes:])):
            raise CorruptBlockError(key)
        b = bytearray(b[:self.nbytes])
        data = torch.frombuffer(b, dtype=self.torch_dtype, count=self.data_bytes // self.torch_dtype.itemsize)
        data = data.view(self.shape)
        if not self.quantized:
            return data, None
        return data, torch.frombuffer(b, dtype=SCALE_DTYPE, offset=self.data_bytes).view(scale_shape(self.shape))

    def put(self, items: dict[tuple[int, int, int], torch.Tensor]) -> None:
        """Write ``{(stream, layer, block): tensor (2, H, L, D)}`` in one transaction."""
        self._put({key: self._encode(s) for key, s in self._stored(items).items()})

    def read_stored(self, keys: list[tuple[int, int, int]]) -> list[Stored]:
        return [self._decode(k, b) for k, b in zip(keys, self._get(keys))]

    def read(self, keys: list[tuple[int, int, int]]) -> Stored:
        """Blocks ``[(stream, layer, block), ...]`` in one transaction, as stored: ``(data,
        scales)``, data (n, 2, H, L, D) in the store dtype and, for an int8 store, float32 scales
        (n, H, D + L) (else None). Raises ``KeyError`` for a missing block and
        ``CorruptBlockError`` for a damaged one."""
        blocks = self.read_stored(list(keys))
        data = torch.stack([d for d, _ in blocks])
        return data, torch.stack([s for _, s in blocks]).float() if self.quantized else None

    def get(self, keys: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Blocks ``[(stream, layer, block), ...]`` in one transaction: a list of tensors (2, H,
        L, D) in the store dtype (an int8 store's dequantized to float32)."""
        keys = list(keys)
        if not keys:
            return []
        data, scales = self.read(keys)
        return list(dequantize(data, scales) if self.quantized else data)

    def check(self):
        """Raise ``StoreDamagedError`` where a file the store maps no longer holds what it
        maps (truncated since it was opened): a mapped page past a file's end is a SIGBUS."""

    def close(self):
        pass


class OverlayStore(BlockStore):
    """A read-only ``base`` store and, past its first ``offset`` blocks, the store of the blocks
    fed since (``attach``): a reader of a saved memory feeds more text without touching its
    files. Blocks are put into the upper store by its own memory, never through this one."""

    def __init__(self, base):
        super().__init__(base.shape, base.store_dtype)
        self.base, self.upper, self.offset = base, None, 0

    def attach(self, upper: BlockStore, offset: int) -> None:
        """Read blocks ``offset`` on from ``upper``, as its blocks ``0`` on."""
        self.upper, self.offset = upper, offset

    def forget(self):
        """Let go of the upper store: this store is its base again."""
        self.upper = None

    def check(self):
        self.base.check()

    def read_stored(self, keys):
        off = self.offset
        mine = [self.upper is not None and k[2] >= off for k in keys]
        new = iter(self.upper.read_stored([(b, layer, i - off) for (b, layer, i), m in zip(keys, mine) if m])
                   if any(mine)
                   else ())
        old = iter(self.base.read_stored([k for k, m in zip(keys, mine) if not m]))
        return [next(new) if m else next(old) for m in mine]

    def close(self):
        self.base.close()
