"""What the paper-claim experiments share: the two models, the held-out books, perplexity over
several books, and the results files (markdown with the exact command, machine and date)."""

import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from landmark_memory.app.cli_args import positive
from landmark_memory.core.fileio import atomic_write
from landmark_memory.core.tokenizer import load_tokenizer
from landmark_memory.format import MemoryOptions
from landmark_memory.jobs.build import encode
from landmark_memory.jobs.evaluate import perplexity
from landmark_memory.memory import RetrievalStats
from landmark_memory.models.model import LandmarkGPT
from landmark_memory.training.data import list_text_files, read_text, split_books, strip_gutenberg

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
# relative to the repository root
LANDMARK_MODEL, FULL_MODEL, INFINI_MODEL = "out/exp-landmark", "out/exp-full", "out/exp-infini"
# the paper's extensions (appendices D and E): a landmark model, the same with a Context Miss
# Token, the same with positional jumps (run_experiments.py: TRAIN_EXT)
BASE_MODEL, CMT_MODEL, JUMP_MODEL = "out/exp9-base", "out/exp9-cmt", "out/exp9-jump"


# facts planted in book text, each with its question and the words a right answer holds
# (exp_diagnose.py, exp_ruler.py)
PLANTED_FACTS = [
    ("The innkeeper's daughter was called Rosalie Fontaine.", "What was the innkeeper's daughter called?",
     ["Rosalie"]),
    ("The old clock in the church tower had stopped at a quarter past four.",
     "At what time had the church tower clock stopped?", ["quarter past four"]),
    ("Every Sunday the miller sold eleven sacks of flour to the baker.",
     "How many sacks of flour did the miller sell to the baker every Sunday?", ["eleven"]),
    ("The notary kept his savings in a blue tin box under the stairs.", "Where did the notary keep his savings?",
     ["tin box"]),
    ("The captain's parrot was named Admiral Biscuit.", "What was the captain's parrot named?", ["Biscuit"]),
    ("The lighthouse keeper painted his door bright orange every spring.",
     "What colour did the lighthouse keeper paint his door?", ["orange"])]


def sentence_end(tok, ids, at):
    """The first position at or after ``at`` that follows a token ending in a full stop (or
    ``len(ids)``): where a planted sentence goes."""
    while at < len(ids) and not tok.decode(ids[at - 1:at]).endswith("."):
        at += 1
    return at


def parser(doc):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus the models were trained on (held-out books "
                                                   "are chosen from it exactly as training chose them)")
    ap.add_argument("--landmark-model", default=LANDMARK_MODEL, help=f"landmark model (default {LANDMARK_MODEL})")
    ap.add_argument("--full-model", default=FULL_MODEL, help=f"full-attention baseline (default {FULL_MODEL})")
    ap.add_argument("--infini-model", default=INFINI_MODEL,
                    help=f"Infini-attention model, left out where missing (default {INFINI_MODEL}; '' to leave out)")
    ap.add_argument("--results", default=str(RESULTS), help="where the markdown and PNG go (default "
                                                            "experiments/results)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def parse(ap, argv=None):
    args = ap.parse_args(argv)
    Path(args.results).mkdir(parents=True, exist_ok=True)
    return args


def load(path):
    path = ROOT / path  # an absolute path stays as it is
    if not (path / "config.json").is_file():
        sys.exit(f"no model at {path}: train it first (python experiments/run_experiments.py --books ... trains "
                 "what is missing)")
    return LandmarkGPT.from_pretrained(path).eval()


def load_optional(path):
    """The model at ``path``, or None where there is none (a row the run leaves out)."""
    return load(path) if path and (ROOT / path / "config.json").is_file() else None


def held_out_books(books):
    """[(name, token ids)] of the validation books training held out of ``books`` (whole books)."""
    tok = load_tokenizer()
    _, val = split_books(list_text_files([books]))
    return [(f.stem, encode(tok, read_text(f))) for f in val]


def books_perplexity(model, books, eval_length, n_tokens, progress=True, **kw):
    """Perplexity over the first ``n_tokens`` predicted tokens, shared out evenly over the
    books, each read in segments of ``eval_length`` (``kw``: ``evaluate.perplexity`` options)."""
    return books_eval(model, books, eval_length, n_tokens, progress, **kw)[:2]


def books_eval(model, books, eval_length, n_tokens, progress=True, **kw):
    """``books_perplexity`` plus the memories' retrieval counts summed over the books."""
    per_book = max(1, math.ceil(n_tokens / len(books) / eval_length))
    loss = count = 0.0
    stats = RetrievalStats()
    for name, ids in books:
        r = perplexity(model, ids, eval_length, max_segments=per_book, progress=progress,
                       desc=f"{name[:18]} @{eval_length}", **kw)
        loss += r["loss"] * r["tokens"]
        count += r["tokens"]
        stats += r["retrieval_stats"]
    return math.exp(loss / count), int(count), stats


def book_tokens(tok, n, data):
    """(1, n) token ids of the books in ``data`` (a file or folder), read in order; a short
    text repeats."""
    ids = []
    for f in list_text_files(data):
        ids += tok.encode(strip_gutenberg(read_text(f))).ids
        if len(ids) >= n:
            break
    while len(ids) < n:
        ids += ids
    return torch.tensor(ids[:n])[None]


class Trials:
    """Trials kept in a JSON file: each cell a list of rows, and every command that added rows.
    It is written as soon as a row is added: a stopped run goes on where it stopped, a later run
    with more trials extends it, runs at the same time (other lengths, other models) add to it
    side by side, and a report names every command its table came from.
    ``command``: this run's (``command_line``), recorded with its first row."""

    def __init__(self, path, command=None):
        self.path, self.command = Path(path), command
        self._load()

    def _load(self):
        state = json.loads(self.path.read_text()) if self.path.exists() else {}
        if state and "cells" not in state:  # adding to it would overwrite its trials
            raise SystemExit(f"{self.path}: trials without the commands that ran them (written before they were "
                             'recorded); make it {"commands": [], "cells": <what it holds>} to go on with it')
        self.commands, self.cells = state.get("commands", []), state.get("cells", {})

    def cell(self, key):
        """The rows of ``key`` so far (a cell not run yet has none, and is not created)."""
        return self.cells.get(key, [])

    def fill(self, key, n, trial):
        """Run ``trial(i)`` (a row) for each trial ``i`` that cell ``key`` still lacks of ``n``,
        adding each row as soon as it is done; yields ``(i, row)`` for each row added."""
        while len(self.cell(key)) < n:
            i = len(self.cell(key))
            row = trial(i)
            if self.add(key, row, at=i):
                yield i, row

    def add(self, key, row, at, replace=False):
        """Add ``row`` as trial ``at`` of cell ``key`` (``at``: the rows the cell held when this
        run drew the trial) and write the file. The file is read again first, under a lock, so
        that rows other runs added since are kept; a trial another run added first is not added
        twice. With ``replace``, the row takes the place of trial ``at`` (one recorded before a
        field of it was). Returns whether the row was added."""
        fd = os.open(self.path.parent, os.O_RDONLY)  # the folder's lock: the file itself is replaced
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._load()
            cell = self.cells.setdefault(key, [])
            if (len(cell) <= at) if replace else (len(cell) != at):
                return False
            if replace:
                cell[at] = row
            else:
                cell.append(row)
            if self.command and self.command not in self.commands:
                self.commands.append(self.command)
            atomic_write(self.path, json.dumps({"commands": self.commands, "cells": self.cells}, indent=1).encode())
            return True
        finally:
            os.close(fd)  # releases the lock


ADAPTER = "shipped=landmark_memory/assets/smollm2-landmark"
# the suites' baseline: SmolLM2 without an adapter, reading a whole prompt in its own context,
# which ends at its 8,192 positions (max_position_embeddings)
BASE, BASE_WINDOW = "base in context", 8192


def adapter_specs(text):
    """[(name, folder)] of ``--adapters`` "name=folder,..." (LoRA landmark adapters; none for "")."""
    if not text:
        return []
    specs = [s.partition("=") for s in text.split(",")]
    if any(not name or not folder for name, _, folder in specs):
        raise SystemExit(f"--adapters: give name=folder for each, got {text!r}")
    return [(name, Path(folder)) for name, _, folder in specs]


def some_of(choices):
    """An argparse type: a comma-separated list of some of ``choices`` (whole names, in the
    order given), so a misspelt one fails at parsing, before any model loads."""

    def parse(text):
        got = text.split(",")
        if not text or set(got) - set(choices):
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}, got {text!r}")
        return got

    return parse


def top_k_option(ap, reads):
    """``--top-k``: memory blocks retrieved per query by the suite's ``reads``."""
    ap.add_argument("--top-k", type=positive, help=f"memory blocks retrieved per query by {reads} (default: the "
                                                   "memory's, 4); its trials are filed apart")


def top_k_memory(top_k):
    """A memory's options for ``--top-k`` (none given: the defaults)."""
    return MemoryOptions() if top_k is None else MemoryOptions(top_k=top_k)


def top_k_label(name, top_k):
    """Adapter ``name`` as its trials at ``--top-k`` are filed, apart from those at the defaults."""
    return name if top_k is None else f"{name} (top-k {top_k})"


def load_smollm2(adapter=None):
    """A ``LoadedModel``: SmolLM2 with the LoRA landmark adapter in the folder ``adapter`` (its
    ``AskPolicy`` and question reader; no retrieval heads, which an experiment sets where it
    measures them), or the base model (None), in eval mode, its tokenizer a ``hf.TextTokenizer``."""
    from landmark_memory.models.hf.lora import adapter_asking
    from landmark_memory.models.hf.smollm2 import load_base, load_landmark
    from landmark_memory.models.hf.tokenizer import TextTokenizer
    from landmark_memory.models.loaded import LoadedModel

    model, hf_tok = load_base() if adapter is None else load_landmark(adapter)
    if adapter is None:
        return LoadedModel(model.eval(), TextTokenizer(hf_tok))
    policy, reader = adapter_asking(model, adapter)
    return LoadedModel(model.eval(), TextTokenizer(hf_tok), reader=reader, policy=policy)


def suite_main(doc, name, lengths, run, report, argv=None, extra=None):
    """The command line of a resumable trial suite (``Trials``): runs ``run(args)`` unless
    ``--report``, then ``report(args)``. ``extra(ap)`` adds the suite's own options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", help="the book corpus (held-out books chosen as training chose them)")
    ap.add_argument("--lengths", default=lengths)
    ap.add_argument("--trials", type=int, default=20, help="trials per cell (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--state", default=str(RESULTS / f"{name}.json"), help="every trial run (JSON; resumed)")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--report", action="store_true", help=f"write {name}.md from the state only")
    if extra:
        extra(ap)
    args = ap.parse_args(argv)
    args.command = command_line(argv)
    if not args.report:
        if not args.books:
            ap.error("--books is needed to run trials")
        run(args)
    report(args)


def machine():
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU, torch {torch.__version__}"


# the question reader SmolLM2's adapter ships and how many of its blocks `ask` reads (``exp_reader.py``'s
# tag of its answers in results/reader.json): stage 11 blended with the retrieval heads, 4 blocks; and the
# retrieval heads alone, shipped before it
SHIPPED_READER = "aboutH24-blend-pin4"
HEADS_READER = "heads8-pin4"
PLACEHOLDERS = {"--books": "$BOOKS", "--work": "WORK", "--baseline": "BASELINE"}  # folders of this machine


def command_line(argv=None, script=None):
    """This process's command as the results record it: ``python <script> <arguments>``, the
    values of ``--books``, ``--work`` and ``--baseline`` written as ``PLACEHOLDERS`` says and
    every path inside the repository (a ``name=folder`` item's folder too) relative to its root,
    so a run from any folder records the same line. ``argv``, ``script``: the arguments and the
    script (default this process's)."""
    args = [str(Path(script or sys.argv[0]).resolve()), *(sys.argv[1:] if argv is None else argv)]
    return " ".join(["python"] + [PLACEHOLDERS[args[i - 1]] if i and args[i - 1] in PLACEHOLDERS
                                  else shlex.quote(",".join(map(_from_root, a.split(","))))
                                  for i, a in enumerate(args)])


def _from_root(item):
    name, eq, path = item.rpartition("=")
    if not path:  # an empty value (``--adapters ''``) names no folder, not the current one
        return item
    where = Path(path).resolve()
    return name + eq + os.path.relpath(where, ROOT) if Path(path).exists() and where.is_relative_to(ROOT) else item


def write_result(name, title, body, results=RESULTS, started=None, argv=None, commands=None):
    """experiments/results/<name>.md: title, the exact command (``argv``, default this
    process's; or ``commands``, every command that added to a resumable state), machine, date
    and run time, then ``body``."""
    commands = commands or [command_line(argv)]
    books = " (BOOKS: the project's 53 Gutenberg books)"
    head = [f"# {title}", ""] + ([f"- command: `{commands[0]}`{books}"] if len(commands) == 1 else
                                 [f"- commands, each adding trials to what the tables read{books}:",
                                  *(f"  - `{c}`" for c in commands)])
    minutes = f", {(time.time() - started) / 60:.1f} min" if started else ""
    head += [f"- machine: {machine()}", f"- date: {time.strftime('%Y-%m-%d')}{minutes}", ""]
    path = Path(results) / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head + body) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")
    return path


@contextlib.contextmanager
def serving(memory, model=None, *extra, env=None):
    """``landmark-memory serve memory`` (``--model model``, more options ``extra``) in its own
    process on a free loopback port, with ``env`` if given: its URL once it answers; then
    SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "landmark_memory.app.entry", "serve", str(memory), "--port", str(port), *extra]
    proc = subprocess.Popen(argv + (["--model", model] if model else []), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=Path(memory).parent)  # (-m imports from its cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        while proc.poll() is None:
            try:
                urllib.request.urlopen(url + "/", timeout=1).read()
                break
            except OSError:
                time.sleep(0.2)
        if proc.poll() is not None:
            raise SystemExit(f"the server on {memory} did not start:\n{proc.stderr.read()[-2000:]}")
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def publish(fig, ax, name, title, body, args, started, argv, alt, notes=(), grid="both"):
    """Finish the plot, save it as <name>.png beside <name>.md, and write the markdown."""
    ax.grid(axis=grid, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(args.results) / f"{name}.png", dpi=120)
    return write_result(name, title, [*body, "", f"![{alt}]({name}.png)", *notes], args.results, started, argv)

