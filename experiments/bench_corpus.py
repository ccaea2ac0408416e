"""Corpora: reading documents in parallel on Ray against the plain build, and what the number
of documents costs a query, measured in one run.

    python experiments/bench_corpus.py                                   # both parts, both models
    python experiments/bench_corpus.py --models bundled --parts ingest
    python experiments/bench_corpus.py --parts documents --counts 1,10,100,1000

Ingestion: the same documents (the held-out book cut into ``--docs`` parts) built by each
configuration as a user runs it, the ``landmark-memory build`` command in a fresh process:
today's plain build (one process, every core), the plain build on one core, Ray with one
worker of one core, Ray with two workers of one core each, and two plain builds at once.
tokens/s is the build's own reading rate (after the model and the workers are up); the whole
command's wall time is shown beside it.

Documents: one memory of ``--total`` tokens of the bundled model's held-out book read as 1,
10, 100 and 1,000 documents (the same blocks, cut otherwise); per count the cost of a decoding
step (warm) and of an ask (open the memory, read a prompt, 16 tokens; the hot cache cold),
against the one-document memory (each the best of three, after one warm-up query).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import RESULTS, plt, some_of, write_result

from landmark_memory.jobs.build import build, read_inputs
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import load_model
from landmark_memory.training.data import SAMPLE_DIR, read_text, strip_gutenberg

BOOK = SAMPLE_DIR / "book" / "up_from_slavery.txt"  # held out of both models' training
MODELS = {"bundled": None, "smollm2": "smollm2-landmark"}
CLI = [sys.executable, "-m", "landmark_memory.app.entry"]  # the command as installed
SPINNING = [sys.executable, "-m", "landmark_memory.app.cli"]  # the same without entry.py's passive OpenMP waits
ONE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}


def write_documents(tok, folder: Path, n_docs: int, n_tokens: int) -> Path:
    """The book's first ``n_tokens`` tokens cut into ``n_docs`` documents of equal length."""
    ids = tok.encode(strip_gutenberg(read_text(BOOK))).ids[:n_tokens]
    folder.mkdir(parents=True, exist_ok=True)
    per = len(ids) // n_docs
    for i in range(n_docs):
        (folder / f"part{i:05d}.txt").write_text(tok.decode(ids[i * per:(i + 1) * per]))
    return folder


def run_build(mem: Path, docs: Path, model: str | None, extra=(), env=None, command=CLI) -> subprocess.Popen:
    argv = command + ["build", str(mem), "--input", str(docs), "--json", "--quiet", *extra]
    argv += ["--model", model] if model else []
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen, t0: float) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        sys.exit(f"build failed:\n{err}")
    doc = json.loads(out)
    return {"tokens": doc["added"], "rate": doc["added"] / doc["seconds"], "wall": time.time() - t0}


def ingest(model_name: str, n_docs: int, n_tokens: int, work: Path) -> list[dict]:
    """tokens/s of each build configuration over the same documents, in this order."""
    loaded = load_model(MODELS[model_name])
    _, tok = loaded.model, loaded.tokenizer
    docs = write_documents(tok, work / f"docs-{model_name}", n_docs, n_tokens)
    model = MODELS[model_name]
    configs = [("plain build, 2 cores, spinning OpenMP waits (before)", [], None, SPINNING),
               ("plain build, 2 cores", [], None, CLI),
               ("plain build, 1 core", [], ONE_THREAD, CLI),
               ("Ray, 1 worker x 1 core", ["--workers", "1", "--worker-threads", "1"], None, CLI),
               ("Ray, 2 workers x 1 core", ["--workers", "2", "--worker-threads", "1"], None, CLI)]
    rows = []
    for i, (name, extra, env, command) in enumerate(configs):
        print(f"{model_name}: {name}", file=sys.stderr)
        t0 = time.time()
        rows.append({"config": name, **finish(run_build(work / f"{model_name}-{i}", docs, model, extra, env, command),
                                              t0)})
    for command, how in ((CLI, ""), (SPINNING, ", spinning (before)")):
        print(f"{model_name}: two plain builds at once{how}", file=sys.stderr)
        t0 = time.time()
        pair = [run_build(work / f"{model_name}-pair{j}{how[:2]}", docs, model, command=command) for j in range(2)]
        for j, p in enumerate(pair):
            rows.append({"config": f"two plain builds at once{how}: build {j + 1}", **finish(p, t0)})
    return rows


def documents(counts: list[int], n_tokens: int, work: Path) -> list[dict]:
    """Per number of documents: building, opening, a decoding step and an ask."""
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    prompt = torch.tensor([tok.encode("The pass key is the school that the author founded in Alabama, and").ids])
    built = {}
    for n in counts:
        print(f"documents: building {n}", file=sys.stderr)
        docs = write_documents(tok, work / f"docs-{n}", n, n_tokens)
        t0 = time.perf_counter()
        with LandmarkMemory(model, path=work / f"corpus-{n}", store="lmdb", documents=True) as mem:
            build(mem, read_inputs([docs]), tok, progress=False)
        built[n] = time.perf_counter() - t0

    def query(path, steps=32):
        t0 = time.perf_counter()  # an ask: open, the prompt, 16 new tokens, the hot cache cold
        mem = LandmarkMemory.open(path, model, readonly=True)
        open_s = time.perf_counter() - t0
        mem.generate(prompt, 16)
        asked = time.perf_counter() - t0
        opened, opening = mem.inspection.stores_opened()
        for _ in range(4):  # warm: the decoding step as a conversation goes on
            mem.inspection.step(torch.tensor([5]))
        t0 = time.perf_counter()
        for _ in range(steps):
            mem.inspection.step(torch.tensor([5]))
        step_ms = 1000 * (time.perf_counter() - t0) / steps
        row = {"blocks": mem.n_blocks, "open_s": open_s, "ask_s": asked, "step_ms": step_ms,
               "searches": mem.retrieval_stats.searches, "stores": opened, "stores_s": opening}
        mem.close()
        return row

    query(work / f"corpus-{counts[0]}")  # compiled kernels and caches warmed once, for every count alike
    rows = []
    for n in counts:
        print(f"documents: querying {n}", file=sys.stderr)
        best = min((query(work / f"corpus-{n}") for _ in range(3)), key=lambda r: r["ask_s"])
        rows.append({"documents": n, "build_s": built[n], **best})
    return rows


def paper_estimate(rows: dict[str, list[dict]]) -> list[str]:
    """What a corpus of 1B tokens needs, from this run's reading rates and the memory's sizes."""
    n = 1e9
    out = ["## On paper: a corpus of 1B tokens", "",
           "| model | blocks | block store, float32 | landmark rows on disk | index RAM: flat or IVF-Flat | "
           "index RAM: IVF-PQ, 32-byte codes | core-hours to read | hours, 64 one-core workers |",
           "|---|---|---|---|---|---|---|---|"]
    shapes = {"bundled": (4, 4, 32, 50), "smollm2": (30, 3, 64, 63)}  # layers, kv heads, head dim, block size
    for name, r in rows.items():
        layers, heads, dim, bs = shapes[name]
        blocks = n / bs
        store = blocks * layers * (2 * heads * (bs + 1) * dim * 4 + 4)  # keys, values and a CRC-32 per layer
        keys = blocks * layers * heads  # one landmark key per block, layer and key/value head
        rate = next(x["rate"] for x in r if x["config"].startswith("Ray, 1 worker"))
        core_hours = n / rate / 3600
        out.append(f"| {name} | {blocks / 1e6:,.1f}M | {store / 2**40:,.1f} TiB | {keys * dim * 4 / 2**30:,.0f} GiB | "
                   f"{keys * dim * 4 / 2**30:,.0f} GiB | {keys * 32 / 2**30:,.0f} GiB | {core_hours:,.0f} | "
                   f"{core_hours / 64:,.0f} |")
    out += ["", "- Reading: each document is read by one worker, so the hours divide by the workers until the "
            "documents run out (a book is some 100K tokens: 10,000 of them in 1B tokens); the rate is this run's "
            "`Ray, 1 worker x 1 core`, on this machine's cores.",
            "- Disk: the block store is the bulk (keys and values of every layer); int8 storage (the compact-memory "
            "issue) would take it about 4x down. The corpus's rows (tokens, landmark keys) are under 1% of it; each "
            "document keeps its own copy of its rows and its own index in its last state file besides.",
            "- Index memory: a flat index holds every landmark key (as the rows on disk), and scanning "
            f"{n / 63 / 1e6:,.1f}M keys (SmolLM2) per layer-head per query is far too slow: `ivf` visits "
            "`nprobe` of its 4 x sqrt(n) lists (some 16K keys a search) with the same memory, and IVF-PQ codes of "
            "32 bytes a key would fit the SmolLM2 corpus's indexes in one machine's RAM (our `ivfpq` kind also "
            "keeps an exact copy to re-rank: as much as flat).",
            "- The driver: merging a document costs appending its rows and keys, nothing like reading it; but each "
            "corpus commit writes every index in its state file, so at this size corpus commits must be rare "
            "(`--commit-every` of an hour or more), or the indexes kept in files of their own."]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,smollm2", help="ingestion with these models (bundled, smollm2)")
    ap.add_argument("--parts", type=some_of(("ingest", "documents")), default=["ingest", "documents"],
                    help="some of ingest,documents (default: both)")
    ap.add_argument("--docs", type=int, default=4, help="documents per ingestion run (default 4)")
    ap.add_argument("--tokens", default="bundled=32768,smollm2=2048", help="tokens per ingestion run, per model")
    ap.add_argument("--counts", default="1,10,100,1000", help="documents per memory in the documents part")
    ap.add_argument("--total", type=int, default=100_000, help="tokens per memory in the documents part")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    started, parts = time.time(), args.parts
    Path(args.results).mkdir(parents=True, exist_ok=True)
    tokens = dict(kv.split("=") for kv in args.tokens.split(","))
    body = []
    with tempfile.TemporaryDirectory() as tmp:
        if "ingest" in parts:
            rates = {m: ingest(m, args.docs, int(tokens[m]), Path(tmp)) for m in args.models.split(",")}
            body += ["## Reading documents: tokens/s of the build's own reading", ""]
            for m, rows in rates.items():
                before, plain, one = (rows[i]["rate"] for i in range(3))
                body += [f"### {m} ({args.docs} documents, {rows[0]['tokens']:,} tokens)", "",
                         "| configuration | tokens/s | vs plain build, 2 cores (before) | vs plain build, 2 cores | "
                         "vs 1 core | whole command |", "|---|---|---|---|---|---|"]
                body += [f"| {r['config']} | {r['rate']:,.0f} | {r['rate'] / before:.2f}x | {r['rate'] / plain:.2f}x | "
                         f"{r['rate'] / one:.2f}x | {r['wall']:.1f} s |" for r in rows]
                body.append("")
            body += paper_estimate(rates) + [""]
        if "documents" in parts:
            rows = documents([int(c) for c in args.counts.split(",")], args.total, Path(tmp))
            base = rows[0]
            body += [f"## One memory, {base['blocks']:,} blocks, read as more and more documents (bundled model)", "",
                     "| documents | build | open | ask (open, prompt, 16 tokens) | vs 1 | of which opening "
                     "document stores | decoding step | vs 1 | FAISS searches |",
                     "|---|---|---|---|---|---|---|---|---|"]
            body += [f"| {r['documents']:,} | {r['build_s']:.1f} s | {r['open_s'] * 1000:.0f} ms | "
                     f"{r['ask_s']:.2f} s | {r['ask_s'] / base['ask_s']:.2f}x | {r['stores']:,} in "
                     f"{r['stores_s'] * 1000:.0f} ms | {r['step_ms']:.1f} ms | {r['step_ms'] / base['step_ms']:.2f}x | "
                     f"{r['searches']:,} |" for r in rows]
            pyplot = plt()
            fig, ax = pyplot.subplots(figsize=(6, 3.5))
            n = [r["documents"] for r in rows]
            ax.plot(n, [r["step_ms"] / base["step_ms"] for r in rows], "o-", label="decoding step")
            ax.plot(n, [r["ask_s"] / base["ask_s"] for r in rows], "s-", label="ask (open, prompt, 16 tokens)")
            ax.axhline(1.5, color="gray", ls="--", lw=0.8, label="target: 1.5x")
            ax.set_xscale("log")
            ax.set_xlabel("documents holding the same blocks")
            ax.set_ylabel("cost vs one document")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(Path(args.results) / "corpus.png", dpi=120)
            body += ["", "![cost of a query against the number of documents](corpus.png)"]
    write_result("corpus", "Corpora: documents read on Ray, one memory over all of them", body, args.results, started)


if __name__ == "__main__":
    main()
