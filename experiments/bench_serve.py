"""Serving a memory over HTTP: the library's ask against ``landmark-memory serve`` on loopback,
the same questions, measured in one run.

    python experiments/bench_serve.py                                    # bundled model and SmolLM2
    python experiments/bench_serve.py --models bundled --requests 32 --concurrency 4

For each model: a memory over the opening of the held-out book; the library's ``ask`` on each
question in this process (the model loaded once, the memory opened afresh per question, as the
server does); then the server in its own process, the same questions one at a time (the
overhead of HTTP) and ``--requests`` of them ``--concurrency`` at a time through the official
OpenAI client (p50/p95 latency, tokens/s, failures).
"""

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from _common import RESULTS, serving, write_result

from landmark_memory.jobs.build import build, read_inputs
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import load_model
from landmark_memory.training.data import SAMPLE_DIR, read_text, strip_gutenberg
from landmark_memory.uses.answer import ask

BOOK = SAMPLE_DIR / "book" / "up_from_slavery.txt"  # held out of both models' training
MODELS = {"bundled": None, "smollm2": "smollm2-landmark"}
QUESTIONS = ["What school did the author found?", "Where was the author born?", "Who taught the author to read?",
             "What did the author do at the salt furnace?", "Why did the author go to Hampton?",
             "What did General Armstrong teach?", "How did the school get its first building?",
             "What did the author say in Atlanta?"]


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(name: str, n_tokens: int, args, work: Path) -> dict:
    loaded = load_model(MODELS[name])
    model, tok = loaded.model, loaded.tokenizer
    docs = work / f"docs-{name}"
    docs.mkdir()
    (docs / "book.txt").write_text(tok.decode(tok.encode(strip_gutenberg(read_text(BOOK))).ids[:n_tokens]))
    path = work / f"memory-{name}"
    with LandmarkMemory(model, path=path, store="lmdb", documents=True) as mem:
        build(mem, read_inputs([docs]), tok, progress=False)
    served = MODELS[name] or "landmark-memory-tiny"

    def library(q):
        t0 = time.perf_counter()
        with LandmarkMemory.open(path, model, readonly=True, cache_bytes=64 << 20) as mem:
            a = ask(mem, loaded, q, max_new_tokens=args.max_tokens)
        return time.perf_counter() - t0, len(a.tokens)

    library(QUESTIONS[0])  # warm: compiled kernels, caches
    lib = [library(q) for q in QUESTIONS]
    with serving(path, MODELS[name], "--parallel", str(args.parallel)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

        def one(q):
            t0 = time.perf_counter()
            r = client.chat.completions.create(model=served, messages=[{"role": "user", "content": q}],
                                               max_tokens=args.max_tokens)
            return time.perf_counter() - t0, r.usage.completion_tokens

        one(QUESTIONS[0])  # warm
        http = [one(q) for q in QUESTIONS]
        failures = 0

        def guarded(q):
            nonlocal failures
            try:
                return one(q)
            except openai.OpenAIError:
                failures += 1
                return None

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            load = [r for r in pool.map(guarded, [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]) if r]
        wall = time.perf_counter() - t0
    return {"model": name, "tokens": n_tokens, "library": lib, "http": http, "load": load, "wall": wall,
            "failures": failures}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,smollm2")
    ap.add_argument("--memory-tokens", default="bundled=32768,smollm2=2048", help="tokens of the book per memory")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=2, help="the server's --parallel")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    started = time.time()
    sizes = dict(kv.split("=") for kv in args.memory_tokens.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(m, int(sizes[m]), args, Path(tmp)) for m in args.models.split(",")]
    body = ["## One question at a time: the library's ask against the same over HTTP", "",
            "| model | memory tokens | library ask, median | over HTTP, median | HTTP vs library |",
            "|---|---|---|---|---|"]
    for r in rows:
        lib, http = statistics.median(t for t, _ in r["library"]), statistics.median(t for t, _ in r["http"])
        body.append(f"| {r['model']} | {r['tokens']:,} | {lib:.2f} s | {http:.2f} s | {http / lib:.2f}x |")
    body += ["", f"## {args.requests} requests, {args.concurrency} at a time (server --parallel {args.parallel}, "
             f"{args.max_tokens} new tokens each)", "",
             "| model | answered | failed | p50 latency | p95 latency | new tokens/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lat = [t for t, _ in r["load"]]
        body.append(f"| {r['model']} | {len(lat)} | {r['failures']} | {percentile(lat, 0.5):.2f} s | "
                    f"{percentile(lat, 0.95):.2f} s | {sum(n for _, n in r['load']) / r['wall']:.1f} |")
    body += ["", "## The page", "",
             "![the page at / after asking a SmolLM2 memory of two documents](serve_page.png)", "",
             "The page in headless Chromium (Debian's package), made with `landmark-memory build shotmem --input "
             "DOCS --model smollm2-landmark --workers 2` (DOCS: Up from Slavery's first 3,000 tokens and 3,000 "
             "tokens from its chapter VII, two documents), `landmark-memory serve shotmem --model smollm2-landmark` "
             "and `python experiments/screenshot_page.py \"http://127.0.0.1:8000/?q=Where was the author born?\" "
             "serve_page.png --wait 25`. The answer is streamed in as it is generated; the strips mark, per "
             "document, where the passages it read lie; below them the passages, most read first. The answer is "
             "wrong (Booker T. Washington was born in Virginia): retrieval from real text is the open issue of "
             "this model, not of the page."]
    write_result("serve", "Serving a memory: the OpenAI-compatible server against the library", body, args.results,
                 started)


if __name__ == "__main__":
    main()
