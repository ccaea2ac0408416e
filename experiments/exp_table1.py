"""Table 1 analog: perplexity on held-out books at several evaluation lengths, full attention
vs landmark retrieval (paper section 4.1).

Each held-out book is cut into segments of the evaluation length, each segment read alone from
its start (the paper's protocol). Rows:
  - full attention with an attention size of 512 (its training length) and of 360: the segment
    is read in pieces of that many tokens, each alone;
  - full attention over the whole segment (RoPE past the training length);
  - the landmark model in sequence over pieces of 512 (its own training setting);
  - landmark with memory: chunks of 250, top-k in {2, 4}, at most 20 / 40 / 80 blocks kept;
  - Infini-attention (when its model exists): the segment streamed through its memory.

    python experiments/exp_table1.py --books BOOKS
"""

import time

from _common import books_perplexity, held_out_books, load, load_optional, parse, parser, plt, publish

from landmark_memory.format import MemoryOptions

LENGTHS = (512, 2048, 4096)


def rows_of(landmark, full, infini):
    """(label, model, attention size, evaluate.perplexity options) per row."""
    rows = [("full attention, pieces of 512", full, 512, dict(context=512)),
            ("full attention, pieces of 360", full, 360, dict(context=360)),
            ("full attention, whole segment", full, None, {}),
            ("landmark in sequence, pieces of 512", landmark, 512, dict(context=512))]
    if infini is not None:
        seg = infini.config.segment_size
        rows.append((f"Infini-attention, segments of {seg}, streamed", infini, seg, {}))
    for k in (2, 4):
        for cap in (20, 40, 80):
            size = 250 + 10 + 50 * k  # counted as the paper does: 250 local tokens, 10 landmarks, k retrieved blocks
            rows.append((f"landmark, chunk 250, k={k}, {cap} blocks", landmark, size,
                         dict(memory=MemoryOptions(chunk_size=250, top_k=k, max_blocks=cap))))
    return rows


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=98304, help="predicted tokens per evaluation length (default 98304)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="evaluation lengths (default 512,2048,4096)")
    args = parse(ap, argv)
    t0 = time.time()
    lengths = [int(x) for x in args.lengths.split(",")]
    landmark, full, infini = load(args.landmark_model), load(args.full_model), load_optional(args.infini_model)
    books = held_out_books(args.books)
    table = {}
    for label, model, _, opts in rows_of(landmark, full, infini):
        for n in lengths:
            if "memory" in opts and n == 512 and opts["memory"].max_blocks != 20:
                continue  # a 512-token segment never holds more than 10 blocks: every cap is the same
            table[label, n], tokens = books_perplexity(model, books, n, args.tokens, progress=not args.quiet, **opts)
        print(label, {n: round(table.get((label, n), float("nan")), 2) for n in lengths})
    labels = list(dict.fromkeys(label for label, _ in table))
    sizes = {label: size for label, _, size, _ in rows_of(landmark, full, infini)}
    body = [f"Held-out books: {', '.join(name for name, _ in books)} (whole books never seen in training). "
            f"{args.tokens:,} predicted tokens per evaluation length, shared evenly over the books; each "
            f"segment read alone from its start. Models: `{args.landmark_model}` (landmark, block 50) and "
            f"`{args.full_model}` (full attention)"
            + (f", `{args.infini_model}` (Infini-attention, plus one gate per head)" if infini else "")
            + ", same size, data and token budget "
            "(see README.md in this folder).", "",
            "| setting | attention size | " + " | ".join(f"eval {n}" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    for label in labels:
        cells = [f"{table[label, n]:.2f}" if (label, n) in table else "(= 20 blocks)" for n in lengths]
        body.append(f"| {label} | {sizes[label] or 'segment'} | " + " | ".join(cells) + " |")
    p = plt()
    fig, ax = p.subplots(figsize=(7.5, 4.5))
    for label in labels:
        xs = [n for n in lengths if (label, n) in table]
        ax.plot(xs, [table[label, n] for n in xs], marker="o", label=label,
                linestyle="--" if label.startswith("full") else "-")
    top = max(v for (label, _), v in table.items() if "whole" not in label)
    ax.set(xscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity", title="Table 1 analog",
           ylim=(None, top * 1.15))
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    publish(fig, ax, "table1", "Table 1 analog: perplexity vs evaluation length", body, args, t0, argv,
            "perplexity vs evaluation length",
            notes=["", "(Full attention over the whole segment is left off the plot's scale where it explodes.)"])


if __name__ == "__main__":
    main()
