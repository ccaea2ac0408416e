"""Figure 6 analog (paper appendix E): positional jumps in training, then exact positions for
far blocks.

Part 1, no memory: perplexity on the held-out books against the context length, each segment
read in one forward (landmarks inserted, positions 0..n), for a model trained with standard
positions (p_jump = 1) and one trained with jumps (p_jump = 100): a random 1..100 positions
after every landmark. Part 2, with memory: the same models read longer segments with chunks
of 250 and k = 4, retrieved blocks placed by stingy mapping (the paper's default) or at their
exact positions.

    python experiments/exp_jump.py --books BOOKS
"""

import time

from _common import BASE_MODEL, JUMP_MODEL, books_perplexity, held_out_books, load, parse, parser, plt, publish

from landmark_memory.format import MemoryOptions


def lengths(text):
    return [int(x) for x in text.split(",")]


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--base-model", default=BASE_MODEL, help=f"trained with p_jump = 1 (default {BASE_MODEL})")
    ap.add_argument("--jump-model", default=JUMP_MODEL, help=f"trained with p_jump = 100 (default {JUMP_MODEL})")
    ap.add_argument("--lengths", type=lengths, default=lengths("256,512,768,1024,1280,1536,2048"),
                    help="context lengths without memory")
    ap.add_argument("--memory-lengths", type=lengths, default=lengths("2048,4096,8192"),
                    help="segment lengths read through memory")
    ap.add_argument("--tokens", type=int, default=65536, help="predicted tokens per setting (default 65536)")
    args = parse(ap, argv)
    t0 = time.time()
    models = {"p_jump = 1": load(args.base_model), "p_jump = 100": load(args.jump_model)}
    books = held_out_books(args.books)
    flat = {}
    for name, model in models.items():
        for n in args.lengths:
            flat[name, n], count = books_perplexity(model, books, n, args.tokens, progress=not args.quiet)
            print(name, n, round(flat[name, n], 2))
    mem = {}
    for name, model in models.items():
        for mapping in ("stingy", "exact"):
            for n in args.memory_lengths:
                mem[name, mapping, n], _ = books_perplexity(model, books, n, args.tokens, progress=not args.quiet,
                                                            memory=MemoryOptions(chunk_size=250, top_k=4,
                                                                                 position_mapping=mapping))
                print(name, mapping, n, round(mem[name, mapping, n], 2))
    body = [f"Models `{args.base_model}` (p_jump = 1) and `{args.jump_model}` (p_jump = 100), same size, data and "
            f"steps, trained on windows of 512; held-out books {', '.join(n for n, _ in books)}; about "
            f"{args.tokens:,} predicted tokens per cell.", "",
            "Without memory (each segment in one forward):", "",
            "| context | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    body += [f"| {n} | " + " | ".join(f"{flat[m, n]:.2f}" for m in models) + " |" for n in args.lengths]
    body += ["", "Through memory (chunks of 250, top-4 per token and head):", "",
             "| segment | " + " | ".join(f"{m}, {mp}" for m in models for mp in ("stingy", "exact")) + " |",
             "|---|" + "---|" * (2 * len(models))]
    body += [f"| {n} | " + " | ".join(f"{mem[m, mp, n]:.2f}" for m in models for mp in ("stingy", "exact")) + " |"
             for n in args.memory_lengths]
    p = plt()
    fig, (ax, ax2) = p.subplots(1, 2, figsize=(10, 4))
    for m in models:
        ax.plot(args.lengths, [flat[m, n] for n in args.lengths], "o-", label=m)
        for mp, style in (("stingy", "o-"), ("exact", "s--")):
            ax2.plot(args.memory_lengths, [mem[m, mp, n] for n in args.memory_lengths], style, label=f"{m}, {mp}")
    ax.axvline(512, color="gray", lw=0.8, ls=":")
    ax.set(xlabel="context length (no memory)", ylabel="perplexity", title="Figure 6 analog: positional jumps",
           ylim=(min(flat.values()) * 0.97, min(max(flat.values()), 3 * min(flat.values()))))
    ax2.set(xlabel="segment length (memory)", ylabel="perplexity", title="stingy vs exact positions")
    ax2.set_xscale("log", base=2)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    publish(fig, ax, "jumps", "Positional jumps: context length without memory, stingy vs exact with memory "
            "(Figure 6 analog)", body, args, t0, argv, "perplexity vs context length")


if __name__ == "__main__":
    main()
