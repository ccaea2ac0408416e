"""Past the exact range: SmolLM2's memories train their ``ivf-rows`` lists only after about 64K
tokens, so no suite below that length searches approximately. Here the same prompts at 128K are
read once into a memory (the defaults: ``ivf-rows``, SmolLM2's shipped adapter) and asked two ways:

- ``ivf-rows``: as the memory opens (``nprobe`` 16 of its lists);
- ``flat``: the same memory searched exhaustively (``nprobe`` past its lists' count: every list
  visited, the exact inner-product search ``flat`` makes over the same key rows), so that the two
  differ by the search alone, not by a second reading of 128K tokens.

    python experiments/exp_far.py --books BOOKS                       # 128K: one haystack, two pass keys
    python experiments/exp_far.py --report

``questions``: ``exp_retrieval.py``'s haystacks (held-out books, ten planted facts each) asked as
``ask`` asks them (the adapter's question reader and its pinned blocks): recall@5 of the fact's
block among the passages, answers right, and whether the two ways read the same passages.
``passkey``: ``exp_retrieval.py``'s book-text pass key, the prompt up to its question read into
the memory, the question and the teacher-forced answer read each way (right: the greedy answer is
the key). Every trial is kept in ``--state`` as soon as it is done: a stopped run resumes.
"""

import random
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ADAPTER, ROOT, Trials, load_smollm2, suite_main, write_result
from _needles import passkey_trial
from _texts import build_timed, haystack, held_out, is_right
from exp_retrieval import ASK_NEW

from landmark_memory.core.passkey import PasskeyPrompts
from landmark_memory.jobs.evaluate import parse_lengths
from landmark_memory.memory import LandmarkMemory
from landmark_memory.uses.answer import ask

WAYS = {"ivf-rows": {}, "flat": {"nprobe": 1 << 20}}  # nprobe is cut to the lists there are


def question_rows(loaded, folder, facts, options, bs):
    """One row per fact of a haystack asked from its memory opened with ``options``."""
    model = loaded.model
    rows = []
    with LandmarkMemory.open(folder, model, readonly=True, **options) as m:
        for _, question, words, (a, b) in facts:
            m.rewind()
            blocks = list(range(a // bs, (b - 1) // bs + 1))
            got = ask(m, loaded, question, max_new_tokens=ASK_NEW, passages=5)
            passages = [p.block for p in got.passages]
            rows.append({"question": question, "blocks": blocks, "passages": passages,
                         "recall5": any(p in blocks for p in passages), "answer": got.text.strip(),
                         "right": is_right(got.text, words)})
    return rows


def run(args):
    state = Trials(args.state, args.command)
    loaded = load_smollm2(args.adapter)
    model, tok = loaded.model, loaded.tokenizer
    bs = model.config.landmark_block_size
    for n in parse_lengths(args.lengths):
        books = [b for b in held_out(args.books, tok) if len(b[2]) > n]
        if not books:
            raise SystemExit(f"no held-out book holds {n:,} tokens")
        for h in range(args.haystacks):
            if all(len(state.cell(f"questions|{n}|{w}")) > h for w in WAYS):
                continue
            name, ids, facts = haystack(tok, books, n, h, args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                build_timed(model, ids, Path(tmp) / "m", f"haystack {h} @{n}, {name}")
                for w, options in WAYS.items():
                    if len(state.cell(f"questions|{n}|{w}")) == h:
                        t0 = time.perf_counter()
                        rows = question_rows(loaded, Path(tmp) / "m", facts, options, bs)
                        state.add(f"questions|{n}|{w}", {"haystack": h, "book": name, "rows": rows}, at=h)
                        print(f"  {w}: recall@5 {np.mean([r['recall5'] for r in rows]):.0%}, right "
                              f"{np.mean([r['right'] for r in rows]):.0%} ({time.perf_counter() - t0:.0f} s)",
                              flush=True)
        prompts = PasskeyPrompts(tok)
        with tempfile.TemporaryDirectory() as tmp:
            for t in range(args.passkeys):
                if all(len(state.cell(f"passkey|{n}|{w}")) > t for w in WAYS):
                    continue
                t0, rng = time.perf_counter(), random.Random(f"{args.seed}|far|{n}|{t}")
                row = passkey_trial(model, tok, prompts, books[t % len(books)], rng, n, Path(tmp) / str(t), WAYS,
                                    in_sequence=False)
                for w in WAYS:
                    state.add(f"passkey|{n}|{w}", {"book": row["book"], "key": row["key"], "depth": row["depth"],
                                                   "answer": row[w], "right": row[w] == row["key"],
                                                   "hits": row[f"{w} hits"]}, at=t)
                print(f"passkey {t} @{n}: key {row['key']} at depth {row['depth']}; "
                      + ", ".join(f"{w} {row[w]}" for w in WAYS) + f" ({time.perf_counter() - t0:.0f} s)", flush=True)


def report(args):
    state = Trials(args.state)
    lengths = sorted({int(k.split("|")[1]) for k in state.cells})
    body = ["Every cell reads the same prompts both ways (one reading of each prompt into memory). recall@5: the "
            "planted fact's block among `ask`'s 5 passages; right: the answer holds the fact's words (questions) or "
            "is the key (pass key); same passages: questions whose 5 passages are the same blocks both ways; hits: "
            "the share of the question's and answer's lookups that held the key's block.", "",
            "| tokens | way | recall@5 | right | same passages | questions | pass key | hits | trials |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n in lengths:
        asked = {w: [r for h in state.cell(f"questions|{n}|{w}") for r in h["rows"]] for w in WAYS}
        same = [a["passages"] == b["passages"] for a, b in zip(asked["ivf-rows"], asked["flat"])]
        for w in WAYS:
            rows, keys = asked[w], state.cell(f"passkey|{n}|{w}")
            key = (f"{sum(r['right'] for r in keys)}/{len(keys)} | {np.mean([r['hits'] for r in keys]):.0%}" if keys
                   else "not run | -")
            body.append(f"| {n // 1024}K | {w} | {sum(r['recall5'] for r in rows)}/{len(rows)} | "
                        f"{sum(r['right'] for r in rows)}/{len(rows)} | {sum(same)}/{len(same)} | {len(rows)} | "
                        f"{key} | {len(keys)} |")
    write_result("far", "Past the exact range: ivf-rows against flat search at 128K (SmolLM2)", body,
                 results=args.results, commands=state.commands)


def options(ap):
    ap.add_argument("--adapter", default=str(ROOT / ADAPTER.partition("=")[2]))
    ap.add_argument("--haystacks", type=int, default=1, help="haystacks per length, ten questions each")
    ap.add_argument("--passkeys", type=int, default=2, help="pass-key prompts per length")


if __name__ == "__main__":
    suite_main(__doc__, "far", "128k", run, report, extra=options)
