"""A memory's sessions as files, read without the model: their names, folders and turn logs
(``turns.jsonl`` and ``turns.idx``, each checked against its CRC-32 before it is used),
listed, read and deleted. ``session.py`` holds a session over an open memory.

A session's folder is its name (``check_name``: a name, never a path, at most 255 bytes in
UTF-8), and its manifest's ``session.name`` must be that name (a folder copied or renamed is
refused). A deletion renames the folder out of the sessions first, to a short name, so a stop
midway leaves no half session and every session that can be made can be deleted.
"""

import json
import os
import secrets
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.fileio import TMP_MARK
from ..core.names import SESSION_NAME_RULE, is_session_name
from .directory import MANIFEST, MemoryDir, leftovers
from .errors import WriterBusyError
from .manifest import Manifest, MemoryFileError

SESSIONS, TURNS, STARTS = "sessions", "turns.jsonl", "turns.idx"
ROLES = ("system", "user", "assistant")


class SessionError(ValueError):
    """A session that cannot be used as asked; ``kind`` says why: "name" (not a name),
    "missing", "exists" (one to start is there already), "busy" (another process holds it) or
    "other" (of another model or memory)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Turn:
    """One turn of a session: who said it (``role``: system, user or assistant), its ``text``,
    where its tokens start among the session's and how many there are, when it was said, and an
    answer's passages (``answer.Passage`` as JSON)."""

    role: str
    text: str
    start: int
    tokens: int
    time: str
    passages: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class SessionInfo:
    """A session as ``landmark-memory sessions`` lists it; ``problem`` says why one cannot be read."""

    name: str
    turns: int
    tokens: int
    updated: str
    problem: str = ""
    committed: bool = True  # False: a chat stopped before the session's first commit (no damage)


def check_name(name: str) -> str:
    """``name`` if it is a session name (``names.is_session_name``: letters, digits, ``_ . -``,
    up to 100 and at most 255 bytes in UTF-8, not starting with a dot or dash), else
    ``SessionError("name")``."""
    if not is_session_name(name):
        raise SessionError("name", f"{name!r} is no session name: {SESSION_NAME_RULE}")
    return name


def new_name() -> str:
    """A fresh session name: the time and four random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def sessions_folder(memory: str | Path) -> Path:
    """The folder of a memory's sessions, refused when it is a symbolic link."""
    folder = Path(memory) / SESSIONS
    if folder.is_symlink():
        raise MemoryFileError(f"{folder} is a symbolic link: a memory writes only its own files; remove the link")
    return folder


def busy_error(e: WriterBusyError, name: str) -> SessionError:
    return SessionError("busy", f"the session {name!r} is in use by another process ({e}); wait for its turn to end")


def check_record(m: Manifest, path: Path) -> None:
    """Refuse what is no session, or a session under another name than its own (a folder
    copied or renamed)."""
    if m.session is None:
        raise MemoryFileError(f"{path} is no session (its manifest has no session record); remove it")
    if m.session.name != path.name:
        raise SessionError("other", f"the folder {path} holds the session {m.session.name!r}, not {path.name!r} (a "
                           "session copied or renamed): give it back its name, or delete it")


def turn_bytes(d: MemoryDir, m: Manifest) -> bytes:
    """The committed bytes of ``turns.jsonl`` of the session in ``d`` (its manifest ``m``),
    checked against their CRC-32: a writer checks what it appends to."""
    data = d.read_rows(TURNS, m.session.turns_bytes)
    if zlib.crc32(data) != (m.rows_crc or {}).get(TURNS, 0):
        raise _damaged(d.path / TURNS, m.session.name, "does not match its session's manifest (its CRC-32 differs)")
    return data


def committed_turns(d: MemoryDir, m: Manifest) -> list[Turn]:
    """The turns the session in ``d`` committed (its manifest ``m``), checked against their CRC-32."""
    f, r = d.path / TURNS, m.session
    data = turn_bytes(d, m)
    try:
        turns = [Turn(**json.loads(line)) for line in data.decode().splitlines()]
    except (ValueError, TypeError) as e:
        raise MemoryFileError(f"{f} holds a line that is no turn ({e}); the session is damaged") from None
    if len(turns) != r.turns:
        raise MemoryFileError(f"{f} holds {len(turns)} turns, its manifest {r.turns}; the session is damaged")
    return turns


def _damaged(f: Path, name: str, why: str) -> MemoryFileError:
    return MemoryFileError(f"{f} {why}; the session is damaged: delete it (`landmark-memory sessions MEMORY "
                           f"--delete {name}`)")


def session_path(memory: str | Path, name: str) -> Path:
    """The folder of the session ``name`` of the memory at ``memory`` (there or not), refused
    when the name is no name or the folder a symbolic link."""
    path = sessions_folder(memory) / check_name(name)
    if path.is_symlink():
        raise MemoryFileError(f"{path} is a symbolic link: a memory writes only its own files; remove the link")
    return path


def require_session(memory: str | Path, name: str) -> Path:
    """The folder of the session ``name`` of the memory at ``memory``; ``SessionError`` if it has none."""
    path = session_path(memory, name)
    if not (path / MANIFEST).is_file():
        raise missing_error(memory, name)
    return path


def missing_error(memory, name: str) -> SessionError:
    return SessionError("missing", f"the memory {memory} has no session {name!r} (`landmark-memory sessions` "
                        "lists them)")


def committed_starts(d: MemoryDir, m: Manifest) -> np.ndarray:
    """int64 (turns,): where each committed turn of the session in ``d`` starts (its manifest
    ``m``), checked against their CRC-32."""
    data = d.read_rows(STARTS, 8 * m.session.turns)
    if zlib.crc32(data) != (m.rows_crc or {}).get(STARTS, 0):
        raise _damaged(d.path / STARTS, m.session.name, "does not match its session's manifest (its CRC-32 differs)")
    return np.frombuffer(data, np.int64)


def read_session(memory: str | Path, name: str) -> tuple[Manifest, list[Turn]]:
    """The last commit of the session ``name`` of the memory at ``memory`` and its turns, read
    without its model or its lock."""
    path = require_session(memory, name)
    d = MemoryDir(path, writable=False)
    m = d.read_manifest()
    check_record(m, path)
    return m, committed_turns(d, m)


def list_sessions(memory: str | Path) -> list[SessionInfo]:
    """Every session of the memory at ``memory``, by name (read without the model)."""
    folder, out = sessions_folder(memory), []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not is_session_name(p.name) or p.is_symlink():
            continue
        if not (p / MANIFEST).exists() and leftovers(p) is not None:
            out.append(SessionInfo(p.name, 0, 0, "", "never committed: a chat stopped before its first commit; chat "
                                   "in it again, or delete it", committed=False))
            continue
        try:
            d = MemoryDir(p, writable=False)
            m = d.read_manifest()
            check_record(m, p)
            turn_bytes(d, m)  # (its turns' files whole and sound: a damaged session is listed as such)
            committed_starts(d, m)
            out.append(SessionInfo(p.name, m.session.turns, m.tokens, m.updated))
        except (MemoryFileError, SessionError) as e:
            out.append(SessionInfo(p.name, 0, 0, "", str(e)))
    return out


def delete_session(memory: str | Path, name: str) -> None:
    """Remove the session ``name`` of the memory at ``memory`` (refused while in use). It is
    first renamed out of the sessions, so a stop midway leaves no half session."""
    path = session_path(memory, name)
    if not path.is_dir():
        raise missing_error(memory, name)
    try:
        d = MemoryDir(path, writable=True)  # (the lock: a session in use is not removed)
    except WriterBusyError as e:
        raise busy_error(e, name) from None
    try:  # (a short name whatever the session's: every session that can be made can be deleted)
        gone = path.with_name(f".{secrets.token_hex(4)}{TMP_MARK}{os.getpid()}")
        os.rename(path, gone)
    finally:
        d.close()
    shutil.rmtree(gone)
    for p in path.parent.iterdir():  # what an earlier deletion stopped midway left
        if p.name.startswith(".") and TMP_MARK in p.name and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
