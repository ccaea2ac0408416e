"""Table 2 analog: retrieval granularity (paper section 4.1). Blocks picked per token and head
(the training setting), per head (one set for the whole chunk), or per token (one set shared
by all heads), at k = 2 and 4, chunks of 250, memory unbounded.

    python experiments/exp_table2.py --books BOOKS
"""

import time

from _common import books_perplexity, held_out_books, load, parse, parser, plt, publish

from landmark_memory.format import MemoryOptions

SETTINGS = ((2048, 2), (2048, 4), (4096, 4))  # the paper's (evaluation length, k) pairs
MODES = (("per_token_head", "per token and head"), ("per_head", "per head"), ("per_token", "per token"))


def blocks_formula(mode, k, heads, chunk=250):
    """The paper's 'Blocks' column: blocks one chunk may read, the same block counted again
    for each token or head that reads it."""
    return {"per_token_head": f"{chunk}·{heads}·{k}", "per_head": f"{heads}·{k}", "per_token": f"{chunk}·{k}"}[mode]


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=98304, help="predicted tokens per setting (default 98304)")
    args = parse(ap, argv)
    t0 = time.time()
    model, books = load(args.landmark_model), held_out_books(args.books)
    heads = model.config.n_head
    names = ", ".join(n for n, _ in books)
    body = [f"Landmark model `{args.landmark_model}` on the held-out books ({names}), {args.tokens:,} predicted tokens "
            "per setting, chunks of 250, no cap on memory.", "",
            "| retrieval | eval length | k | blocks | perplexity |", "|---|---|---|---|---|"]
    results = {}
    for mode, label in MODES:
        for n, k in SETTINGS:
            ppl, _ = books_perplexity(model, books, n, args.tokens, progress=not args.quiet,
                                      memory=MemoryOptions(chunk_size=250, top_k=k, retrieval=mode))
            results[mode, n, k] = ppl
            body.append(f"| {label} | {n} | {k} | {blocks_formula(mode, k, heads)} | {ppl:.2f} |")
            print(label, n, k, round(ppl, 2))
    p = plt()
    fig, ax = p.subplots(figsize=(7, 4))
    width = 0.27
    for i, (mode, label) in enumerate(MODES):
        ax.bar([j + (i - 1) * width for j in range(len(SETTINGS))], [results[mode, n, k] for n, k in SETTINGS],
               width, label=label)
    ax.set_xticks(range(len(SETTINGS)), [f"eval {n}, k={k}" for n, k in SETTINGS])
    lo = min(results.values())
    ax.set(ylabel="perplexity", title="Table 2 analog: retrieval granularity",
           ylim=(lo * 0.97, max(results.values()) * 1.01))
    publish(fig, ax, "table2", "Table 2 analog: retrieval granularity", body, args, t0, argv,
            "perplexity per retrieval granularity", grid="y")


if __name__ == "__main__":
    main()
