"""Where the demo's pass-key passage ranks among the passages ``ask`` reports, for each way of
asking: the passages counted over every layer or over the deeper half alone, the question and
answer choosing blocks as the memory reads or centred.

    python experiments/exp_passage_layers.py                 # the bundled model, seeds 0-7
    python experiments/exp_passage_layers.py --model smollm2-landmark --seeds 0-3 --out passage_layers_smollm2

Each seed plants the demo's pass key in the bundled sample book as the demo does (the book's first 8,192 tokens for a
model other than the bundled one), builds the memory as the demo builds it, and asks the demo's question once per way
of centring; the lookups of every layer (the question's last token and each answer token, as ``ask`` counts them) rank
the blocks. A rank is the place of the first block holding the key's digits among the blocks read most; "-" where no
block holding them was read. SmolLM2's 30 layers were measured the same way on planted facts in ``exp_retrieval.py``
(``k4 deep``).
"""

import argparse
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from _common import write_result

from landmark_memory import LandmarkMemory, ask
from landmark_memory.jobs.build import build, read_inputs
from landmark_memory.jobs.demo import (
    LARGE_MODEL_TOKENS,
    MAX_KEY,
    QUESTION,
    SAMPLE_BOOK,
    plant_passkey,
    read_text,
    strip_gutenberg,
)
from landmark_memory.models.kinds import load_model
from landmark_memory.models.model import LandmarkGPT

WAYS = ("every layer", "deeper half", "centred, every layer", "centred, deeper half")


def ranks(loaded, seed):
    """(key, depth, {way: rank of the key's passage or None}, {centred: answer right})."""
    model, tok = loaded.model, loaded.tokenizer
    rng = random.Random(seed)
    key = rng.randint(1, MAX_KEY)
    text = strip_gutenberg(read_text(SAMPLE_BOOK))
    if not isinstance(model, LandmarkGPT):  # as the demo reads it
        text = tok.decode(tok.encode(text).ids[:LARGE_MODEL_TOKENS])
    text, depth = plant_passkey(text, key, rng)
    out, right = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        book = Path(tmp) / "book.txt"
        book.write_text(text)
        with LandmarkMemory(model, path=Path(tmp) / "m", store="lmdb", documents=True) as mem:
            build(mem, read_inputs([book]), tok, progress=False)
        with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as mem:
            n, half = mem.n_blocks, mem.shape.n_layer // 2
            holds = {b for b in range(n) if str(key) in tok.decode(mem.tokens(0, b, b + 1).tolist())}
            for centre in (False, True):
                mem.rewind()
                layers = [Counter() for _ in range(mem.shape.n_layer)]
                generate = mem.generate

                def counting(*a, on_read, **kw):  # ask's lookups, per layer
                    def read(retrieved):
                        on_read(retrieved)
                        for c, r in zip(layers, retrieved):
                            c.update(b for b in r[0].flatten().tolist() if 0 <= b < n)
                    return generate(*a, on_read=read, **kw)

                mem.generate = counting
                got = ask(mem, loaded, QUESTION, raw=True, max_new_tokens=8, centre=centre)
                del mem.generate
                right[centre] = str(key) in got.text
                for label, counted in (("every layer", layers), ("deeper half", layers[half:])):
                    order = [b for b, _ in sum(counted, Counter()).most_common()]
                    way = f"centred, {label}" if centre else label
                    out[way] = next((i + 1 for i, b in enumerate(order) if b in holds), None)
    return key, depth, out, right


def model_layers(model):
    return model.config.n_layer if isinstance(model, LandmarkGPT) else model.config.num_hidden_layers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-7", help="a range of demo seeds, FIRST-LAST")
    ap.add_argument("--model", default=None, help="a model name or folder (default: the bundled model)")
    ap.add_argument("--out", default="passage_layers", help="the results file's name")
    ap.add_argument("--results", default=None, help="folder of the results (default experiments/results)")
    args = ap.parse_args(argv)
    first, last = map(int, args.seeds.split("-"))
    loaded = load_model(args.model, "cpu")
    model = loaded.model
    t0, rows = time.time(), []
    for seed in range(first, last + 1):
        key, depth, got, right = ranks(loaded, seed)
        rows.append((seed, key, depth, got, right))
        print(seed, key, f"{depth:.2f}", got, flush=True)
    def show(r):
        return "-" if r is None else str(r)

    half = f"layers {model_layers(model) // 2}-{model_layers(model) - 1} of {model_layers(model)}"
    body = [f"Model: {args.model or 'the bundled model'}. Rank of the pass key's passage among the blocks the demo's "
            f"answer read, by the lookups counted (every layer, or the deeper half: {half}) and by how the question "
            "and answer chose blocks "
            "(as the memory reads, or centred). '-': no block holding the key was read by those layers.", "",
            "| seed | key | depth | " + " | ".join(WAYS) + " | right (plain / centred) |",
            "|---|---|---|" + "---|" * len(WAYS) + "---|"]
    for seed, key, depth, got, right in rows:
        body.append(f"| {seed} | {key} | {depth:.2f} | " + " | ".join(show(got[w]) for w in WAYS)
                    + f" | {'yes' if right[False] else 'no'} / {'yes' if right[True] else 'no'} |")
    big = float("inf")  # a passage never read ranks after every one
    body += ["", "| way | median rank | first 5 | never read |", "|---|---|---|---|"]
    for w in WAYS:
        r = [got[w] or big for *_, got, _ in rows]
        body.append(f"| {w} | {np.median(r):.1f} | {sum(x <= 5 for x in r)}/{len(r)} | "
                    f"{sum(got[w] is None for *_, got, _ in rows)} |")
    write_result(args.out, "The demo's pass key: its passage's rank by the layers counted", body,
                 **({"results": args.results} if args.results else {}), started=t0, argv=argv)


if __name__ == "__main__":
    main()
