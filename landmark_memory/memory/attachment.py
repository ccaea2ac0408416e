"""Blocks attached after a read-only memory's saved ones: a session's (``uses/session.py``).

They are a memory of their own in a folder of their own, opened at its last commit: while they are
attached (``LandmarkMemory.attach``), what the memory reads goes into them, and a commit writes
them with the memory's open chunk to their folder, never to the memory's.
"""

from dataclasses import dataclass

import torch

from ..format.directory import MemoryDir
from ..format.manifest import TOKENS, Manifest
from ..storage import DTYPES
from .blocks import BlockMemory
from .decoding import OpenChunk
from .saved import load_blocks, saved_chunk, write_commit


@dataclass(frozen=True)
class Attachment:
    """Whose blocks follow a read-only memory's saved ones (``LandmarkMemory.attachment``):
    ``owner`` (a session) and ``base_blocks``, the saved blocks before them; the memory's block
    ``b >= base_blocks`` is the owner's block ``b - base_blocks``."""

    owner: object
    base_blocks: int


class AttachedBlocks:
    """The blocks of the folder ``d`` at its commit ``manifest`` (with its ``state``), shaped as
    ``mem``'s (a ``LandmarkMemory``, which imports this module), to read after its saved ones.
    ``rows_crc``: the CRC-32s of their rows as loaded (the owner carries them on from there); ``chunk``:
    the open chunk their last commit kept."""

    def __init__(self, mem, d: MemoryDir, manifest: Manifest, state: dict[str, torch.Tensor]):
        dtype = DTYPES[manifest.model.dtype]  # (the memory's: the session's manifest is made of its record)
        self.blocks = BlockMemory(mem.shape, mem.options, store_path=d.store_path(), readonly=False,
                                  device=mem.device, dtype=dtype, rope=mem.backbone.rope, cache_bytes=0,
                                  key_path=d.key_path())
        try:
            self.rows_crc = {TOKENS: 0}
            if manifest.streams is not None:
                self.rows_crc = load_blocks(d, self.blocks, manifest, state, self.rows_crc,
                                            mem.backbone.vocab_size, mapped=False)
            self.chunk: OpenChunk = saved_chunk(d, manifest, state, mem.device, dtype)
        except BaseException:
            self.blocks.close()
            raise

    @property
    def n_blocks(self) -> int:
        return self.blocks.n_blocks

    @property
    def pending_tokens(self) -> int:
        """Tokens of the open chunk their last commit kept."""
        return 0 if self.chunk.ids is None else self.chunk.ids.shape[1]

    def commit(self, d: MemoryDir, manifest: Manifest, committed: int, rows_crc: dict[str, int],
               chunk: OpenChunk) -> None:
        """Write the blocks past the ``committed`` ones and ``chunk`` (the memory's open chunk) to
        ``d`` as the commit ``manifest`` (``saved.write_commit``; CRC-32s carried on from
        ``rows_crc``)."""
        write_commit(d, self.blocks, manifest, committed, committed, rows_crc, chunk)
        self.chunk = chunk

    def close(self) -> None:
        self.blocks.close()
