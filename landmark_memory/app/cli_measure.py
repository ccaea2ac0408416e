"""The measuring commands: ``eval`` (perplexity), ``compare`` (exact against approximate
retrieval) and ``passkey`` (the paper's pass key test)."""

from ..index import KINDS
from ..jobs.build import encode
from ..jobs.evaluate import compare_indexes, parse_lengths, passkey_accuracy, perplexity, uses_memory
from ..models.kinds import load_model, reading_mode, reads_through_memory
from ..models.model import BUNDLED_MODEL
from .cli_common import UsageError, emit, memory_options, read_one_text


def cmd_eval(args):
    inp = read_one_text(args.input)
    loaded = load_model(args.model, args.device)
    model, tok = loaded.model, loaded.tokenizer
    ids = encode(tok, inp.text)
    mem = memory_options(args, model) if uses_memory(model, args.full_attention) else None
    res = perplexity(model, ids, args.eval_length, memory=mem, max_segments=args.max_segments, progress=not args.quiet)
    mode = "memory" if mem else reading_mode(model)
    doc = {"input": str(inp.path), "mode": mode, "eval_length": args.eval_length,
           **({"memory": mem.to_dict()} if mem else {}),
           **{k: res[k] for k in ("perplexity", "loss", "tokens", "segments", "seconds")}}
    emit(args, doc, f"{inp.path.name}: perplexity {res['perplexity']:.3f} over {res['tokens']:,} tokens "
                    f"({res['segments']} segments of {args.eval_length}, {mode}), {res['seconds']:.1f} s")
    return 0


def cmd_compare(args):
    inp = read_one_text(args.input)
    loaded = load_model(args.model, args.device)
    model, tok = loaded.model, loaded.tokenizer
    if not reads_through_memory(model):
        raise UsageError("compare measures retrieval: give a model a memory reads (a landmark model, or a Hugging "
                         "Face model of a family we read)")
    kinds = [k.strip() for k in args.index.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"unknown index kind(s) {', '.join(bad)}; choose from {', '.join(KINDS)}")
    ids = encode(tok, inp.text)
    length = args.eval_length or len(ids) - 1
    opts = memory_options(args, model, index=kinds[0])  # (each kind in turn)
    rows = compare_indexes(model, ids, kinds, length, opts, max_segments=args.max_segments, progress=not args.quiet)
    if args.plot:
        from ..jobs.plots import plot_compare

        plot_compare(rows, args.plot, title=f"{inp.path.name}: {length:,}-token segments, top-{opts.top_k}")
    doc = {"input": str(inp.path), "eval_length": length, "top_k": opts.top_k, "chunk_size": opts.chunk_size,
           "index_options": opts.index_options, "rows": rows}
    lines = [f"{inp.path.name}: segments of {length:,} tokens, top-{opts.top_k}, chunk {opts.chunk_size}",
             f"{'index':8s} {'perplexity':>10s} {'vs exact':>9s} {'recall@k':>9s} {'search ms':>10s} {'searches':>9s}"]
    lines += [f"{r['index']:8s} {r['perplexity']:10.3f} {r['ppl_delta_pct']:+8.2f}% {r['recall']:9.3f} "
              f"{r['search_ms']:10.3f} {r['searches']:9,}" for r in rows]
    emit(args, doc, "\n".join(lines))
    return 0


def cmd_passkey(args):
    loaded = load_model(args.model, args.device)
    model, tok = loaded.model, loaded.tokenizer
    lengths = parse_lengths(args.lengths)
    mem = memory_options(args, model) if uses_memory(model, args.full_attention) else None
    rows = passkey_accuracy(model, tok, lengths, args.trials, args.seed, memory=mem, progress=not args.quiet)
    label = "landmark + memory" if mem else reading_mode(model)
    if args.plot:
        from ..jobs.plots import plot_passkey

        plot_passkey({label: rows}, args.plot)
    doc = {"model": str(args.model or BUNDLED_MODEL), "mode": label, "trials": args.trials, "seed": args.seed,
           **({"memory": mem.to_dict()} if mem else {}), "results": rows}
    lines = [f"passkey, {label}, {args.trials} trials per length (seed {args.seed})"]
    lines += [f"{r['length']:>9,} tokens: {100 * r['accuracy']:5.1f}% ({r['correct']}/{r['trials']})" for r in rows]
    emit(args, doc, "\n".join(lines))
    return 0
