"""The ``landmark-memory`` command: build, inspect, query and measure persistent memories.

    landmark-memory demo                                   # the whole story in a few minutes
    landmark-memory build my-memory --input books/         # ingest (resumable, Ctrl-C commits)
    landmark-memory info my-memory
    landmark-memory ask my-memory "Who is Mr Hyde?" --show-retrieved
    landmark-memory eval --input book.txt --eval-length 2048
    landmark-memory compare --input book.txt --index flat,hnsw,ivf,ivfpq --plot compare.png
    landmark-memory passkey --lengths 1k,4k,16k --trials 20 --plot passkey.png
    landmark-memory train --preset tiny                    # experiments/train.py's options

Every command takes ``--help``; ``--json`` prints one JSON document on stdout (progress bars
go to stderr). ``--model`` defaults to the bundled model. Errors exit with status 2 and a
message saying what to do; an interrupted build exits with 130 after committing.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from .build import build, encode, read_inputs
from .decode import decode
from .evaluate import compare_indexes, parse_lengths, passkey_accuracy, perplexity, uses_memory
from .index import KINDS
from .kinds import backbone_for, is_landmark, load_model, reading_mode
from .memory import MAPPINGS, RETRIEVALS, LandmarkMemory, MemoryDir, MemoryFileError, default_chunk_size
from .model import BUNDLED_MODEL
from .storage import DTYPES


class UsageError(ValueError):
    pass


# ---- shared helpers ---------------------------------------------------------------------
def emit(args, doc, text):
    """One JSON document with --json, else human-readable text."""
    print(json.dumps(doc, indent=1) if args.json else text)


def memory_options(args, model):
    """LandmarkMemory options from the command line (the chunk size resolved for ``model``)."""
    chunk = args.chunk_size or default_chunk_size(backbone_for(model).block_size)
    opts = {"top_k": args.top_k, "chunk_size": chunk, "index": args.index, "retrieval": args.retrieval,
            "position_mapping": args.position_mapping, "cmt_cutoff": getattr(args, "cmt_cutoff", None)}
    index_options = {k: getattr(args, k) for k in ("train_size", "nprobe", "ef_search") if getattr(args, k, None)}
    return {**{k: v for k, v in opts.items() if v is not None}, "index_options": index_options}


def add_model_args(p):
    p.add_argument("--model", help="model directory (save_pretrained layout); default: the bundled model")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda when available)")


CHUNK_HELP = "tokens per chunk (default: the multiple of the block size nearest 250)"


def add_retrieval_args(p, index_default="flat", top_k_default=4):
    p.add_argument("--chunk-size", type=int, help=CHUNK_HELP)
    p.add_argument("--top-k", type=int, default=top_k_default, help=f"blocks retrieved per query (default {top_k_default})")
    p.add_argument("--index", default=index_default, help=f"landmark index: {', '.join(KINDS)} (default {index_default})")
    p.add_argument("--retrieval", choices=RETRIEVALS, default="per_token_head", help="retrieval granularity")
    p.add_argument("--position-mapping", choices=MAPPINGS, default="stingy", help="positions of retrieved blocks")
    p.add_argument("--cmt-cutoff", type=float, help=CMT_HELP)


CMT_HELP = ("models trained with a Context Miss Token (--cmt): a query whose CMT share is below this retrieves "
            "nothing, and a step whose queries all are searches no index (default 0: always retrieve)")


def add_index_tuning(p, train_size=None):
    p.add_argument("--train-size", type=int, default=train_size,
                   help=f"landmarks before IVF indexes train (default {train_size or '4096 ivf, 16384 ivfpq'})")
    p.add_argument("--nprobe", type=int, help="IVF lists visited per query (default 16)")
    p.add_argument("--ef-search", type=int, help="HNSW search breadth (default 128)")


def read_one_text(path):
    inputs = read_inputs([path])
    if len(inputs) != 1:
        raise UsageError(f"--input takes one text file, {path} holds {len(inputs)}")
    return inputs[0]


# ---- commands ---------------------------------------------------------------------------
def cmd_build(args):
    inputs = read_inputs(args.input)  # every input checked before the memory is touched
    path = Path(args.memory)
    fixed = {"index": args.index, "store": args.store, "chunk_size": args.chunk_size, "store_dtype": args.store_dtype}
    if (path / "manifest.json").exists():
        saved = MemoryDir(path, writable=False).read_manifest()
        was = {**{k: getattr(saved.options, k) for k in fixed}, "block_size": saved.model.shape.block_size}
        changed = [k for k, v in {**fixed, "block_size": args.block_size}.items() if v and v != was[k]]
        if changed:
            raise UsageError(f"{path} was built with " + ", ".join(f"{k}={was[k]}" for k in changed)
                             + "; these cannot change: drop the flags or build a new memory")
        model, tok = load_model(args.model, args.device, saved.model.shape.block_size)
        query = {"top_k": args.top_k} if args.top_k else {}
        mem = LandmarkMemory.open(path, model, **query)
        created = False
    else:
        model, tok = load_model(args.model, args.device, args.block_size)
        opts = {k: v for k, v in fixed.items() if v is not None}
        opts.setdefault("store", "lmdb")
        mem = LandmarkMemory(model, path=path, top_k=args.top_k or 4, **opts)
        created = True
    try:
        summary = build(mem, inputs, tok, commit_every=args.commit_every, progress=not args.quiet)
    finally:
        mem.close(commit=False)  # build() committed everything it fed
    doc = {"memory": str(path), "created": created, **summary, "tokens": mem.n_tokens, "blocks": mem.n_blocks,
           "commit": mem.commit_count}
    lines = [f"{'created' if created else 'updated'} {path}: {mem.n_tokens:,} tokens in {mem.n_blocks:,} blocks "
             f"(commit {mem.commit_count}); {summary['added']:,} tokens added"]
    lines += [f"skipped (already in memory): {s}" for s in summary["skipped"]]
    if summary["interrupted"]:
        lines.append("interrupted: everything fed so far is committed; run the same build again to continue")
    emit(args, doc, "\n".join(lines))
    return 130 if summary["interrupted"] else 0


def memory_info(path: str | Path) -> dict:
    """The manifest's facts about a memory, with its files checked."""
    d = MemoryDir(path, writable=False)
    m, _ = d.read_commit()
    d.read_block_rows(m)  # present and long enough
    disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    o = m.options
    return {"memory": str(path), "tokens": m.tokens, "blocks": m.blocks, "pending_tokens": m.pending_tokens,
            "streams": m.streams, "index": o.index, "store": o.store, "store_dtype": o.store_dtype,
            "block_bytes": m.block_bytes, "chunk_size": o.chunk_size, "top_k": o.top_k,
            "block_size": m.model.shape.block_size, "commit": m.commit, "updated": m.updated, "disk_bytes": disk,
            "model": {"fingerprint": m.model.fingerprint, "config": m.model.config},
            "inputs": [{"path": e.path, "tokens": e.tokens, "ingested": e.ingested, "start": e.start,
                        "sha256": e.sha256, "done": e.done} for e in m.inputs]}


def cmd_info(args):
    info = memory_info(args.memory)
    lines = [f"memory      {info['memory']} (commit {info['commit']}, {info['updated']})",
             f"tokens      {info['tokens']:,} in {info['blocks']:,} blocks of {info['block_size']} "
             f"(+{info['pending_tokens']} in the open chunk)",
             f"index       {info['index']}, store {info['store']} ({info['store_dtype']}), "
             f"chunk {info['chunk_size']}, top-k {info['top_k']}",
             f"disk        {info['disk_bytes'] / 2**20:,.1f} MiB",
             f"inputs      {len(info['inputs'])}"]
    lines += [f"  {'done' if e['done'] else 'partial':7s} {e['ingested']:>10,} / {e['tokens']:<10,} {e['path']}"
              for e in info["inputs"]]
    emit(args, info, "\n".join(lines))
    return 0


def source_of(mem, ids, block, tok):
    """(passage text, source path, token offset in that source) of a memory block; ``ids``
    are the memory's tokens."""
    bs = mem.shape.block_size
    ids = ids[block * bs:(block + 1) * bs]
    at = block * bs
    for e in mem.inputs:
        if e.start <= at < e.start + e.tokens:
            return tok.decode(ids.tolist()), e.path, at - e.start
    return tok.decode(ids.tolist()), None, at


def cmd_ask(args):
    saved = MemoryDir(args.memory, writable=False).read_manifest()
    model, tok = load_model(args.model, args.device, saved.model.shape.block_size)
    query = {k: v for k, v in (("top_k", args.top_k), ("cmt_cutoff", args.cmt_cutoff)) if v is not None}
    mem = LandmarkMemory.open(args.memory, model, readonly=True, **query)
    n_saved = mem.n_blocks  # blocks the prompt adds are not passages of the memory
    ids = tok.encode(args.prompt).ids
    if not ids:
        raise UsageError("the prompt is empty")
    uses = Counter()

    def feed(nxt):  # (1, 1) -> (1, vocab), counting the blocks the last position read
        out = mem.forward(nxt.to(mem.device))
        for r in out.retrieved:  # (1, H, T, k)
            uses.update(b for b in r[0, :, -1].flatten().tolist() if 0 <= b < n_saved)
        return out.logits[:, -1]

    logits = feed(torch.tensor([ids]))
    new = decode(logits, feed, args.max_new_tokens, temperature=args.temperature,
                 generator=torch.Generator().manual_seed(args.seed))[0].tolist()
    if new:  # the last new token reads the memory too: its lookups count with the others'
        feed(torch.tensor([new[-1:]]))
    mem.close()
    total = sum(uses.values()) or 1
    passages, memory_ids = [], mem.tokens()
    for block, n in uses.most_common(args.passages):
        text, src, offset = source_of(mem, memory_ids, block, tok)
        passages.append({"block": block, "share": n / total, "source": src, "token_offset": offset, "text": text})
    doc = {"prompt": args.prompt, "text": tok.decode(new), "retrieved": passages, "memory_tokens": mem.n_tokens}
    lines = [args.prompt + tok.decode(new)]
    if args.show_retrieved:
        for p in passages:
            lines.append(f"\n--- retrieved block {p['block']} ({100 * p['share']:.0f}% of lookups), "
                         f"{p['source']} at token {p['token_offset']:,}:\n{p['text'].strip()}")
    emit(args, doc, "\n".join(lines))
    return 0


def cmd_eval(args):
    inp = read_one_text(args.input)
    model, tok = load_model(args.model, args.device)
    ids = encode(tok, inp.text)
    mem = memory_options(args, model) if uses_memory(model, args.full_attention) else None
    res = perplexity(model, ids, args.eval_length, memory=mem, max_segments=args.max_segments, progress=not args.quiet)
    mode = "memory" if mem else reading_mode(model)
    doc = {"input": str(inp.path), "mode": mode, "eval_length": args.eval_length, **({"memory": mem} if mem else {}),
           **{k: res[k] for k in ("perplexity", "loss", "tokens", "segments", "seconds")}}
    emit(args, doc, f"{inp.path.name}: perplexity {res['perplexity']:.3f} over {res['tokens']:,} tokens "
                    f"({res['segments']} segments of {args.eval_length}, {mode}), {res['seconds']:.1f} s")
    return 0


def cmd_compare(args):
    inp = read_one_text(args.input)
    model, tok = load_model(args.model, args.device)
    if not is_landmark(model):
        raise UsageError("compare measures retrieval: give a landmark model")
    kinds = [k.strip() for k in args.index.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise UsageError(f"unknown index kind(s) {', '.join(bad)}; choose from {', '.join(KINDS)}")
    ids = encode(tok, inp.text)
    length = args.eval_length or len(ids) - 1
    opts = memory_options(args, model)
    opts.pop("index")
    rows = compare_indexes(model, ids, kinds, length, opts, max_segments=args.max_segments, progress=not args.quiet)
    if args.plot:
        from .plots import plot_compare

        plot_compare(rows, args.plot, title=f"{inp.path.name}: {length:,}-token segments, top-{args.top_k}")
    doc = {"input": str(inp.path), "eval_length": length, "top_k": args.top_k, "chunk_size": opts["chunk_size"],
           "index_options": opts["index_options"], "rows": rows}
    lines = [f"{inp.path.name}: segments of {length:,} tokens, top-{args.top_k}, chunk {opts['chunk_size']}",
             f"{'index':8s} {'perplexity':>10s} {'vs exact':>9s} {'recall@k':>9s} {'search ms':>10s} {'searches':>9s}"]
    lines += [f"{r['index']:8s} {r['perplexity']:10.3f} {r['ppl_delta_pct']:+8.2f}% {r['recall']:9.3f} "
              f"{r['search_ms']:10.3f} {r['searches']:9,}" for r in rows]
    emit(args, doc, "\n".join(lines))
    return 0


def cmd_passkey(args):
    model, tok = load_model(args.model, args.device)
    lengths = parse_lengths(args.lengths)
    mem = memory_options(args, model) if uses_memory(model, args.full_attention) else None
    rows = passkey_accuracy(model, tok, lengths, args.trials, args.seed, memory=mem, progress=not args.quiet)
    label = "landmark + memory" if mem else reading_mode(model)
    if args.plot:
        from .plots import plot_passkey

        plot_passkey({label: rows}, args.plot)
    doc = {"model": str(args.model or BUNDLED_MODEL), "mode": label, "trials": args.trials, "seed": args.seed,
           **({"memory": mem} if mem else {}), "results": rows}
    lines = [f"passkey, {label}, {args.trials} trials per length (seed {args.seed})"]
    lines += [f"{r['length']:>9,} tokens: {100 * r['accuracy']:5.1f}% ({r['correct']}/{r['trials']})" for r in rows]
    emit(args, doc, "\n".join(lines))
    return 0


def cmd_demo(args):
    from .demo import run_demo

    return run_demo(args)


def cmd_train(argv):
    from .train import main as train_main

    train_main(argv)
    return 0


# ---- argument parsing -------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="landmark-memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    sub.add_parser("train", help="train a model (the options of experiments/train.py; see `train --help`)",
                   add_help=False)

    p = sub.add_parser("build", parents=[common], help="build or extend a saved memory from text files")
    p.add_argument("memory", help="memory directory (created if absent, extended if present)")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_DIR", help=".txt files or folders of them")
    add_model_args(p)
    p.add_argument("--index", choices=KINDS, help="landmark index of a new memory (default flat)")
    p.add_argument("--store", choices=("lmdb", "mmap"), help="block store of a new memory (default lmdb)")
    p.add_argument("--store-dtype", choices=sorted(DTYPES), help="stored key/value dtype (default: the model's)")
    p.add_argument("--block-size", type=int, help="tokens per block (default: the model's)")
    p.add_argument("--chunk-size", type=int, help=CHUNK_HELP + "; fixed when the memory is created")
    p.add_argument("--top-k", type=int, help="blocks retrieved per query (default 4)")
    p.add_argument("--commit-every", type=float, default=60.0, metavar="SECONDS",
                   help="commit at least this often (default 60; each input's end commits too)")
    p.set_defaults(fn=cmd_build)

    p = sub.add_parser("info", parents=[common], help="what a memory holds")
    p.add_argument("memory")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("ask", parents=[common], help="continue from a memory's end with a prompt")
    p.add_argument("memory")
    p.add_argument("prompt")
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed when temperature > 0")
    p.add_argument("--top-k", type=int, help="blocks retrieved per query (default: the memory's)")
    p.add_argument("--cmt-cutoff", type=float, help=CMT_HELP)
    p.add_argument("--show-retrieved", action="store_true", help="print the passages the answer read")
    p.add_argument("--passages", type=int, default=3, help="passages to report (default 3)")
    p.set_defaults(fn=cmd_ask)

    p = sub.add_parser("eval", parents=[common], help="perplexity of a text (paper Table 1 protocol)")
    p.add_argument("--input", required=True, metavar="FILE")
    add_model_args(p)
    p.add_argument("--eval-length", type=int, default=2048, help="tokens per segment (default 2048)")
    p.add_argument("--max-segments", type=int, help="evaluate only the first segments")
    p.add_argument("--full-attention", action="store_true",
                   help="each segment in one forward, no memory (the model's own attention)")
    add_retrieval_args(p)
    add_index_tuning(p)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("compare", parents=[common], help="exact vs approximate retrieval: perplexity, recall, latency")
    p.add_argument("--input", required=True, metavar="FILE")
    add_model_args(p)
    p.add_argument("--index", default="flat,hnsw,ivf,ivfpq", help="index kinds, comma-separated (default all CPU kinds)")
    p.add_argument("--eval-length", type=int, default=0, help="tokens per segment (default 0: the whole text)")
    p.add_argument("--max-segments", type=int, help="evaluate only the first segments")
    p.add_argument("--chunk-size", type=int, help=CHUNK_HELP)
    p.add_argument("--top-k", type=int, default=4, help="blocks retrieved per query (default 4)")
    p.add_argument("--retrieval", choices=RETRIEVALS, default="per_token_head")
    p.add_argument("--position-mapping", choices=MAPPINGS, default="stingy")
    add_index_tuning(p, train_size=1024)
    p.add_argument("--plot", metavar="FILE.png", help="bar charts of the table")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("passkey", parents=[common], help="the paper's passkey retrieval test")
    add_model_args(p)
    p.add_argument("--lengths", default="1k,2k,4k,8k", help="prompt lengths in tokens (default 1k,2k,4k,8k; k = 1024)")
    p.add_argument("--trials", type=int, default=10, help="prompts per length (default 10)")
    p.add_argument("--seed", type=int, default=0, help="keys and depths are reproducible from it")
    p.add_argument("--full-attention", action="store_true", help="whole prompt in one forward, no memory")
    p.add_argument("--plot", metavar="FILE.png", help="accuracy vs length")
    add_retrieval_args(p)
    add_index_tuning(p)
    p.set_defaults(fn=cmd_passkey)

    p = sub.add_parser("demo", parents=[common], help="build, save, reopen and query a memory over the sample book")
    p.add_argument("--out", help="where to keep the memory (default: a temporary folder, removed afterwards)")
    p.add_argument("--seed", type=int, help="where the passkey goes and what it is (default: random)")
    p.add_argument("--book", metavar="FILE", help="a text file to use instead of the bundled sample book")
    add_model_args(p)
    p.set_defaults(fn=cmd_demo)
    return ap


ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, MemoryFileError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":
        return cmd_train(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ERRORS as e:
        print(f"landmark-memory {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"landmark-memory {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
