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
seals it (``text_file.py``): only an index its seal still vouches for is read as it lies; one
copied in from elsewhere, changed since, or left by a crash is built again by the next writer,
and a reader (``ask``, ``search``, the server) builds its own copy in memory meanwhile. A reader
never writes the file; blocks committed after the index are added to a copy in memory. A file is
read only once ``text_file.py`` finds it to be an index of ours; one whose pages prove damaged as
they are read raises ``TextIndexError``: a reader searches a copy built in memory instead
(``uses/search.py``), a writer starts a new file.
"""

import os
import sqlite3
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..core.fileio import TMP_MARK
from .text_file import (
    TEXT_INDEX,
    TEXT_SEAL,
    TextIndexError,
    check_place,
    connect,
    counts,
    create,
    damage,
    read_meta,
    rows_crc,
    seal_index,
    sealed,
)

__all__ = ["TEXT_INDEX", "TEXT_SEAL", "TextIndex", "TextIndexError", "block_texts", "match_words"]

EDGE = 8  # tokens of the block before that a block's row holds
BATCH = 4096  # blocks decoded and inserted at a time


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
    ``TextIndex.open`` (or ``in_memory``); ``sync`` adds the blocks it lacks; ``search`` ranks.
    A file's pages found damaged as they are read raise ``TextIndexError``."""

    def __init__(self, db: sqlite3.Connection, digest: str, path: Path | None = None, readonly: bool = False):
        self.db, self.digest, self.path, self.readonly = db, digest, path, readonly
        self.blocks, self.crc = counts(read_meta(db))

    @classmethod
    def in_memory(cls, digest: str, source: sqlite3.Connection | None = None) -> "TextIndex":
        """A new index held in memory (``source``: a copy of that index's database)."""
        db = sqlite3.connect(":memory:", check_same_thread=False)
        if source is None:
            create(db, digest)
        else:
            source.backup(db)
        return cls(db, digest)

    @classmethod
    def open(cls, folder: str | Path, digest: str, writable: bool, check: bool = False) -> "TextIndex":
        """The index in ``folder`` made with the tokenizer of ``digest``, as its seal vouches
        for it (and, with ``check``, as ``damage`` finds it sound: a writer's repair); otherwise
        a new one: for a ``writable`` caller (the memory's writer) a temporary file that
        ``close`` puts in place, for a reader one in memory.

        Raises ``TextIndexError`` for a writer where the index cannot be put in place
        (``check_place``)."""
        folder = Path(folder)
        final = folder / TEXT_INDEX
        if writable:
            check_place(folder)
        db = sealed(folder, digest)
        if db is not None and not writable:
            return cls(db, digest, final, readonly=True)
        if db is not None:  # (a writer appends to its own sealed file: opened again to write)
            db.close()
            index = cls(connect(final, "rw"), digest, final)
            if check and damage(index.db, index.blocks) is not None:
                index._start_again()
            return index
        if not writable:
            return cls.in_memory(digest)
        db, tmp = _new_file(folder, digest)
        return cls(db, digest, tmp)

    def _start_again(self) -> None:
        """A writer's index found damaged: its file let go (left as it is until ``close`` puts
        a new one in its place), the index started again, empty, in a new temporary file."""
        self.db.close()
        self.db, self.path = _new_file(self.path.parent, self.digest)
        self.blocks, self.crc = 0, 0

    def sync(self, rows: np.ndarray, borders: set[int], decode_batch: Callable[[list[list[int]]], list[str]],
             quiet: bool = True) -> int:
        """Index the blocks of ``rows`` (int32 (n, block_size): the memory's committed token rows,
        stream 0) it does not hold yet, after emptying it where the rows it holds are not
        ``rows``' first ones; a reader's file is copied into memory first. ``decode_batch``
        turns token ids into text, leaving out special tokens; ``borders``: the special tokens'
        ids. A writer whose file proves damaged starts it again in a new file. Returns the
        blocks added."""
        try:
            return self._add(rows, borders, decode_batch, quiet)
        except sqlite3.DatabaseError as e:
            if self.readonly or self.path is None or self.path.name != TEXT_INDEX:
                raise self._damaged(e) from None
        self._start_again()
        return self._add(rows, borders, decode_batch, quiet)

    def _add(self, rows: np.ndarray, borders: set[int], decode_batch, quiet: bool) -> int:
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
        got = self._read("SELECT rowid, bm25(text) FROM text WHERE text MATCH ? AND rowid < ? "
                         "ORDER BY bm25(text) LIMIT ?", (query, n_blocks, k))
        return [(int(b), -float(s)) for b, s in got]

    def frequencies(self, words: Iterable[str], n_blocks: int) -> dict[str, int]:
        """{word: how many of the first ``n_blocks`` blocks hold it} for each of ``words``."""
        return {w: self._read("SELECT count(*) FROM text WHERE text MATCH ? AND rowid < ?",
                              (match_words([w]), n_blocks))[0][0] for w in words}

    def _read(self, sql: str, args: tuple) -> list[tuple]:
        try:
            return self.db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise self._damaged(e) from None

    def _damaged(self, e: sqlite3.DatabaseError) -> TextIndexError:
        where = self.path if self.path is not None else "(in memory)"
        return TextIndexError(f"the text index {where} is damaged ({e}): `landmark-memory index` builds it again")

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
            try:
                os.replace(self.path, final)
            except OSError:
                self.path.unlink(missing_ok=True)
                raise
        seal_index(final)

    def __enter__(self) -> "TextIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _new_file(folder: Path, digest: str) -> tuple[sqlite3.Connection, Path]:
    """A new, empty index in a temporary file of ``folder``: (its connection, its path)."""
    tmp = folder / f".{TEXT_INDEX}{TMP_MARK}{os.getpid()}"
    for p in (tmp, Path(f"{tmp}-journal")):
        p.unlink(missing_ok=True)
    db = connect(tmp, "rwc")
    try:
        create(db, digest)
    except BaseException:
        db.close()
        tmp.unlink(missing_ok=True)
        raise
    return db, tmp
