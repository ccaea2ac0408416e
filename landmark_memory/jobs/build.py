"""Building a memory from text files: each file a document, read apart, and one corpus over
all of them (``uses/corpus.py``).

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..core.tokenizer import EOS_TOKEN, encode_text
from ..format.corpus_files import (
    committed_tokens,
    document_folders,
    document_manifest,
    drop_merged_rows,
    finished,
    packs,
    unmerged_states,
)
from ..format.manifest import InputRecord, document_folder
from ..format.text_file import TextIndexError, check_place
from ..memory import LandmarkMemory
from ..training.data import list_text_files, read_text, strip_gutenberg
from ..uses.corpus import ReadDocument, merge_document, merge_read
from .reading import DocumentJob, DocumentReader, LocalReader


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
CUT_TRIES = 16  # places tried for a cut of each kind
CUT_REACH = 1 << 16  # characters past a piece's size searched for a boundary of the text's
# where a pre-tokenizer cuts before it merges anything: before whitespace that ends a word (one space, two, tabs,
# no-break spaces), and between letters and punctuation (text written without spaces: Chinese, Japanese)
_CUT = re.compile(r"(?<=\S)(?=\s)|(?<=[^\W\d_])(?=[^\w\s])|(?<=[^\w\s])(?=[^\W\d_])")


def encode(tokenizer, text: str) -> np.ndarray:
    """int32 (n,) token ids of a text as the memory holds it: Gutenberg licence stripped,
    end-of-text after. Tokenized a piece at a time (``pieces``), so that the tokenizer's own
    memory stays bounded whatever the shape of the text (a 50 MB line held 7 GB at once): the
    ids are those of the text tokenized whole wherever the tokenizer cuts it anywhere."""
    def ids(piece: str) -> list[int]:  # (a special token's text in a document is text: ``encode_text``)
        return encode_text(tokenizer, piece).ids

    def splits(left: str, right: str) -> bool:  # the tokenizer cuts there: the window's ids are its sides'
        return ids(left + right) == ids(left) + ids(right)

    def bounds(window: str) -> list[int]:  # where the tokenizer ends a token of ``window``
        return [end for _, end in encode_text(tokenizer, window).offsets]

    parts = [np.asarray(ids(piece), np.int32) for piece in pieces(strip_gutenberg(text), splits, bounds)]
    return np.concatenate(parts + [np.array([tokenizer.token_to_id(EOS_TOKEN)], np.int32)])


def pieces(text: str, splits: Callable[[str, str], bool], bounds: Callable[[str], list[int]] | None = None,
           size: int | None = None) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``size`` (``PIECE_CHARS``) characters, each cut where
    ``splits`` says the ``CUT_WINDOW`` characters each side tokenize as their two sides do, so that
    each piece tokenizes as that span of the whole does. The places tried, ``CUT_TRIES`` of each
    kind: the text's own boundaries within ``CUT_REACH`` (``_CUT``: a word's end, whatever
    whitespace follows; letters against punctuation), then the token ends the tokenizer gives a
    window there (``bounds``: text with no boundary, such as one long word). Where none passes, the
    piece ends at such a token end all the same (the ids beside that cut may differ from the whole
    text's; memory stays bounded), or, without ``bounds``, the rest stays whole."""
    size, at = size or PIECE_CHARS, 0
    while len(text) - at > size:
        cut = _cut(text, at + size, splits, bounds)
        if cut is None:
            break
        yield text[at:cut]
        at = cut
    yield text[at:]


def _cut(text: str, target: int, splits, bounds) -> int | None:
    """Where a piece reaching ``target`` of ``text`` ends (``pieces``), or None: the rest whole."""
    def tokenizes_apart(cut: int) -> bool:
        return splits(text[max(cut - CUT_WINDOW, 0):cut], text[cut:cut + CUT_WINDOW])

    own = islice((m.start() for m in _CUT.finditer(text, target, min(target + CUT_REACH, len(text)))), CUT_TRIES)
    cut = next((c for c in own if tokenizes_apart(c)), None)
    if cut is not None or bounds is None:
        return cut
    window = text[target:target + 2 * CUT_WINDOW]
    ends = [target + e for e in bounds(window) if 0 < e < len(window)]
    return next((c for c in ends[:CUT_TRIES] if tokenizes_apart(c)), ends[len(ends) // 2] if ends else target)


def encode_document(tokenizer, text: str, block_size: int) -> np.ndarray:
    """int32 (n * block_size,) a document's token ids: ``encode``'s, then end-of-text tokens up
    to the end of its last block, so that every token of it is in a block."""
    ids = encode(tokenizer, text)
    return np.concatenate([ids, np.full(-len(ids) % block_size, ids[-1], np.int32)])


IN_MEMORY_CHUNKS = 8  # a new small document of at most this many chunks is read in RAM, not in a folder
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
    try:  # (before anything is read: the index follows every commit)
        check_place(mem.dir.path)
    except TextIndexError as e:
        raise TextIndexError(f"{e} (nothing was read)") from None
    mem.text_index.follow(tokenizer)
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
            mem.commit()  # (the text index follows it, sealed)
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
    mem.text_index.catch_up(quiet=not progress)  # (up to date, unless nothing was merged now)
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
