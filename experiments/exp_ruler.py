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

import time
from pathlib import Path

import numpy as np
from _common import (
    ADAPTER,
    BASE,
    BASE_WINDOW,
    Trials,
    adapter_specs,
    load_smollm2,
    plt,
    some_of,
    suite_main,
    top_k_label,
    top_k_memory,
    top_k_option,
    write_result,
)
from _ruler_tasks import TASKS, trial_prompt
from _texts import held_out

from landmark_memory.jobs.evaluate import greedy_continuation, parse_lengths

MAX_NEW = {"single": 12, "multikey": 12, "multivalue": 48, "multiquery": 48, "vartrack": 32, "qa": 16}


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
        loaded = load_smollm2(folder)
        model, tok = loaded.model, loaded.tokenizer
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
        model = None  # freed before the next one loads


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
    ap.add_argument("--tasks", type=some_of(TASKS), default=list(TASKS), help=f"some of {','.join(TASKS)} (default: "
                                                                              "all)")
    top_k_option(ap, "the landmark model")


def main(argv=None):
    suite_main(__doc__, "ruler", "4k,8k,16k,32k", run, report, argv, extra=options)


if __name__ == "__main__":
    main()
