"""A text index's file in a memory folder, read as a file anyone may have written: its seal,
the checks before anything reads it, its damage, and what ``info`` and ``verify`` say of it
(``text_index.py`` holds the index itself).

A writer seals the file when it lets it go: ``text.seal.json`` holds the file's status then
(size, device, inode, modification and change times, as ``format/seals.py``), which a copied or
changed file no longer has (what follows from that is ``text_index.py``'s).

A file is read as an index only once it is found to be one: an SQLite file in rollback-journal
mode (one in write-ahead-log mode would make a mere reader create files beside it), its tables
exactly ours (no view, trigger or other table), its ``meta`` rows counts; each of these looks is
bounded in SQLite's steps, so no file (a recursive view) can hold a reader. An index whose pages
prove damaged as they are read raises ``TextIndexError``; ``damage`` (FTS5's own integrity-check
and the rows against the blocks) is what ``verify`` and ``landmark-memory index`` look for,
since damage can also leave an index that finds nothing without an error.
"""

import functools
import itertools
import os
import re
import sqlite3
import zlib
from pathlib import Path

import numpy as np

from ..core.fileio import file_status, open_nofollow
from .errors import MemoryFileError
from .seals import read_seal, write_seal

TEXT_INDEX = "text.sqlite"
TEXT_SEAL = "text.seal.json"
VERSION = 1
MAX_SEAL_BYTES = 1 << 12
SCHEMA = ("CREATE VIRTUAL TABLE text USING fts5(body, content='', "
          "tokenize='porter unicode61 remove_diacritics 2')",
          "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
SQLITE_HEADER = b"SQLite format 3\x00"
ROLLBACK_JOURNAL = b"\x01\x01"  # the header's bytes 18 and 19 in rollback-journal mode (2, 2: write-ahead log)
STEPS, READ_STEPS = 1000, 10_000  # a reader's checks of a file: at most READ_STEPS times STEPS of SQLite's steps
MAX_SCHEMA_ROWS, MAX_SQL_CHARS = 16, 512  # what the checks read of the file's schema
META_KEYS = ("version", "digest", "blocks", "crc")
COUNT = re.compile(r"[0-9]{1,15}")  # a count in ``meta`` (a CRC-32 has at most 10 digits)


class TextIndexError(MemoryFileError):
    """A text index file that is no index of this tool's, or whose pages are damaged."""


def rows_crc(rows: np.ndarray) -> int:
    """The CRC-32 of ``rows`` (int32 (n, block_size) token ids) as ``tokens.bin`` holds them."""
    return zlib.crc32(np.ascontiguousarray(rows, "<i4"))


def check_place(folder: str | Path) -> None:
    """Raise ``TextIndexError`` where a writer could not put the text index of ``folder`` in
    place: its name taken by what is no file (a folder), which no rename replaces."""
    final = Path(folder) / TEXT_INDEX
    if os.path.lexists(final) and not os.path.islink(final) and not final.is_file():
        raise TextIndexError(f"{final} is no file, and the memory's text index must be one there: move it away "
                             "and run the command again")


def connect(path: Path, mode: str) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{path}?mode={mode}", uri=True, check_same_thread=False)
    db.execute("PRAGMA trusted_schema = OFF")  # (an index's schema runs no function of ours)
    return db


def create(db: sqlite3.Connection, digest: str) -> None:
    with db:
        for statement in SCHEMA:
            db.execute(statement)
        db.executemany("INSERT INTO meta VALUES (?, ?)",
                       [("version", str(VERSION)), ("digest", digest), ("blocks", "0"), ("crc", "0")])


def _schema_rows(db: sqlite3.Connection) -> set[tuple]:
    return set(db.execute(f"SELECT type, name, tbl_name, substr(sql, 1, {MAX_SQL_CHARS}) FROM sqlite_master "
                          f"LIMIT {MAX_SCHEMA_ROWS}"))


@functools.cache
def _schema() -> frozenset[tuple]:
    """What ``sqlite_master`` holds in an index of ours, as this SQLite's FTS5 writes it."""
    db = sqlite3.connect(":memory:")
    try:
        create(db, "")
        return frozenset(_schema_rows(db))
    finally:
        db.close()


def read_meta(db: sqlite3.Connection) -> dict[str, str]:
    """The index's ``meta`` ({key: value} of ``META_KEYS``), each a string and the counts
    decimal; ``TextIndexError`` where it is not."""
    got = dict(db.execute("SELECT key, substr(value, 1, 100) FROM meta WHERE typeof(key) = 'text' AND "
                          f"typeof(value) = 'text' AND key IN ({', '.join('?' * len(META_KEYS))})", META_KEYS))
    if set(got) != set(META_KEYS) or not all(COUNT.fullmatch(got[k]) for k in ("version", "blocks", "crc")) \
            or int(got["crc"]) >= 1 << 32:
        raise TextIndexError("its meta table does not hold its version, tokenizer, blocks and CRC-32 as text "
                             "and counts")
    return got


def counts(meta: dict[str, str]) -> tuple[int, int]:
    return int(meta["blocks"]), int(meta["crc"])


def _checked(path: Path) -> tuple[sqlite3.Connection, dict[str, str]]:
    """(the index file ``path`` open to read, its ``meta``) once it is found to be an index of
    ours: an SQLite file in rollback-journal mode, our tables and nothing else, its ``meta``
    counts, each look bounded in SQLite's steps. Raises ``TextIndexError`` saying what it is not."""
    try:
        with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
            head = f.read(100)
    except OSError as e:
        raise TextIndexError(f"{path} cannot be read ({e.strerror or e})") from None
    if len(head) < 100 or not head.startswith(SQLITE_HEADER):
        raise TextIndexError(f"{path} is no SQLite database")
    if head[18:20] != ROLLBACK_JOURNAL:  # (a reader of a write-ahead log writes its -wal and -shm files)
        raise TextIndexError(f"{path} is an SQLite database in write-ahead-log mode (or another that is not "
                             "rollback-journal), which no index of ours is")
    try:
        db = connect(path, "ro")
    except sqlite3.Error as e:
        raise TextIndexError(f"{path} cannot be read as SQLite ({e})") from None
    steps = itertools.count()
    db.set_progress_handler(lambda: next(steps) >= READ_STEPS, STEPS)  # (a true value ends the statement)
    try:
        meta = read_meta(db) if _schema_rows(db) == _schema() else None
    except (sqlite3.Error, TextIndexError, UnicodeDecodeError) as e:  # (text the file holds is not UTF-8)
        db.close()
        raise TextIndexError(f"{path} cannot be read as a text index ({e})") from None
    if meta is None:
        db.close()
        raise TextIndexError(f"{path} holds other tables, views or triggers than a text index's")
    db.set_progress_handler(None, 0)  # (ours, from here on: a search reads as long as it must)
    return db, meta


def index_state(folder: str | Path) -> dict | None:
    """What ``info`` says of the text index in ``folder``: its ``bytes``, whether its seal still
    vouches for it (``sealed``) and the ``blocks`` it says it holds (None where it cannot be read
    as an index, ``problem`` saying why); None where there is none. Nothing is written."""
    path = Path(folder) / TEXT_INDEX
    status = file_status(path)
    if status is None:
        return None
    state = {"bytes": status[0], "sealed": _seal_holds(Path(folder)), "blocks": None}
    try:
        db, meta = _checked(path)
    except TextIndexError as e:
        return {**state, "problem": str(e)}
    db.close()
    return {**state, "blocks": counts(meta)[0]}


def damage(db: sqlite3.Connection, blocks: int) -> str | None:
    """What is wrong with the index ``db`` that says it holds ``blocks`` blocks: pages that
    FTS5's integrity-check finds damaged, or rows that are not one per block (rowids 0 to
    ``blocks`` - 1); None where it is sound. FTS5 runs its check as a write (``db`` must be
    writable: a reader's copy in memory), which changes nothing."""
    try:
        db.execute("INSERT INTO text(text, rank) VALUES ('integrity-check', 0)")
        n, lo, hi = db.execute("SELECT count(*), min(id), max(id) FROM text_docsize").fetchone()
    except sqlite3.DatabaseError as e:
        return f"FTS5's integrity-check fails: {e}"
    if (n, lo, hi) != ((blocks, 0, blocks - 1) if blocks else (0, None, None)):
        return f"it holds {n:,} rows (blocks {lo} to {hi}) where it says it holds blocks 0 to {blocks - 1}"
    return None


def problems(folder: str | Path, rows: np.ndarray | None) -> list[str]:
    """What ``verify`` finds wrong with the text index in ``folder`` where its seal vouches for
    it (readers read it as it lies; any other is built again, never read): no index of ours,
    damaged (``damage``), or holding other rows than ``rows`` (int32 (n, block_size), the
    memory's committed token rows of stream 0; None: not compared). One line each, with what to do."""
    folder = Path(folder)
    if not _seal_holds(folder):
        return []
    fix = (f"`landmark-memory index {folder}` builds it again (readers search a copy built in memory "
           "meanwhile)")
    try:
        db, meta = _checked(folder / TEXT_INDEX)
    except TextIndexError as e:
        return [f"the text index is sealed but {e}: {fix}"]
    blocks, crc = counts(meta)
    copy = sqlite3.connect(":memory:")
    try:
        db.backup(copy)
        why = damage(copy, blocks)
    except sqlite3.DatabaseError as e:
        why = f"its pages cannot be read ({e})"
    finally:
        copy.close()
        db.close()
    if why is not None:
        return [f"the text index {folder / TEXT_INDEX} is damaged: {why}; {fix}"]
    if rows is not None and (blocks > len(rows) or rows_crc(rows[:blocks]) != crc):
        return [f"the text index {folder / TEXT_INDEX} holds other rows than the memory's first {blocks:,} blocks; "
                f"{fix}"]
    return []


def _seal_holds(folder: Path) -> bool:
    """Whether ``text.seal.json`` vouches for the index file as it is now: its status the seal's,
    changed before the seal was written, and no journal beside it."""
    path = folder / TEXT_INDEX
    status = file_status(path)
    if status is None or os.path.lexists(f"{path}-journal"):
        return False
    seal, sealed_at = read_seal(folder / TEXT_SEAL, MAX_SEAL_BYTES)
    return isinstance(seal, dict) and seal.get("version") == VERSION and seal.get("status") == status \
        and status[4] < sealed_at


def sealed(folder: Path, digest: str) -> sqlite3.Connection | None:
    """The index file of ``folder``, open to read, where its seal vouches for it, it is ours
    (``_checked``: its tables and meta; its version and tokenizer ``digest``) and no crash
    left a journal beside it."""
    if not _seal_holds(folder):
        return None
    try:
        db, meta = _checked(folder / TEXT_INDEX)
    except TextIndexError:
        return None
    if meta["version"] == str(VERSION) and meta["digest"] == digest:
        return db
    db.close()
    return None


def seal_index(path: Path) -> None:
    """Write the seal of the index file ``path`` as it is now, once the file system's clock has
    passed its change time (a later change then shows)."""
    status = file_status(path)
    if status is not None:
        write_seal(path.with_name(TEXT_SEAL), {"version": VERSION, "status": status}, status[4])
