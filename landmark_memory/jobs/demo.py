"""``landmark-memory demo``: a persistent memory over a book, end to end, in a few minutes.

1. plant a pass key at a random place in the bundled sample book and build a saved memory
   over it (progress shown);
2. close the memory, reopen it from disk and ask for the pass key, showing the passage the
   answer read;
3. read the book again with exact and approximate landmark indexes and print the
   perplexity, recall and search latency of each.
"""

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..core.passkey import MAX_KEY, QUESTION, fact, first_int
from ..format import MemoryOptions
from ..memory import LandmarkMemory
from ..models.kinds import load_model
from ..models.model import LandmarkGPT
from ..training.data import SAMPLE_DIR, read_text, strip_gutenberg
from ..uses.answer import ask
from .build import build, encode, read_inputs
from .evaluate import compare_indexes

SAMPLE_BOOK = SAMPLE_DIR / "book" / "up_from_slavery.txt"
DEMO_INDEXES = ("flat", "ivf-rows", "hnsw", "ivf", "ivfpq")
PASSAGES = 8  # retrieved passages the ask step reports, most-read first
COMPARE_TOKENS = 32768  # the book's opening read once per index kind: a fraction of the whole keeps the demo short
LARGE_MODEL_TOKENS = 8192  # of the book, for a model other than the bundled one (CPU minutes, not hours)
COMPARE_OPTIONS = MemoryOptions(top_k=4, index_options={"train_size": 256, "nprobe": 2})


def plant_passkey(text, key, rng):
    """``text`` with the pass key sentence inserted after a random sentence; returns the new
    text and the fraction of the text that precedes the key."""
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", text)]
    if not ends:
        raise ValueError("the text has no sentence end to plant a pass key after")
    at = rng.choice(ends)
    return text[:at] + fact(key) + text[at:], at / len(text)


def passage_line(label, p, note=None):
    """Two lines: which passage (share of lookups, where it is) and its text."""
    return (f"   {label} ({100 * p['share']:.0f}% of lookups, token {p['token_offset']:,} of {Path(p['source']).name}"
            f"{'; ' + note if note else ''}):\n   \"{' '.join(p['text'].split())}\"")


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.time()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    key = rng.randint(1, MAX_KEY)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="landmark-demo-"))
    mem_path = work / "memory"
    if mem_path.exists():
        raise ValueError(f"{mem_path} already exists; give the demo a new --out folder")
    work.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    try:
        source = Path(args.book) if args.book else SAMPLE_BOOK
        loaded = load_model(args.model, args.device)
        model, tok = loaded.model, loaded.tokenizer
        text = strip_gutenberg(read_text(source))
        cap = args.book_tokens or (None if isinstance(model, LandmarkGPT) else LARGE_MODEL_TOKENS)
        if cap:
            text = tok.decode(tok.encode(text).ids[:cap])
        text, depth = plant_passkey(text, key, rng)
        book = work / "book-with-passkey.txt"
        book.write_text(text)
        n_tokens = len(encode(tok, text))

        say(f"1. Building a memory over {source.name} ({n_tokens:,} tokens{' of its opening' if cap else ''}) with the "
            f"pass key {key} planted {100 * depth:.0f}% of the way in (seed {seed})")
        with LandmarkMemory(model, path=mem_path, store="lmdb", documents=True) as mem:
            build(mem, read_inputs([book]), tok, progress=not args.quiet)
        say(f"   saved to {mem_path}: {mem.n_blocks:,} blocks, commit {mem.manifest.commit}")

        say(f"2. Reopening it from disk and asking:{QUESTION}")
        with LandmarkMemory.open(mem_path, model, readonly=True) as mem:  # every block read, most read first
            asked = ask(mem, loaded, QUESTION, raw=True, max_new_tokens=8, passages=mem.n_blocks).to_json()
        read = asked.pop("passages")
        asked["retrieved"] = read[:PASSAGES]
        answer = first_int(asked["text"])
        top = read[0] if read else None
        say(f"   answer:{asked['text']!r} -> {answer} ({'correct' if answer == key else f'wrong, the key is {key}'})")
        rank = next((i + 1 for i, p in enumerate(read) if str(key) in p["text"]), None)  # the key's passage
        if top:
            say(passage_line("most-read passage", top, "holds the key" if rank == 1 else "does not hold the key"))
        if rank is not None and rank > 1:
            say(passage_line(f"passage holding the key, read {rank}th most of {len(read)}", read[rank - 1]))
        elif top and rank is None:
            say(f"   the key's passage was not among the {len(read)} the answer read")

        ids = encode(tok, text)
        bundled = isinstance(model, LandmarkGPT)  # IVF kinds need 256 landmarks a layer-head: 16K tokens of blocks
        length = min(COMPARE_TOKENS if bundled else LARGE_MODEL_TOKENS // 2, len(ids) - 1)
        kinds = DEMO_INDEXES if bundled else ("flat", "ivf-rows")
        if next(model.parameters()).is_cuda:  # the exact search on the GPU beside FAISS's on the CPU
            kinds += ("flat-torch",)
        say(f"3. Perplexity of the book's first {length:,} tokens read through memory, exact vs approximate "
            "landmark search"
            + (" (IVF kinds train on the first 256 landmarks of each layer and head)" if bundled else ""))
        rows = compare_indexes(model, ids, kinds, length, COMPARE_OPTIONS, max_segments=1, progress=not args.quiet)
        say(f"   {'index':8s} {'perplexity':>10s} {'vs exact':>9s} {'recall@4':>9s} {'search ms':>10s}")
        for r in rows:
            say(f"   {r['index']:8s} {r['perplexity']:10.2f} {r['ppl_delta_pct']:+8.2f}% {r['recall']:9.3f} "
                f"{r['search_ms']:10.3f}")
        say(f"done in {time.time() - t0:.0f} s")
        if args.json:
            print(json.dumps({"seed": seed, "key": key, "depth": depth, "tokens": n_tokens, "answer": answer,
                              "correct": answer == key, "retrieved": asked["retrieved"], "key_passage_rank": rank,
                              "passages_read": len(read), "compare": rows,
                              "seconds": time.time() - t0, "memory": str(mem_path) if args.out else None}, indent=1))
        return 0
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
