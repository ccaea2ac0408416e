"""The text index's engine: SQLite's FTS5 (what ships) against tantivy, on libraries of small
documents around the six question books' excerpts, by what they cost and what they find.

    python experiments/bench_text_index.py --books BOOKS --counts 10000,100000

A library is the six books' first 32,256 tokens (SmolLM2's tokenizer; each a document) and N
small documents of about 200 characters (``bench_library.small_documents``), laid out as a corpus
lays out its documents: each its tokens, an end-of-text token, and end-of-text tokens to the end
of its last block of 64. Each engine indexes every block's row as the memory's text index does
(``text_index.block_texts``: the block after the last 8 tokens of the one before, cut at a
document's end) and is measured on it: the build (one thread), the files' size per token, the
query time (median over the second set's 78 questions, 50 blocks each), and recall@5 of the
questions' evidence (its block among the first five). No model is read: tantivy is a bench
dependency only (``pip install tantivy``; without it, its rows are left out).
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import write_result
from bench_library import SMALL_CHARS, small_documents
from exp_evidence import questions
from exp_natural import evidence_span

from landmark_memory.core.tokenizer import special_ids
from landmark_memory.format.text_index import TextIndex, block_texts
from landmark_memory.jobs.build import encode
from landmark_memory.models.hf.smollm2 import base_model_dir
from landmark_memory.models.hf.tokenizer import TextTokenizer
from landmark_memory.training.data import read_text
from landmark_memory.uses.evidence import own_words
from landmark_memory.uses.search import _decoder

BS, EXCERPT, DEPTH = 64, 32_256, 50


def library_rows(books: Path, folder: Path, n: int, tok):
    """(int32 (blocks, BS) rows of the library, [(question, its evidence's blocks)])."""
    small_documents(books, folder, n)
    eos = tok.token_to_id("<|endoftext|>")
    parts, asked, at = [], [], 0
    for book in sorted({q["book"] for q in questions()}):
        ids = encode(tok, read_text(books / f"{book}.txt"))[:EXCERPT - 1].tolist() + [eos]
        for q in questions():
            if q["book"] == book:
                a, b = evidence_span(tok, ids, q["evidence"])
                asked.append((q, list(range((at + a) // BS, (at + b - 1) // BS + 1))))
        parts.append(ids)
        at += -(-len(ids) // BS) * BS
        parts[-1] += [eos] * (-len(ids) % BS)
    texts = [f.read_text() for f in sorted(folder.glob("doc*.txt"))[:n]]
    for enc in tok.encode_batch(texts):
        ids = enc.ids + [eos]
        parts.append(ids + [eos] * (-len(ids) % BS))
    return np.array([t for p in parts for t in p], np.int32).reshape(-1, BS), asked


def fts5(rows, tok, folder, asked):
    t0 = time.perf_counter()
    with TextIndex.open(folder, "bench", writable=True) as index:
        index.sync(rows, set(special_ids(tok)), _decoder(tok))
    built = time.perf_counter() - t0
    index = TextIndex.open(folder, "bench", writable=False)
    try:
        return measured(built, folder, lambda words: index.search(words, DEPTH, len(rows)), asked)
    finally:
        index.close()


def tantivy_index(rows, tok, folder, asked):
    import tantivy

    sb = tantivy.SchemaBuilder()
    sb.add_integer_field("block", stored=True, indexed=True)
    sb.add_text_field("body", stored=False, tokenizer_name="en_stem")
    index = tantivy.Index(sb.build(), path=str(folder))
    t0 = time.perf_counter()
    writer = index.writer(heap_size=200_000_000, num_threads=1)
    borders, decode = set(special_ids(tok)), _decoder(tok)
    for a in range(0, len(rows), 4096):
        for b, text in enumerate(block_texts(rows, a, min(a + 4096, len(rows)), borders, decode), a):
            writer.add_document(tantivy.Document(block=b, body=text))
    writer.commit()
    writer.wait_merging_threads()
    built = time.perf_counter() - t0
    index.reload()
    searcher = index.searcher()

    def search(words):
        query = index.parse_query(" OR ".join(f'"{w}"' for w in words), ["body"])
        return [(searcher.doc(a)["block"][0], s) for s, a in searcher.search(query, DEPTH).hits]

    return measured(built, folder, search, asked)


def measured(built, folder, search, asked):
    times, found = [], 0
    for q, blocks in asked:
        words = own_words(q["question"])
        search(words)  # (warm)
        t0 = time.perf_counter()
        got = search(words)
        times.append(time.perf_counter() - t0)
        found += bool({b for b, _ in got[:5]} & set(blocks))
    size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    return {"build_s": built, "bytes": size, "query_ms": 1000 * float(np.median(times)), "recall5": found}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True)
    ap.add_argument("--counts", default="10000", help="small documents around the excerpts, comma-separated")
    ap.add_argument("--work", help="where the documents are kept (default: a temporary folder)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = TextTokenizer(AutoTokenizer.from_pretrained(base_model_dir(), trust_remote_code=False))
    work = Path(args.work or tempfile.mkdtemp())
    engines = {"FTS5 (SQLite 3.40, shipped)": fts5}
    try:
        import tantivy  # noqa: F401
        engines["tantivy (tantivy-py, en_stem)"] = tantivy_index
    except ImportError:
        pass
    rows_out = []
    for n in [int(c) for c in args.counts.split(",")]:
        rows, asked = library_rows(Path(args.books), work / f"docs{n}", n, tok)
        tokens = rows.size
        for name, run in engines.items():
            folder = work / f"index-{n}-{run.__name__}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            got = run(rows, tok, folder, asked)
            rows_out.append(f"| {name} | {n:,} | {len(rows):,} | {got['build_s']:.1f} | {got['bytes'] / 2**20:,.1f} | "
                            f"{got['bytes'] / tokens:.2f} | {got['query_ms']:.2f} | {got['recall5']}/{len(asked)} |")
            print(rows_out[-1], flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    body = [f"Libraries of the six question books' first {EXCERPT:,} tokens and N small documents of about "
            f"{SMALL_CHARS} characters, in blocks of {BS} (SmolLM2's tokenizer); each engine indexes every block's "
            "row as the memory's text index does. Build: one thread, decoding included; size: the index's files; "
            f"query: the median of the 78 questions' own words, {DEPTH} blocks; recall@5: the evidence's block among "
            "the first five.", "",
            "| engine | small documents | blocks | build s | size MiB | bytes per token | query ms | recall@5 |",
            "|---|---|---|---|---|---|---|---|", *rows_out]
    write_result("text_index", "The text index's engine: SQLite FTS5 against tantivy", body)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
