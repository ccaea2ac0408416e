"""Per-token decode latency and resident memory: landmark memory (each index kind) vs full
attention with a KV cache, same model weights, same run.

    python experiments/bench_decode.py                                   # 4K..64K on CPU
    python experiments/bench_decode.py --contexts 4096,32768 --indexes flat,hnsw --shape tiny

The landmark memory ingests real book text (its ingestion speed is reported too) and then
decodes ``--steps`` tokens at each context length. The full-attention baseline decodes with a
preallocated KV cache of the same length; its cache holds random values, which cost the same
time as real ones and spare an O(n^2) prefill. Memory: the KV cache of full attention vs the
landmark memory's fast part (landmark keys, indexes, hot cache, current chunk) and its block
store.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import book_tokens
from landmark_memory import LandmarkConfig, LandmarkGPT, load_tokenizer
from landmark_memory.data import SAMPLE_DIR
from landmark_memory.memory import LandmarkMemory

MiB = 2 ** 20


SHAPES = {"tiny": dict(n_layer=4, n_head=4, n_embd=128, ffn_hidden=512),
          "small": dict(n_layer=6, n_head=8, n_embd=512, ffn_hidden=2048),
          "paper": dict(n_layer=12, n_head=8, n_embd=1024, ffn_hidden=4096)}


def load_model(path, shape):
    if path:
        return LandmarkGPT.from_pretrained(path)
    torch.manual_seed(0)  # decoding costs the same with untrained weights
    return LandmarkGPT(LandmarkConfig.for_tokenizer(**SHAPES[shape]))


@torch.no_grad()
def full_attention_ms(model, n, steps):
    """ms per token decoding at context n with a KV cache, and the cache's bytes."""
    cfg = model.config
    shape = (1, cfg.n_head, n + steps, cfg.head_dim)
    cache = [(torch.randn(shape), torch.randn(shape)) for _ in model.blocks]

    def step(tok, pos):
        h = model.wte(tok)  # (1, 1, C)
        for block, (ck, cv) in zip(model.blocks, cache):
            q, k, v = block.attn.heads(block.ln_1(h))
            p = torch.tensor([pos])
            ck[:, :, pos], cv[:, :, pos] = block.attn.rope(k, p)[:, :, 0], v[:, :, 0]
            y = F.scaled_dot_product_attention(block.attn.rope(q, p), ck[:, :, :pos + 1], cv[:, :, :pos + 1])
            h = h + block.attn.merge(y)
            h = h + block.mlp(block.ln_2(h))
        return model.lm_head(model.ln_f(h))

    step(torch.tensor([[5]]), n)  # warm up
    t0 = time.perf_counter()
    for i in range(steps):
        step(torch.tensor([[5]]), n + i)
    kv_bytes = 2 * cfg.n_layer * n * cfg.n_embd * 4
    return (time.perf_counter() - t0) * 1e3 / steps, kv_bytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,32768,65536")
    ap.add_argument("--indexes", default="flat,hnsw,ivf,ivfpq")
    ap.add_argument("--model", default=None, help="a saved LandmarkGPT (default: an untrained one of --shape)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="model shape without --model")
    ap.add_argument("--cache-mib", type=int, default=64, help="hot-block cache budget")
    ap.add_argument("--train-size", type=int, default=512, help="landmarks before IVF indexes train")
    ap.add_argument("--data", default=str(SAMPLE_DIR), help="text to ingest")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=250)
    args = ap.parse_args(argv)
    contexts = sorted(map(int, args.contexts.split(",")))
    model = load_model(args.model, args.shape).eval()
    ids = book_tokens(load_tokenizer(), contexts[-1] + len(contexts) * args.steps, Path(args.data))
    c = model.config
    print(f"model {model.num_params() / 1e6:.2f}M params ({c.n_layer} layers, {c.n_head} heads of {c.head_dim}), "
          f"block_size {c.block_size}, top_k {args.top_k}, chunk {args.chunk_size}, hot cache {args.cache_mib} MiB, "
          f"{torch.get_num_threads()} threads, {args.steps} decode steps per point")
    full = {n: full_attention_ms(model, n, args.steps) for n in contexts}
    print("| context | method | ms / token | speed-up vs full | fast memory MiB | store MiB | ingest tok/s |")
    print("|---|---|---|---|---|---|---|")
    for n in contexts:
        print(f"| {n} | full attention + KV cache | {full[n][0]:.2f} | 1.00x | {full[n][1] / MiB:.1f} | - | - |")
    for kind in args.indexes.split(","):
        mem = LandmarkMemory(model, index=kind, top_k=args.top_k, chunk_size=args.chunk_size,
                             cache_bytes=args.cache_mib * MiB, index_options={"train_size": args.train_size})
        fed = 0
        for n in contexts:
            t0 = time.perf_counter()
            mem.forward(ids[:, fed:n])
            rate = (n - fed) / (time.perf_counter() - t0)
            fed = n
            t0 = time.perf_counter()
            for i in range(args.steps):
                mem.step(ids[:, fed + i])
            ms = (time.perf_counter() - t0) * 1e3 / args.steps
            fed += args.steps
            usage = mem.memory_usage()
            fast, store = usage["fast"], usage["store"]
            print(f"| {n} | landmark, {kind} | {ms:.2f} | {full[n][0] / ms:.2f}x | {fast / MiB:.1f} | "
                  f"{store / MiB:.1f} | {rate:,.0f} |", flush=True)
        mem.close()


if __name__ == "__main__":
    main()
