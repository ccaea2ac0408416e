"""A library: what opening, asking, serving, adding a document and building cost as a corpus
gains documents (2 KB each), as ratios against the smallest library, measured in one run.

    python experiments/bench_library.py --books BOOKS                            # 100, 1,000, 10,000 documents
    python experiments/bench_library.py --books BOOKS --counts 100,10000 --baseline ../old-checkout

The documents are the paragraphs of the books training held out, gathered into documents of
about 2 KB, each opened by a line of its own ("Document 17.") and cycled past the last
paragraph. Each library is built once as a user builds one (``landmark-memory build --workers
2``, the bundled model) into ``--work``, where later runs find it. Per library, its files read
once first (``warm``), each figure in fresh processes as ``bench_scale.py`` measures a memory:
the open (the median of three), the resident memory after it, a warm ``ask`` (the median of
8), a request to ``serve`` one at a time (the median of 8), and adding one 2 KB document
(``build`` in the process, after the model loads; the median of 3), and for this version the
same with the seals its last writer left removed first (every key file read, as before them).
With ``--baseline``, an earlier checkout of the package builds and measures libraries of its
own the same way, in the same run. Then what
reading one document costs one core, four ways (``reading_ceiling``): what bounds a build's
documents per second; and the document list alone at up to 100,000 records (``list_costs``).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_scale import CLI, commit_of, env_for, measure_server, run_probe

ROOT = Path(__file__).resolve().parents[1]
DOCUMENT_CHARS = 2000


SMALL_CHARS = 200  # at most, a small document: about one block


def _paragraphs(books: Path) -> list[str]:
    """The paragraphs (over 80 characters) of the books training held out, in order."""
    from landmark_memory.training.data import list_text_files, read_text, split_books, strip_gutenberg

    _, held_out = split_books(list_text_files([books]))
    return [p.strip() for f in held_out for p in re.split(r"\n\s*\n", strip_gutenberg(read_text(f)))
            if len(p.strip()) > 80]


def _write_documents(folder: Path, n: int, texts: list[str]) -> None:
    """``n`` documents in ``folder``, the ``texts`` cycled, each opened by a line naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:06d}.txt").write_text(f"Document {i}.\n\n{texts[i % len(texts)]}", encoding="utf-8")
    (folder / "DONE").write_text(f"{n} documents from {len(texts)} distinct texts\n")


def write_library(books: Path, folder: Path, n: int) -> None:
    """``n`` documents of about 2 KB in ``folder`` (kept: a later run finds them)."""
    if (folder / "DONE").is_file():
        return
    docs, cur = [], ""
    for p in _paragraphs(books):
        cur = f"{cur}\n\n{p}" if cur else p
        if len(cur) >= DOCUMENT_CHARS:
            docs.append(cur)
            cur = ""
    _write_documents(folder, n, docs)


def small_documents(books: Path, folder: Path, n: int) -> None:
    """``n`` small documents in ``folder``: each a paragraph of a book training held out, its
    white space made single spaces, cut at a word to at most ``SMALL_CHARS`` characters (kept: a
    later run finds them)."""
    if (folder / "DONE").is_file():
        return
    paragraphs = [" ".join(p.split()) for p in _paragraphs(books)]
    _write_documents(folder, n, [p[:p.rfind(" ", 0, SMALL_CHARS)] if len(p) > SMALL_CHARS else p
                                 for p in paragraphs])  # (a word cut)


def build_library(memory: Path, inputs: Path, package: Path | None, workers: int) -> dict:
    """``landmark-memory build`` of ``inputs`` (the bundled model, ``workers`` Ray workers): its
    ``--json`` summary, with the command's wall time; a memory built before is not built again."""
    done = memory.parent / f"{memory.name}.build.json"
    if done.is_file():
        return json.loads(done.read_text())
    argv = CLI + ["build", str(memory), "--input", str(inputs), "--workers", str(workers), "--json", "--quiet"]
    t0 = time.time()
    run = subprocess.run(argv, env=env_for(package), capture_output=True, text=True, cwd=memory.parent)
    if run.returncode:
        raise SystemExit(f"building {memory} failed:\n{run.stderr[-2000:]}")
    doc = {**json.loads(run.stdout), "wall_s": time.time() - t0}
    done.write_text(json.dumps(doc))
    print(f"  built {memory}: {doc['documents']:,} documents in {doc['wall_s']:.0f} s", file=sys.stderr)
    return doc


def warm(memory: Path) -> float:
    """Read every file of ``memory`` once, so that what follows finds it in the page cache as a
    library in use is (the figures are then the software's, not the disk's: a library the
    machine's memory does not hold reads its blocks from the disk); the gigabytes read."""
    total = 0
    for f in sorted(memory.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    total += len(chunk)
    return total / 1e9


def measure(memory: Path, package: Path | None, books: Path, threads: int, append: Path) -> dict:
    print(f"  {warm(memory):.1f} GB read into the page cache", file=sys.stderr)
    opens = [run_probe(memory, "bundled", package, threads, books) for _ in range(2)]
    full = run_probe(memory, "bundled", package, threads, books, asks=True, append=append, unsealed=package is None)
    text = memory / "text.sqlite"
    return {**full, "open_s": statistics.median([o["open_s"] for o in opens] + [full["open_s"]]),
            **measure_server(memory, "bundled", package),
            **({"text_bytes": text.stat().st_size} if text.is_file() else {})}


def served(memory: Path, shares: int) -> dict:
    """A warm ask (the median of 8) by one process against a front whose ``shares`` Ray actors
    hold the corpus's blocks (a local cluster on this machine), the same questions; the answers
    compared, and the front's round trips and bytes per ask."""
    import torch
    from bench_scale import QUESTIONS

    from landmark_memory.app.served import Shares
    from landmark_memory.memory import LandmarkMemory
    from landmark_memory.models.kinds import load_model
    from landmark_memory.uses.answer import ask

    loaded = load_model(None)
    model = loaded.model
    torch.set_num_threads(1)  # as each share: the front and the shares share 2 cores
    out, answers = {}, {}
    group = Shares(memory, None, shares, threads=1)
    try:
        for name in ("one process", f"{shares} shares on Ray"):
            mem = LandmarkMemory.open(memory, model, readonly=True)
            if name != "one process":
                group.serve(mem)
            times = []
            for i, q in enumerate([QUESTIONS[0]] + QUESTIONS):
                t0 = time.perf_counter()
                answers.setdefault(name, []).append(ask(mem, loaded, q, max_new_tokens=8, raw=True))
                times.append(time.perf_counter() - t0)
                mem.rewind()
                if i == 0:
                    searches, moved, steps = group.searches, group.moved, mem.retrieval_stats.searches
            out[name] = {"ask_s": statistics.median(times[1:])}
            if name != "one process":
                n = len(QUESTIONS)
                out[name].update(searches_per_ask=(group.searches - searches) / n,
                                 layer_searches_per_ask=(mem.retrieval_stats.searches - steps) / n,
                                 kib_per_ask=(group.moved - moved) / n / 1024)
            mem.close()
    finally:
        group.close()
    out["same_answers"] = answers["one process"] == answers[f"{shares} shares on Ray"]
    return out


def reading_ceiling(memory: Path, inputs: Path, n: int = 48, batch: int = 16) -> dict:
    """Milliseconds a 2 KB document costs one core (torch, FAISS and numba on one thread, as a
    build's worker), each the best of 2 rounds over ``n`` documents of the library's commonest
    length: ``layers``, the model's own layers over the document whole in one pass (no memory,
    no output head: what any reading of it computes at least); ``in_memory``, a build's steps
    into a memory in RAM; ``batched``, ``batch`` such documents read as the streams of one
    memory; ``build``, ``build.read_document`` as a build reads a small document (in RAM, its
    blocks stored as the corpus stores them, ready to merge); ``folder``, the same into a folder
    of its own (its store and commits: a large document's way); and whether the batch's landmark keys equal those read
    alone, bit for bit."""
    import tempfile
    from collections import Counter
    from dataclasses import replace

    import numpy as np
    import torch

    from landmark_memory.core.layout import insert_landmarks
    from landmark_memory.jobs.build import encode_document
    from landmark_memory.jobs.distributed import set_threads
    from landmark_memory.jobs.reading import DocumentJob, read_document, read_steps
    from landmark_memory.memory import LandmarkMemory
    from landmark_memory.models.kinds import load_model

    set_threads(1)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    with LandmarkMemory.open(memory, model, readonly=True) as corpus:
        options = corpus.options
    ids = [encode_document(tok, f.read_text(encoding="utf-8"), cfg.block_size)
           for f in sorted(inputs.glob("doc*.txt"))[:20 * n]]
    length = Counter(len(x) for x in ids).most_common(1)[0][0]
    docs = [x for x in ids if len(x) == length][:n]

    def read(x: np.ndarray) -> LandmarkMemory:  # (streams, tokens), as read_document steps
        mem = LandmarkMemory(model, replace(options, store="memory"))
        for _ in read_steps(mem, x):
            pass
        mem.end_document()
        return mem

    def layers(x: np.ndarray) -> None:
        h = insert_landmarks(torch.from_numpy(x[None]).long(), cfg.block_size, cfg.landmark_id)
        positions, h = torch.arange(h.shape[1]), model.wte(h)
        for block in model.blocks:
            h = block(h, positions)

    def best(run) -> float:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) / len(docs) * 1000)
        return min(times)

    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        out = {"tokens": length, "documents": len(docs), "batch": batch,
               "layers_ms": best(lambda: [layers(x) for x in docs]),
               "in_memory_ms": best(lambda: [read(x[None]).close() for x in docs]),
               "batched_ms": best(lambda: [read(np.stack(docs[i:i + batch])).close()
                                           for i in range(0, len(docs), batch)])}
        for key, in_memory in (("build_ms", True), ("folder_ms", False)):  # read in RAM (a small one), or in a folder
            jobs = iter(DocumentJob(Path(tmp) / f"{key}{i}", f"d{i}", f"{i:064x}", x, options, 1e9, in_memory)
                        for i, x in enumerate(docs * 2))
            out[key] = best(lambda: [read_document(next(jobs), model) for _ in docs])
        alone, together = [read(x[None]) for x in docs[:batch]], read(np.stack(docs[:batch]))
        out["batch_equal"] = all(torch.equal(a.keys(layer, slice(None)), together.keys(layer, slice(None), stream=s))
                                 for layer in range(cfg.n_layer) for s, a in enumerate(alone))
        for m in alone + [together]:
            m.close()
    return out


def list_costs(sizes: list[int], repeats: int = 5) -> list[dict]:
    """What a corpus's document list costs by its number of documents, blocks aside (a library
    of 100,000 documents of 2 KB holds some 66 GB of blocks): ``sizes`` records written into
    pages as commits of 1,000 write them (``DocumentList.write``), then, each on the list opened
    anew from its manifest entry (the median of ``repeats``), in milliseconds: finding an input the
    list holds and one it does not (``by_folder``: what a build asks), the record of a passage's
    token (``containing``), a session's name for every document (what each turn records), and
    reading every record (what a build and a turn did before digests and full pages named
    them); with the manifest's bytes for the list."""
    import hashlib
    import tempfile
    from types import SimpleNamespace

    from landmark_memory.format import MemoryDir
    from landmark_memory.format.documents import DocumentList, InputRecord
    from landmark_memory.format.manifest import document_folder
    from landmark_memory.uses.session import _documents_digest

    def sha(i: int) -> str:
        return hashlib.sha256(str(i).encode()).hexdigest()

    out = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            d, written = MemoryDir(tmp, writable=True), DocumentList(paged=True)
            for i in range(n):
                written.append(InputRecord(f"/library/doc{i:06d}.txt", f"doc{i:06d}.txt", sha(i), 700, 700, 700 * i,
                                           document=document_folder(sha(i)), packed=True))
                if (i + 1) % 1000 == 0 or i == n - 1:
                    written.write(d)
            entry = {"pages": [list(p.__dict__.values()) for p in written.pages], "digests_crc32": written.digests_crc}

            def timed(run) -> float:
                times = []
                for _ in range(repeats):
                    listed = DocumentList.of_manifest(json.loads(json.dumps({**entry, "shards": []})), 50)
                    listed.attach(d, lambda e, where: None)
                    t0 = time.perf_counter()
                    run(listed)
                    times.append(1000 * (time.perf_counter() - t0))
                return statistics.median(times)

            held, new = document_folder(sha(n // 2)), document_folder(sha(n))
            out.append({"documents": n, "manifest_bytes": len(json.dumps(entry)),
                        "find_ms": timed(lambda listed: listed.by_folder([held, new])),
                        "passage_ms": timed(lambda listed: listed.containing(700 * (n // 3) + 5)),
                        "session_ms": timed(lambda listed: _documents_digest(SimpleNamespace(inputs=listed), n)),
                        "every_page_ms": timed(lambda listed: [e.sha256 for e in listed])})
            d.close()
    return out


def report(rows: list[dict]) -> list[str]:
    def ms(r, key):
        return f"{1000 * r[key]:.1f} ms" if key in r else "-"

    out = ["| version | documents | tokens | open | RSS after open | warm ask | server request | search | "
           "text index query | text index per token | add one document | the same, seals removed | build | "
           "built documents/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        unsealed = f"{r['append_unsealed_s']:.2f} s" if "append_unsealed_s" in r else "-"
        per_token = f"{r['text_bytes'] / r['tokens']:.2f} B" if "text_bytes" in r else "-"
        out.append(f"| {r['version']} ({r['commit']}) | {r['documents']:,} | {r['tokens']:,} | "
                   f"{ms(r, 'open_s')} | {r['rss_open_mb']:.0f} MB | {1000 * r['ask_s']:.0f} ms | "
                   f"{1000 * r['serve_alone_p50_s']:.0f} ms | {ms(r, 'search_s')} | {ms(r, 'text_query_s')} | "
                   f"{per_token} | {r['append_s']:.2f} s | {unsealed} | "
                   f"{r['build']['wall_s']:.0f} s | {r['documents'] / r['build']['seconds']:.1f} |")
    keys = ("open_s", "rss_open_mb", "ask_s", "serve_alone_p50_s", "search_s", "append_s", "append_unsealed_s")
    out += ["", "Ratios against the smallest library of the same version:", "",
            "| version | documents | open | RSS after open | warm ask | server request | search | add one document | "
            "the same, seals removed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next(b for b in rows if b["version"] == r["version"])
        out.append(f"| {r['version']} | {r['documents']:,} | " + " | ".join(
            f"{r[k] / base[k]:.2f}x" if k in r and k in base else "-" for k in keys) + " |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus (its held-out books give the documents)")
    ap.add_argument("--counts", default="100,1000,10000", help="documents per library, comma-separated")
    ap.add_argument("--documents", choices=["2kb", "small"], default="2kb",
                    help=f"2kb: documents of about 2 KB; small: of at most {SMALL_CHARS} characters, about a block")
    ap.add_argument("--work", help="where the libraries are built and kept between runs (default "
                    "~/.cache/landmark-memory/bench-library)",
                    default=os.path.join(os.path.expanduser("~"), ".cache", "landmark-memory", "bench-library"))
    ap.add_argument("--baseline", default=None, help="a checkout of an earlier version to measure beside this one")
    ap.add_argument("--workers", type=int, default=2, help="Ray workers that build each library (default 2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the measuring processes")
    ap.add_argument("--shares", type=int, default=2, help="Ray actors serving the second library (0: not measured)")
    ap.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    args = ap.parse_args()
    started, books, work = time.time(), Path(args.books), Path(args.work)
    Path(args.results).mkdir(parents=True, exist_ok=True)  # (checked now, not after an hour of building)
    counts = [int(c) for c in args.counts.split(",")]
    versions = [("this version", None)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    from _common import write_result

    built, kind = [], "" if args.documents == "2kb" else "small-"
    for n in counts:  # every library built first: nothing else runs while they are measured
        inputs = work / f"docs-{kind}{n}"
        (write_library if args.documents == "2kb" else small_documents)(books, inputs, n)
        for label, package in versions:
            memory = work / f"library-{kind}{n}-{'this' if package is None else 'baseline'}"
            built.append((n, label, package, memory, build_library(memory, inputs, package, args.workers)))
    rows = []
    for n, label, package, memory, summary in built:
        print(f"  measuring {memory} ({label})", file=sys.stderr)
        rows.append({"version": label, "commit": commit_of(package), "documents": n, "build": summary,
                     **measure(memory, package, books, args.threads, work / f"append-{n}-{label.split()[0]}.txt")})
    rows.sort(key=lambda r: (r["version"] != "baseline", r["documents"]))
    print("  timing document lists of 100 to 100,000 records", file=sys.stderr)
    lists = list_costs([100, 1000, 10_000, 100_000])
    print("  timing a document's reading on one core", file=sys.stderr)
    smallest = next(m for n, _, package, m, _ in built if package is None)
    ceiling = reading_ceiling(smallest, work / f"docs-{kind}{max(counts)}")
    ray_served = None
    if args.shares:
        second = counts[min(1, len(counts) - 1)]
        memory = next(m for n, _, package, m, _ in built if package is None and n == second)
        print(f"  serving {memory} from {args.shares} shares", file=sys.stderr)
        ray_served = {"documents": second, **served(memory, args.shares)}
    (Path(args.results) / "library.json").write_text(json.dumps({"rows": rows, "served": ray_served,
                                                                 "ceiling": ceiling, "lists": lists}, indent=1))
    documents = ("about 2 KB (paragraphs of the held-out books" if args.documents == "2kb" else
                 f"at most {SMALL_CHARS} characters (a paragraph of the held-out books each, cut at a word")
    body = ["Each library is built once by `landmark-memory build --workers 2` (the bundled model) from documents of "
            f"{documents}, each opened by a line of its own), then measured in fresh "
            "processes (`bench_scale.py`'s probes): the open (median of 3), the resident memory after it, a warm ask "
            "(median of 8, 8 tokens each), a server request one at a time (median of 8), `search` (5 passages, "
            "nothing generated) and the text index's query alone (medians of 8), the text index's file per token "
            "stored, and adding one 2 KB "
            "document (`build` in the process, after the model loads; the median of 3 added one after the other), "
            "and for this version the same with the seals its last writer left removed before each (`keys/seals.json`: "
            "the writer then reads every key and index file, as before seals). The build's documents/s is over its own "
            "reading and merging (the command's wall time beside it). The baseline is an earlier checkout "
            "(`--baseline`) measuring libraries it built itself, in the same run. Before a library is measured, "
            "each of its files is read once, so that it lies in the page cache as a library in use does (without "
            "that, a library that the last builds pushed out of it reads its blocks from the disk, and its figures "
            "are the disk's).", ""]
    body += report(rows)
    body += ["", "## The document list by its number of documents, blocks aside", "",
             "A library of 100,000 documents of 2 KB holds some 66 GB of blocks, more than this machine's free disk; "
             "what grows with the number of documents, rather than with tokens, is the document list. Records of 2 KB "
             "documents written into pages as commits of 1,000 write them (`list_costs`), then on the list opened "
             "anew from its manifest entry (median of 5): finding one input it holds and one it does not (what a "
             "build asks), the record of a passage's token, a session's name for all its documents (what each turn "
             "records), and reading every record (what a build and each turn did before).", "",
             "| documents | the list in the manifest | find two inputs | a passage's record | a session's documents "
             "| every record |", "|---:|---:|---:|---:|---:|---:|"]
    body += [f"| {r['documents']:,} | {r['manifest_bytes']:,} B | {r['find_ms']:.1f} ms | {r['passage_ms']:.1f} ms | "
             f"{r['session_ms']:.1f} ms | {r['every_page_ms']:,.1f} ms |" for r in lists]
    c = ceiling
    body += ["", "## What reading a document costs one core", "",
             f"A document of {c['tokens']} tokens (the commonest length; best of 2 rounds over {c['documents']}, one "
             f"thread, as a build's worker): the model's own layers over it whole, in one pass with no memory and no "
             f"output head, {c['layers_ms']:.0f} ms, what any reading of it computes at least: at most "
             f"{2000 / c['layers_ms']:.0f} documents a second on 2 cores. A build's steps into a memory in RAM "
             f"{c['in_memory_ms']:.0f} ms; as a build reads it (`build.read_document`, in RAM, its blocks stored as "
             f"the corpus stores them) {c['build_ms']:.0f} ms; into a folder of its own with its store and commits "
             f"(a large document's way) {c['folder_ms']:.0f} ms; "
             f"{c['batch']} documents of one length read as the streams of one batch {c['batched_ms']:.0f} ms a "
             f"document (landmark keys bit for bit those read alone: {c['batch_equal']})."]
    if ray_served:
        one, many = (ray_served[k] for k in ray_served if k not in ("documents", "same_answers"))
        body += ["", f"## The {ray_served['documents']:,}-document library served by {args.shares} Ray actors", "",
                 "A warm ask (8 tokens, median of 8) by one process and by a front whose shares hold the blocks "
                 "(`app/served.py`, a local Ray on this machine; front and shares one thread each): "
                 f"{1000 * one['ask_s']:.0f} ms against {1000 * many['ask_s']:.0f} ms "
                 f"({many['ask_s'] / one['ask_s']:.2f}x); "
                 f"answers the same, text and passages: {ray_served['same_answers']}. Per ask: "
                 f"{many['searches_per_ask']:.0f} fan-outs (one per memory layer and chunk, every share asked at once) "
                 f"for {many['layer_searches_per_ask']:.0f} layer searches, {many['kib_per_ask']:,.0f} KiB moved "
                 "(queries, top-k and blocks)."]
    write_result("library", "A library of small documents: cost by the number of documents", body, args.results,
                 started)


if __name__ == "__main__":
    main()
