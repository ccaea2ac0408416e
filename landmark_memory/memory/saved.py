"""A memory saved in a directory: its folder and commits (docs/design/format.md).

``SavedFiles`` is a memory's part (``LandmarkMemory.files``) that knows its folder and the
commits there: it writes a commit of the blocks and the open chunk it is given, takes the blocks
of a commit into the block memory it is given, and says whether a later commit only appended.
``open_folder`` finds a saved memory's folder as ``LandmarkMemory.open`` needs it. A corpus
(``documents``) reads its large documents' blocks from their stores and its small ones' from
its own, where they were packed (``uses/corpus.py`` merges them), and pages its document list.
"""

import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..core.fileio import FileWatch
from ..core.names import DISK_STORES
from ..format.directory import MemoryDir
from ..format.errors import wrong_model
from ..format.manifest import KEYS, LANDMARKS, TOKENS, WINDOW, Manifest, MemoryFileError
from ..format.seals import seal, statuses, unchanged, vouched
from ..models.fingerprint import model_fingerprint
from .blocks import BlockMemory
from .decoding import OpenChunk


@dataclass
class Opened:
    """A saved memory's folder as ``LandmarkMemory.open`` found it, for the memory it makes to
    take: the folder (its lock held), its last commit and state, how it is open, and the
    fingerprint of the model, checked against the commit's."""

    dir: MemoryDir
    manifest: Manifest
    state: dict[str, torch.Tensor]
    readonly: bool
    fingerprint: str


def write_commit(d: MemoryDir, blocks: BlockMemory, manifest: Manifest, first: int, keys_committed: int,
                 rows_crc: dict[str, int], chunk: OpenChunk) -> None:
    """Commit ``manifest`` (its counts filled in, ``commit`` the last one's) to ``d``: the rows of
    ``blocks`` past block ``first`` (their CRC-32s carried on from ``rows_crc``; the key files'
    from block ``keys_committed``), the indexes and the open ``chunk`` in a state file, then the
    manifest (docs/design/format.md, "Commit protocol"). ``manifest`` ends as committed: its commit
    number, state file and CRC-32s."""
    manifest.inputs.write(d)  # a corpus's new documents, into its pages
    if manifest.streams is not None:
        layout = manifest.rows
        for name, data in blocks.rows_since(layout, first).items():
            if data:  # (no new rows: the file is left as it is, its seal standing)
                d.write_rows(name, first * layout.sizes[name], data)
            manifest.rows_crc[name] = zlib.crc32(data, rows_crc[name])
        kept = blocks.sync_keys(keys_committed, rows_crc)  # every key file and index file of this commit
        manifest.rows_crc = {name: crc for name, crc in manifest.rows_crc.items()  # (files no longer kept go)
                             if not name.startswith(f"{KEYS}/")} | kept
        state = blocks.index_state() | {name: torch.from_numpy(s) for name, s in blocks.key_sums().items()}
        if chunk.ids is not None:
            state["pending_ids"] = chunk.ids.cpu()
            for layer, (k, v) in enumerate(chunk.kv):
                state[f"pending.{layer}.k"], state[f"pending.{layer}.v"] = k.cpu(), v.cpu()
        for layer, (k, v) in chunk.windows.items():
            state[f"{WINDOW}{layer}.k"], state[f"{WINDOW}{layer}.v"] = k.cpu(), v.cpu()
        manifest.state = d.write_state(manifest.commit + 1, state) if state else None
    manifest.commit += 1
    d.write_manifest(manifest)
    d.drop_old_states(manifest.state.name if manifest.state else None)
    blocks.drop_stale_files()


def sealable_files(m: Manifest) -> dict[str, int]:
    """``{file: committed bytes}`` of the files a writer's seals cover (``format/seals.py``):
    ``tokens.bin`` and every key and index file of the commit ``m``."""
    return {TOKENS: m.blocks * m.rows.sizes[TOKENS], **m.key_file_bytes()} if m.streams is not None else {}


def load_blocks(d: MemoryDir, blocks: BlockMemory, manifest: Manifest, state: dict[str, torch.Tensor],
                rows_crc: dict[str, int], vocab_size: int, mapped: bool) -> dict[str, int]:
    """Take the blocks of the commit ``manifest`` (with its ``state``) that ``blocks`` lacks,
    from ``d``'s files; returns the CRC-32s of the rows, carried on from ``rows_crc``. A reader
    maps the token rows (``mapped``: checked where passages read them, and by ``verify``); a
    writer, which appends to them, checks their CRC-32 and ids first, and the CRC-32 of every
    key file and index file, but of the files sealed unchanged since the last writer closed them
    (``format/seals.py``: those it maps as a reader does), and of the page its commit appends
    to, before any uncommitted tail is cut."""
    sealed = set()
    if not mapped:
        sealed = unchanged(d.path, sealable_files(manifest), manifest.rows_crc or {})
        for _ in d.key_file_rows(manifest, skip=sealed):
            pass
        manifest.inputs.check_appendable(d)  # (a corpus's page its next commit appends to)
    rows, crcs = d.read_block_rows(manifest, blocks.n_blocks, rows_crc, mapped=mapped or TOKENS in sealed)
    tokens = np.frombuffer(rows[TOKENS], np.int32) if not isinstance(rows[TOKENS], np.memmap) else np.zeros(0, np.int32)
    if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise MemoryFileError(f"{d.path / TOKENS} holds token ids outside the model's vocabulary; the "
                              "memory is damaged: restore it from a backup or rebuild it")
    blocks.extend(manifest.rows, manifest.blocks, rows, state, d.path, runs=manifest.keeps_runs)
    return {**(manifest.rows_crc or {}), **crcs}


def saved_chunk(d: MemoryDir, manifest: Manifest, state: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> OpenChunk:
    """The open chunk of the commit ``manifest`` from its ``state`` (``OpenChunk``), its shapes
    checked; ``MemoryFileError`` if the state file lacks or misshapes an entry."""
    expected = manifest.pending_shapes()
    windows, wrong = manifest.window_entries(state)
    wrong += [k for k, shape in expected.items() if k not in state or tuple(state[k].shape) != shape]
    if wrong:
        raise MemoryFileError(f"the state file of {d.path} lacks or misshapes {', '.join(wrong[:3])}; the "
                              "memory is damaged: restore it from a backup or rebuild it")
    chunk = OpenChunk(windows={layer: tuple(state[n].to(device, dtype) for n in kv) for layer, kv in windows.items()})
    if expected:
        chunk.ids = state["pending_ids"].to(device)
        chunk.kv = [tuple(state[f"pending.{layer}.{n}"].to(device, dtype) for n in "kv")
                    for layer in range(manifest.model.shape.n_layer)]
    return chunk


def open_folder(path: str | Path, model: torch.nn.Module, readonly: bool) -> Opened:
    """The saved memory at ``path`` as ``LandmarkMemory.open`` takes it (``Opened``): its last
    commit read and checked to be a memory of its own built by ``model`` (not a session, not a
    document a corpus merged); ``MemoryFileError`` says which otherwise, the folder let go."""
    fingerprint = model_fingerprint(model)
    d = MemoryDir(path, writable=not readonly)
    try:
        manifest, state = d.read_commit()
        if manifest.session is not None:
            raise MemoryFileError(f"{path} is the session {manifest.session.name!r} of the memory "
                                  f"{Path(path).resolve().parent.parent}: open that memory and the session in it "
                                  f"(`landmark-memory chat MEMORY --session {manifest.session.name}`)")
        if manifest.rows_merged:
            raise MemoryFileError(f"{path} is a document of a corpus, which holds its rows now: open the corpus "
                                  f"(the folder that holds {Path(path).parent.name}/)")
        if manifest.model.fingerprint != fingerprint:
            raise MemoryFileError(wrong_model(path, manifest.model, getattr(model, "landmark_name", "")))
        given = getattr(model, "tokenizer_digest", "")  # (a model loaded with its tokenizer: ``kinds.load_model``)
        if manifest.model.tokenizer and given and manifest.model.tokenizer != given:
            raise MemoryFileError(f"the memory {path} was built with this model's weights but another tokenizer (its "
                                  "tokenizer files or chat template changed since): its token ids would read as other "
                                  "words; give the model the tokenizer it was built with, or build a new memory")
        return Opened(d, manifest, state, readonly, fingerprint)
    except BaseException:
        d.close()
        raise


class SavedFiles:
    """A memory's folder and what it knows of the commits there.

    Parameters
    ----------
    dir : MemoryDir or None (the memory is not saved), its writer lock held unless ``readonly``.
    readonly : bool, nothing is ever written (any number of readers).
    documents : bool, a corpus: its blocks are its documents'.

    Attributes
    ----------
    manifest : Manifest or None, the last commit this memory wrote or read: a new folder's commit 0,
        written when it was made (``created``); None: not saved.
    """

    def __init__(self, dir: MemoryDir | None, readonly: bool = False, documents: bool = False,
                 created: Manifest | None = None):
        self.dir, self.readonly, self.documents = dir, readonly, documents
        self.manifest: Manifest | None = created
        self._committed_blocks = 0  # blocks of the last commit: a commit writes the rows after them
        self._rows_crc = {TOKENS: 0}  # CRC-32 of the committed rows of each row file (and key file)
        self._keys_committed = 0  # blocks whose keys the key files' committed CRC-32s cover
        self._checked: dict[str, list[int]] = {}  # a writer's sealable files' status before it checked them
        self._tokens = FileWatch(dir.path / TOKENS) if dir is not None else None  # a writer's: its commits write it
        self._sealable = False  # a writer whose key and index files were checked, or written, to its manifest

    commit_count = property(lambda self: 0 if self.manifest is None else self.manifest.commit,
                            doc="The number of the last commit this memory wrote or read (0: none).")

    def commit(self, blocks: BlockMemory, manifest: Manifest, chunk: OpenChunk) -> int:
        """Commit ``blocks`` and the open ``chunk`` as ``manifest`` says (its counts; the commit
        number and CRC-32s are filled in here); returns the commit number."""
        if self.dir is None:
            raise ValueError(f"this memory has no directory: create it with a path (and store= one of {DISK_STORES}) "
                             "to save it")
        if self.readonly:
            raise ValueError(f"the memory {self.dir.path} is open read-only; open it with readonly=False to save")
        crcs = {name: crc for name, crc in self._rows_crc.items() if name != LANDMARKS}  # format 5 has key files
        manifest = replace(manifest, commit=self.commit_count, rows_crc=crcs)
        self._sealable = False
        with self._tokens.change():
            write_commit(self.dir, blocks, manifest, self._committed_blocks, self._keys_committed, self._rows_crc,
                         chunk)
        self.manifest, self._rows_crc = manifest, manifest.rows_crc
        self._committed_blocks = self._keys_committed = manifest.blocks
        self._sealable = manifest.version >= 5
        return self.commit_count

    def follow(self, blocks: BlockMemory, manifest: Manifest, state: dict[str, torch.Tensor], vocab_size: int) -> None:
        """Take into ``blocks`` what the commit ``manifest`` (with its ``state``) holds beyond
        them: its blocks, and a corpus's documents' stores."""
        self.manifest = manifest
        if manifest.streams is not None:
            if self.documents:
                blocks.shards.follow(manifest.inputs.shards, manifest.blocks)  # (its documents' stores, its own)
            if not self.readonly:  # (before the check: a change while it reads shows at close)
                self._checked = statuses(self.dir.path, sealable_files(manifest))
            self._rows_crc = load_blocks(self.dir, blocks, manifest, state, self._rows_crc, vocab_size,
                                         mapped=self.readonly)
            self._tokens = FileWatch(self.dir.path / TOKENS)  # (taken after its uncommitted tail was cut)
            self._keys_committed = manifest.blocks if manifest.version >= 5 else 0  # else: converted at a commit
            self._sealable = not self.readonly and manifest.version >= 5
        self._committed_blocks = manifest.blocks

    def newer(self, inputs: list) -> tuple[Manifest, dict[str, torch.Tensor]] | None:
        """The folder's commit after the one last read, with its state (None: there is none);
        ``MemoryFileError`` if the memory changed otherwise than by appending since (a corpus's
        ``inputs``, those of the commit last read, must stay the first of its)."""
        if self.dir.read_manifest().commit == self.commit_count:
            return None
        manifest, state = self.dir.read_commit()
        seen = self.manifest
        appended = (manifest.model.fingerprint == seen.model.fingerprint and manifest.options == seen.options
                    and manifest.documents == seen.documents and manifest.blocks >= seen.blocks
                    and manifest.commit > seen.commit and seen.streams in (None, manifest.streams)
                    and manifest.version == seen.version
                    and (not self.documents or manifest.inputs.extends(inputs)))
        if not appended:
            raise MemoryFileError(f"the memory {self.dir.path} changed otherwise than by appending since it was "
                                  f"opened (commit {self.commit_count}, now {manifest.commit}); open it again")
        return manifest, state

    def close(self, kept: dict[str, tuple] | None = None) -> None:
        """Release the folder (and its writer lock); a writer seals first those of its files
        that hold its last commit and that it ``kept`` from others (their statuses when it took
        them and after its last change, ``BlockMemory.close``; its key files let go)."""
        if self.dir is None:
            return
        try:
            if self._sealable and kept:
                m, kept = self.manifest, {**kept, **({TOKENS: self._tokens.kept} if self._tokens.kept else {})}
                seal(self.dir.path, sealable_files(m), m.rows_crc or {}, vouched(self._checked, kept))
        except OSError:
            pass  # (seals only spare the next writer reading: without them it reads every file)
        finally:
            self.dir.close()
