"""Living in a corpus: what opening, asking, serving and appending to a memory cost as it grows,
as ratios against the smallest memory, measured in one run.

    python experiments/bench_scale.py --books BOOKS                              # 100K, 1M, 3.5M tokens, bundled
    python experiments/bench_scale.py --books BOOKS --models smollm2 --sizes 100k
    python experiments/bench_scale.py --books BOOKS --baseline ../old-checkout   # the same, an earlier version too

Each memory is built once, as a user builds one (``landmark-memory build --workers 2`` over
whole books in the books' manifest order, the last cut where the size is reached; past the 53
books, copies of them, each with a line of its own at the top), into ``--work``, where later runs find it
(and a stopped build goes on). Per memory, each in a fresh process: the open (three processes,
the median), the process's resident memory after it, a warm ``ask`` (8 questions, 8 tokens
each, on a memory kept open; the median), then appending a 2 KB document of its own and
committing it as ``build`` does (in the process, after the model loads; three documents, one
after the other, the median). Then ``serve`` in its
own process: 8 requests one at a time (p50, against the warm ask) and 16 requests 4 at a time
(p50, p95), and the disk the memory takes per token. With ``--baseline``, an earlier checkout
of the package measures memories it built itself the same way, in the same run.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"bundled": None, "smollm2": "smollm2-landmark"}
QUESTIONS = ["What did the captain say?", "Who came to the door?", "Where was the house?", "Why did she leave?",
             "What was in the letter?", "Who was the stranger?", "What happened at night?", "How did it end?"]
SIZES = {"100k": 100_000, "1m": 1_000_000, "3.5m": 3_500_000, "10m": 10_000_000, "30m": 30_000_000}
APPENDS = 3  # documents appended one after the other per memory (the median is its figure)


def size_arg(text: str) -> list[str]:
    sizes = [s.strip().lower() for s in text.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown size(s) {', '.join(bad)}; choose from {', '.join(SIZES)}")
    return sizes


def book_files(books: Path) -> list[Path]:
    """The books in the manifest's order (a folder without one: by name)."""
    manifest = books / "MANIFEST.tsv"
    if manifest.is_file():
        names = [line.split("\t")[0] for line in manifest.read_text().splitlines()[1:] if line.strip()]
        return [books / n for n in names if (books / n).is_file()]
    return sorted(books.glob("*.txt"))


def write_inputs(books: Path, folder: Path, tokens: int, tokenizer) -> None:
    """Whole books into ``folder`` until they hold ``tokens`` tokens; past the last book, copies
    of them, each with a first line of its own (a document is known by its content)."""
    if folder.is_dir() and (folder / "DONE").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    files, total, n = book_files(books), 0, 0
    while total < tokens:
        src = files[n % len(files)]
        copy = n // len(files)
        text = src.read_text(encoding="utf-8")
        if copy:
            text = f"Copy {copy} of {src.name}.\n" + text
        count = len(tokenizer.encode(text).ids)
        if total + count > tokens:  # the last book is cut where the size is reached
            text = text[:int(len(text) * (tokens - total) / count)]
            count = len(tokenizer.encode(text).ids)
        (folder / f"{n:05d}_{src.name}").write_text(text, encoding="utf-8")
        total += count
        n += 1
    (folder / "DONE").write_text(f"{n} files, {total} tokens\n")


CLI = [sys.executable, "-m", "landmark_memory.app.entry"]


def commit_of(package: Path | None) -> str:
    """The git commit a checkout of the package is at (default this one), short, "+" when the
    package's files differ from it; "" outside git."""
    git = ["git", "-C", str(package or ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(git + ["status", "--porcelain", "--", "landmark_memory"], capture_output=True, text=True)
    return head.stdout.strip() + ("+" if changed.stdout.strip() else "") if head.returncode == 0 else ""


def env_for(package: Path | None) -> dict:
    """This environment, with the package imported from ``package`` (a checkout; default this one).
    Commands run with ``-m`` get another working folder: Python looks for modules there first."""
    return {**os.environ, "PYTHONPATH": str(package or ROOT)}


def build_memory(memory: Path, inputs: Path, model: str | None, package: Path | None, workers: int) -> None:
    argv = CLI + ["build", str(memory), "--input", str(inputs), "--workers", str(workers), "--quiet"]
    argv += ["--model", model] if model else []
    t0 = time.time()
    run = subprocess.run(argv, env=env_for(package), capture_output=True, text=True, cwd=memory.parent)
    if run.returncode:
        raise SystemExit(f"building {memory} failed:\n{run.stderr[-2000:]}")
    print(f"  built {memory} in {time.time() - t0:.0f} s: {run.stdout.strip()}", file=sys.stderr)


def probe(args) -> None:
    """In a fresh process: open the memory read-only (time, resident memory), a warm ask, then
    (``--append``) append a 2 KB document and commit it. One JSON line on stdout."""
    import psutil
    import torch

    from landmark_memory.jobs.build import build, read_inputs
    from landmark_memory.memory import LandmarkMemory
    from landmark_memory.models.kinds import load_model
    from landmark_memory.uses.answer import ask

    torch.set_num_threads(args.threads)
    proc = psutil.Process()
    loaded = load_model(MODELS[args.models])
    if not hasattr(loaded, "model"):  # (a version before ``LoadedModel``: model and tokenizer)
        loaded = SimpleNamespace(model=loaded[0], tokenizer=loaded[1], asked=loaded[1])
    model, tok, asked = loaded.model, loaded.tokenizer, getattr(loaded, "asked", loaded)
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    mem = LandmarkMemory.open(args.probe, model, readonly=True)
    out = {"open_s": time.perf_counter() - t0, "rss_model_mb": rss0 / 2**20,
           "rss_open_mb": proc.memory_info().rss / 2**20, "tokens": mem.n_tokens}
    if args.asks:
        times = []
        for i, q in enumerate([QUESTIONS[0]] + QUESTIONS):  # the first warms up
            t0 = time.perf_counter()
            ask(mem, asked, q, max_new_tokens=8, raw=True)
            if i:
                times.append(time.perf_counter() - t0)
            if hasattr(mem, "rewind"):  # a kept memory forgets each question (earlier versions cannot)
                mem.rewind()
        out.update(ask_s=statistics.median(times), rss_ask_mb=proc.memory_info().rss / 2**20)
        out.update(searched(mem, asked))
    mem.close()
    if args.append:
        doc, seals = Path(args.append), Path(args.probe) / "keys" / "seals.json"
        book = book_files(Path(args.books))[0].read_text(encoding="utf-8")

        def append(unsealed: bool) -> float:
            doc.write_text(f"Appended at {time.time_ns()}.\n" + book[20_000:22_000], encoding="utf-8")
            if unsealed:  # the writer reads every key file, as before seals (format/seals.py)
                seals.unlink(missing_ok=True)
            t0 = time.perf_counter()
            with LandmarkMemory.open(args.probe, model) as w:
                build(w, read_inputs([doc]), tok, progress=False)
            return time.perf_counter() - t0

        out["append_s"] = statistics.median([append(False) for _ in range(APPENDS)])
        if args.unsealed:
            out["append_unsealed_s"] = statistics.median([append(True) for _ in range(APPENDS)])
    print(json.dumps(out))


def searched(mem, asked) -> dict:
    """The median seconds of ``search`` (5 passages, nothing generated) and of the text index's
    query alone over the questions, after one to warm up; {} for a version without them."""
    try:
        from landmark_memory.uses.search import search, text_ranking
    except ImportError:
        return {}
    times = {"search_s": [], "text_query_s": []}
    for i, q in enumerate([QUESTIONS[0]] + QUESTIONS):
        tok = getattr(asked, "tokenizer", asked)
        for key, run in (("search_s", lambda: search(mem, asked, q)),
                         ("text_query_s", lambda: text_ranking(mem, tok, q, mem.n_blocks))):
            t0 = time.perf_counter()
            run()
            if i:
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(xs) for key, xs in times.items()}


def read_speed(args) -> None:
    """Read the first ``args.read`` tokens of the longest books, one after another as one
    document, into a memory as a build's worker reads a document (``args.read_index`` or the
    default index, int8 blocks, no output head); tokens/s over each 50K. One JSON line on stdout."""
    import torch

    from landmark_memory.jobs.build import encode_document
    from landmark_memory.memory import LandmarkMemory
    from landmark_memory.models.kinds import backbone_for, load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(MODELS[args.models])
    model, tok = loaded.model, loaded.tokenizer
    books = sorted(book_files(Path(args.books)), key=lambda f: -f.stat().st_size)
    ids, n = [], 0
    for f in books:
        if n >= args.read:
            break
        ids.append(encode_document(tok, f.read_text(encoding="utf-8"), backbone_for(model).block_size))
        n += len(ids[-1])
    ids = torch.from_numpy(np.concatenate(ids)[:args.read]).long()[None]
    index = {"index": args.read_index} if args.read_index else {}
    mem, span, times = LandmarkMemory(model, store_dtype="int8", **index), 50_000, [(0, 0.0)]
    step = mem.options.chunk_size
    t0 = time.perf_counter()
    for at in range(0, ids.shape[1], step):
        mem.forward(ids[:, at:at + step], logits="none")
        if (at + step) % span < step:
            times.append((at + step, time.perf_counter() - t0))
    tps = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(times, times[1:])]
    print(json.dumps({"tokens": ids.shape[1], "index": mem.options.index, "read_first_tps": tps[0],
                      "read_last_tps": tps[-1], "read_min_tps": min(tps), "read_tps": tps}))


def run_probe(memory: Path, model: str, package: Path | None, threads: int, books: Path, asks=False,
              append: Path | None = None, unsealed: bool = False) -> dict:
    argv = [sys.executable, __file__, "--probe", str(memory), "--models", model, "--threads", str(threads),
            "--books", str(books)] + (["--asks"] if asks else []) + (["--append", str(append)] if append else [])
    argv += ["--unsealed"] if unsealed else []
    run = subprocess.run(argv, env=env_for(package), capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"measuring {memory} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def rows_and_indexes(memory: Path, everywhere: bool) -> int:
    """Bytes of token rows, landmark keys and index state in the corpus and its documents
    (``everywhere``: what the disk holds beyond the blocks themselves), or of one copy: the
    corpus's token rows and landmark keys."""
    def rows(f: Path) -> bool:
        return f.name in ("tokens.bin", "landmarks.bin") or f.parent.name == "keys"

    if not everywhere:
        return sum(f.stat().st_size for f in [*memory.iterdir(), *(memory / "keys").glob("*")] if f.is_file()
                   and rows(f))
    return sum(f.stat().st_size for f in memory.rglob("*") if f.is_file() and (rows(f) or f.name.startswith("state.")))


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure_server(memory: Path, model: str, package: Path | None) -> dict:
    from _common import serving

    served = MODELS[model] or "landmark-memory-tiny"
    with serving(memory, MODELS[model], env=env_for(package)) as (url, proc):
        def one(q):
            body = json.dumps({"model": served, "prompt": q, "max_tokens": 8}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                json.loads(r.read())
            return time.perf_counter() - t0

        one(QUESTIONS[0])  # warm
        alone = [one(q) for q in QUESTIONS]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(one, QUESTIONS + QUESTIONS))
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "/v1/memory", timeout=600) as r:
            info = json.loads(r.read())
        info_s = time.perf_counter() - t0
        rss = _rss_mb(proc.pid)
    return {"serve_alone_p50_s": statistics.median(alone), "serve_p50_s": percentile(together, 0.5),
            "serve_p95_s": percentile(together, 0.95), "memory_route_s": info_s, "serve_rss_mb": rss,
            "disk_bytes": info["disk_bytes"]}


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus the memories are built from")
    ap.add_argument("--models", default="bundled", help="bundled, smollm2 or both, comma-separated (default bundled)")
    ap.add_argument("--sizes", type=size_arg, default=["100k", "1m", "3.5m"],
                    help=f"memory sizes in tokens, comma-separated, from {', '.join(SIZES)} (default 100k,1m,3.5m)")
    ap.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "landmark-memory", "bench-scale"),
                    help="where the memories are built and kept between runs")
    ap.add_argument("--baseline", default=None, help="a checkout of an earlier version to measure beside this one")
    ap.add_argument("--baseline-sizes", type=size_arg, default=None, help="the sizes the baseline measures (default "
                                                                          "all)")
    ap.add_argument("--read-tokens", type=int, default=500_000,
                    help="tokens of one long document read in this process to time the first and last 50K (0: not)")
    ap.add_argument("--workers", type=int, default=2, help="Ray workers that build each memory (default 2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the measuring processes")
    ap.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--asks", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--append", help=argparse.SUPPRESS)
    ap.add_argument("--unsealed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--read-indexes", default="",
                    help="index kinds the long document is read with, comma-separated (default: each version's "
                         "default)")
    ap.add_argument("--read", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--read-index", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.read:
        return read_speed(args)
    if args.probe:
        return probe(args)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if any(m not in MODELS for m in models):
        ap.error(f"--models: choose from {', '.join(MODELS)}")
    started, books, work = time.time(), Path(args.books), Path(args.work)
    versions = [("this version", None)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    from _common import command_line

    from landmark_memory.models.kinds import load_model

    rows, memories = [], []
    for model in models:  # every memory built first: nothing else runs while they are measured
        tok = load_model(MODELS[model]).tokenizer
        for size in args.sizes:
            inputs = work / f"{model}-{size}" / "inputs"
            write_inputs(books, inputs, SIZES[size], tok)
            for label, package in versions:
                if package is not None and args.baseline_sizes is not None and size not in args.baseline_sizes:
                    continue
                memory = work / f"{model}-{size}" / ("memory" if package is None else "memory-baseline")
                build_memory(memory, inputs, MODELS[model], package, args.workers)
                memories.append((model, size, label, package, memory))
    for model, size, label, package, memory in memories:
        print(f"  measuring {memory} ({label})", file=sys.stderr)
        opens = [run_probe(memory, model, package, args.threads, books) for _ in range(2)]
        full = run_probe(memory, model, package, args.threads, books, asks=True,
                         append=work / f"{model}-{size}" / f"append-{label.split()[0]}.txt")
        row = {"model": model, "size": size, "version": label, "commit": commit_of(package), **full,
               "open_s": statistics.median([o["open_s"] for o in opens] + [full["open_s"]]),
               **measure_server(memory, model, package)}
        row["disk_per_token"] = row["disk_bytes"] / row["tokens"]
        row["rows_copies"] = rows_and_indexes(memory, everywhere=True) / rows_and_indexes(memory, everywhere=False)
        row["keys_bytes"] = sum(f.stat().st_size for f in [*(memory / "keys").glob("*.f32"), memory / "landmarks.bin"]
                                if f.is_file())
        print("   ", json.dumps(row), file=sys.stderr)
        rows.append(row)
    if args.read_tokens:  # reading one long document, as a build's worker reads it
        kinds = [k.strip() for k in args.read_indexes.split(",") if k.strip()] or [""]
        for model in models:
            for label, package in versions:
                for kind in kinds:
                    argv = [sys.executable, __file__, "--read", str(args.read_tokens), "--models", model, "--books",
                            str(books), "--threads", str(args.threads), "--read-index", kind]
                    run = subprocess.run(argv, env=env_for(package), capture_output=True, text=True)
                    if run.returncode:
                        raise SystemExit(f"reading failed:\n{run.stderr[-3000:]}")
                    reading = json.loads(run.stdout.strip().splitlines()[-1])
                    print("   ", label, json.dumps(reading), file=sys.stderr)
                    rows.append({"model": model, "version": label, "commit": commit_of(package),
                                 "size": f"read {reading['index']}", **reading})
    # rows of earlier runs (other models or sizes) stay, each group's ratios from its own run
    state = Path(args.results) / "scale.json"
    old = json.loads(state.read_text()) if state.is_file() else {"commands": [], "rows": []}
    key = lambda r: (r["model"], r["size"], r["version"])  # noqa: E731
    mine = {key(r) for r in rows}
    rows = [r for r in old["rows"] if key(r) not in mine and (r["model"], r["version"]) not in
            {(m, v) for m, _, v in mine}] + rows
    commands = [c for c in old["commands"] if c != command_line()] + [command_line()]
    state.write_text(json.dumps({"commands": commands, "rows": rows}, indent=1) + "\n")
    report(rows, commands, args, started)


def on_paper(groups: dict) -> list[str]:
    """What a billion tokens would take, scaled from the largest memory of each model measured."""
    out = ["## A billion tokens, on paper", ""]
    for (model, version), group in groups.items():
        if version != "this version":
            continue
        r = max(group, key=lambda r: r["tokens"])
        keys = r["keys_bytes"] / r["tokens"]
        out += [f"- {model}: the {r['size']} memory takes {r['disk_per_token']:,.0f} bytes of disk per token, so 1B "
                f"tokens take {r['disk_per_token'] / 1000:.2f} TB; its landmark keys {keys:.1f} bytes per token, "
                f"{keys:.1f} GB at 1B. The default ivf-rows index reads the keys of the lists a query probes, "
                "about 8 sqrt(n) of a layer-head's n (0.2% at 1B tokens of the bundled model), so the keys "
                "can stay on local disk, mapped, with the page cache holding what is read."]
    out += ["- A corpus too large for one machine: documents are read apart already, so both halves shard by "
            "document range. Each Ray actor would map the key files and lists of its share of the "
            "documents and search it; the driver merges the shards' top-k per query exactly as a read-only memory "
            "merges its saved blocks and its overlay today (`BlockMemory._search`), and reads the chosen blocks "
            "from the documents' stores.", ""]
    return out


def report(rows: list[dict], commands: list[str], args, started: float) -> None:
    from _common import plt, write_result

    body = ["Each row is a memory built once with `landmark-memory build --workers 2`; every figure is measured",
            "in one run, and the ratios are against the smallest memory of the same model and version. The baseline",
            "rows were measured with an earlier checkout of the package (`--baseline`) on memories it built itself.",
            "`open` is the first open in a fresh process after the model loaded, so it includes hashing the",
            "model's weights once (about half a second for SmolLM2, a few milliseconds for the bundled model).",
            "`rows and indexes / one copy`: token rows, landmark keys and index state of the corpus and its",
            "documents against the corpus's own token rows and keys.", ""]
    cols = [("open_s", "open (s)", "{:.3f}"), ("rss_open_mb", "RSS after open (MB)", "{:,.0f}"),
            ("rss_ask_mb", "RSS after the asks (MB)", "{:,.0f}"),
            ("ask_s", "warm ask (s)", "{:.3f}"), ("serve_alone_p50_s", "server, one at a time p50 (s)", "{:.3f}"),
            ("serve_p50_s", "server, 4 at a time p50 (s)", "{:.3f}"), ("serve_p95_s", "p95 (s)", "{:.3f}"),
            ("memory_route_s", "/v1/memory (s)", "{:.3f}"), ("serve_rss_mb", "server RSS (MB)", "{:,.0f}"),
            ("append_s", "append 2 KB + commit (s)", "{:.2f}"), ("disk_per_token", "disk per token (B)", "{:,.0f}"),
            ("rows_copies", "rows and indexes / one copy", "{:.2f}")]
    ratio_of = ["open_s", "rss_open_mb", "ask_s", "serve_alone_p50_s", "append_s"]
    groups, reads = {}, [r for r in rows if r["size"].startswith("read")]
    for r in rows:
        if not r["size"].startswith("read"):
            groups.setdefault((r["model"], r["version"]), []).append(r)
    for (model, version), group in groups.items():
        smallest = min(group, key=lambda r: r["tokens"])
        commit = group[0].get("commit")
        body += [f"## {model}, {version}" + (f" (commit {commit})" if commit else ""), "",
                 "| memory | tokens | " + " | ".join(c[1] for c in cols) + " | server / warm ask |",
                 "|---|---:|" + "---:|" * len(cols) + "---:|"]
        for r in group:
            cells = []
            for key, _, fmt in cols:
                cell = fmt.format(r[key]) if key in r else "-"
                if key in ratio_of and r is not smallest:
                    cell += f" ({r[key] / smallest[key]:.2f}x)"
                cells.append(cell)
            body.append(f"| {r['size']} | {r['tokens']:,} | " + " | ".join(cells) +
                        f" | {r['serve_alone_p50_s'] / r['ask_s']:.2f}x |")
        body.append("")
    if reads:
        body += ["## Reading one long document", "",
                 "The longest books one after another as one document, read as a build's worker reads a document",
                 "(int8 blocks, no output head), in a process of its own, one index after another.", "",
                 "| model | version | tokens | index | tokens/s, first 50K | tokens/s, last 50K | slowest 50K | last / "
                 "first |",
                 "|---|---|---:|---|---:|---:|---:|---:|"]
        body += [f"| {r['model']} | {r['version']}" + (f" ({r['commit']})" if r.get("commit") else "")
                 + f" | {r['tokens']:,} | {r['index']} | {r['read_first_tps']:,.0f} | "
                 f"{r['read_last_tps']:,.0f} | " + (f"{r['read_min_tps']:,.0f}" if "read_min_tps" in r else "-") +
                 f" | {r['read_last_tps'] / r['read_first_tps']:.0%} |" for r in reads]
        body.append("")
    fig, axes = plt().subplots(1, 4, figsize=(15, 3.6))
    for ax, (key, title) in zip(axes, [("open_s", "open (s)"), ("rss_open_mb", "RSS after open (MB)"),
                                       ("ask_s", "warm ask (s)"), ("serve_alone_p50_s", "server request p50 (s)")]):
        for (model, version), group in groups.items():
            group = sorted(group, key=lambda r: r["tokens"])
            ax.plot([r["tokens"] for r in group], [r[key] for r in group], "o-", label=f"{model}, {version}")
        ax.set_xscale("log")
        ax.set_xlabel("tokens in memory")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(args.results) / "scale.png", dpi=110)
    body += ["![open, RSS, ask and server latency against the memory's size](scale.png)", ""]
    body += on_paper(groups)
    write_result("scale", "A corpus you can live in: cost against the memory's size", body, Path(args.results),
                 started, commands=commands)


if __name__ == "__main__":
    main()
