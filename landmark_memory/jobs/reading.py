"""Reading documents: a build's jobs (``DocumentJob``) and what reads them, one in a folder
of its own (committing as it goes, resumed from its last commit) or small ones in RAM, those of
one length together as the streams of one memory (``batches``, ``read_batch``); ``LocalReader``
reads them in this process, ``distributed.RayReader`` on Ray. ``build.py`` merges what they read.
"""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from ..core import heap
from ..format import MemoryFileError
from ..format.manifest import InputRecord
from ..format.options import MemoryOptions
from ..memory import LandmarkMemory
from ..uses.corpus import ReadDocument

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
            mem.inputs.append(InputRecord.of_file(job.path, job.sha256, len(job.ids), start=mem.n_tokens))
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
        entries = [InputRecord.of_file(j.path, j.sha256, len(j.ids), start=0) for j in jobs]  # (a stream each)
        for entry in entries:
            mem.inputs.append(entry)
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
    stored = mem.transfer.raw_blocks([(stream, layer, b) for layer in range(layers) for b in range(n)])
    # one tensor each, not a view per block (which would carry its whole chunk's storage to the driver)
    data = torch.stack([d for d, _ in stored])
    scales = None if stored[0][1] is None else torch.stack([s for _, s in stored])
    block_keys = [mem.keys(layer, slice(None), stream=stream)[None] for layer in range(layers)]  # (1, H_kv, n, D)
    return ReadDocument(entry, n, data, scales, block_keys, mem.tokens(stream)[None])  # ids (1, n * block_size)


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
