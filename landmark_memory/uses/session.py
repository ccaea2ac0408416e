"""Sessions: named conversations over a memory, each read into a saved memory of its own.

A session lives in ``<memory>/sessions/<name>/``, a memory directory of the usual format (its
own writer lock, commits, token rows, key files, index files and store: the same crash safety)
whose manifest says ``session`` (its name, the memory it is held over, its turns), whose
``turns.jsonl`` holds one JSON line per turn (role, text, where its tokens start, an answer's
passages), and whose ``turns.idx`` holds where each turn starts (int64: all a turn reads of
them, so opening a session costs the same however long it is), both appended and committed
with the blocks. Attached to the memory opened read-only
(``Session.attach``), its blocks follow the memory's saved ones: a query searches both (the
memory's index and the session's, their top-k merged), and what is fed goes into the
session's files, which ``commit`` makes durable. The memory itself is never written, and any
number of sessions share it.

What a session sees of a corpus that grows: a turn reads the corpus at the commit the open
memory holds when the turn starts (``answer.say`` follows the memory's commits first, so every
document committed before the turn), the session's blocks after it; its earlier turns stay as
they were read. A memory changed otherwise than by appending documents, or another model, is
refused, and so is a session made over a memory built with other options, or found under
another name than its own. Its files as files (names, turn logs, listing, deleting) are
``session_files.py``'s.
"""

import hashlib
import json
import zlib
from bisect import bisect_right
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ..format.directory import MANIFEST, MemoryDir
from ..format.errors import WriterBusyError
from ..format.manifest import TOKENS, BaseRecord, Manifest, SessionRecord
from ..format.session_files import (
    STARTS,
    TURNS,
    SessionError,
    Turn,
    busy_error,
    check_record,
    committed_starts,
    committed_turns,
    missing_error,
    new_name,
    session_path,
    turn_bytes,
)
from ..memory.attachment import AttachedBlocks
from ..memory.engine import LandmarkMemory


def base_record(m: Manifest) -> BaseRecord:
    """What a session records of the memory whose commit is ``m`` (``BaseRecord``)."""
    if m.documents:
        return BaseRecord(m.blocks, len(m.inputs), _documents_digest(m, len(m.inputs)))
    whole = json.dumps([m.blocks, m.pending_tokens, (m.rows_crc or {}).get(TOKENS), m.state and m.state.sha256])
    return BaseRecord(m.blocks, 0, hashlib.sha256(whole.encode()).hexdigest())


def _documents_digest(m: Manifest, n: int, by_pages: bool = True) -> str:
    """The first ``n`` documents of the corpus whose commit is ``m``, named by a SHA-256: the full
    pages of its list among them by their manifest entries (a full page is never written again:
    its bytes and CRC-32 stand for its records), the others by their fields, so that naming
    them reads one page at most; ``by_pages=False``: every one by its fields (as sessions
    recorded it before)."""
    whole = m.inputs.full_pages(n) if by_pages else []
    docs = [[e.document, e.sha256, e.start, e.ingested] for e in m.inputs[sum(p.count for p in whole):n]]
    pages = [list(asdict(p).values()) for p in whole]
    return hashlib.sha256(json.dumps([pages, docs] if pages else docs).encode()).hexdigest()


def holds(m: Manifest, over: BaseRecord) -> bool:
    """Whether the memory whose commit is ``m`` still holds what a session read of it (``over``):
    the same documents and more for a corpus, the same commit for another memory."""
    if m.documents:
        n = over.documents
        return len(m.inputs) >= n and m.blocks >= over.blocks and (over.digest == _documents_digest(m, n) or (
            bool(m.inputs.full_pages(n)) and over.digest == _documents_digest(m, n, by_pages=False)))
    return base_record(m) == over


class Session:
    """A named conversation over a memory opened read-only (``mem``): its blocks, its turns,
    its writer lock. ``Session.open`` makes or opens one; ``answer.say`` holds a turn."""

    def __init__(self, mem: LandmarkMemory, d: MemoryDir, manifest: Manifest, state: dict):
        self.mem, self.dir, self.manifest, self.name = mem, d, manifest, manifest.session.name
        turn_bytes(d, manifest)  # what a turn appends to, checked before anything is cut
        self._starts = committed_starts(d, manifest).tolist()  # where each turn starts, for ``locate``
        self.blocks = AttachedBlocks(mem, d, manifest, state)
        try:
            self._rows_crc = dict(self.blocks.rows_crc)
            for name, nbytes in ((TURNS, manifest.session.turns_bytes), (STARTS, 8 * manifest.session.turns)):
                d.cut_rows(name, nbytes)  # what a stopped turn left after the committed turns
                self._rows_crc[name] = (manifest.rows_crc or {}).get(name, 0)
        except BaseException:
            self.blocks.close()
            raise
        self._turns: list[Turn] | None = None  # read when first asked for

    # ---- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, mem: LandmarkMemory, name: str | None = None, *, create: bool = True,
             new: bool = False) -> "Session":
        """The session ``name`` over ``mem`` (a saved memory opened read-only), made when there
        is none and ``create`` (without a name: a new one, ``new_name``); ``new``: one that
        exists is refused. It holds the session's writer lock until ``close``."""
        if mem.dir is None or not mem.readonly:
            raise ValueError("a session is held over a saved memory opened read-only: "
                             "LandmarkMemory.open(path, model, readonly=True)")
        if mem.streams not in (None, 1):
            raise ValueError(f"a session continues one stream; the memory {mem.dir.path} holds {mem.streams}")
        name = new_name() if name is None else name
        path = session_path(mem.dir.path, name)
        if new and (path / MANIFEST).is_file():
            raise SessionError("exists", f"the memory {mem.dir.path} has a session {name!r} already: choose another "
                               "name, or resume that one")
        if not (path / MANIFEST).is_file():
            if not create:
                raise missing_error(mem.dir.path, name)
            try:
                d = MemoryDir.create(path, Manifest(model=mem.manifest.model, options=mem.manifest.options,
                                                    session=SessionRecord(name, base_record(mem.manifest))))
            except WriterBusyError as e:
                raise busy_error(e, name) from None
            manifest, state = d.read_commit()
        else:
            try:
                d = MemoryDir(path, writable=True)
            except WriterBusyError as e:
                raise busy_error(e, name) from None
            try:
                manifest, state = d.read_commit()
                _check_identity(mem, manifest, path)
            except BaseException:
                d.close()
                raise
        try:
            return cls(mem, d, manifest, state)
        except BaseException:
            d.close()
            raise

    # ---- a turn ---------------------------------------------------------------------------------
    @property
    def turns(self) -> list[Turn]:
        """Every turn so far (read from ``turns.jsonl`` when first asked for)."""
        if self._turns is None:
            self._turns = committed_turns(self.dir, self.manifest)
        return self._turns

    @property
    def n_turns(self) -> int:
        return self.manifest.session.turns

    @property
    def n_tokens(self) -> int:
        """Tokens of the session (its blocks' and its open chunk's)."""
        pending = self.mem.pending_count if self.attached else self.blocks.pending_tokens
        return self.blocks.n_blocks * self.mem.shape.block_size + pending

    @property
    def attached(self) -> bool:
        """Whether the memory reads into this session now (``attach``)."""
        a = self.mem.attachment
        return a is not None and a.owner is self

    def attach(self) -> None:
        """Put the session after the memory's blocks (the memory rewound first): what the memory
        reads from here on goes into the session. Nothing to do while it is attached."""
        mem = self.mem
        if self.attached:
            return
        mem.rewind()
        _check_over(mem, self.manifest, self.dir.path)
        # (a session before its first turn takes the memory's open chunk, if any)
        mem.attach(self, self.blocks, resume=bool(self.manifest.commit))

    def commit(self, turns: list[Turn]) -> None:
        """Make what the memory read since the last commit durable in the session, with ``turns``
        (docs/design/format.md, "Commit protocol"; ``turns.jsonl`` is written with the token rows)."""
        mem, r = self.mem, self.manifest.session
        if not self.attached:
            raise RuntimeError(f"the session {self.name} is not attached to its memory: attach it first")
        data = b"".join(json.dumps(asdict(t), ensure_ascii=False).encode() + b"\n" for t in turns)
        starts = np.array([t.start for t in turns], np.int64).tobytes()
        self.dir.write_rows(TURNS, r.turns_bytes, data)
        self.dir.write_rows(STARTS, 8 * r.turns, starts)
        crcs = {**self._rows_crc, TURNS: zlib.crc32(data, self._rows_crc[TURNS]),
                STARTS: zlib.crc32(starts, self._rows_crc[STARTS])}
        P, committed = mem.pending_count, self.manifest.blocks
        m = replace(self.manifest, streams=1, blocks=self.blocks.n_blocks, pending_tokens=P,
                    tokens=self.blocks.n_blocks * mem.shape.block_size + P, rows_crc=crcs,
                    session=replace(r, over=base_record(mem.manifest), turns=r.turns + len(turns),
                                    turns_bytes=r.turns_bytes + len(data)))
        chunk = mem.open_chunk()
        self.blocks.commit(self.dir, m, committed, self._rows_crc, chunk)
        self.manifest, self._rows_crc = m, m.rows_crc
        if self._turns is not None:
            self._turns += turns
        self._starts += [t.start for t in turns]

    def locate(self, block: int) -> tuple[int, int]:
        """``(turn, token offset in it)`` of the first token of the session's block ``block``."""
        at = block * self.mem.shape.block_size
        t = max(bisect_right(self._starts, at) - 1, 0)
        return t, at - (self._starts[t] if self._starts else 0)

    def reopen(self) -> "Session":
        """This session at its last commit, opened again (closed first): what its memory read
        since, a turn stopped midway, is dropped."""
        mem, name = self.mem, self.name
        self.close()
        return Session.open(mem, name, create=False)

    def close(self) -> None:
        """Let the memory go (rewound) and release the session's files and lock."""
        if self.attached:
            self.mem.rewind()
        self.blocks.close()
        self.dir.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_identity(mem: LandmarkMemory, m: Manifest, path: Path) -> None:
    """Refuse what is no session, a session under another name, of another model, or made
    over a memory built with other options (its blocks are stored as that memory's are)."""
    check_record(m, path)
    if m.model.fingerprint != mem.manifest.model.fingerprint:
        raise SessionError("other", f"the session {m.session.name!r} was held with another model (weights "
                           f"{m.model.fingerprint[:12]}) than the memory's; delete it or use its model")
    ours, theirs = m.options.built(), mem.manifest.options.built()
    if ours != theirs:
        differ = ", ".join(f"{k} {ours.get(k)!r} against {theirs.get(k)!r}" for k in sorted(ours.keys() | theirs.keys())
                           if ours.get(k) != theirs.get(k))
        raise SessionError("other", f"the session {m.session.name!r} was made over a memory built with other options "
                           f"than {mem.dir.path} ({differ}); delete it")


def _check_over(mem: LandmarkMemory, m: Manifest, path: Path) -> None:
    """Refuse a session over a memory that no longer holds what the session read of it."""
    _check_identity(mem, m, path)
    if not holds(mem.manifest, m.session.over):
        raise SessionError("other", f"the session {m.session.name!r} was held over another memory: "
                           f"{mem.dir.path} no longer holds what it read (rebuilt, or changed otherwise than by "
                           "adding documents); delete the session")
