"""A saved memory read without its model: ``describe`` (what ``landmark-memory info`` shows)
and ``verify`` (``info --verify``: every file and stored block checked, each problem named, the
file or the block of the store, so a user knows what is damaged). Nothing is written."""

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.names import NPROBE
from ..format.corpus_files import document_states
from ..format.directory import MemoryDir
from ..format.errors import NoMemoryError
from ..format.manifest import TOKENS, Manifest, MemoryFileError
from ..format.session_files import committed_starts, committed_turns, list_sessions, sessions_folder
from ..format.text_file import index_state
from ..format.text_file import problems as text_index_problems
from ..index import KINDS, derived_from_rows, index_from_bytes
from ..storage import StoreDamagedError, open_store


def describe(path: str | Path, manifest: Manifest | None = None) -> dict:
    """The manifest's facts about the memory at ``path``, its state and row files checked; or,
    given the ``manifest`` of the commit an open memory holds (checked when it opened), those
    facts without reading the memory again (the folder's sizes and, for a corpus, the
    documents not merged yet are looked at)."""
    d = MemoryDir(path, writable=False)
    m = manifest
    if m is None:
        m, _ = d.read_commit()
        d.read_block_rows(m)  # present, long enough and (format 3 on) matching their CRC-32
        d.check_key_files(m)  # present and long enough
    sessions = sessions_folder(path)
    disk = _folder_bytes(Path(path), skip=sessions)
    o, shape = m.options, m.model.shape
    if m.documents:
        starts = {e.document: e.start for e in m.inputs}
        inputs = [{"path": s.path, "tokens": s.tokens, "ingested": s.read, "start": starts.get(s.folder),
                   "sha256": s.sha256, "status": s.status, "document": s.folder, **({"problem": s.problem} if
                                                                                      s.problem else {})}
                  for s in document_states(d, m.inputs)]
    else:
        inputs = [{"path": e.path, "tokens": e.tokens, "ingested": e.ingested, "start": e.start, "sha256": e.sha256,
                   "status": "left" if e.abandoned else "done" if e.done else "partial"} for e in m.inputs]
    # on disk: the memory's tokens and, in a corpus, those of its documents not merged yet
    read = m.tokens + sum(e["ingested"] for e in inputs if m.documents and e["status"] in ("read", "partial"))
    return {"memory": str(path), "tokens": m.tokens, "blocks": m.blocks, "pending_tokens": m.pending_tokens,
            "streams": m.streams, "index": o.index, "index_search": _index_search(m), "store": o.store,
            "store_dtype": o.store_dtype,
            "block_bytes": m.block_bytes, "chunk_size": o.chunk_size, "top_k": o.top_k,
            "layers": len(shape.windows) or shape.n_layer, "memory_layers": shape.n_layer,
            "windows": {str(layer): w for layer, w in shape.window_layers.items()},
            "store_bytes_per_token": round(m.block_bytes / shape.block_size, 1),
            "block_size": shape.block_size, "block_keys": o.block_keys, "commit": m.commit, "updated": m.updated,
            "disk_bytes": disk,
            "tokens_read": read, "bytes_per_token": round(disk / read, 1) if read else None,
            "model": {"fingerprint": m.model.fingerprint, "config": m.model.config},
            "documents": m.documents, "inputs": inputs, "text_index": index_state(path),
            "sessions": sum(1 for p in sessions.iterdir() if not p.name.startswith(".")) if sessions.is_dir() else 0,
            "sessions_bytes": _folder_bytes(sessions) if sessions.is_dir() else 0}


def _index_search(m: Manifest) -> str:
    """How the memory's index searches at this commit, in words."""
    o = m.options
    return KINDS[o.index].make.search_words(m.blocks, o.train_size, o.index_options.get("nprobe") or NPROBE)


def _folder_bytes(path: Path, skip: Path | None = None) -> int:
    """Bytes of the files under ``path`` (links not followed), but for the folder ``skip``."""
    total = 0
    for e in os.scandir(path):
        if skip is not None and e.path == str(skip):
            continue
        if e.is_dir(follow_symlinks=False):
            total += _folder_bytes(Path(e.path))
        elif e.is_file(follow_symlinks=False):
            total += e.stat(follow_symlinks=False).st_size
    return total


@dataclass
class VerifyReport:
    """What ``verify`` found: ``problems`` (one line each, empty when the memory is sound),
    ``damaged_blocks`` ((stream, layer, block) of the store), and the counts checked."""

    problems: list[str] = field(default_factory=list)
    damaged_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    blocks_checked: int = 0
    indexes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str | Path) -> VerifyReport:
    """Check the memory at ``path``: manifest, state file (size, checksum, contents), row
    files (length, CRC-32), every landmark index (readable, one key per block), every
    block of the store (present, CRC-32 where the memory keeps them) and the text index its
    seal vouches for (``text_file.problems``: FTS5's integrity-check, its rows the blocks')."""
    report, d = VerifyReport(), MemoryDir(path, writable=False)
    try:
        manifest, state = d.read_commit()
    except NoMemoryError:
        raise  # (nothing there: no memory to call damaged)
    except MemoryFileError as e:
        report.problems.append(str(e))
        return report
    rows = None
    if manifest.rows_merged:  # a corpus's document: its corpus holds (and checks) its rows, it holds the blocks
        _check_store(d, manifest, report)
        return report
    if manifest.streams is not None:  # else nothing fed yet
        try:
            rows = all_rows(d, manifest)
        except MemoryFileError as e:
            report.problems.append(str(e))
        _check_state(manifest, state, report, rows_sound=rows is not None)
    if manifest.documents and (pages := manifest.inputs.problems()):  # (each damaged page named; no record is
        report.problems += pages                                        # trusted then)
    elif manifest.documents:
        _check_documents(d, manifest, rows, report)
        bs = manifest.model.shape.block_size
        packed = [b for e in manifest.inputs if e.packed for b in range(e.start // bs, (e.start + e.ingested) // bs)]
        if packed:
            _check_store(d, manifest, report, packed)
    elif manifest.streams is not None:
        _check_store(d, manifest, report)
    if manifest.session is None:  # (a session's turns are indexed in memory, never in a file)
        tokens = None if rows is None else manifest.rows.decode_tokens(rows[TOKENS][0])[:, 0]  # (blocks, bs)
        report.problems += text_index_problems(path, tokens)
    if manifest.session is not None:
        try:
            committed_turns(d, manifest)
            committed_starts(d, manifest)
        except MemoryFileError as e:
            report.problems.append(str(e))
    else:
        _check_sessions(Path(path), report)
    return report


def _check_sessions(path: Path, report: VerifyReport) -> None:
    """Every session of the memory verified as the memory it is, its turns too (one a chat
    stopped before its first commit holds nothing to verify)."""
    for s in (s for s in list_sessions(path) if s.committed):
        sub = verify(sessions_folder(path) / s.name)
        report.problems += [f"session {s.name}: {p}" for p in sub.problems]
        report.blocks_checked += sub.blocks_checked
        report.indexes_checked += sub.indexes_checked


def all_rows(d: MemoryDir, m: Manifest) -> dict[str, tuple[bytes, int]]:
    """``{file: (bytes, bytes per block)}``: the committed rows of every row file and key file of
    the memory in ``d``, each checked against its CRC-32 in the manifest ``m`` (and so are the
    files the index kind keeps beside them)."""
    rows, _ = d.read_block_rows(m)
    tokens, vocab = np.frombuffer(rows[TOKENS], np.int32), m.model.config.get("vocab_size")
    if isinstance(vocab, int) and len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        raise MemoryFileError(f"{d.path / TOKENS} holds token ids outside the model's vocabulary ({vocab:,}); the "
                              "memory is damaged: restore it from a backup or rebuild it")
    out, size, index_files = {name: (data, m.rows.sizes[name]) for name, data in rows.items()}, m.rows.key_row_bytes, \
        m.index_files()
    for name, data in d.key_file_rows(m):
        if name not in index_files:  # (an index's lists are its own: a document's differ from its corpus's)
            out[name] = data, size
    return out


def _check_documents(d: MemoryDir, m: Manifest, rows: dict | None, report: VerifyReport) -> None:
    """Every document of a corpus verified as the memory it is, and the corpus's rows of each
    merged one equal to the document's own."""
    bs = m.model.shape.block_size
    merged = {e.document: e for e in m.inputs}
    for s in document_states(d, m.inputs):
        where = f"document {s.folder} ({s.name or 'unnamed'})"
        if s.problem:
            report.problems.append(f"{where}: {s.problem}")
            continue
        if s.folder in merged and merged[s.folder].packed:  # its blocks are the corpus's (checked there), its rows
            continue
        sub = verify(d.path / s.folder)
        report.problems += [f"{where}: {p}" for p in sub.problems]
        e = merged.get(s.folder)
        first = e.start // bs if e else 0
        report.damaged_blocks += [(b, layer, first + block) for b, layer, block in sub.damaged_blocks]
        report.blocks_checked += sub.blocks_checked
        report.indexes_checked += sub.indexes_checked
        if e is None or rows is None or sub.problems:
            continue
        doc = d.document(s.folder)
        m = doc.read_manifest()
        if m.rows_merged:  # one copy: the corpus's
            continue
        own = all_rows(doc, m)
        n = e.ingested // bs
        for name, (data, size) in rows.items():
            if name in own and data[first * size:(first + n) * size] != own[name][0][:n * size]:
                report.problems.append(f"{where}: the corpus's {name} rows differ from the document's own")


def _check_state(m: Manifest, state: dict, report: VerifyReport, rows_sound: bool) -> None:
    """The state file's indexes and open chunk; an exact flat index is its landmark rows, sound
    when they are (``rows_sound``)."""
    shape, o = m.model.shape, m.options
    if derived_from_rows(o.index):
        report.indexes_checked += m.streams * shape.n_layer * shape.n_kv_head if rows_sound else 0
    for b in range(0 if derived_from_rows(o.index) else m.streams):
        for layer in range(shape.n_layer):
            for h in range(shape.n_kv_head):
                name = f"index.{b}.{layer}.{h}"
                try:
                    n = index_from_bytes(o.index, shape.head_dim, state[name].numpy(), **o.index_options).ntotal
                except KeyError:
                    report.problems.append(f"the state file {m.state.name} lacks {name}")
                    continue
                except (RuntimeError, ValueError) as e:
                    report.problems.append(f"{name} of the state file {m.state.name} cannot be read ({e})")
                    continue
                report.indexes_checked += 1
                if n != m.blocks:
                    report.problems.append(f"{name} holds {n} block keys, the manifest names {m.blocks} blocks")
    for name, s in m.pending_shapes().items():
        if name not in state or tuple(state[name].shape) != s:
            report.problems.append(f"the state file {m.state.name if m.state else '(none)'} lacks or misshapes {name} "
                                   f"(want {s})")
    for name in m.window_entries(state)[1]:
        report.problems.append(f"the state file {m.state.name} holds {name}, which is no sliding-window layer's window "
                               "of this model's shape")


def _check_store(d: MemoryDir, m: Manifest, report: VerifyReport, blocks: list[int] | None = None) -> None:
    """Every block of the memory's store (``blocks``: these only) present and sound."""
    shape = m.model.shape
    try:
        store = open_store(m.options.store, shape.block_entry, d.store_path(), m.options.store_dtype, readonly=True,
                           checksums=m.options.block_checksums)
    except (StoreDamagedError, MemoryFileError, OSError) as e:
        report.problems.append(f"the block store cannot be opened: {e}")
        return
    try:
        for b in range(m.streams):
            for layer in range(shape.n_layer):
                for block in range(m.blocks) if blocks is None else blocks:
                    key = (b, layer, block)
                    try:
                        store.get([key])
                    except KeyError:
                        report.damaged_blocks.append(key)
                        report.problems.append(f"block {block} of layer {layer} (stream {b}) is missing from the store")
                    except StoreDamagedError as e:
                        report.damaged_blocks.append(key)
                        report.problems.append(f"{e} in the store")
                    report.blocks_checked += 1
    finally:
        store.close()
