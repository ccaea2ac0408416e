"""A memory's full-text index: the text of each block in SQLite's FTS5, ranked by BM25, so a
question's words find the blocks that hold them however far into a memory they lie
(``uses/search.py`` joins its ranking to the retrieval heads').

One row per block of stream 0 (the stream ``ask`` reads), its rowid the block: the block's text
after up to ``EDGE`` tokens of the block before (a word cut at a block's border is found whole
in the later block), never across a document's or a turn's end (a special token); a row never
changes once written, so the index grows by appending. Porter-stemmed,
case- and accent-folded words; no text is kept, only the index (FTS5 ``content=''``): a
passage's words are read from ``tokens.bin``.

The index is derived from the memory's committed token rows and its tokenizer, and it is
checked against them, never trusted: ``meta`` records the blocks it holds, the CRC-32 of their
rows in ``tokens.bin`` and the tokenizer's digest; an index whose rows are not the memory's
(rows rewritten, another tokenizer) is built again. A writer builds a missing index in a
temporary file renamed into place, and adds a commit's new blocks in one SQLite transaction,
so a crash leaves the index before or after them, never between. When it lets the index go it
writes ``text.seal.json``: the file's status then (size, device, inode, modification and
change times, as ``format/seals.py``). Only an index whose status is still its seal's is read
as it lies: one copied in from elsewhere, changed since, or left by a crash is built again by
the next writer, and a reader (``ask``, ``search``, the server) builds its own copy in memory
meanwhile. A reader never writes the file; blocks committed after the index are added to a
copy in memory.
"""

import os
import sqlite3
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..core.fileio import TMP_MARK, file_status
from .seals import read_seal, write_seal

TEXT_INDEX = "text.sqlite"
TEXT_SEAL = "text.seal.json"
VERSION = 1
EDGE = 8  # tokens of the block before that a block's row holds
BATCH = 4096  # blocks decoded and inserted at a time
MAX_SEAL_BYTES = 1 << 12
SCHEMA = ("CREATE VIRTUAL TABLE text USING fts5(body, content='', "
          "tokenize='porter unicode61 remove_diacritics 2')",
          "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)")
TABLES = {"text", "text_data", "text_idx", "text_docsize", "text_config", "meta", "sqlite_autoindex_meta_1"}


def rows_crc(rows: np.ndarray) -> int:
    """The CRC-32 of ``rows`` (int32 (n, block_size) token ids) as ``tokens.bin`` holds them."""
    return zlib.crc32(np.ascontiguousarray(rows, "<i4"))


def block_texts(rows: np.ndarray, first: int, last: int, borders: set[int],
                decode_batch: Callable[[list[list[int]]], list[str]]) -> list[str]:
    """The indexed text of blocks ``[first, last)`` of ``rows`` (int32 (n, block_size)): each
    block's tokens after the last ``EDGE`` of the block before, those from its last token of
    ``borders`` (a document's or turn's end) on."""
    out = []
    for b in range(first, last):
        before = rows[b - 1, -EDGE:].tolist() if b > 0 else []
        cut = [i for i, t in enumerate(before) if t in borders]
        out.append(before[cut[-1] + 1:] + rows[b].tolist() if cut else before + rows[b].tolist())
    return decode_batch(out)


def match_words(words: Iterable[str]) -> str:
    """An FTS5 query that matches a row holding any of ``words`` (each a quoted phrase: none
    is read as query syntax)."""
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in words)


class TextIndex:
    """The text index of a memory folder (or of an unsaved memory, in memory only).

    ``blocks``: the blocks it holds (the memory's first ``blocks`` of stream 0). Open with
    ``TextIndex.open`` (or ``in_memory``); ``sync`` adds the blocks it lacks; ``search`` ranks."""

    def __init__(self, db: sqlite3.Connection, digest: str, path: Path | None = None, readonly: bool = False):
        self.db, self.digest, self.path, self.readonly = db, digest, path, readonly
        self.blocks, self.crc = _meta(db)

    @classmethod
    def in_memory(cls, digest: str, source: sqlite3.Connection | None = None) -> "TextIndex":
        """A new index held in memory (``source``: a copy of that index's database)."""
        db = sqlite3.connect(":memory:", check_same_thread=False)
        if source is None:
            _create(db, digest)
        else:
            source.backup(db)
        return cls(db, digest)

    @classmethod
    def open(cls, folder: str | Path, digest: str, writable: bool) -> "TextIndex":
        """The index in ``folder`` made with the tokenizer of ``digest``, as its seal vouches
        for it; otherwise a new one: for a ``writable`` caller (the memory's writer) a
        temporary file that ``close`` puts in place, for a reader one in memory."""
        folder = Path(folder)
        db = _sealed(folder, digest)
        if db is not None and not writable:
            return cls(db, digest, folder / TEXT_INDEX, readonly=True)
        if db is not None:  # (a writer appends to its own sealed file: opened again to write)
            db.close()
            return cls(_connect(folder / TEXT_INDEX, "rw"), digest, folder / TEXT_INDEX)
        if not writable:
            return cls.in_memory(digest)
        tmp = folder / f".{TEXT_INDEX}{TMP_MARK}{os.getpid()}"
        for p in (tmp, Path(f"{tmp}-journal")):
            p.unlink(missing_ok=True)
        db = _connect(tmp, "rwc")
        _create(db, digest)
        return cls(db, digest, tmp)

    def sync(self, rows: np.ndarray, borders: set[int], decode_batch: Callable[[list[list[int]]], list[str]],
             quiet: bool = True) -> int:
        """Index the blocks of ``rows`` (int32 (n, block_size): the memory's committed token rows,
        stream 0) it does not hold yet, after emptying it where the rows it holds are not
        ``rows``' first ones; a reader's file is copied into memory first. ``decode_batch``
        turns token ids into text, leaving out special tokens; ``borders``: the special tokens'
        ids. Returns the blocks added."""
        n = len(rows)
        stale = self.blocks > n or rows_crc(rows[:self.blocks]) != self.crc
        if self.blocks == n and not stale:
            return 0
        if self.readonly:  # a reader: a copy in memory grows
            copy = TextIndex.in_memory(self.digest, None if stale else self.db)
            self.db.close()
            self.db, self.path, self.readonly, self.blocks, self.crc = copy.db, None, False, copy.blocks, copy.crc
        elif stale:
            with self.db:
                self.db.execute("INSERT INTO text(text) VALUES ('delete-all')")
            self.blocks, self.crc = 0, 0
        first = self.blocks
        with self.db:  # one transaction: all of it or none
            bar = tqdm(total=n - first, desc="text index", unit="block", disable=quiet or n - first < BATCH)
            for a in range(first, n, BATCH):
                z = min(a + BATCH, n)
                texts = block_texts(rows, a, z, borders, decode_batch)
                self.db.executemany("INSERT INTO text(rowid, body) VALUES (?, ?)", zip(range(a, z), texts))
                bar.update(z - a)
            bar.close()
            crc = rows_crc(rows)
            self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [("blocks", str(n)), ("crc", str(crc))])
        self.blocks, self.crc = n, crc
        return n - first

    def search(self, words: Iterable[str], k: int, n_blocks: int) -> list[tuple[int, float]]:
        """The ``k`` blocks of the first ``n_blocks`` whose text BM25 ranks first for ``words``,
        as (block, score: higher is better), best first; none where no block holds a word."""
        query = match_words(words)
        if not query or k <= 0:
            return []
        got = self.db.execute("SELECT rowid, bm25(text) FROM text WHERE text MATCH ? AND rowid < ? "
                              "ORDER BY bm25(text) LIMIT ?", (query, n_blocks, k)).fetchall()
        return [(int(b), -float(s)) for b, s in got]

    def frequencies(self, words: Iterable[str], n_blocks: int) -> dict[str, int]:
        """{word: how many of the first ``n_blocks`` blocks hold it} for each of ``words``."""
        return {w: self.db.execute("SELECT count(*) FROM text WHERE text MATCH ? AND rowid < ?",
                                   (match_words([w]), n_blocks)).fetchone()[0] for w in words}

    def close(self) -> None:
        """Let the index go; a writer's file is put in place (a new one renamed over the old)
        and sealed."""
        if self.db is None:
            return
        self.db.close()
        self.db = None
        if self.path is None or self.readonly:
            return
        final = self.path.with_name(TEXT_INDEX)
        if self.path != final:  # (a journal left beside the old file would be played into the new one)
            Path(f"{final}-journal").unlink(missing_ok=True)
            os.replace(self.path, final)
        _seal(final)

    def __enter__(self) -> "TextIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connect(path: Path, mode: str) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{path}?mode={mode}", uri=True, check_same_thread=False)
    db.execute("PRAGMA trusted_schema = OFF")  # (an index's schema runs no function of ours)
    return db


def _create(db: sqlite3.Connection, digest: str) -> None:
    with db:
        for statement in SCHEMA:
            db.execute(statement)
        db.executemany("INSERT INTO meta VALUES (?, ?)",
                       [("version", str(VERSION)), ("digest", digest), ("blocks", "0"), ("crc", "0")])


def _meta(db: sqlite3.Connection) -> tuple[int, int]:
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    return int(meta["blocks"]), int(meta["crc"])


def index_state(folder: str | Path) -> dict | None:
    """What ``info`` says of the text index in ``folder``: its ``bytes``, whether its seal still
    vouches for it (``sealed``) and the ``blocks`` it says it holds (None where it cannot be read
    as an index); None where there is none."""
    path = Path(folder) / TEXT_INDEX
    status = file_status(path)
    if status is None:
        return None
    blocks = None
    try:
        db = _connect(path, "ro")
        try:
            blocks = _meta(db)[0]
        finally:
            db.close()
    except (sqlite3.Error, KeyError, ValueError):
        pass
    return {"bytes": status[0], "sealed": _seal_holds(Path(folder)), "blocks": blocks}


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


def _sealed(folder: Path, digest: str) -> sqlite3.Connection | None:
    """The index file of ``folder``, open to read, where its seal vouches for it, it is ours
    (its tables, version and tokenizer ``digest``) and no crash left a journal beside it."""
    path = folder / TEXT_INDEX
    if not _seal_holds(folder):
        return None
    try:
        db = _connect(path, "ro")
    except sqlite3.Error:
        return None
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall()) if tables == TABLES else {}
        if meta.get("version") == str(VERSION) and meta.get("digest") == digest:
            _meta(db)
            return db
    except (sqlite3.Error, KeyError, ValueError):
        pass
    db.close()
    return None


def _seal(path: Path) -> None:
    """Write the seal of the index file ``path`` as it is now, once the file system's clock has
    passed its change time (a later change then shows)."""
    status = file_status(path)
    if status is not None:
        write_seal(path.with_name(TEXT_SEAL), {"version": VERSION, "status": status}, status[4])
