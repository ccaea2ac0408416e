"""A memory saved in a directory: commit, open, close (docs/DESIGN.md, "Persistence").

``LandmarkMemory`` (engine.py) reads and computes; this part of it writes its commits and
restores them. A corpus (``documents``) keeps no blocks of its own: its blocks are its
documents', read from their stores (``memory/corpus.py`` merges them).
"""

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..core.names import DISK_STORES
from ..storage import DTYPE_NAMES
from ..storage.sharded import Shard
from .blocks import BlockMemory
from .directory import MemoryDir, model_fingerprint
from .manifest import KEYS, LANDMARKS, TOKENS, WINDOW, Manifest, MemoryFileError, ModelRecord


def wrong_model(path, saved: ModelRecord, given: str) -> str:
    """One line: which model built the memory at ``path``, which was given, what to pass."""
    built = f"{saved.name} (weights {saved.fingerprint[:12]})" if saved.name else f"weights {saved.fingerprint[:12]}"
    mine = f"--model {given}" if given else "the model given"
    fix = f"pass --model {saved.name}" if saved.name else "open it with the model that built it"
    return f"the memory {path} was built with another model, {built}, not with {mine}: {fix}"


@dataclass
class OpenChunk:
    """What a commit keeps of the text past the memory's last block, no RoPE applied: the open
    chunk's token ids (streams, P) and per memory layer its keys and values (streams, H_kv, P
    with landmarks, D); per sliding-window layer the keys and values of the positions its window
    still reads (streams, H_kv, at most window - 1, D)."""

    ids: torch.Tensor | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


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
    manifest (docs/DESIGN.md, "Commit protocol"). ``manifest`` ends as committed: its commit
    number, state file and CRC-32s."""
    if manifest.streams is not None:
        layout = manifest.rows
        for name, data in blocks.rows_since(layout, first).items():
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


def load_blocks(d: MemoryDir, blocks: BlockMemory, manifest: Manifest, state: dict[str, torch.Tensor],
                rows_crc: dict[str, int], vocab_size: int, mapped: bool) -> dict[str, int]:
    """Take the blocks of the commit ``manifest`` (with its ``state``) that ``blocks`` lacks,
    from ``d``'s files; returns the CRC-32s of the rows, carried on from ``rows_crc``. A reader
    maps the token rows (``mapped``: checked where passages read them, and by ``verify``); a
    writer, which appends to them, reads them and checks their CRC-32 and ids first, and the
    CRC-32 of every key file and index file (before any uncommitted tail is cut)."""
    if not mapped:
        for _ in d.key_file_rows(manifest):
            pass
    rows, crcs = d.read_block_rows(manifest, blocks.n_blocks, rows_crc, mapped=mapped)
    tokens = np.frombuffer(rows[TOKENS], np.int32) if not mapped else np.zeros(0, np.int32)
    if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise MemoryFileError(f"{d.path / TOKENS} holds token ids outside the model's vocabulary; the "
                              "memory is damaged: restore it from a backup or rebuild it")
    blocks.extend(manifest.rows, manifest.blocks, rows, state, d.path)
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


class SavedMemory:
    """The saving half of ``LandmarkMemory``: everything here needs the attributes that
    ``LandmarkMemory._setup`` makes."""

    def _new_blocks(self, readonly: bool, key_files: bool = True) -> BlockMemory:
        """The memory's blocks, none yet; a corpus reads those of its documents from their stores
        (``BlockMemory.add_shard``). ``key_files``: its landmark keys are (or, for a writer, will
        be) in its key files; else in memory (a reader of a memory from before them)."""
        shards = [] if self.documents else None  # their stores open, and are checked, when first read
        saved = self.dir is not None
        return BlockMemory(self.shape, self.options, store_path=None if not saved or self.documents else
                           self.dir.store_path(), readonly=readonly, device=self.device, dtype=self.dtype,
                           rope=self.rope, cache_bytes=self.cache_bytes, shards=shards,
                           shard_path=lambda name: self.dir.document(name).store_path(),
                           key_path=self.dir.key_path() if saved and key_files else None)

    # ---- persistence --------------------------------------------------------------------
    def commit(self) -> int:
        """Make everything fed so far durable in the memory directory (docs/DESIGN.md, "Commit
        protocol"); returns the commit number. A process killed at any instant leaves the
        memory at its last commit."""
        if self.dir is None:
            raise ValueError(f"this memory has no directory: create it with a path (and store= one of {DISK_STORES}) "
                             "to save it")
        if self.readonly:
            raise ValueError(f"the memory {self.dir.path} is open read-only; open it with readonly=False to save")
        manifest = self._manifest()
        write_commit(self.dir, self.blocks, manifest, self._committed_blocks, self._keys_committed, self._rows_crc,
                     self.open_chunk())
        self.manifest = manifest
        self.commit_count, self._committed_blocks, self._rows_crc = manifest.commit, self.n_blocks, manifest.rows_crc
        self._keys_committed = self.n_blocks
        return self.commit_count

    @classmethod
    def open(cls, path: str | Path, model: torch.nn.Module, *, readonly: bool = False, cache_bytes: int = 256 << 20,
             backend: str = "auto", **options) -> "LandmarkMemory":
        """A saved memory, at its last commit, ready to continue as if it had never stopped.

        Parameters
        ----------
        path : str or Path, the memory directory.
        model : the model the memory was built with (checked by fingerprint).
        readonly : bool, read without the writer lock (any number of readers); text fed
            afterwards stays in this process and is never saved: ``rewind()`` forgets it,
            ``refresh()`` follows later commits.
        options : query-time settings to change (``QUERY_OPTIONS``: top_k, retrieval,
            position_mapping, max_blocks, cmt_cutoff, sink_blocks, local_blocks, centre; and the
            index's nprobe, ef_search). The rest was fixed when the memory was built.
        """
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
            saved = manifest.model
            if saved.fingerprint != fingerprint:
                raise MemoryFileError(wrong_model(path, saved, getattr(model, "landmark_name", "")))
            return cls(model, manifest.options.with_query(**options), cache_bytes=cache_bytes, backend=backend,
                       opened=Opened(d, manifest, state, readonly, fingerprint))
        except BaseException:
            d.close()
            raise

    def _take(self, opened: Opened) -> None:
        """Become the saved memory ``opened`` (``LandmarkMemory.__init__`` for ``open``)."""
        m = opened.manifest
        self.dir, self.readonly, self._fingerprint, self.documents = opened.dir, opened.readonly, opened.fingerprint, \
            m.documents
        self.blocks = self._new_blocks(opened.readonly, key_files=m.version >= 5 or not opened.readonly)
        try:
            self._follow(m, opened.state)
        except BaseException:
            self.blocks.close()
            raise

    def refresh(self) -> bool:
        """Follow the memory's writer: take the blocks committed since this read-only memory
        opened or last refreshed, reading only what was appended (rows, documents' stores; an
        approximate index is read again from the state file). Text fed since is forgotten
        first (``rewind``). Answers then equal a fresh open's. Returns whether there was a new
        commit; a memory changed otherwise than by appending, or a file it maps cut short since
        (which would be a SIGBUS at the next read), raises ``MemoryFileError``."""
        if self.dir is None or not self.readonly:
            raise ValueError("only a saved memory opened read-only follows its writer's commits; a writable one "
                             "is the newest there is")
        if self.dir.read_manifest().commit == self.commit_count:
            self.blocks.check_files()
            return False
        manifest, state = self.dir.read_commit()
        seen, old = self.manifest, self.inputs
        appended = (manifest.model.fingerprint == seen.model.fingerprint and manifest.options == seen.options
                    and manifest.documents == seen.documents and manifest.blocks >= seen.blocks
                    and manifest.commit > seen.commit and seen.streams in (None, manifest.streams)
                    and manifest.version == seen.version
                    and (not self.documents or manifest.inputs[:len(old)] == old))
        if not appended:
            raise MemoryFileError(f"the memory {self.dir.path} changed otherwise than by appending since it was "
                                  f"opened (commit {self.commit_count}, now {manifest.commit}); open it again")
        self.blocks.check_files()
        self.rewind()
        self._follow(manifest, state)
        return True

    def _follow(self, manifest: Manifest, state: dict[str, torch.Tensor]) -> None:
        """Take the commit ``manifest`` (with its ``state``): the blocks it holds beyond this
        memory's, its documents' stores, its open chunk."""
        self.commit_count, self.manifest = manifest.commit, manifest
        if manifest.streams is not None:
            if self.documents:
                bs = self.shape.block_size
                for e in manifest.inputs[len(self.inputs):]:
                    self.blocks.add_shard(Shard(e.start // bs, e.ingested // bs, e.document))
            self._rows_crc = load_blocks(self.dir, self.blocks, manifest, state, self._rows_crc,
                                         self.backbone.vocab_size, mapped=self.readonly)
            self._keys_committed = manifest.blocks if manifest.version >= 5 else 0  # else: converted at a commit
        self.inputs, self._committed_blocks = list(manifest.inputs), manifest.blocks
        self.take(saved_chunk(self.dir, manifest, state, self.device, self.dtype))
        self._saved_chunk = self.pending_ids, self.pending_kv, dict(self.window_kv)  # as taken: rotated once

    def open_chunk(self) -> OpenChunk:
        """What was fed past the last block, as a commit keeps it."""
        kv = [(k, v) for k, _, v in self.pending_kv] if self.pending_ids is not None else []
        return OpenChunk(self.pending_ids, kv, dict(self.window_kv))

    def take(self, chunk: OpenChunk) -> None:
        """Continue after ``chunk`` (``open_chunk`` of this memory or of one that read the same
        blocks): its keys rotated to where the open chunk sits now."""
        self.window_kv = dict(chunk.windows)
        if chunk.ids is None:
            self.pending_ids, self.pending_kv = None, [None] * self.shape.n_layer
            return
        pos = self._base() + torch.arange(chunk.kv[0][0].shape[2], device=self.device)
        self.pending_ids, self.pending_kv = chunk.ids, [(k, self.rope(k, pos), v) for k, v in chunk.kv]

    def rewind(self) -> None:
        """Forget what was fed to this read-only memory since it opened or last refreshed: it
        holds its commit again, exactly (the hot cache keeps the saved blocks it holds)."""
        if not self.readonly:
            raise ValueError("only a memory opened read-only rewinds; a writer keeps what it was fed (close it "
                             "with commit=False to drop what was fed since its last commit)")
        self.blocks.rewind()
        self.pending_ids, self.pending_kv, windows = self._saved_chunk
        self.window_kv = dict(windows)
        self._recent_keys.clear()
        self._mean_keys.clear()
        self._forced = None
        self.attached = None

    def model_record(self) -> ModelRecord:
        """The model this memory was built with, as its manifest records it (fingerprint first)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return ModelRecord(self._fingerprint, self.model.config.to_dict(), self.shape, DTYPE_NAMES[self.dtype],
                           getattr(self.model, "landmark_name", ""))

    def _manifest(self) -> Manifest:
        crcs = {name: crc for name, crc in self._rows_crc.items() if name != LANDMARKS}  # format 5 has key files
        return Manifest(model=self.model_record(), options=self.options, streams=self.streams, blocks=self.n_blocks,
                        tokens=self.n_tokens, pending_tokens=self.pending_count, inputs=self.inputs,
                        commit=self.commit_count, rows_crc=crcs, documents=self.documents)

    def close(self, commit: bool = True) -> None:
        """Release the store and the writer lock; a writable saved memory commits first
        (``commit=False`` drops what was fed since the last commit)."""
        if self._closed:
            return
        try:
            if commit and self.dir is not None and not self.readonly:
                self.commit()
        finally:  # a commit that failed (a full disk) leaves the last one standing: the files are let go all the same
            self._closed = True
            self.blocks.close()
            if self.dir is not None:
                self.dir.close()

    def __enter__(self) -> "LandmarkMemory":
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(commit=exc_type is None)
