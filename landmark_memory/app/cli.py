"""The ``landmark-memory`` command: each sub-command's work (``cli_args.py`` holds the command
line, ``entry.py`` the entry point that parses it before the heavy imports)."""

import contextlib
import errno
import os
import signal
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path

from ..core.printing import printable
from ..format import MemoryDir
from ..format.manifest import FORMAT_VERSION
from ..format.options import MemoryOptions
from ..format.session_files import delete_session, list_sessions
from ..jobs.build import build, read_inputs
from ..jobs.distributed import RayReader, WorkerError
from ..memory import LandmarkMemory
from ..models.kinds import load_model, model_name
from ..uses.answer import ask
from ..uses.answering import choose_policy
from ..uses.inspect import describe, verify
from ..uses.search import search, snippet
from ..uses.session import Session
from .cli_args import ask_options, given, parser
from .cli_common import UsageError, emit, saved_model, say_block_keys
from .cli_measure import cmd_compare, cmd_eval, cmd_passkey
from .stopping import exit_status, sigterm_interrupts


def cmd_build(args):
    inputs = read_inputs(args.input)  # every input checked before the memory is touched
    path = Path(args.memory)
    if args.ray_address and not args.workers:
        raise UsageError("--ray-address needs --workers: how many workers read documents on the cluster")
    fixed = {"index": args.index, "store": args.store, "chunk_size": args.chunk_size, "store_dtype": args.store_dtype,
             "block_keys": args.block_keys}
    saved = saved_model(args, required=False)
    if saved is not None:
        if not saved.documents:
            raise UsageError(f"{path} reads its inputs in one context (a memory built before corpora); build now "
                             "reads each file as its own document: build into a new memory (this one still opens "
                             "for ask)")
        was = {**{k: getattr(saved.options, k) for k in fixed}, "block_size": saved.model.shape.block_size,
               "train_size": saved.options.index_options.get("train_size")}
        asked = {**fixed, "block_size": args.block_size, "train_size": args.train_size}
        changed = [k for k, v in asked.items() if v and v != was[k]]
        if changed:
            raise UsageError(f"{path} was built with " + ", ".join(f"{k}={was[k]}" for k in changed)
                             + "; these cannot change: drop the flags or build a new memory")
    block_size = saved.model.shape.block_size if saved else args.block_size
    loaded = load_model(args.model, args.device, block_size)
    model, tok = loaded.model, loaded.tokenizer
    reader = (RayReader(args.workers, args.ray_address, args.model, args.device, block_size, args.worker_threads,
                        memory=path) if args.workers else contextlib.nullcontext())
    with reader:  # Ray is up and every worker sees the folder before anything is written
        if saved is not None:
            mem = LandmarkMemory.open(path, model, **given(args, "top_k"))
        else:
            settings = {**fixed, "store": args.store or "lmdb", "top_k": args.top_k, "block_size": args.block_size,
                        "index_options": {"train_size": args.train_size} if args.train_size else None}
            mem = LandmarkMemory(model, MemoryOptions.of(**{k: v for k, v in settings.items() if v is not None}),
                                 path=path, documents=True)
        say_block_keys(model, mem.options)
        try:
            summary = build(mem, inputs, tok, reader=reader if args.workers else None, commit_every=args.commit_every,
                            progress=not args.quiet, leave_unfinished=args.leave_unfinished)
        finally:
            mem.close(commit=False)  # build() committed everything it merged
    doc = {"memory": str(path), "created": saved is None, **asdict(summary), "documents": len(mem.inputs),
           "tokens": mem.n_tokens, "blocks": mem.n_blocks, "commit": mem.manifest.commit,
           "workers": args.workers or 0}
    lines = [f"{'updated' if saved else 'created'} {path}: {len(mem.inputs):,} documents, {mem.n_tokens:,} tokens in "
             f"{mem.n_blocks:,} blocks (commit {mem.manifest.commit}); {summary.added:,} tokens read now in "
             f"{summary.seconds:,.1f} s ({summary.added / max(summary.seconds, 1e-9):,.0f} tokens/s)"]
    lines += [f"skipped (already in memory): {s}" for s in summary.skipped]
    lines += [f"left unfinished: {s}" for s in summary.left]
    lines += [f"set aside, not merged: {s}" for s in summary.set_aside]
    if summary.interrupted:
        lines.append(f"interrupted ({summary.interrupted}): every document read so far is committed; run the same "
                     "build again to continue")
    emit(args, doc, "\n".join(lines))
    return 128 + signal.Signals[summary.interrupted].value if summary.interrupted else 0


def _layers(info: dict) -> str:
    """Which layers keep a memory, in words."""
    n, kept, windows = info["layers"], info["memory_layers"], sorted(set(info["windows"].values()))
    if kept == n:
        return f"{n}, each with a memory"
    return (f"{kept} of {n} with a memory (the other {n - kept} attend to a sliding window of "
            f"{' or '.join(map(str, windows))} positions and keep only it)")


def _text_index(state: dict | None, blocks: int) -> str:
    if state is None:
        return "none (`landmark-memory index` writes one; readers build it in memory meanwhile)"
    held = f"unreadable: {state['problem']}" if state["blocks"] is None else \
        f"{state['blocks']:,} of {blocks:,} blocks"
    trust = "sealed" if state["sealed"] else "not sealed: built again by the next writer, in memory by readers"
    return f"{held}, {state['bytes'] / 2**20:,.1f} MiB, {trust}"


def cmd_info(args):
    if args.verify:
        return cmd_verify(args)
    info = describe(args.memory)
    kind = "documents" if info["documents"] else "inputs"
    lines = [f"memory      {info['memory']} (commit {info['commit']}, {info['updated']})",
             f"tokens      {info['tokens']:,} in {info['blocks']:,} blocks of {info['block_size']} "
             f"(+{info['pending_tokens']} in the open chunk)",
             "blocks      " + ("searched by their landmarks' keys" if info["block_keys"] == "landmark" else
                                "searched by the mean of their own keys (no landmarks: training-free)"),
             f"index       {info['index']} ({info['index_search']}), store {info['store']} ({info['store_dtype']}), "
             f"chunk {info['chunk_size']}, top-k {info['top_k']}",
             f"layers      {_layers(info)}; {info['store_bytes_per_token']:,.0f} bytes per token in the store",
             f"disk        {info['disk_bytes'] / 2**20:,.1f} MiB" + (
                 f" ({info['bytes_per_token']:,.0f} bytes per token read)" if info["bytes_per_token"] else ""),
             f"sessions    {info['sessions']:,} ({info['sessions_bytes'] / 2**20:,.1f} MiB)",
             f"text index  {_text_index(info['text_index'], info['blocks'])}",
             f"{kind:11s} {len(info['inputs'])}"]
    lines += [f"  {e['status']:7s} {e['ingested']:>10,} / {e['tokens']:<10,} {e['path']}" for e in info["inputs"]]
    emit(args, info, "\n".join(lines))
    return 0


def cmd_verify(args):
    report = verify(args.memory)
    doc = {"memory": str(args.memory), "ok": report.ok, "problems": report.problems,
           "damaged_blocks": [dict(zip(("stream", "layer", "block"), k)) for k in report.damaged_blocks],
           "blocks_checked": report.blocks_checked, "indexes_checked": report.indexes_checked}
    head = (f"{args.memory}: sound ({report.blocks_checked:,} stored blocks and {report.indexes_checked:,} indexes "
            "checked)" if report.ok else f"{args.memory}: damaged, {len(report.problems)} problem(s); restore the "
            "memory from a backup or rebuild it")
    emit(args, doc, "\n".join([head, *(f"  {p}" for p in report.problems)]))
    return 0 if report.ok else 2


def cmd_ask(args):
    saved = saved_model(args)
    loaded = load_model(args.model, args.device, saved.model.shape.block_size)
    model = loaded.model
    with LandmarkMemory.open(args.memory, model, readonly=True, **given(args, "top_k", "cmt_cutoff")) as mem:
        say_block_keys(model, mem.options)
        answer = ask(mem, loaded, args.prompt, ask_options(args))
    doc = {"prompt": args.prompt, "chat": answer.chat, "text": answer.text,
           "retrieved": [asdict(p) for p in answer.passages], "memory_tokens": answer.memory_tokens,
           **answer.evidence_fields()}
    lines = [f"Q: {args.prompt}\nA: {answer.text.strip()}" if answer.chat else args.prompt + answer.text]
    lines += answer.evidence_lines()
    if args.show_retrieved:
        for p in answer.passages:
            lines.append(f"\n--- retrieved block {p.block} ({100 * p.share:.0f}% of lookups), "
                         f"{p.source} at token {p.token_offset:,}:\n{p.text.strip()}")
    emit(args, doc, "\n".join(lines))
    return 0


def cmd_search(args):
    saved = saved_model(args)
    loaded = load_model(args.model, args.device, saved.model.shape.block_size)
    model = loaded.model
    with LandmarkMemory.open(args.memory, model, readonly=True) as mem:
        found = search(mem, loaded, args.question, k=args.passages)
    r = found.ranking
    lines = [f"Q: {args.question}"]
    if found.quote is not None:
        lines.append(f"Quote: {found.quote.cited()}")
    for i, p in enumerate(found.passages, 1):
        where = f"session {p.session}, turn {p.turn + 1}" if p.session else p.source or "the memory"
        text = p.text.strip() if args.full else snippet(p.text, args.question)
        lines.append(f"{i}. block {p.block} ({where}, token {p.token_offset:,}): {text}")
    if not found.passages:
        lines.append("(no passage: the memory holds none of the question's words)")
    lines.append(f"{found.seconds * 1000:,.0f} ms; heads {len(r.heads)} candidates ranked, text index "
                 f"{len(r.text)} blocks with its words")
    emit(args, found.to_json(), "\n".join(lines))
    return 0


def cmd_index(args):
    saved = saved_model(args)
    loaded = load_model(args.model, args.device, saved.model.shape.block_size)
    model, tok = loaded.model, loaded.tokenizer
    mem, t0 = LandmarkMemory.open(args.memory, model), time.perf_counter()
    try:
        added = mem.text_index.keep(tok, quiet=args.quiet, check=True)  # (a damaged index is built again)
        if saved.version < FORMAT_VERSION:  # an older memory's commit in this format (its ivf-rows runs written)
            mem.commit()
    finally:
        mem.close(commit=False)  # (nothing else to commit: the text index is written and sealed)
    emit(args, {"memory": args.memory, "blocks": mem.n_blocks, "added": added, "format_was": saved.version},
         f"{args.memory}: text index of {mem.n_blocks:,} blocks ({added:,} added) in "
         f"{time.perf_counter() - t0:,.1f} s" + (f"; format {saved.version} brought to {FORMAT_VERSION}"
                                                 if saved.version < FORMAT_VERSION else ""))
    return 0


def cmd_chat(args):
    from .chat import chat

    saved = saved_model(args)
    loaded = load_model(args.model, args.device, saved.model.shape.block_size)
    model, options = loaded.model, ask_options(args)
    choose_policy(loaded, options)  # (a policy the model cannot answer by: one line, before a session is made)
    with LandmarkMemory.open(args.memory, model, readonly=True, **given(args, "top_k")) as mem:
        say_block_keys(model, mem.options)
        with Session.open(mem, args.session) as session:
            if args.session is None:
                print(f"session {session.name} (resume it with --session {session.name})", file=sys.stderr)
            return chat(session, loaded, options, as_json=args.json)


def cmd_sessions(args):
    from .chat import sessions_text

    MemoryDir(args.memory, writable=False).read_manifest()  # a memory, or one line saying why not
    if args.delete:
        delete_session(args.memory, args.delete)
        emit(args, {"deleted": args.delete}, f"deleted the session {args.delete}")
        return 0
    emit(args, [asdict(s) for s in list_sessions(args.memory)], sessions_text(args.memory))
    return 0


API_KEY_VARIABLE = "LANDMARK_MEMORY_API_KEY"


def cmd_serve(args):
    from .serve import ServeConfig, create_app, serve

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)
    if key is not None and not key.strip():
        raise UsageError(f"{API_KEY_VARIABLE} is set but empty: an empty key would turn authentication off; set a "
                         "key, or unset it to serve without one")
    if args.ray_address and not args.shares:
        raise UsageError("--ray-address runs a corpus's shares on that cluster: give --shares N too")
    saved = saved_model(args)
    loaded = load_model(args.model, args.device, saved.model.shape.block_size)
    model = loaded.model
    cfg = ServeConfig(Path(args.memory), str(args.model or "landmark-memory-tiny"), api_key=key, host=args.host,
                      allowed_hosts=tuple(args.allowed_host), parallel=args.parallel, max_tokens=args.max_tokens,
                      max_body=args.max_body, shares=args.shares or 0, ray_address=args.ray_address, model=args.model)
    app = create_app(cfg, loaded)  # opens the memory: the right model, a readable memory
    say_block_keys(model, saved.options)
    print(f"serving {printable(str(args.memory))} with {printable(cfg.model_name)} at http://{args.host}:{args.port}/ "
          "(Ctrl-C stops)", file=sys.stderr)
    serve(app, args.host, args.port)
    return 0


def cmd_heads(args):
    from ..models.heads import heads_path, save_heads
    from ..uses.choose_heads import choose_heads, shipped_questions

    if args.model is None:
        raise UsageError("the bundled model was trained on books alone and answers no questions: pass --model (a "
                         "Hugging Face model's folder or smollm2, smollm2-landmark)")
    loaded = load_model(args.model, args.device)
    model, tok = loaded.model, loaded.tokenizer
    questions, texts = shipped_questions()
    heads, how = choose_heads(model, tok, questions, texts, tokens=args.tokens, progress=not args.json)
    heads = replace(heads, blocks=args.blocks)
    path = heads_path(args.model)
    save_heads(heads, path, model=model_name(args.model), chosen_by=how)
    recall = how["recall@5"][how["count"]]
    emit(args, {"model": model_name(args.model), "path": str(path), "heads": [list(h) for h in heads.heads],
                "blocks": heads.blocks, **how},
         f"{len(heads.heads)} retrieval heads (memory layer, key/value head) {list(heads.heads)}: the evidence's block "
         f"among the first 5 for {100 * recall:.0f}% of {how['questions']} development questions; saved to {path} "
         "(ask, chat and serve read with them)")
    return 0


def cmd_demo(args):
    from ..jobs.demo import run_demo

    return run_demo(args)


def cmd_train(argv):
    from ..training.train import main as train_main

    train_main(argv, prog="landmark-memory train")
    return 0


COMMANDS = {"build": cmd_build, "info": cmd_info, "ask": cmd_ask, "search": cmd_search, "index": cmd_index,
            "chat": cmd_chat, "sessions": cmd_sessions,
            "serve": cmd_serve, "eval": cmd_eval,
            "compare": cmd_compare, "passkey": cmd_passkey, "heads": cmd_heads, "demo": cmd_demo}
ERRORS = (ValueError, OSError, WorkerError)  # bad input, damaged memories (MemoryFileError), files that cannot be
# read or written, a worker dying again and again


def os_error_text(e: OSError) -> str:
    """What an error of the operating system means for the command, and what to do."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno == errno.EROFS:
        return (f"the file system is read-only{where}: build into a folder on a writable disk (ask, info and serve "
                "read a memory without writing it)")
    if e.errno == errno.EACCES:
        return f"permission denied{where}: run as a user who may write there, or choose another folder"
    return str(e)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":
        return cmd_train(argv[1:])
    args = parser().parse_args(argv)
    # (serve: uvicorn answers SIGTERM itself, shutting down gracefully and ending by the signal)
    with sigterm_interrupts(args.command != "serve"), warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: print(
            f"landmark-memory {args.command}: warning: {printable(str(message))}", file=sys.stderr)
        try:
            return COMMANDS[args.command](args)
        except BrokenPipeError:  # whoever read the output stopped (`info | head`): end quietly, as Unix tools do
            with contextlib.suppress(OSError, ValueError):  # (and let the exit's flush write nowhere)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        except ERRORS as e:
            text = os_error_text(e) if isinstance(e, OSError) else str(e)
            print(f"landmark-memory {args.command}: error: {printable(text)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM
            print(f"landmark-memory {args.command}: interrupted", file=sys.stderr)
            return exit_status(e)


if __name__ == "__main__":
    sys.exit(main())
