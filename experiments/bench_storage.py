"""Compact memories: what each stored key/value dtype costs and loses, every dtype measured in
the same run against float32.

    python experiments/bench_storage.py                                  # bundled model and SmolLM2
    python experiments/bench_storage.py --models bundled --dtypes float32,int8 --out /tmp/storage.md

For each model and store dtype, on the held-out book (Up from Slavery, bundled as the sample):
- a memory built over its first ``--build-tokens`` tokens (cut to whole chunks, so that no open
  chunk waits in the state file, as at the end of a document ``build`` reads) as ``build``
  writes one (LMDB, flat index, no logits): reading speed (best of ``--repeats`` builds), and
  disk bytes per token (every file of the memory, as ``landmark-memory info`` counts them);
- decoding on that memory: ms per token over ``--steps`` steps, best of ``--repeats``;
- perplexity through memory over the first ``max(--lengths)`` tokens, in segments of each
  of ``--lengths`` (the protocol of smollm2.md);
- the paper's passkey prompts at ``--passkey-length``, the same ``--trials`` for every dtype.
Speeds come first for every dtype, one after another, so they share the machine's state.
"""

import argparse
import tempfile
import time
from pathlib import Path

from _common import book_tokens, write_result

from landmark_memory.format import MemoryOptions
from landmark_memory.jobs.evaluate import passkey_accuracy, perplexity
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import load_model
from landmark_memory.training.data import SAMPLE_DIR
from landmark_memory.uses.inspect import describe

HELD_OUT = SAMPLE_DIR / "book" / "up_from_slavery.txt"
MODELS = {"bundled": None, "smollm2-landmark": "smollm2-landmark"}
KiB = 1024


def build(model, ids, dtype, folder):
    """(tokens/s, disk bytes per token, the open memory) of a memory over ``ids`` written to ``folder``."""
    mem = LandmarkMemory(model, path=folder, store="lmdb", store_dtype=dtype)
    t0 = time.perf_counter()
    for a in range(0, ids.shape[1], mem.options.chunk_size):
        mem.forward(ids[:, a:a + mem.options.chunk_size], logits="none")
    mem.commit()
    rate = ids.shape[1] / (time.perf_counter() - t0)
    return rate, describe(folder)["disk_bytes"] / ids.shape[1], mem


def decode_ms(mem, ids, steps):
    """ms per decoding step over ``steps`` tokens of ``ids`` (after one untimed step)."""
    mem.inspection.step(ids[:, 0])
    t0 = time.perf_counter()
    for i in range(steps):
        mem.inspection.step(ids[:, 1 + i])
    return (time.perf_counter() - t0) * 1e3 / steps


def speeds(model, ids, dtypes, args):
    """{dtype: (ingest tokens/s, disk bytes per token, decode ms per token)}, best of the repeats."""
    out = {d: [0.0, 0.0, float("inf")] for d in dtypes}
    chunk = LandmarkMemory(model).options.chunk_size
    n = args.build_tokens - args.build_tokens % chunk
    build_ids, tail = ids[:, :n], ids[:, n:]
    with tempfile.TemporaryDirectory() as tmp:
        for d in dtypes:  # untimed: a process's first chunk and step of each dtype load compiled code
            mem = build(model, build_ids[:, :1024], d, Path(tmp) / d)[2]
            decode_ms(mem, tail, 1)
            mem.close(commit=False)
        for r in range(args.repeats):
            for d in dtypes:  # dtypes interleaved: a drift of the machine's speed hits all alike
                rate, per_token, mem = build(model, build_ids, d, Path(tmp) / f"{d}-{r}")
                ms = decode_ms(mem, tail, args.steps)
                mem.close(commit=False)
                out[d] = [max(out[d][0], rate), per_token, min(out[d][2], ms)]
    return out


def quality(model, tok, ids, dtypes, args):
    """{dtype: {length: perplexity, "passkey": [each trial right?], "answers": [each trial's answer]}}."""
    out = {}
    for d in dtypes:
        out[d] = {}
        for n in args.lengths:
            r = perplexity(model, ids[0, :max(args.lengths) + 1], n, memory=MemoryOptions(store_dtype=d),
                           progress=not args.quiet,
                           desc=f"{d} @{n}")
            out[d][n] = r["perplexity"]
        rows = passkey_accuracy(model, tok, [args.passkey_length], args.trials, args.seed,
                                memory=MemoryOptions(store_dtype=d), progress=not args.quiet)
        out[d]["passkey"] = [a["answer"] == a["key"] for r in rows for a in r["answers"]]
        out[d]["answers"] = [a["answer"] for r in rows for a in r["answers"]]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,smollm2-landmark", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8", help="store dtypes; float32 first: the baseline")
    ap.add_argument("--lengths", default="8192,32768", help="perplexity segment lengths")
    ap.add_argument("--build-tokens", type=int, default=8192, help="tokens of the built memory (default 8192)")
    ap.add_argument("--steps", type=int, default=48, help="decoding steps timed (default 48)")
    ap.add_argument("--repeats", type=int, default=2, help="builds per dtype; the best speed counts (default 2)")
    ap.add_argument("--passkey-length", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="the markdown (default experiments/results/storage.md)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    args.lengths = sorted(map(int, args.lengths.split(",")))
    dtypes = args.dtypes.split(",")
    started, body = time.time(), []
    for name in args.models.split(","):
        loaded = load_model(MODELS[name], "cpu")
        model, tok = loaded.model, loaded.tokenizer
        ids = book_tokens(tok, max(args.lengths + [args.build_tokens + args.steps + 1]) + 1, HELD_OUT)
        fast = speeds(model, ids, dtypes, args)
        good = quality(model, tok, ids, dtypes, args)
        base = dtypes[0]
        body += [f"## {name}", "",
                 f"Built over {args.build_tokens:,} tokens less the last open chunk; perplexity over the first "
                 f"{max(args.lengths):,}; passkey "
                 f"at {args.passkey_length:,} tokens, the same {args.trials} prompts (seed {args.seed}) for each "
                 "dtype.",
                 "", "| store dtype | disk KiB / token | vs " + base + " | " +
                 " | ".join(f"perplexity @{n:,} | vs {base}" for n in args.lengths) +
                 " | passkey | ingest tokens/s | vs " + base + " | decode ms / token | vs " + base + " |",
                 "|---|" + "---|" * (7 + 2 * len(args.lengths))]
        for d in dtypes:
            rate, per_token, ms = fast[d]
            ppl = " | ".join(f"{good[d][n]:.3f} | {good[d][n] / good[base][n] - 1:+.2%}" for n in args.lengths)
            right, same = good[d]["passkey"], sum(a == b for a, b in zip(good[d]["answers"], good[base]["answers"]))
            body.append(f"| {d} | {per_token / KiB:.2f} | {per_token / fast[base][1]:.1%} | {ppl} | "
                        f"{sum(right)}/{len(right)} "
                        f"({same} answers as {base}'s) | "
                        f"{rate:,.0f} | {rate / fast[base][0]:.2f}x | {ms:.1f} | {fast[base][2] / ms:.2f}x |")
        body.append("")
        print("\n".join(body[-len(dtypes) - 3:]), flush=True)
        del model
    write_result("storage" if args.out is None else Path(args.out).stem, "Compact memories: store dtypes", body,
                 **({} if args.out is None else {"results": Path(args.out).parent}), started=started)


if __name__ == "__main__":
    main()
