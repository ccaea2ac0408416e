"""Table 3 analog (paper appendix D): a Context Miss Token decides when retrieval is needed.

Perplexity on the held-out books at evaluation length 2048 with k = 4 and chunks of 250, for
a landmark model trained without a CMT (the baseline) and one trained with it (p_cmt = 0.5),
at CMT cutoffs 0, 0.1, 0.3, 0.5 and 1.0. Per cutoff: the drop rate (query retrievals whose
CMT share fell below the cutoff, per token, layer and head), the index searches skipped (a
layer-head searches nothing when every query of the step is below the cutoff), and the
decode time per token after a long context, against cutoff 0 measured in the same run.

    python experiments/exp_cmt.py --books BOOKS
"""

import dataclasses
import time

import numpy as np
import torch
from _common import BASE_MODEL, CMT_MODEL, books_eval, held_out_books, load, parse, parser, plt, publish

from landmark_memory.format import MemoryOptions
from landmark_memory.memory import LandmarkMemory, RetrievalStats

CUTOFFS = (0.0, 0.1, 0.3, 0.5, 1.0)


@torch.no_grad()
def decode_ms(model, ids, context, steps, **memory):
    """Median ms per greedily decoded token after reading ``context`` tokens of ``ids``, and
    the memory's retrieval counts over the decoded tokens alone."""
    mem = LandmarkMemory(model, **memory)
    logits = mem.forward(torch.as_tensor(np.asarray(ids[:context], dtype=np.int64))[None], logits="last").logits[:, -1]
    start = dataclasses.replace(mem.retrieval_stats)  # (the counts of the decoded tokens alone)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = mem.inspection.step(logits.argmax(-1))
        times.append(time.perf_counter() - t0)
    stats = RetrievalStats(*(getattr(mem.retrieval_stats, f.name) - getattr(start, f.name)
                             for f in dataclasses.fields(start)))
    mem.close()
    return 1e3 * float(np.median(times)), stats


def saved(stats):
    searches = stats.searches + stats.skipped_searches
    return stats.skipped_queries / max(1, stats.queries), stats.skipped_searches / max(1, searches)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--base-model", default=BASE_MODEL, help=f"landmark model without a CMT (default {BASE_MODEL})")
    ap.add_argument("--cmt-model", default=CMT_MODEL, help=f"the same trained with a CMT (default {CMT_MODEL})")
    ap.add_argument("--eval-length", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=98304, help="predicted tokens per setting (default 98304)")
    ap.add_argument("--decode-context", type=int, default=32768, help="tokens read before decoding (default 32768)")
    ap.add_argument("--decode-steps", type=int, default=64, help="tokens decoded per cutoff (default 64)")
    args = parse(ap, argv)
    t0 = time.time()
    base, cmt, books = load(args.base_model), load(args.cmt_model), held_out_books(args.books)
    memory = dict(chunk_size=250, top_k=4)
    longest = max(books, key=lambda b: len(b[1]))
    rows = []
    for label, model, cutoff in [("baseline (no CMT)", base, None)] + [(f"{c:g}", cmt, c) for c in CUTOFFS]:
        opts = memory if cutoff is None else {**memory, "cmt_cutoff": cutoff}
        ppl, n, stats = books_eval(model, books, args.eval_length, args.tokens, progress=not args.quiet,
                                   memory=MemoryOptions.of(**opts))
        ms, dec = decode_ms(model, longest[1], args.decode_context, args.decode_steps, **opts)
        rows.append(dict(label=label, cutoff=cutoff, ppl=ppl, tokens=n, drop=saved(stats)[0],
                         searches_saved=saved(stats)[1], ms=ms, decode_saved=saved(dec)[1]))
        print(label, f"ppl {ppl:.2f} drop {rows[-1]['drop']:.1%} decode {ms:.2f} ms/token")
    ref = next(r for r in rows if r["cutoff"] == 0.0)
    body = [f"Baseline `{args.base_model}` and CMT model `{args.cmt_model}` (same size, data and steps) on the "
            "held-out "
            f"books ({', '.join(n for n, _ in books)}), {rows[0]['tokens']:,} predicted tokens per row at evaluation "
            f"length {args.eval_length}, chunks of 250, top-4 per token and head, flat index. Drop rate: query "
            "retrievals (token x layer x head) whose CMT share was below the cutoff. Searches skipped: index searches "
            "(step x layer x head) skipped because every query of the step was below the cutoff. Decode: median time "
            f"per greedy token after reading {args.decode_context:,} tokens of {longest[0]} ({args.decode_steps} "
            "tokens), where each token is its own step, so its searches skipped are its drop rate.", "",
            "| cutoff | perplexity | vs cutoff 0 | drop rate | searches skipped | decode ms/token | decode speed-up | "
            "decode searches skipped |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = f"{100 * (r['ppl'] / ref['ppl'] - 1):+.2f}%"
        body.append(f"| {r['label']} | {r['ppl']:.2f} | {delta} | {100 * r['drop']:.0f}% | "
                    f"{100 * r['searches_saved']:.0f}% | {r['ms']:.2f} | {ref['ms'] / r['ms']:.2f}x | "
                    f"{100 * r['decode_saved']:.0f}% |")
    p = plt()
    fig, ax = p.subplots(figsize=(7, 4))
    cm = [r for r in rows if r["cutoff"] is not None]
    ax.plot([100 * r["drop"] for r in cm], [r["ppl"] for r in cm], "o-", label="CMT model")
    for r in cm:
        ax.annotate(f"cutoff {r['label']}", (100 * r["drop"], r["ppl"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(rows[0]["ppl"], color="gray", ls="--", label="baseline (no CMT)")
    ax.set(xlabel="retrievals dropped (%)", ylabel=f"perplexity at {args.eval_length}",
           title="Table 3 analog: Context Miss Token cutoff")
    publish(fig, ax, "cmt", "Context Miss Token: retrievals skipped vs perplexity (Table 3 analog)", body, args, t0,
            argv, "perplexity vs share of retrievals dropped")


if __name__ == "__main__":
    main()
