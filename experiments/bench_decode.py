"""Per-token decode latency and resident memory: landmark memory (each index kind) vs full
attention with a KV cache, same model weights, same run.

    python experiments/bench_decode.py                                   # 4K..64K on CPU
    python experiments/bench_decode.py --contexts 4096,32768 --indexes flat,hnsw --shape tiny
    python experiments/bench_decode.py --model smollm2-landmark --contexts 8192,32768,131072

The landmark memory ingests real book text (its ingestion speed is reported too) and then
decodes ``--steps`` tokens at each context length. The full-attention baseline decodes with a
KV cache of the same length holding random values, which cost the same time as real ones and
spare an O(n^2) prefill: for a LandmarkGPT a preallocated cache read by PyTorch's SDPA, for a
converted Hugging Face model the plain model it was converted from (``--baseline``; for
``smollm2-landmark`` the published SmolLM2) with transformers' SDPA attention and its
``DynamicCache``, the path a user would otherwise take. Memory: the KV cache of full attention
vs the landmark memory's fast part (landmark keys, indexes, hot cache, current chunk) and its
block store.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import book_tokens

from landmark_memory import LandmarkConfig, LandmarkGPT, load_tokenizer
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import backbone_for, load_model
from landmark_memory.training.data import SAMPLE_DIR

MiB = 2 ** 20
BASELINES = {"smollm2-landmark": "smollm2"}  # the plain model a named landmark model was converted from

SHAPES = {"tiny": dict(n_layer=4, n_head=4, n_embd=128, ffn_hidden=512),
          "small": dict(n_layer=6, n_head=8, n_embd=512, ffn_hidden=2048),
          "paper": dict(n_layer=12, n_head=8, n_embd=1024, ffn_hidden=4096)}


def models(args):
    """``(landmark model, tokenizer, decode step of the full-attention baseline)``."""
    if not args.model:
        torch.manual_seed(0)  # decoding costs the same with untrained weights
        model = LandmarkGPT(LandmarkConfig.for_tokenizer(**SHAPES[args.shape])).eval()
        return model, load_tokenizer(), gpt_kv_cache(model)
    loaded = load_model(args.model, "cpu")
    model, tok = loaded.model, loaded.tokenizer
    if isinstance(model, LandmarkGPT):
        return model, tok, gpt_kv_cache(model)
    baseline = args.baseline or BASELINES.get(args.model)
    if baseline is None:
        raise SystemExit(f"--baseline: the plain Hugging Face model {args.model} was converted from")
    return model, tok, hf_dynamic_cache(load_model(baseline, "cpu").model)


def gpt_kv_cache(model):
    """``cached(n, steps)``: a LandmarkGPT's layers decoding with a preallocated KV cache
    holding n positions; returns the step function and the cache's bytes."""
    cfg = model.config

    def cached(n, steps):
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

        return step, 2 * cfg.n_layer * n * cfg.n_embd * 4

    return cached


def hf_dynamic_cache(model):
    """``cached(n, steps)`` for a plain Hugging Face model: a ``DynamicCache`` filled with n
    random positions, extended one token per step by the model's own forward."""
    from transformers import DynamicCache

    bb = model.config
    H_kv, D = bb.num_key_value_heads, getattr(bb, "head_dim", None) or bb.hidden_size // bb.num_attention_heads

    def cached(n, steps):
        cache = DynamicCache(config=bb)
        for layer in range(bb.num_hidden_layers):
            cache.update(torch.randn(1, H_kv, n, D), torch.randn(1, H_kv, n, D), layer)

        def step(tok, pos):
            return model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1]

        return step, 2 * bb.num_hidden_layers * n * H_kv * D * 4

    return cached


@torch.no_grad()
def full_attention_ms(cached, n, steps):
    """ms per token decoding at context n with a KV cache, and the cache's bytes."""
    step, kv_bytes = cached(n, steps + 1)
    step(torch.tensor([[5]]), n)  # warm up
    t0 = time.perf_counter()
    for i in range(steps):
        step(torch.tensor([[5]]), n + 1 + i)
    return (time.perf_counter() - t0) * 1e3 / steps, kv_bytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,32768,65536")
    ap.add_argument("--indexes", default="flat,ivf-rows,hnsw,ivf,ivfpq")
    ap.add_argument("--model", default=None, help="a landmark model: a saved LandmarkGPT, a converted Hugging Face "
                                                  "model or smollm2-landmark (default: an untrained LandmarkGPT of "
                                                  "--shape)")
    ap.add_argument("--baseline", help="with a converted Hugging Face --model, the plain model it came from "
                                       "(default: smollm2 for smollm2-landmark)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="model shape without --model")
    ap.add_argument("--cache-mib", type=int, default=256, help="hot-block cache budget (default 256, the memory's own)")
    ap.add_argument("--train-size", type=int, default=512, help="landmarks before IVF indexes train")
    ap.add_argument("--data", default=str(SAMPLE_DIR), help="text to ingest")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=None, help="default the memory's (about 250)")
    ap.add_argument("--store-dtype", default="", help="stored key/value dtypes, comma-separated, each its own rows "
                                                      "(default: the model's)")
    args = ap.parse_args(argv)
    contexts = sorted(map(int, args.contexts.split(",")))
    model, tok, cached = models(args)
    ids = book_tokens(tok, contexts[-1] + len(contexts) * (args.steps + 1), Path(args.data))
    bb = backbone_for(model)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model or args.shape} {params / 1e6:.2f}M params ({bb.n_layer} layers, {bb.n_head} heads "
          f"over {bb.n_kv_head} key/value heads of {bb.head_dim}), block_size {bb.block_size}, top_k {args.top_k}, "
          f"hot cache {args.cache_mib} MiB, {torch.get_num_threads()} threads, {args.steps} decode steps per point")
    full = {}
    for n in contexts:  # one cache at a time: at 128K a model's cache can take gigabytes
        full[n] = full_attention_ms(cached, n, args.steps)
    print("| context | method | ms / token | speed-up vs full | fast memory MiB | store MiB | ingest tok/s |")
    print("|---|---|---|---|---|---|---|")
    for n in contexts:
        print(f"| {n} | full attention + KV cache | {full[n][0]:.2f} | 1.00x | {full[n][1] / MiB:.1f} | - | - |")
    for kind, dtype in [(k, d) for k in args.indexes.split(",") for d in args.store_dtype.split(",")]:
        mem = LandmarkMemory(model, index=kind, top_k=args.top_k, chunk_size=args.chunk_size, store_dtype=dtype or None,
                             cache_bytes=args.cache_mib * MiB, index_options={"train_size": args.train_size})
        method = f"landmark, {kind}" + (f", {dtype} store" if dtype else "")
        fed = 0
        for n in contexts:
            t0 = time.perf_counter()
            for a in range(fed, n, mem.options.chunk_size):  # a chunk at a time: the retrieved ids stay small
                mem.forward(ids[:, a:min(n, a + mem.options.chunk_size)], logits="none")
            rate = (n - fed) / (time.perf_counter() - t0)
            mem.inspection.step(ids[:, n])  # untimed: a process's first step loads compiled code
            fed = n + 1
            t0 = time.perf_counter()
            for i in range(args.steps):
                mem.inspection.step(ids[:, fed + i])
            ms = (time.perf_counter() - t0) * 1e3 / args.steps
            fed += args.steps
            usage = mem.inspection.usage()
            fast, store = usage.fast, usage.store
            print(f"| {n} | {method} | {ms:.2f} | {full[n][0] / ms:.2f}x | {fast / MiB:.1f} | "
                  f"{store / MiB:.1f} | {rate:,.0f} |", flush=True)
        mem.close()


if __name__ == "__main__":
    main()
