"""Ingestion speed: reading a held-out book through memory against the same model's own
in-sequence forward over the same tokens, measured in the same run.

    python experiments/bench_ingest.py                                  # bundled model, 32K tokens
    python experiments/bench_ingest.py --indexes flat --stores memory --profile
    python experiments/bench_ingest.py --growth 8192,131072,1048576 --indexes hnsw,ivf,flat --data BOOKS
    python experiments/bench_ingest.py --model my-landmark-llama --window 8192

The in-sequence forward reads the text in windows of ``--window`` tokens (the model's training length; 512 for the
bundled model's pretraining), each window alone. The memory reads it chunk by chunk, each query retrieving its top-k
blocks, as ``build`` does: without the output head (no logits). Overhead = 1 - memory tokens/s / forward tokens/s,
against the forward as the model runs it (with its head) and against the same forward without its head (the same work
as reading into memory, less the memory). ``--profile`` splits the memory's time into its parts (the model's own
layers, the attention kernel over local and retrieved blocks, landmark scoring and FAISS searches, the hot cache,
store writes). ``--growth`` measures tokens/s over ``--span`` tokens read once the memory holds each given number of
tokens (a cost that grows with the memory shows here).
"""

import argparse
import collections
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from _common import book_tokens

from landmark_memory.memory import LandmarkMemory, decoding
from landmark_memory.memory.blocks import BlockMemory
from landmark_memory.memory.lookup import BlockLookup
from landmark_memory.models.kinds import backbone_for, in_sequence_logits, load_model
from landmark_memory.training.data import SAMPLE_DIR

HELD_OUT = SAMPLE_DIR / "book" / "up_from_slavery.txt"  # held out of the bundled model's training
PARTS = [(decoding, "landmark_attention_inference", "attention kernel"), (BlockLookup, "choose", "retrieval"),
         (BlockMemory, "search", "  of which FAISS searches"), (BlockMemory, "pool", "hot cache (pool)"),
         (BlockMemory, "add_chunk", "store writes, index adds")]


@torch.no_grad()
def forward_rate(model, ids, window, head=True):
    """Tokens/s of the in-sequence forward over ``ids`` in windows of ``window``, best of two;
    ``head=False``: the forward stops at the last hidden states (no logits)."""
    with contextlib.nullcontext() if head else without_head(model):
        in_sequence_logits(model, ids[:, :window])  # warm up
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            for a in range(0, ids.shape[1], window):
                in_sequence_logits(model, ids[:, a:a + window])
            best = max(best, ids.shape[1] / (time.perf_counter() - t0))
    return best


@contextlib.contextmanager
def without_head(model):
    """The model (a LandmarkGPT or a Hugging Face causal LM) with its output head replaced by
    the identity while the block runs."""
    head = model.lm_head
    model.lm_head = torch.nn.Identity()
    try:
        yield
    finally:
        model.lm_head = head


class Profile:
    """Seconds spent in each part of ``PARTS`` (and the model's layers) while enabled."""

    def __init__(self, backbone_cls):
        self.seconds, self._undo = collections.Counter(), []
        parts = PARTS + [(backbone_cls, n, "model layers") for n in ("embed", "qkv", "finish", "head")]
        for owner, name, label in parts:
            self._wrap(owner, name, label)

    def _wrap(self, owner, name, label):
        orig = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def close(self):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


def read_through_memory(model, ids, piece, **options):
    """Tokens/s of ``LandmarkMemory.forward`` over ``ids`` fed ``piece`` tokens at a time, no logits."""
    with tempfile.TemporaryDirectory() as tmp:
        path = None if options.get("store", "memory") == "memory" else Path(tmp) / "m"
        mem = LandmarkMemory(model, path=path, **options)
        t0 = time.perf_counter()
        for a in range(0, ids.shape[1], piece):
            mem.forward(ids[:, a:a + piece], logits="none")
        rate = ids.shape[1] / (time.perf_counter() - t0)
        mem.close(commit=False)
    return rate


def growth(model, ids, sizes, span, piece, **options):
    """Tokens/s over ``span`` tokens read once the memory holds each of ``sizes`` tokens."""
    mem, fed, out = LandmarkMemory(model, **options), 0, {}
    for n in sizes:
        while fed < n:
            mem.forward(ids[:, fed:min(n, fed + piece)], logits="none")
            fed = min(n, fed + piece)
        t0 = time.perf_counter()
        mem.forward(ids[:, fed:fed + span], logits="none")
        out[n] = span / (time.perf_counter() - t0)
        fed += span
    mem.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled model)")
    ap.add_argument("--data", default=str(HELD_OUT), help="text file or folder to read (default: the held-out book)")
    ap.add_argument("--tokens", type=int, default=32768, help="tokens read per measurement (default 32768)")
    ap.add_argument("--window", type=int, default=512, help="in-sequence window (default 512)")
    ap.add_argument("--indexes", default="flat,ivf-rows,hnsw,ivf,ivfpq")
    ap.add_argument("--stores", default="memory,lmdb")
    ap.add_argument("--store-dtype", default="", help="stored key/value dtypes, comma-separated, each its own rows "
                                                      "(default: the model's)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--train-size", type=int, default=1024, help="landmarks before IVF indexes train (default 1024)")
    ap.add_argument("--piece", type=int, default=0,
                    help="tokens per forward call (default 0: one chunk, as build feeds them)")
    ap.add_argument("--profile", action="store_true", help="time the parts of the first memory row")
    ap.add_argument("--growth", help="memory sizes in tokens, e.g. 8192,131072,1048576 (instead of the table)")
    ap.add_argument("--span", type=int, default=8192, help="tokens timed at each growth point (default 8192)")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, "cpu")
    model, tok = loaded.model, loaded.tokenizer
    n = max(map(int, args.growth.split(","))) + args.span if args.growth else args.tokens
    ids = book_tokens(tok, n, Path(args.data))
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model or 'bundled'}: {params / 1e6:.2f}M parameters; {torch.get_num_threads()} threads; "
          f"top-k {args.top_k}; text {Path(args.data).name}")
    options = dict(top_k=args.top_k, index_options={"train_size": args.train_size})
    args.piece = args.piece or LandmarkMemory(model, **options).options.chunk_size
    if args.growth:
        sizes = sorted(map(int, args.growth.split(",")))
        print(f"| index | {' | '.join(f'{s:,} tokens' for s in sizes)} | last / first |")
        print("|---|" + "---|" * (len(sizes) + 1))
        for kind in args.indexes.split(","):
            rates = growth(model, ids, sizes, args.span, args.piece, index=kind, **options)
            print(f"| {kind} | {' | '.join(f'{r:,.0f}' for r in rates.values())} | "
                  f"{rates[sizes[-1]] / rates[sizes[0]]:.2f}x |", flush=True)
        return
    fwd, bare = forward_rate(model, ids, args.window), forward_rate(model, ids, args.window, head=False)
    print(f"in-sequence forward, windows of {args.window}: {fwd:,.0f} tokens/s over {ids.shape[1]:,} tokens "
          f"({bare:,.0f} without its output head)")
    print("| index | store | tokens/s | vs forward | overhead | overhead vs forward without head |")
    print("|---|---|---|---|---|---|")
    rows = [(kind, store, dtype) for kind in args.indexes.split(",") for store in args.stores.split(",")
            for dtype in args.store_dtype.split(",")]
    # warm up as the forward was: a process's first chunk and decoding step load compiled code
    warm, k = LandmarkMemory(model, **options), min(2 * args.piece, ids.shape[1] - 1)
    warm.forward(ids[:, :k], logits="none")
    warm.inspection.step(ids[:, k])
    warm.close()
    for i, (kind, store, dtype) in enumerate(rows):
        profile = Profile(type(backbone_for(model))) if args.profile and i == 0 else None
        t0 = time.perf_counter()
        rate = read_through_memory(model, ids, args.piece, index=kind, store=store, store_dtype=dtype or None,
                                   **options)
        store = f"{store} ({dtype})" if dtype else store
        if profile is not None:
            total, parts = time.perf_counter() - t0, dict(profile.seconds)
            profile.close()
        print(f"| {kind} | {store} | {rate:,.0f} | {rate / fwd:.2f} | {1 - rate / fwd:.0%} | {1 - rate / bare:.0%} |",
              flush=True)
    if args.profile:
        print(f"\nprofile of the first row ({total:.2f} s in all):")
        for label, s in sorted(parts.items(), key=lambda x: -x[1]):
            print(f"  {label:28s} {s:7.2f} s  {s / total:5.1%}")
        inner = sum(s for label, s in parts.items() if not label.startswith("  "))
        print(f"  {'other (Python, RoPE, glue)':28s} {total - inner:7.2f} s  {(total - inner) / total:5.1%}")

if __name__ == "__main__":
    main()
