"""Exact vs approximate landmark search on the largest memory that fits: one whole held-out
book read as a single segment (every block stays retrievable), with the flat index as the
reference. Per index kind: perplexity delta, recall@k of the retrieved blocks, FAISS search
latency, and passkey accuracy through memory.

    python experiments/exp_exact_vs_approx.py --books BOOKS
"""

import time
from dataclasses import replace

from _common import held_out_books, load, parse, parser, write_result

from landmark_memory.core.tokenizer import load_tokenizer
from landmark_memory.format import MemoryOptions
from landmark_memory.index import KINDS
from landmark_memory.jobs.evaluate import compare_indexes, parse_lengths, passkey_accuracy
from landmark_memory.jobs.plots import plot_compare


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--indexes", default="flat,ivf-rows,hnsw,ivf,ivfpq", help=f"index kinds among {', '.join(KINDS)}")
    ap.add_argument("--max-tokens", type=int, default=0, help="read at most this many tokens of the book (0: all)")
    ap.add_argument("--train-size", type=int, default=1024, help="landmarks before IVF indexes train (default 1024)")
    ap.add_argument("--nprobe", type=int, default=16, help="IVF lists visited per query (default 16)")
    ap.add_argument("--ef-search", type=int, default=128, help="HNSW search breadth (default 128)")
    ap.add_argument("--passkey-lengths", default="8k", help="passkey prompt lengths per index kind")
    ap.add_argument("--passkey-trials", type=int, default=5)
    args = parse(ap, argv)
    t0 = time.time()
    model = load(args.landmark_model)
    name, ids = max(held_out_books(args.books), key=lambda b: len(b[1]))
    if args.max_tokens:
        ids = ids[:args.max_tokens + 1]
    kinds = [k.strip() for k in args.indexes.split(",")]
    index_options = {"train_size": args.train_size, "nprobe": args.nprobe, "ef_search": args.ef_search}
    memory = MemoryOptions(chunk_size=250, top_k=4, index_options=index_options)
    rows = compare_indexes(model, ids, kinds, len(ids) - 1, memory, progress=not args.quiet)
    tok, lengths = load_tokenizer(), parse_lengths(args.passkey_lengths)
    for r in rows:
        pk = passkey_accuracy(model, tok, lengths, args.passkey_trials, seed=0,
                              memory=replace(memory, index=r["index"]), progress=not args.quiet)
        r["passkey"] = {p["length"]: p["accuracy"] for p in pk}
    blocks = (len(ids) - 1) // model.config.block_size
    body = [f"`{args.landmark_model}` reading all of {name} ({len(ids) - 1:,} tokens, {blocks:,} blocks per layer and "
            f"head in memory at the end) as one segment; chunks of 250, top-4, per token and head. Index options: "
            f"train_size {args.train_size} (IVF kinds search exactly until then), nprobe {args.nprobe}, ef_search "
            f"{args.ef_search}. Recall@4: share of the exact (flat) search's blocks that the index also returned, "
            "over every token, layer and head. Search latency: one FAISS call (one chunk's queries of one head).", "",
            "| index | perplexity | vs exact | recall@4 | search ms / call | searches | passkey " +
            ", ".join(f"{n:,}" for n in lengths) + f" ({args.passkey_trials} trials) |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        pk = ", ".join(f"{100 * r['passkey'][n]:.0f}%" for n in lengths)
        body.append(f"| {r['index']} | {r['perplexity']:.3f} | {r['ppl_delta_pct']:+.2f}% | {r['recall']:.3f} | "
                    f"{r['search_ms']:.2f} | {r['searches']:,} | {pk} |")
    plot_compare(rows, f"{args.results}/exact_vs_approx.png",
                 title=f"{name}: {len(ids) - 1:,} tokens, top-4")
    body += ["", "![exact vs approximate](exact_vs_approx.png)"]
    write_result("exact_vs_approx", "Exact vs approximate landmark search", body, args.results, t0, argv)


if __name__ == "__main__":
    main()
