"""Ingesting text files into a saved memory: resumable, crash-safe and interruptible.

Each input is recorded in the memory's manifest with its content hash, its token count and how
many of its tokens are in memory. Building again with the same inputs skips finished ones and
continues an unfinished one exactly where its last commit left it, so a killed or interrupted
build loses nothing and duplicates nothing.
"""

import hashlib
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .data import list_text_files, read_text, strip_gutenberg
from .memory import LandmarkMemory
from .tokenizer import EOS_TOKEN


@dataclass
class TextInput:
    path: Path
    text: str
    sha256: str


def read_inputs(paths: list[str | Path]) -> list[TextInput]:
    """Every text file named or found under ``paths``, read and checked before anything is
    written (empty, binary and non-UTF-8 files raise ``ValueError``)."""
    out = []
    for f in list_text_files(paths):
        text = read_text(f)
        out.append(TextInput(f, text, hashlib.sha256(text.encode()).hexdigest()))
    return out


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a text as the memory holds it: Gutenberg licence stripped, end-of-text after."""
    return tokenizer.encode(strip_gutenberg(text)).ids + [tokenizer.token_to_id(EOS_TOKEN)]


class _StopOnSignal:
    """Ctrl-C (SIGINT) and SIGTERM (what ``kill``, systemd and container runtimes send) set a
    flag that the build loop checks between chunks; it then commits and stops."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.signum, self._old = None, {}
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def build(mem: LandmarkMemory, inputs: list[TextInput], tokenizer, commit_every: float = 60.0,
          progress: bool = True, leave_unfinished: bool = False) -> dict:
    """Feed ``inputs`` (``TextInput``) into the writable saved memory ``mem``.

    Commits every ``commit_every`` seconds and after each input. An input left unfinished by an
    earlier build is finished first; ``leave_unfinished`` leaves it as it is instead (its tokens
    so far stay in memory), for when its file has changed since. Returns a summary dict:
    ``added`` (tokens fed now), ``skipped`` (inputs already in memory), ``left`` (the input
    left unfinished, if any), ``interrupted`` (the signal that stopped the build, or None).
    """
    done = {e.sha256: e for e in mem.inputs}
    unfinished = next((e for e in mem.inputs if not e.done), None)
    given = {i.sha256: i for i in inputs}
    summary = {"added": 0, "skipped": [], "left": None, "interrupted": None}
    if unfinished is not None and leave_unfinished:
        unfinished.abandoned, summary["left"] = True, unfinished.path
        mem.commit()
        unfinished = None
    if unfinished is not None and unfinished.sha256 not in given:
        e = unfinished
        changed = next((i for i in inputs if str(i.path.resolve()) == e.path), None)
        what = (f"{e.path} has changed since its build began ({e.ingested:,} of its {e.tokens:,} tokens are in "
                "memory): restore its old content to finish it, or build with --leave-unfinished to keep those "
                "tokens and go on (the new content is then read as a new input)" if changed else
                f"the memory holds an unfinished input, {e.path} ({e.ingested:,} of {e.tokens:,} tokens); build "
                "again with that file among the inputs to finish it first, or with --leave-unfinished to leave it")
        raise ValueError(what)
    order = [given[unfinished.sha256]] if unfinished else []
    order += [i for i in inputs if i not in order]
    last_commit = time.monotonic()
    with _StopOnSignal() as stop:
        for inp in order:
            entry = done.get(inp.sha256)
            if entry is not None and entry.done:
                summary["skipped"].append(str(inp.path))
                continue
            ids = encode(tokenizer, inp.text)
            if entry is None:
                entry = done[inp.sha256] = mem.add_input(inp.path, inp.sha256, len(ids))
            elif entry.tokens != len(ids):
                raise ValueError(f"{inp.path} now encodes to {len(ids):,} tokens, not the {entry.tokens:,} recorded "
                                 "when its build began: the tokenizer differs; rebuild the memory from scratch")
            pos = entry.ingested
            bar = tqdm(total=len(ids), initial=pos, unit="tok", unit_scale=True, desc=inp.path.name,
                       disable=not progress, dynamic_ncols=True)
            while pos < len(ids):
                n = min(mem.options.chunk_size - mem.pending_count, len(ids) - pos)
                mem.forward(torch.tensor([ids[pos:pos + n]]), logits="none")
                pos += n
                entry.ingested = pos
                summary["added"] += n
                bar.update(n)
                if stop.signum is not None or time.monotonic() - last_commit >= commit_every:
                    mem.commit()
                    last_commit = time.monotonic()
                if stop.signum is not None:
                    bar.close()
                    summary["interrupted"] = signal.Signals(stop.signum).name
                    return summary
            bar.close()
            mem.commit()
            last_commit = time.monotonic()
    return summary
