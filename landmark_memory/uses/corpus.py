"""A corpus: documents read apart, one memory that searches them all.

Each document is a memory of its own in ``docs/<sha256[:16]>/`` (``manifest.document_folder``),
read from its own first token and seeing only its own blocks while it is read, by one writer
(a process, or a Ray worker: ``build.py``). The corpus is a memory whose manifest says
``documents``: its row files and its FAISS index per (layer, key/value head) cover every merged
document's blocks, one after another in merge order, and its block store is theirs
(``storage.sharded.ShardedStore``): a query searches one index however many documents there
are, and reads each retrieved block from its document's store.

The build's driver is the corpus's one writer: it merges a document once its reading is done
(``merge_document``) and commits the corpus as any memory commits.
"""

import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from ..format.directory import MANIFEST, MemoryDir
from ..format.documents import DocumentList
from ..format.manifest import DOCUMENT_FOLDER, KEYS, LANDMARKS, TOKENS, InputRecord, Manifest, MemoryFileError, key_file
from ..format.seals import SEALS
from ..index import KINDS
from ..memory.engine import LandmarkMemory
from ..storage import BlockStore, MemoryStore
from ..storage.sharded import Shard

PACK_BYTES = 64 << 20  # a document whose blocks take at most this much goes into the corpus's own store


def packs(blocks: int, block_bytes: int) -> bool:
    """Whether a document of ``blocks`` blocks of ``block_bytes`` (all layers) goes into the corpus's own store."""
    return blocks * block_bytes <= PACK_BYTES


def document_manifest(corpus: MemoryDir, folder: str) -> Manifest | None:
    """The last commit of the document in ``folder``, checked; None while it has none."""
    d = corpus.document(folder)
    if not (d.path / MANIFEST).is_file():
        return None
    m = d.read_manifest()
    if m.documents or len(m.inputs) > 1 or (m.streams or 1) != 1:
        raise MemoryFileError(f"{d.path} is not a document of the corpus {corpus.path}; the memory is damaged: "
                              "restore it from a backup or rebuild it")
    return m


def committed_tokens(m: Manifest | None) -> int:
    """Tokens of a document its last commit ``m`` holds (0 before its first)."""
    return m.inputs[0].ingested if m is not None and m.inputs else 0


def finished(m: Manifest) -> bool:
    """Whether the document whose last commit is ``m`` was read to its end (its open chunk
    then goes into blocks, so none is left)."""
    return bool(m.inputs) and m.inputs[0].done and not m.pending_tokens


def merge_document(mem: LandmarkMemory, folder: str) -> InputRecord:
    """Append the committed blocks of the document in ``folder`` to the corpus ``mem`` (open
    for writing with its model): token and landmark rows, landmark keys into every index, and
    its blocks: a small document's (``PACK_BYTES``) copied into the corpus's own store, a large
    one's store as the next shard of the corpus's. A document not read to its end is merged as
    far as it was committed and marked abandoned. ``mem.commit()`` makes it durable."""
    d = mem.dir.document(folder)
    m = document_manifest(mem.dir, folder)
    if m is None or not m.inputs:
        raise MemoryFileError(f"{d.path} holds no document yet: build it again to read it")
    if m.model.fingerprint != mem.model_record().fingerprint:
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


def drop_merged_rows(corpus: MemoryDir, folder: str, packed: bool) -> None:
    """Keep one copy of a merged document: once its corpus has committed it, a ``packed``
    document's folder is removed, and another's own token rows, landmark keys and index state
    (its store stays, the corpus's blocks being read from it). The next call removes what a
    stop midway left (the other's manifest says ``rows_merged`` first)."""
    d = corpus.document(folder)  # (refused when it is a link; rmtree follows none inside it)
    if packed:
        if d.path.exists():
            shutil.rmtree(d.path)
        return
    names = {p.name for p in d.path.iterdir()} if d.path.is_dir() else set()
    if not names & {TOKENS, LANDMARKS, KEYS} and not any(n.startswith("state.") for n in names):
        return  # nothing left to drop (every build looks: its manifest need not be read)
    m = document_manifest(corpus, folder)
    if m is None:
        return
    if not m.rows_merged:
        m.rows_merged, m.state, m.rows_crc = True, None, None
        d.write_manifest(m)
    keys = d.key_path() / KEYS  # (refused when keys/ is a link: nothing outside the memory is removed)
    dropped = [d.path / TOKENS, d.path / LANDMARKS, d.path / SEALS, *d.path.glob("state.*.safetensors"),
               *keys.glob("*.f32"), *(f for kind in {k.make for k in KINDS.values()} for f in kind.own_files(keys))]
    for f in dropped:
        f.unlink(missing_ok=True)
    if keys.is_dir() and not any(keys.iterdir()):
        keys.rmdir()


def saved_block_keys(d: MemoryDir, m: Manifest, rows: dict[str, bytes], device: torch.device) -> list[torch.Tensor]:
    """Per layer the landmark keys (streams, H_kv, n, D) of the committed blocks of the memory in
    ``d`` (its manifest ``m``): from its key files, or from ``rows`` (its ``landmarks.bin``, read
    whole) before format 5."""
    if LANDMARKS in rows:
        return m.rows.decode_landmarks(rows[LANDMARKS], device)
    s, keys = m.model.shape, dict(d.key_file_rows(m))  # (checked against their CRC-32: the corpus appends them)
    return [torch.from_numpy(np.stack([np.stack([
        np.frombuffer(keys[key_file(b, layer, h)], np.float32).reshape(m.blocks, s.head_dim)
        for h in range(s.n_kv_head)]) for b in range(m.streams)])).to(device) for layer in range(s.n_layer)]


@dataclass
class DocumentState:
    """A document as ``info`` shows it: ``status`` is "done" (in the corpus), "left" (abandoned:
    what was read of it is in the corpus), "read" (read to its end, merged at the build's next
    corpus commit), "partial" (reading stopped or under way) or "damaged" (``problem`` says why)."""

    folder: str
    path: str
    name: str
    sha256: str
    tokens: int
    read: int
    status: str
    problem: str = ""


def document_folders(corpus: MemoryDir) -> list[str]:
    """The document folders under the corpus's ``docs/`` (``DOCUMENT_FOLDER``), in name order:
    its large documents and those not merged yet (a packed one's goes once it is merged)."""
    docs = corpus.path / "docs"
    names = sorted(os.listdir(docs)) if docs.is_dir() and not docs.is_symlink() else []
    return [f"docs/{n}" for n in names if DOCUMENT_FOLDER.fullmatch(f"docs/{n}")]


def document_states(corpus: MemoryDir, merged: DocumentList) -> list[DocumentState]:
    """Every document of a corpus: the ``merged`` ones (its manifest's inputs) in corpus order,
    then ``unmerged_states``."""
    return [DocumentState(e.document, e.path, e.name, e.sha256, e.tokens, e.ingested,
                          "left" if e.abandoned else "done") for e in merged] + unmerged_states(corpus, merged)


def unmerged_states(corpus: MemoryDir, merged: DocumentList) -> list[DocumentState]:
    """The documents under the corpus's ``docs/`` that ``merged`` (its manifest's inputs) does
    not hold, as their own last commits say how far they are; reads no page but those of the
    merged documents that keep a folder there."""
    out, folders = [], document_folders(corpus)
    held = merged.by_folder(folders)
    for folder in folders:
        if folder in held:
            continue
        try:
            m = document_manifest(corpus, folder)
        except MemoryFileError as e:
            out.append(DocumentState(folder, "", "", "", 0, 0, "damaged", str(e)))
            continue
        if m is not None and m.inputs:
            e = m.inputs[0]
            out.append(DocumentState(folder, e.path, e.name, e.sha256, e.tokens, e.ingested,
                                     "read" if finished(m) else "partial"))
    return out
