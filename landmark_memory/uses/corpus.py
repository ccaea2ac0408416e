"""A corpus: documents read apart, one memory that searches them all.

Each document is a memory of its own in ``docs/<sha256[:16]>/`` (``manifest.document_folder``),
read from its own first token and seeing only its own blocks while it is read, by one writer
(a process, or a Ray worker: ``build.py``). The corpus is a memory whose manifest says
``documents``: its row files and its FAISS index per (layer, key/value head) cover every merged
document's blocks, one after another in merge order, and its block store is theirs
(``storage.sharded.ShardedStore``): a query searches one index however many documents there
are, and reads each retrieved block from its document's store.

The build's driver is the corpus's one writer: it merges a document once its reading is done
(``merge_document``) and commits the corpus as any memory commits. The documents' folders as
files (their states, saved keys, what a merge drops) are ``format/corpus_files.py``'s.
"""

from dataclasses import dataclass

import numpy as np
import torch

from ..format.corpus_files import document_manifest, finished, packs, saved_block_keys
from ..format.manifest import TOKENS, InputRecord, MemoryFileError
from ..memory.engine import LandmarkMemory
from ..storage import BlockStore, MemoryStore
from ..storage.sharded import Shard


def merge_document(mem: LandmarkMemory, folder: str) -> InputRecord:
    """Append the committed blocks of the document in ``folder`` to the corpus ``mem`` (open
    for writing with its model): token and landmark rows, block keys into every index, and
    its blocks: a small document's (``PACK_BYTES``) copied into the corpus's own store, a large
    one's store as the next shard of the corpus's. A document not read to its end is merged as
    far as it was committed and marked abandoned. ``mem.commit()`` makes it durable."""
    d = mem.dir.document(folder)
    m = document_manifest(mem.dir, folder)
    if m is None or not m.inputs:
        raise MemoryFileError(f"{d.path} holds no document yet: build it again to read it")
    if m.model.fingerprint != mem.manifest.model.fingerprint:
        raise MemoryFileError(f"the document {d.path} was read by another model than its corpus {mem.dir.path}; "
                              "remove that folder and build again to read it anew")
    fixed = ("store", "store_dtype", "chunk_size", "block_checksums")
    if any(getattr(m.options, k) != getattr(mem.options, k) for k in fixed):
        raise MemoryFileError(f"the document {d.path} was read with other store or chunk options than its corpus; "
                              "remove that folder and build again to read it anew")
    entry = m.inputs[0]
    rows, _ = d.read_block_rows(m)
    layout = m.rows
    ids = layout.decode_tokens(rows[TOKENS]).transpose(1, 0, 2).reshape(layout.streams, -1)  # (1, n * bs)
    block_keys = saved_block_keys(d, m, rows, mem.device) if m.blocks else None
    return _append(mem, folder, entry, m.blocks, block_keys, ids, packs(m.blocks, m.block_bytes), not finished(m))


@dataclass
class ReadDocument:
    """A small document read to its end in RAM, not in a folder of its own (``build.read_document``
    of a job ``in_memory``): ``entry`` its record; its ``blocks`` blocks as stored, ``data`` (n_layer
    * blocks, 2, H_kv, L, D) in the store dtype layer by layer and, for an int8 store, ``scales``;
    per layer their ``block_keys`` (1, H_kv, blocks, D) and its token ``ids`` (1, blocks * block_size)."""

    entry: InputRecord
    blocks: int
    data: torch.Tensor
    scales: torch.Tensor | None
    block_keys: list[torch.Tensor]
    ids: np.ndarray


def merge_read(mem: LandmarkMemory, folder: str, read: ReadDocument) -> InputRecord:
    """``merge_document`` of a document read in RAM (``read``), to be named ``folder`` as if
    it had been read there: the corpus holds it packed, exactly as the folder's would be."""
    keys = [(0, layer, b) for layer in range(mem.shape.n_layer) for b in range(read.blocks)]
    store = MemoryStore(mem.shape.block_entry, mem.options.store_dtype)
    store.keep({k: (read.data[i], None if read.scales is None else read.scales[i]) for i, k in enumerate(keys)})
    return _append(mem, folder, read.entry, read.blocks, read.block_keys if read.blocks else None, read.ids, True,
                   False, store)


def _append(mem: LandmarkMemory, folder: str, entry: InputRecord, blocks: int, block_keys: list[torch.Tensor] | None,
            ids: np.ndarray, packed: bool, abandoned: bool, source: BlockStore | None = None) -> InputRecord:
    """Append a document's ``blocks`` to the corpus ``mem`` and record it (``entry``, its own)."""
    start, bs = mem.n_blocks, mem.shape.block_size
    shard = Shard(start, blocks, folder)
    mem.add_document(shard, packed, block_keys, ids, source)
    record = InputRecord(path=entry.path, name=entry.name, sha256=entry.sha256, tokens=entry.tokens,
                         ingested=blocks * bs, start=start * bs, abandoned=abandoned, document=folder, packed=packed)
    mem.inputs.append(record, None if packed else shard)
    return record












