"""Building a memory from text files: each file a document, read apart, and one corpus over
all of them (``memory/corpus.py``).

A document is read from its own first token and sees only its own blocks while it is read,
so documents can be read in any order, by any number of workers (``distributed.py`` runs them
on Ray), and give the same blocks. Each is read into its own folder, committing every
``commit_every`` seconds: a reader killed or stopped goes on from its last commit, and a
document read to its end is never read again. The driver (``build``) merges documents into the
corpus in the inputs' order, each as soon as it and every document before it are read, so the
same inputs give the same memory bit for bit however many workers read them.
"""

import hashlib
import re
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

import numpy as np
import torch
from tqdm import tqdm

from ..core import heap
from ..core.tokenizer import EOS_TOKEN
from ..memory import LandmarkMemory, MemoryFileError
from ..memory.corpus import (ReadDocument, committed_tokens, document_folders, document_manifest,
                             drop_merged_rows, finished, merge_document, merge_read, packs, unmerged_states)
from ..memory.manifest import InputRecord, document_folder
from ..memory.options import MemoryOptions
from ..training.data import list_text_files, read_text, strip_gutenberg


@dataclass
class TextInput:
    """A text file to read: ``sha256`` names its content (``content_sha256``), ``bytes_sha256``
    its text as read, which is how builds before content hashes named a document."""

    path: Path
    text: str
    sha256: str
    bytes_sha256: str = ""


def content_sha256(text: str) -> str:
    """The SHA-256 that names a text as a document: of the text without a byte-order mark and
    with CRLF and CR line ends as LF, so that the same text saved another way is the same
    document (the document reads the text as given)."""
    normal = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return hashlib.sha256(normal.encode()).hexdigest()


def read_inputs(paths: list[str | Path]) -> list[TextInput]:
    """Every text file named or found under ``paths``, read and checked before anything is
    written (empty, binary and non-UTF-8 files, and names that are not UTF-8, raise ``ValueError``)."""
    out = []
    for f in list_text_files(paths):
        try:  # a memory records its documents by name, in UTF-8
            str(f).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{ascii(str(f))[1:-1]}: the file's name is not UTF-8, and a memory records its "
                             "documents by name; rename it (e.g. convmv -f latin1 -t utf8 --notest)") from None
        text = read_text(f)
        out.append(TextInput(f, text, content_sha256(text), hashlib.sha256(text.encode()).hexdigest()))
    return out


PIECE_CHARS = 1 << 20  # a text is tokenized a piece of about this many characters at a time
CUT_WINDOW = 256  # characters each side of a cut that must tokenize as their two sides do
CUT_TRIES = 16  # places tried for a cut: a tokenizer that cuts at none of them reads the rest whole
_CUT = re.compile(r"(?<=\S)(?= \w)")  # before a space that starts a word, after one that ends one


def encode(tokenizer, text: str) -> np.ndarray:
    """int32 (n,) token ids of a text as the memory holds it: Gutenberg licence stripped,
    end-of-text after. Tokenized a piece at a time (``pieces``), so that the tokenizer's own
    memory stays bounded whatever the shape of the text (a 50 MB line held 7 GB at once): the
    ids are those of the text tokenized whole."""
    def splits(left: str, right: str) -> bool:  # the tokenizer cuts there: the window's ids are its sides'
        return tokenizer.encode(left + right).ids == tokenizer.encode(left).ids + tokenizer.encode(right).ids

    parts = [np.asarray(tokenizer.encode(piece).ids, np.int32) for piece in pieces(strip_gutenberg(text), splits)]
    return np.concatenate(parts + [np.array([tokenizer.token_to_id(EOS_TOKEN)], np.int32)])


def pieces(text: str, splits: Callable[[str, str], bool], size: int | None = None) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``size`` (``PIECE_CHARS``) characters. Each but
    the last ends before a space that starts a word after a character that ends one (where a
    tokenizer's pre-tokenizer cuts before it merges anything) and where ``splits`` says the
    ``CUT_WINDOW`` characters each side tokenize as their two sides do: so each piece tokenizes
    as that span of the whole does. Where none of ``CUT_TRIES`` such places passes (a tokenizer
    that does not cut there), the rest stays whole."""
    size, at = size or PIECE_CHARS, 0
    while len(text) - at > size:
        cut, tries = _CUT.search(text, at + size), 1
        while cut is not None and not splits(text[max(cut.start() - CUT_WINDOW, 0):cut.start()],
                                             text[cut.start():cut.start() + CUT_WINDOW]):
            cut, tries = (_CUT.search(text, cut.start() + 1) if tries < CUT_TRIES else None), tries + 1
        if cut is None:
            break
        yield text[at:cut.start()]
        at = cut.start()
    yield text[at:]


def encode_document(tokenizer, text: str, block_size: int) -> np.ndarray:
    """int32 (n * block_size,) a document's token ids: ``encode``'s, then end-of-text tokens up
    to the end of its last block, so that every token of it is in a block."""
    ids = encode(tokenizer, text)
    return np.concatenate([ids, np.full(-len(ids) % block_size, ids[-1], np.int32)])


IN_MEMORY_CHUNKS = 8  # a new small document of at most this many chunks is read in RAM, not in a folder
BATCH_DOCUMENTS = 16  # documents read in RAM of one length are read this many at once, as a memory's streams
BATCH_WINDOW = 64  # ... among this many consecutive jobs: the corpus merges in order and holds what came early


@dataclass(frozen=True)
class DocumentJob:
    """One document to read: into ``folder`` (absolute), with the corpus's ``options``; or,
    ``in_memory``, in RAM and handed to the corpus whole (``corpus.ReadDocument``): a small new
    document read in a second or so, whose folder, commits and fsyncs would cost a build of many
    such documents a quarter of its time (88 ms against 71 ms a 2 KB document,
    results/library.md). One stopped midway keeps nothing and is read again."""

    folder: Path
    path: str
    sha256: str
    ids: np.ndarray  # int32 (n * block_size,), ``encode_document``
    options: MemoryOptions
    commit_every: float
    in_memory: bool = False


@dataclass(frozen=True)
class DocumentResult:
    folder: Path
    added: int  # tokens read now (and kept)
    done: bool  # read to its end (else stopped)
    read: ReadDocument | None = None  # a document read in RAM, to merge as it is


def read_document(job: DocumentJob, model: torch.nn.Module, stop: Callable[[], bool] = lambda: False,
                  on_tokens: Callable[[int], None] = lambda n: None) -> DocumentResult:
    """Read one document into its folder, from its last commit on: a memory of its own, its
    blocks in its own store. Commits every ``job.commit_every`` seconds and at its end; when
    ``stop()`` turns true, commits and returns unfinished. A job ``in_memory`` is read in RAM
    (``_read_in_memory``)."""
    if job.in_memory:
        return _read_in_memory((job,), model, stop, on_tokens)[0]
    if (job.folder / "manifest.json").is_file():
        mem = LandmarkMemory.open(job.folder, model)
    else:
        mem = LandmarkMemory(model, job.options, path=job.folder)
    try:
        if not mem.inputs:
            mem.add_input(Path(job.path), job.sha256, len(job.ids))
        entry = mem.inputs[0]
        if entry.sha256 != job.sha256 or entry.tokens != len(job.ids):
            raise MemoryFileError(f"{job.folder} holds another document than {job.path} (or the tokenizer changed); "
                                  "remove that folder and build again")
        added, last_commit = 0, time.monotonic()
        for n in read_steps(mem, job.ids[None], entry.ingested):
            entry.ingested, added = entry.ingested + n, added + n
            on_tokens(n)
            if stop() or time.monotonic() - last_commit >= job.commit_every:
                mem.commit()
                last_commit = time.monotonic()
            if stop():
                return DocumentResult(job.folder, added, False)
        if mem.pending_count or added:
            mem.end_document()
            mem.commit()
        return DocumentResult(job.folder, added, True)
    finally:
        mem.close(commit=False)  # everything fed was committed above


def _read_in_memory(jobs: tuple[DocumentJob, ...], model: torch.nn.Module, stop: Callable[[], bool],
                    on_tokens: Callable[[int], None]) -> list[DocumentResult]:
    """Read small documents of one length whole, as the streams of one memory in RAM, their
    blocks stored as the corpus stores them; returns them (``DocumentResult.read``), or
    nothing when ``stop()`` turns true."""
    with LandmarkMemory(model, replace(jobs[0].options, store="memory")) as mem:
        entries = [mem.add_input(Path(j.path), j.sha256, len(j.ids)) for j in jobs]
        for n in read_steps(mem, np.stack([j.ids for j in jobs])):
            on_tokens(n * len(jobs))
            if stop():
                return [DocumentResult(j.folder, 0, False) for j in jobs]
        mem.end_document()
        return [DocumentResult(j.folder, len(j.ids), True, _held(mem, s, e))
                for s, (j, e) in enumerate(zip(jobs, entries))]


def _held(mem: LandmarkMemory, stream: int, entry: InputRecord) -> ReadDocument:
    """What the corpus merges of ``stream``, a document read in RAM (``entry`` its record)."""
    layers, n = mem.shape.n_layer, mem.n_blocks
    stored = mem.stored([(stream, layer, b) for layer in range(layers) for b in range(n)], raw=True)
    # one tensor each, not a view per block (which would carry its whole chunk's storage to the driver)
    data = torch.stack([d for d, _ in stored])
    scales = None if stored[0][1] is None else torch.stack([s for _, s in stored])
    landmarks = [mem.keys(layer, slice(None), stream=stream)[None] for layer in range(layers)]  # (1, H_kv, n, D)
    return ReadDocument(entry, n, data, scales, landmarks, mem.tokens(stream)[None])  # ids (1, n * block_size)


def batches(jobs: list[DocumentJob]) -> Iterator[tuple[DocumentJob, ...]]:
    """``jobs`` as a reader reads them: a job in a folder alone, jobs in RAM of one length up to
    ``BATCH_DOCUMENTS`` at once (``read_batch``), each batch of ``BATCH_WINDOW`` consecutive jobs
    where its first job was."""
    for a in range(0, len(jobs), BATCH_WINDOW):
        open_: dict[int, list[DocumentJob]] = {}  # length -> its batch; dicts keep the order they were made in
        out: list[list[DocumentJob]] = []
        for job in jobs[a:a + BATCH_WINDOW]:
            batch = open_.get(len(job.ids)) if job.in_memory else None
            if batch is None or len(batch) == BATCH_DOCUMENTS:
                batch = [job]
                out.append(batch)
                if job.in_memory:
                    open_[len(job.ids)] = batch
            else:
                batch.append(job)
        yield from map(tuple, out)


def read_batch(batch: tuple[DocumentJob, ...], model: torch.nn.Module, stop: Callable[[], bool] = lambda: False,
               on_tokens: Callable[[int], None] = lambda n: None) -> list[DocumentResult]:
    """``read_document`` of each job of a batch (``batches``): one alone, or several in RAM as the
    streams of one memory, each stream what its document reads alone."""
    if len(batch) == 1:
        return [read_document(batch[0], model, stop, on_tokens)]
    return _read_in_memory(batch, model, stop, on_tokens)


def read_steps(mem: LandmarkMemory, ids: np.ndarray, pos: int = 0) -> Iterator[int]:
    """Feed ``mem`` the token ids ``ids`` int32 (streams, n) from ``pos`` on, each step what its
    open chunk takes (a commit between steps leaves it where the next read goes on); yields
    each step's tokens. The C heap's free pages go back every ``TRIM_TOKENS`` tokens
    (``core.heap``): a long document's reading holds the same memory from start to end."""
    since_trim = 0
    while pos < ids.shape[1]:
        n = min(mem.options.chunk_size - mem.pending_count, ids.shape[1] - pos)
        mem.forward(torch.from_numpy(ids[:, pos:pos + n]).long(), logits="none")
        pos, since_trim = pos + n, since_trim + n
        if since_trim >= heap.TRIM_TOKENS:
            heap.trim()
            since_trim = 0
        yield n


class DocumentReader(Protocol):
    """Where documents are read: ``LocalReader`` (this process) or ``distributed.RayReader``."""

    def run(self, jobs: list[DocumentJob], stop: Callable[[], bool], bar: tqdm) -> Iterator[DocumentResult]:
        """Read ``jobs``, yielding each result as it comes (any order); after ``stop()`` turns
        true, the documents under way commit and stop, and no more start."""


class LocalReader:
    """Documents read one after another in this process."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def run(self, jobs, stop, bar):
        for batch in batches(jobs):
            if stop():
                return
            yield from read_batch(batch, self.model, stop, bar.update)


class _StopOnSignal:
    """Ctrl-C (SIGINT) and SIGTERM (what ``kill``, systemd and container runtimes send) set a
    flag that the build checks between chunks; it then commits and stops."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.signum, self._old = None, {}
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __call__(self) -> bool:
        return self.signum is not None

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


@dataclass
class BuildSummary:
    """What a build did: ``added`` tokens read now in ``seconds`` (reading and merging, after
    the model and the workers are up), documents ``merged`` into the corpus now, inputs
    ``skipped`` (already in it), documents ``left`` unfinished, and the signal that
    ``interrupted`` it (or None)."""

    added: int = 0
    seconds: float = 0.0
    merged: int = 0
    skipped: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)  # documents an earlier build left damaged: why, what to do
    interrupted: str | None = None


def build(mem: LandmarkMemory, inputs: list[TextInput], tokenizer, reader: DocumentReader | None = None,
          commit_every: float = 60.0, progress: bool = True, leave_unfinished: bool = False,
          in_memory_chunks: int = IN_MEMORY_CHUNKS) -> BuildSummary:
    """Read ``inputs`` as documents into the corpus ``mem`` (writable, ``documents=True``) and
    merge them, in the inputs' order, as they are read; ``reader`` reads them (default: in this
    process). The corpus commits at most every ``commit_every`` seconds and at the end.

    A document an earlier build left unfinished is finished when its file is among the
    inputs; when it is not (its file changed or was dropped), ``leave_unfinished`` merges what
    was read of it, and otherwise the build stops before reading anything and says what to do.

    A new document of at most ``in_memory_chunks`` chunks, small enough to be packed, is read in
    RAM (``DocumentJob.in_memory``) unless ``commit_every`` is 0 (every chunk to be committed).
    """
    if not mem.documents:
        raise ValueError(f"{mem.dir.path} reads its inputs in one context (a memory built before corpora); build "
                         "now reads each file as its own document: build these files into a new memory (this one "
                         "still opens for ask and generate)")
    summary, bs = BuildSummary(), mem.shape.block_size
    names = {s for inp in inputs for s in (inp.sha256, inp.bytes_sha256) if s}  # (the list's pages of these alone)
    merged = {e.sha256 for e in mem.inputs.by_folder(document_folder(s) for s in names).values()}
    given: dict[str, TextInput] = {}
    for inp in inputs:
        old = inp.bytes_sha256
        if old and old != inp.sha256 and (old in merged or (mem.dir.path / document_folder(old)).is_dir()):
            inp = replace(inp, sha256=old)  # a document an earlier version named by its bytes: keep its name
        if inp.sha256 in merged or inp.sha256 in given:
            summary.skipped.append(str(inp.path))
        else:
            given[inp.sha256] = inp
    root = mem.dir.path.resolve()  # workers elsewhere (Ray) find documents by absolute paths
    queue = _unmerged_documents(mem, given, leave_unfinished, summary)  # folders still to merge, read ones first
    jobs, ready, read_before = [], set(), 0
    block_bytes = mem.shape.block_bytes(mem.options.store_dtype)
    for folder in queue:  # read to their end, or left as they are
        m = document_manifest(mem.dir, folder)
        ready.add(folder)
        if not finished(m):
            summary.left.append(m.inputs[0].path)
    for sha, inp in given.items():
        folder = document_folder(sha)
        queue.append(folder)
        m = document_manifest(mem.dir, folder)
        if m is not None and finished(m):  # read by an earlier build: never read again
            ready.add(folder)
        else:
            read_before += committed_tokens(m)
            ids = encode_document(tokenizer, inp.text, bs)
            small = len(ids) <= in_memory_chunks * mem.options.chunk_size and \
                packs(len(ids) // bs, block_bytes)  # (merged packed, as its folder's would be)
            jobs.append(DocumentJob(root / folder, str(inp.path.resolve()), sha, ids, mem.options, commit_every,
                                    in_memory=m is None and commit_every > 0 and small))
    started = last_commit = time.monotonic()
    for folder, e in mem.inputs.by_folder(document_folders(mem.dir)).items():  # copies an earlier build left
        drop_merged_rows(mem.dir, folder, e.packed)
    uncommitted: list[InputRecord] = []  # merged since the last commit: their own copies go once it is made
    held: dict[str, ReadDocument] = {}  # documents read in RAM, waiting for those before them

    def merge_ready(force=False):
        nonlocal last_commit
        while queue and queue[0] in ready:
            folder = queue.pop(0)
            read = held.pop(folder, None)
            uncommitted.append(merge_document(mem, folder) if read is None else merge_read(mem, folder, read))
            summary.merged += 1
        if uncommitted and (force or time.monotonic() - last_commit >= commit_every):
            mem.commit()
            last_commit = time.monotonic()
            while uncommitted:
                e = uncommitted.pop(0)
                drop_merged_rows(mem.dir, e.document, e.packed)

    with _StopOnSignal() as stop, tqdm(total=sum(len(j.ids) for j in jobs), initial=read_before,
                                       unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
                                       desc=f"{len(jobs)} documents") as bar:
        merge_ready()
        for result in (reader or LocalReader(mem.model)).run(jobs, stop, bar):
            summary.added += result.added
            if result.done:
                folder = str(result.folder.relative_to(root))
                ready.add(folder)
                if result.read is not None:
                    held[folder] = result.read
                merge_ready()
        merge_ready(force=True)
        if stop():
            summary.interrupted = signal.Signals(stop.signum).name
    summary.seconds = time.monotonic() - started
    return summary


def _unmerged_documents(mem: LandmarkMemory, given: dict[str, TextInput], leave_unfinished: bool,
                        summary: BuildSummary) -> list[str]:
    """Folders under ``docs/`` of documents not merged yet whose files are not among the inputs
    (by content): read ones are merged first; an unfinished one stops the build unless
    ``leave_unfinished``; a damaged one is set aside (``summary.set_aside``: a failed build
    never blocks the next)."""
    out = []
    for s in unmerged_states(mem.dir, mem.inputs):
        if s.sha256 in given:
            continue
        if s.status == "damaged":
            summary.set_aside.append(f"{s.problem}; or remove {mem.dir.path / s.folder} to drop that document")
            continue
        if s.status == "partial" and not leave_unfinished:
            changed = any(str(i.path.resolve()) == s.path for i in given.values())
            raise ValueError(
                f"{s.path} has changed since its build began ({s.read:,} of its {s.tokens:,} tokens are read): "
                "restore its old content to finish it, or build with --leave-unfinished to keep those tokens and "
                "go on (the new content is then read as a new document)" if changed else
                f"the memory holds an unfinished document, {s.path} ({s.read:,} of {s.tokens:,} tokens); build "
                "again with that file among the inputs to finish it first, or with --leave-unfinished to leave it")
        out.append(s.folder)
    return out
