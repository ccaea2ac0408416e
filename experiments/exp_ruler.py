"""A RULER-style suite over held-out books: SmolLM2 with landmarks reading through memory
against the base model in its own context.

    python experiments/exp_ruler.py --books BOOKS                                  # 4K-32K, 20 trials
    python experiments/exp_ruler.py --books BOOKS --lengths 4k,8k --trials 5       # a first pass
    python experiments/exp_ruler.py --books BOOKS --adapters stage6=out/smollm2-stage6,stage5=... --lengths 8k
    python experiments/exp_ruler.py --books BOOKS --adapters '' --lengths 8k       # the base model alone
    python experiments/exp_ruler.py --books BOOKS --lengths 16k --tasks single,qa --top-k 16
    python experiments/exp_ruler.py --books BOOKS --report                         # ruler.md from what ran

The tasks of RULER (Hsieh et al., 2024), their haystack consecutive text of a book the
fine-tuning never saw (a random held-out book and offset per trial), the needles at random
depths, the prompt ending with an answer prefix that both models continue greedily:
- ``single``: one needle, "One of the special magic numbers for KEY is: VALUE.";
- ``multikey``: four needles of different keys, one asked (the others are distractors);
- ``multivalue``: four needles of one key, every value asked;
- ``multiquery``: four needles of different keys, every one asked;
- ``vartrack``: a chain "VAR A = VALUE.", "VAR B = VAR A.", ... of five variables spread
  through the text, asked which variables hold VALUE;
- ``qa``: one fact in a plain sentence among the book's, asked as a question.
A trial scores the share of the asked values (variables, the fact's words) found in the
answer; a cell is the mean over its trials, with the count shown. Keys are seven-digit numbers
as in RULER. Every trial is kept in ``--state`` (JSON) as soon as it is done, so a stopped run
goes on where it stopped, and more trials can be added later; ``--report`` writes ruler.md
and its plot from the state. The landmark model's rows are named by its adapter
(``--adapters name=folder,...``, default the shipped one under the name ``shipped``), so rows
of different adapter stages never share a cell; ``--top-k K`` has the memory retrieve K blocks per
query and files its trials apart, under the adapter's name followed by ``(top-k K)``;
``--tasks`` runs some of the tasks. Runs at the same time may share one state
(another length in one, the base model alone in another): each keeps the other's trials.
"""

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from _common import (ADAPTER, BASE, BASE_WINDOW, PLANTED_FACTS, Trials, adapter_specs, load_smollm2, plt, some_of,
                     suite_main, top_k_label, top_k_memory, top_k_option, write_result)
from exp_smollm2 import held_out
from landmark_memory.app.evaluate import greedy_continuation, parse_lengths

TASKS = ("single", "multikey", "multivalue", "multiquery", "vartrack", "qa")
WORDS = ("amber", "brisk", "cedar", "dusky", "ember", "frost", "gleam", "hazel", "ivory", "jolly", "keen", "lunar",
         "maple", "noble", "olive", "pearl", "quiet", "raven", "silver", "tulip", "umber", "velvet", "willow", "zephyr")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pillow", "quarry", "ribbon", "saddle", "timber", "valley", "wagon")
INTRO = "Some special magic numbers are hidden within the following text. Make sure to memorize it. " \
        "I will quiz you about the numbers afterwards.\n"
MAX_NEW = {"single": 12, "multikey": 12, "multivalue": 48, "multiquery": 48, "vartrack": 32, "qa": 16}


def number(rng):
    return str(rng.randint(1_000_000, 9_999_999))


def key(rng, taken=()):
    while True:
        k = f"{rng.choice(WORDS)}-{rng.choice(NOUNS)}"
        if k not in taken:
            return k


def needle(k, v):
    return f" One of the special magic numbers for {k} is: {v}."


def task(name, rng):
    """(needles, question with its answer prefix, the strings a right answer holds, intro)."""
    if name in ("single", "multikey", "multiquery"):
        keys = [key(rng)]
        while len(keys) < (1 if name == "single" else 4):
            keys.append(key(rng, keys))
        values = [number(rng) for _ in keys]
        if name == "multiquery":
            asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
            return ([needle(k, v) for k, v in zip(keys, values)],
                    f"\nWhat are all the special magic numbers for {asked} mentioned in the provided text? The "
                    f"special magic numbers for {asked} mentioned in the provided text are", values, INTRO)
        return ([needle(k, v) for k, v in zip(keys, values)],
                f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text? The special magic "
                f"number for {keys[0]} mentioned in the provided text is", values[:1], INTRO)
    if name == "multivalue":
        k, values = key(rng), [number(rng) for _ in range(4)]
        return ([needle(k, v) for v in values],
                f"\nWhat are all the special magic numbers for {k} mentioned in the provided text? The special magic "
                f"numbers for {k} mentioned in the provided text are", values, INTRO)
    if name == "vartrack":
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
        v = number(rng)
        chain = [f" VAR {names[0]} = {v}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return (chain, f"\nQuestion: Find all variables that are assigned the value {v} in the text above. Answer: "
                       f"According to the chain(s) of variable assignment in the text above, 5 variables are assigned "
                       f"the value {v}, they are:", names,
                "Memorize and track the chain(s) of variable assignment hidden in the following text.\n")
    sentence, question, words = PLANTED_FACTS[rng.randrange(len(PLANTED_FACTS))]
    return [" " + sentence], f"\nAnswer the question from the text above. Question: {question} Answer:", words, \
        "Read the following text and answer the question after it.\n"


@dataclass(frozen=True)
class Prompt:
    """A trial's prompt: ``ids`` (exactly the length asked), the strings a right answer holds,
    the token span [start, end) of each needle in ``ids`` (in the order they stand), and where
    the question (with its answer prefix) starts."""

    ids: list[int]
    want: list[str]
    needles: list[tuple[int, int]]
    question_at: int


def prompt(tok, book_ids, length, name, rng) -> Prompt:
    """The prompt of task ``name`` over ``book_ids`` from ``rng``."""
    needles, question, want, intro = task(name, rng)
    head, tail = tok.encode(intro).ids, tok.encode(question).ids
    pieces = [tok.encode(n).ids for n in needles]
    n_hay = length - len(head) - len(tail) - sum(map(len, pieces))
    start = rng.randrange(0, len(book_ids) - n_hay)
    hay = list(book_ids[start:start + n_hay])
    cuts = sorted(rng.randint(0, n_hay) for _ in pieces)
    if name != "vartrack":  # a chain keeps its order: each link comes after the one it names
        rng.shuffle(pieces)
    out, last, spans = list(head), 0, []
    for cut, piece in zip(cuts, pieces):
        out += hay[last:cut]
        spans.append((len(out), len(out) + len(piece)))
        out += piece
        last = cut
    out += hay[last:]
    return Prompt(out + tail, want, spans, len(out))


def trial_prompt(tok, books, length, name, i, seed) -> tuple[str, Prompt]:
    """Trial ``i`` of task ``name`` at ``length``: its book's name and its prompt, the same for
    every model and every script that reads it (``books``: ``held_out``'s list)."""
    rng = random.Random(f"{seed}|{name}|{length}|{i}")
    book, _, ids = books[i % len(books)]
    return book, prompt(tok, ids, length, name, rng)


def score(text, want):
    return sum(w.lower() in text.lower() for w in want) / len(want)


def run(args):
    state = Trials(args.state, args.command)
    lengths = parse_lengths(args.lengths)
    models = [(f"landmark {top_k_label(name, args.top_k)} + memory", folder)
              for name, folder in adapter_specs(args.adapters)]
    for label, folder in models + [(BASE, None)]:
        todo = [(n, t) for n in lengths for t in args.tasks if label != BASE or n <= BASE_WINDOW]
        if all(len(state.cell(f"{label}|{t}|{n}")) >= args.trials for n, t in todo):
            continue
        model, tok = load_smollm2(folder)
        books = held_out(args.books, tok)
        memory = None if label == BASE else top_k_memory(args.top_k)
        def trial(n, t, i):
            book, p = trial_prompt(tok, books, n, t, i, args.seed)
            t0 = time.perf_counter()
            text = tok.decode(greedy_continuation(model, p.ids, MAX_NEW[t], memory))
            return {"book": book, "score": score(text, p.want), "want": p.want, "answer": text,
                    "seconds": round(time.perf_counter() - t0, 1)}

        for n, t in todo:
            for i, row in state.fill(f"{label}|{t}|{n}", args.trials, lambda i: trial(n, t, i)):
                print(f"{label} {t} @{n} trial {i}: {row['score']:.2f} {row['answer'].strip()[:60]!r}", flush=True)
        del model


def report(args):
    trials = Trials(args.state)
    state = trials.cells
    lengths = sorted({int(k.split("|")[2]) for k in state})
    body = ["Each cell: the mean score (share of the asked values found in the greedy answer) and the trials run. "
            "Haystacks are consecutive text of the held-out books; every model reads the same prompts. A landmark row "
            "is named by its adapter (stageN: the SmolLM2 adapter after that stage of its model card).", "",
            "| model | task | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    means, labels = {}, list(dict.fromkeys(k.split("|")[0] for k in state))
    for label in labels:
        for t in TASKS:
            cells = []
            for n in lengths:
                got = state.get(f"{label}|{t}|{n}", [])
                if got:
                    means[label, t, n] = float(np.mean([g["score"] for g in got]))
                    cells.append(f"{means[label, t, n]:.0%} ({len(got)})")
                else:
                    cells.append("-")
            if any(c != "-" for c in cells):
                body.append(f"| {label} | {t} | " + " | ".join(cells) + " |")
    pyplot = plt()
    fig, axes = pyplot.subplots(1, len(TASKS), figsize=(3 * len(TASKS), 3), sharey=True)
    for ax, t in zip(axes, TASKS):
        for label in labels:
            xs = [n for n in lengths if (label, t, n) in means]
            ax.plot(xs, [means[label, t, n] for n in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(t)
        ax.set_xlabel("tokens")
    axes[0].set_ylabel("score")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # the legend below the panels covers no point
    fig.savefig(Path(args.results) / "ruler.png", dpi=110)
    body += ["", "![RULER-style scores by length](ruler.png)", ""]
    write_result("ruler", "A RULER-style suite over held-out books", body, results=args.results,
                 commands=trials.commands)


def options(ap):
    ap.add_argument("--adapters", default=ADAPTER,
                    help="comma-separated name=folder of LoRA landmark adapters (default: the shipped one; '' for "
                         "the base model alone)")
    ap.add_argument("--tasks", type=some_of(TASKS), default=list(TASKS), help=f"some of {','.join(TASKS)} (default: all)")
    top_k_option(ap, "the landmark model")


def main(argv=None):
    suite_main(__doc__, "ruler", "4k,8k,16k,32k", run, report, argv, extra=options)


if __name__ == "__main__":
    main()
