"""A corpus's document folders as files: where each lies (``docs/<sha256[:16]>/``), how far its own
commits say it was read, the keys they hold, and what of a merged one is dropped once its corpus
committed it. Read and written without a model: ``build`` (``jobs/build.py``) and ``info``
(``uses/inspect.py``) ask here, and ``uses/corpus.py`` merges a document's blocks into its corpus.
"""

import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from ..index import KINDS
from .directory import MANIFEST, MemoryDir
from .documents import DocumentList
from .manifest import DOCUMENT_FOLDER, KEYS, LANDMARKS, TOKENS, Manifest, MemoryFileError, key_file
from .seals import SEALS

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


def drop_merged_rows(corpus: MemoryDir, folder: str, packed: bool) -> None:
    """Keep one copy of a merged document: once its corpus has committed it, a ``packed``
    document's folder is removed, and another's own token rows, block keys and index state
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
    """Per layer the block keys (streams, H_kv, n, D) of the committed blocks of the memory in
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
