"""The demo's question asked of the bundled model with the text index's first block read first
(``answering.plan.TEXT_BLOCKS`` = 1, the default) and without (0, as before): is the pass key's passage
the first `ask` names, and is the answer still right?

    python experiments/exp_demo_passages.py --work DIR [--seeds 1,2,3,4,5,7]

Per seed, the demo's book (the bundled sample) with the pass key planted as ``landmark-memory
demo --seed S`` plants it, built once into ``DIR/sS`` (a later run finds it), then asked the
demo's question both ways on the same memory read-only: the answer, whether it holds the key,
the rank of the key's passage among every passage the answer read, and how many it read.
"""

import argparse
import random
from pathlib import Path

from _common import write_result

from landmark_memory.jobs import demo
from landmark_memory.jobs.build import build, read_inputs
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import load_model
from landmark_memory.training.data import read_text, strip_gutenberg
from landmark_memory.uses import answer
from landmark_memory.uses.answering import plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="the memories (one per seed; kept)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4, 5, 7])
    ap.add_argument("--results", default=None, help="where demo_passages.md goes (default experiments/results)")
    args = ap.parse_args(argv)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    book = strip_gutenberg(read_text(demo.SAMPLE_BOOK))
    rows, shipped = [], plan.TEXT_BLOCKS
    for seed in args.seeds:
        rng = random.Random(seed)  # as the demo draws them: the key, then where it goes
        key = rng.randint(1, demo.MAX_KEY)
        text, depth = demo.plant_passkey(book, key, rng)
        work = Path(args.work) / f"s{seed}"
        if not (work / "memory").exists():
            work.mkdir(parents=True, exist_ok=True)
            (work / "book.txt").write_text(text)
            with LandmarkMemory(model, path=work / "memory", store="lmdb", documents=True) as mem:
                build(mem, read_inputs([work / "book.txt"]), tok, progress=False)
        for blocks in (0, shipped):
            plan.TEXT_BLOCKS = blocks
            with LandmarkMemory.open(work / "memory", model, readonly=True) as mem:
                a = answer.ask(mem, loaded, demo.QUESTION, raw=True, max_new_tokens=8, passages=mem.n_blocks)
            rank = next((i + 1 for i, p in enumerate(a.passages) if str(key) in p.text), None)
            rows.append((seed, depth, blocks, a.text, str(key) in a.text, rank, len(a.passages)))
            print(rows[-1], flush=True)
    plan.TEXT_BLOCKS = shipped
    body = ["The bundled model has no retrieval heads and no question reader: `ask` now reads first the block the "
            "memory's text index ranks first for the question's words, and names it first. The demo's question "
            f"({demo.QUESTION.strip()!r}), its book and pass key as `landmark-memory demo --seed S` makes them.", "",
            "| seed | key at | text index blocks read first | answer | right | the key's passage, ranked "
            "| passages read |",
            "|---:|---:|---:|---|---|---:|---:|"]
    body += [f"| {s} | {d:.0%} | {b} | `{t.strip()}` | {'yes' if ok else 'no'} | {r or '-'} | {n} |"
             for s, d, b, t, ok, r, n in rows]
    write_result("demo_passages", "The demo's passages: the text index's block read first", body,
                 **({"results": args.results} if args.results else {}))


if __name__ == "__main__":
    main()
