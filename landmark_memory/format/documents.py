"""What a memory holds of its text files: one ``InputRecord`` each, in a ``DocumentList``.

A memory read in one context lists its few inputs in its manifest. A corpus may hold 100,000
documents, so from format 7 its list is paged (docs/design/format.md, "On-disk format"): the records
lie in ``documents/<page>.jsonl``, ``PAGE_DOCUMENTS`` JSON lines a page, appended like a row
file, and the manifest holds one ``PageRecord`` per page (its records, committed bytes, CRC-32
and first token) and the ``Shard`` of each document that keeps its own store. Opening reads
neither pages nor records; a page is read, checked and parsed when a record of it is first
asked for (a passage names its document), and a damaged page is named without costing any
other. Beside the pages, ``documents/digests.bin`` holds each committed record's document
folder as 8 bytes (``folder_digest``), its CRC-32 in the manifest, so that a build finds which
of its inputs the corpus holds by reading that file and the pages of its hits, not every page.
``DocumentList`` is the one sequence of records, paged or not, committed or not.
"""

import bisect
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..storage.sharded import Shard
from .errors import MemoryFileError

PAGE_DOCUMENTS = 1024  # records per page of a corpus's document list
PAGES = "documents"
DIGESTS = f"{PAGES}/digests.bin"  # uint64 little-endian, one per committed record: ``folder_digest``


def folder_digest(folder: str) -> int:
    """A document folder (``docs/`` and 16 hex digits, ``manifest.document_folder``) as a number."""
    return int(folder[-16:], 16)


def page_file(i: int) -> str:
    """The file of page ``i`` of a corpus's document list, relative to the memory."""
    return f"{PAGES}/{i:06d}.jsonl"


@dataclass
class InputRecord:
    """A text file ingested by ``build``: where its tokens start in the memory and how many of
    them are in it (``ingested`` advances as the build goes). In a corpus (``Manifest.documents``)
    each is a document read apart in its own ``document`` folder, and ``ingested`` counts the
    tokens of its blocks in the corpus."""

    path: str
    name: str
    sha256: str
    tokens: int
    ingested: int
    start: int
    abandoned: bool = False  # left unfinished on purpose (its file changed mid-build)
    document: str | None = None  # a corpus's document folder (``document_folder``); None: read in this context
    packed: bool = False  # a corpus's document whose blocks are in the corpus's own store (its folder removed)

    @classmethod
    def of_file(cls, path: str | Path, sha256: str, tokens: int, start: int) -> "InputRecord":
        """The record of the text file ``path`` whose ``tokens`` tokens are fed from the memory's
        token ``start`` on, none yet (``ingested`` is the caller's to advance)."""
        return cls(path=str(Path(path).resolve()), name=Path(path).name, sha256=sha256, tokens=tokens, ingested=0,
                   start=start)

    @property
    def done(self) -> bool:
        """Nothing more of it will be read: all of it is in memory, or it was abandoned."""
        return self.ingested == self.tokens or self.abandoned


@dataclass(frozen=True)
class PageRecord:
    """A page of a corpus's document list as the manifest commits it: its ``count`` records in
    its first ``bytes`` bytes, their ``crc32``, and ``start``, the first token of its first."""

    count: int
    bytes: int
    crc32: int
    start: int


class DocumentList:
    """The records of a memory's inputs: committed pages (``pages``, read from the folder that
    ``attach`` gives when first needed) then ``tail``, the records not in pages (a list kept in
    the manifest, or those appended since the last commit). ``paged``: a commit writes the
    tail into pages (a corpus from format 7). ``shards``: the documents that keep their own
    store, in blocks. ``digests_crc``: the CRC-32 of the committed records' digests (None: a
    list written before them, whose next commit writes them). ``check(record, where)`` checks
    a record read from a page as the manifest checks its inputs."""

    def __init__(self, tail: list[InputRecord] = (), *, paged: bool = False, pages: list[PageRecord] = (),
                 shards: list[Shard] = (), digests_crc: int | None = None):
        self.paged, self.pages, self.tail, self.shards = paged, list(pages), list(tail), list(shards)
        self.digests_crc = digests_crc
        self._ends = _running(p.count for p in self.pages)  # records up to the end of each page
        self._read: dict[int, list[InputRecord]] = {}
        self._digests: np.ndarray | None = None  # uint64 (committed records,) once read and found sound
        self.dir, self.check = None, lambda record, where: None

    @classmethod
    def of_manifest(cls, doc: dict, block_size: int) -> "DocumentList":
        """A manifest's (JSON ``doc``) document list: paged (a corpus from format 7), or its inputs
        listed in it (a corpus of format 4 to 6 is paged at its next commit, each document a shard)."""
        if "pages" in doc:
            return cls(paged=True, pages=[PageRecord(*p) for p in doc["pages"]],
                       shards=[Shard(*s) for s in doc["shards"]], digests_crc=doc.get("digests_crc32"))
        records, corpus = [InputRecord(**e) for e in doc["inputs"]], bool(doc.get("documents", False))
        bs = block_size if type(block_size) is int and block_size > 0 else 1  # (a wrong one is refused after)
        return cls(records, paged=corpus, shards=[Shard(e.start // bs, e.ingested // bs, e.document)
                                                  for e in records if corpus and not e.packed
                                                  and type(e.start) is int and type(e.ingested) is int])

    def attach(self, d, check) -> None:
        """Read pages from the memory folder ``d`` (a ``MemoryDir``), each record ``check``ed."""
        self.dir, self.check = d, check

    # ---- a sequence ---------------------------------------------------------------------
    def __len__(self) -> int:
        return (self._ends[-1] if self._ends else 0) + len(self.tail)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("document index out of range")
        i %= n
        paged = self._ends[-1] if self._ends else 0
        if i >= paged:
            return self.tail[i - paged]
        p = bisect.bisect_right(self._ends, i)
        return self.page(p)[i - (self._ends[p - 1] if p else 0)]

    def __iter__(self) -> Iterator[InputRecord]:
        for p in range(len(self.pages)):
            yield from self.page(p)
        yield from self.tail

    def __eq__(self, other) -> bool:  # as a manifest records it (pages by their records in the manifest)
        return isinstance(other, DocumentList) and (self.paged, self.pages, self.tail, self.shards,
                                                    self.digests_crc) == (
            other.paged, other.pages, other.tail, other.shards, other.digests_crc)

    def append(self, record: InputRecord, shard: Shard | None = None) -> None:
        """Add ``record`` (with its ``shard``: a document that keeps its own store)."""
        self.tail.append(record)
        if shard is not None:
            self.shards.append(shard)

    def containing(self, token: int) -> InputRecord | None:
        """The record whose tokens hold the memory's token ``token`` (inputs lie in the order
        their tokens start), or None; reads one page at most."""
        p = bisect.bisect_right([q.start for q in self.pages], token) - 1
        tail_start = self.tail[0].start if self.tail else None
        records = self.tail if tail_start is not None and token >= tail_start or p < 0 else self.page(p)
        i = bisect.bisect_right(records, token, key=lambda e: e.start) - 1
        e = records[i] if i >= 0 else None
        return e if e is not None and token < e.start + e.ingested else None

    def full_pages(self, n: int) -> list[PageRecord]:
        """The full pages the first ``n`` records fill (a full page is never written again)."""
        return [p for p, end in zip(self.pages, self._ends) if p.count == PAGE_DOCUMENTS and end <= n]

    def by_folder(self, folders: Iterable[str]) -> dict[str, InputRecord]:
        """``{folder: record}``: the records of those document ``folders`` the list holds. The
        committed ones are found by their digests, reading only the pages that hold them; a
        list without sound digests (written before them, or damaged) reads every page."""
        wanted = set(folders)
        found = {e.document: e for e in self.tail if e.document in wanted}
        if self.pages and wanted:
            digests = self.digests()
            if digests is None:
                records = (e for p in range(len(self.pages)) for e in self.page(p))
            else:
                keys = np.array([folder_digest(f) for f in wanted], np.uint64)
                records = (self[int(i)] for i in np.flatnonzero(np.isin(digests, keys)))
            found |= {e.document: e for e in records if e.document in wanted}
        return found

    def digests(self) -> np.ndarray | None:
        """uint64 (committed records,): each committed record's ``folder_digest``, read and
        checked when first asked for; None where none are kept or they are not sound (the
        pages are what a record is: ``problems`` names the file, the next commit writes it anew)."""
        if self._digests is None and self.digests_crc is not None and self.dir is not None:
            n = self._ends[-1] if self._ends else 0
            try:
                data = self.dir.read_rows(DIGESTS, 8 * n)
            except MemoryFileError:
                return None
            if zlib.crc32(data) == self.digests_crc:
                self._digests = np.frombuffer(data, "<u8")
        return self._digests

    def extends(self, other: "DocumentList") -> bool:
        """Whether this list is ``other`` with records appended (pages compared, not read)."""
        if len(self) < len(other) or self.pages[:max(len(other.pages) - 1, 0)] != other.pages[:-1]:
            return False
        if other.pages:
            mine, theirs = self.pages[len(other.pages) - 1], other.pages[-1]
            if mine.start != theirs.start or mine.count < theirs.count or mine.bytes < theirs.bytes:
                return False
        return self.tail[:len(other.tail)] == other.tail

    # ---- pages --------------------------------------------------------------------------
    def page(self, p: int) -> list[InputRecord]:
        """The records of page ``p``, read and checked when first asked for."""
        if p not in self._read:
            where, data = self._page_bytes(p, self.dir)
            try:
                records = [InputRecord(**json.loads(line)) for line in data.split(b"\n")[:-1]]
            except (ValueError, TypeError) as e:
                why = str(e) if str(e).isprintable() else repr(str(e))  # (a key may hold a line break)
                raise MemoryFileError(f"{where} garbles a record ({why}); restore that file from a backup") from None
            for e in records:
                self.check(e, where)
            self._read[p] = records
        return self._read[p]

    def _page_bytes(self, p: int, d) -> tuple[str, bytes]:
        """``(where, bytes)``: page ``p``'s committed bytes read afresh from the memory folder
        ``d`` and checked against its CRC-32 and count of records in the manifest (``where``
        names it in messages)."""
        r, first = self.pages[p], self._ends[p] - self.pages[p].count
        where = f"{d.path / page_file(p) if d else page_file(p)} (documents {first:,} to {first + r.count - 1:,})"
        if d is None:
            raise MemoryFileError(f"{where} cannot be read: the list is not attached to its memory")
        _own_folder(d)
        data = d.read_rows(page_file(p), r.bytes)  # (a missing or short file is named)
        if zlib.crc32(data) != r.crc32 or data.count(b"\n") != r.count:  # (JSON escapes a new line in a string)
            raise MemoryFileError(f"{where} does not match the manifest (its CRC-32 or records differ); the "
                                  "other documents and every block are sound: restore that file from a backup")
        return where, data

    def check_appendable(self, d) -> None:
        """Check, read afresh from the memory folder ``d``, the page a commit appends to (the
        last, if not full) against the manifest, as a writer checks its key files before it
        writes: ``MemoryFileError`` names it otherwise. (``digests.bin`` is checked as it is
        read; unsound, it is written anew from the pages.)"""
        if self.paged and self.pages and self.pages[-1].count < PAGE_DOCUMENTS:
            self._page_bytes(len(self.pages) - 1, d)

    def write(self, d) -> None:
        """Append the tail to the pages in the memory folder ``d`` (each page's file written
        after its committed bytes, fsynced), the page it appends to and the digests checked
        afresh first: what a commit does before its manifest. A list that is not paged is
        written in the manifest."""
        if not (self.paged and self.tail):
            return
        self.check_appendable(d)
        self._digests = None  # (read and checked again: what changed since is not appended to)
        _own_folder(d).mkdir(exist_ok=True)
        self._write_digests(d, self.tail)
        while self.tail:
            last = self.pages[-1] if self.pages else None
            if last is None or last.count == PAGE_DOCUMENTS:
                p, last = len(self.pages), PageRecord(0, 0, 0, self.tail[0].start)
                self.pages.append(last)
                self._read[p] = []
            p = len(self.pages) - 1
            take, self.tail = self.tail[:PAGE_DOCUMENTS - last.count], self.tail[PAGE_DOCUMENTS - last.count:]
            data = b"".join(json.dumps(asdict(e), ensure_ascii=False).encode() + b"\n" for e in take)
            d.write_rows(page_file(p), last.bytes, data)
            self.pages[p] = PageRecord(last.count + len(take), last.bytes + len(data), zlib.crc32(data, last.crc32),
                                       last.start)
            if p in self._read:
                self._read[p] = self._read[p] + take
            self._ends = _running(q.count for q in self.pages)

    def _write_digests(self, d, new: list[InputRecord]) -> None:
        """Append the digests of the ``new`` records after the committed ones in ``d``'s file;
        where those are not sound (or none were kept), write them all anew from the pages."""
        n, committed = (self._ends[-1] if self._ends else 0), self.digests()
        if committed is None:  # (once: a list from before digests, or a damaged file)
            committed = np.array([folder_digest(e.document) for p in range(len(self.pages)) for e in self.page(p)],
                                 "<u8")
            d.write_rows(DIGESTS, 0, committed.tobytes())
            self.digests_crc = zlib.crc32(committed.tobytes())
        data = np.array([folder_digest(e.document) for e in new], "<u8")
        d.write_rows(DIGESTS, 8 * n, data.tobytes())
        self.digests_crc = zlib.crc32(data.tobytes(), self.digests_crc)
        self._digests = np.concatenate([committed, data])

    def problems(self) -> list[str]:
        """Every page read and checked (``verify``): one line per page that is not sound."""
        out = []
        for p in range(len(self.pages)):
            try:
                self.page(p)
            except MemoryFileError as e:
                out.append(str(e))
        if self.pages and not out:
            listed = np.array([folder_digest(e.document) for e in self if e.document], "<u8")
            digests = self.digests()
            if self.digests_crc is not None and (digests is None or not np.array_equal(digests, listed[:len(digests)])):
                out.append(f"{self.dir.path / DIGESTS} does not match the manifest or the pages (its CRC-32 or digests "
                           "differ); every document and block is sound, and the next build writes it anew")
        return out


def _own_folder(d):
    """The folder of the pages of the memory in ``d``, refused when it is a symbolic link."""
    folder = d.path / PAGES
    if os.path.islink(folder):
        raise MemoryFileError(f"{folder} is a symbolic link: a memory reads and writes only its own files; remove the "
                              "link (or restore the memory from a backup)")
    return folder


def _running(counts) -> list[int]:
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return out
