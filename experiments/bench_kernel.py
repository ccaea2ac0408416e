"""Landmark attention kernels vs PyTorch SDPA (full causal attention, the ceiling).

    python experiments/bench_kernel.py                       # GPU: bf16, T = 1K..16K, D = 64, 128
    python experiments/bench_kernel.py --T 512,1024 --D 64 --decode 4096   # CPU: reference and dense vs SDPA
    TRITON_INTERPRET=1 python experiments/bench_kernel.py --T 128 --D 64 --backends sdpa,triton,triton-onepass \
        --decoder triton --decode 2048 --reps 1           # CPU: the Triton kernels interpreted (slow; a smoke run)

Prints forward and forward+backward time and peak memory per backend, each backend's time as a ratio of SDPA's
measured in the same run, and (up to ``--check-T``) each landmark backend's relative error against the float64
reference, so a fast path is never timed unchecked. The Triton backend needs a GPU (on a CPU the dense backend, its
fast path, takes its place); the reference and dense backends are skipped beyond ``--max-reference-T``, where their T
x T buffers would not fit.

Decode: one new token against a context of n tokens. SDPA reads the whole KV cache; landmark
decoding scores the n / (block_size + 1) landmarks (a matmul and top-k, standing in for the
index search), then runs the inference entry point over the current block and the top_k
retrieved blocks of a GPU-resident pool.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from landmark_memory.kernels import landmark_attention, landmark_attention_inference


def _timed(fn, reps, device):
    fn()  # warm up (and compile)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps, torch.cuda.max_memory_allocated() / 2**20
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps, float("nan")


def cmt_inputs(cmt, B, H, T, D, block_size, dtype, device):
    """With ``cmt``: a random Context Miss Token key and half the landmarks CMT-controlled."""
    if not cmt:
        return {}
    return dict(cmt_k=torch.randn(B, H, 1, D, device=device, dtype=dtype, requires_grad=True),
                cmt_blocks=torch.rand(B, T // (block_size + 1), device=device) < 0.5)


def bench(backend, B, H, T, D, block_size, dtype, device, reps, cmt=False):
    """(forward ms, forward MiB, fwd+bwd ms, fwd+bwd MiB); None where it does not fit."""
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    extra = cmt_inputs(cmt and backend != "sdpa", B, H, T, D, block_size, dtype, device)
    if backend == "sdpa":
        def attn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        def attn():
            return landmark_attention(q, k, v, block_size, backend=backend, **extra)

    def fwd():
        with torch.no_grad():
            attn()

    def fwd_bwd():
        torch.autograd.grad(attn(), (q, k, v), do)

    try:
        return (*_timed(fwd, reps, device), *_timed(fwd_bwd, reps, device))
    except torch.OutOfMemoryError:
        return None
    finally:
        q = k = v = do = None  # (the closures' tensors freed before the cache is emptied)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def rel_error(backend, B, H, T, D, block_size, dtype, device, cmt=False):
    """Largest ||x - ref|| / ||ref|| over the output and the gradients (of q, k, v and the CMT
    key), the reference being the paper-equation attention in float64 on the same (rounded)
    inputs."""
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(3))
    do = torch.randn_like(q)
    extra = cmt_inputs(cmt, B, H, T, D, block_size, dtype, device)

    def run(be, dt):
        x = [t.detach().to(dt).requires_grad_() for t in (q, k, v, *extra.values())][:3 + bool(cmt)]
        o = landmark_attention(*x[:3], block_size, backend=be, **({"cmt_k": x[3], "cmt_blocks": extra["cmt_blocks"]}
                                                                   if cmt else {}))
        return [o, *torch.autograd.grad(o, x, do.to(dt))]

    got, ref = run(backend, dtype), run("reference", torch.float64)
    err = max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref))
    q = k = v = do = got = ref = None
    return err


def bench_decode(backend, n, B, H, D, block_size, top_k, dtype, device, reps):
    """ms per decoded token for one layer at context n, or None where it does not fit."""
    L = block_size + 1
    n_blocks, local = n // L, n % L + 1
    try:
        q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
        if backend == "sdpa":
            k, v = (torch.randn(B, H, n, D, device=device, dtype=dtype) for _ in range(2))
            return _timed(lambda: F.scaled_dot_product_attention(q, k, v), reps, device)[0]
        pool_k, pool_v = (torch.randn(n_blocks * B, H, L, D, device=device, dtype=dtype) for _ in range(2))
        lm = pool_k[:, :, block_size].view(B, n_blocks, H, D).transpose(1, 2)  # (B, H, n_blocks, D)
        k, v = (torch.randn(B, H, local, D, device=device, dtype=dtype) for _ in range(2))
        offset = torch.arange(B, device=device)[:, None, None, None] * n_blocks

        def step():
            top = (q @ lm.transpose(-2, -1)).topk(min(top_k, n_blocks), dim=-1).indices  # (B, H, 1, k)
            return landmark_attention_inference(q, k, v, block_size, pool_k=pool_k, pool_v=pool_v,
                                                block_table=top + offset, block_pos=top * L, backend=backend)

        return _timed(step, reps, device)[0]
    except torch.OutOfMemoryError:
        return None
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="1024,2048,4096,8192,16384")
    ap.add_argument("--D", default="64,128")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=50)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--reps", type=int, default=None, help="default: 10 on GPU, 2 on CPU")
    ap.add_argument("--max-reference-T", type=int, default=8192, help="skip the O(T^2) reference beyond this")
    ap.add_argument("--check-T", type=int, default=4096, help="check each backend against a float64 reference up to "
                                                              "this T")
    ap.add_argument("--decode", default=None, help="decode contexts (default: 4K..1M on GPU, 4K..16K on CPU; 0 = none)")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--cmt", action="store_true", help="landmark backends with a Context Miss Token (half the "
                                                        "landmarks controlled)")
    ap.add_argument("--backends", help="comma-separated, sdpa first (default: sdpa, reference, triton and "
                                       "triton-onepass on a GPU; sdpa, reference, dense on a CPU)")
    ap.add_argument("--decoder", help="the landmark backend of the decode rows (default: triton on a GPU, auto on a "
                                      "CPU, its compiled decode kernel)")
    ap.add_argument("--out", type=Path, help="also append the tables to this markdown file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = args.reps or (10 if device.type == "cuda" else 2)
    backends = (args.backends.split(",") if args.backends else  # dense: the CPU fast path
                ["sdpa", "reference", *(("triton", "triton-onepass") if device.type == "cuda" else ("dense",))])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"

    def emit(line=""):
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    emit(f"device {name}, {dtype}, B={args.B} H={args.H} block_size={args.block_size}, mean of {reps} runs"
         + (", landmark backends with a Context Miss Token" if args.cmt else ""))
    emit("| T | D | backend | fwd ms | fwd MiB | fwd+bwd ms | fwd+bwd MiB | fwd / SDPA | fwd+bwd / SDPA | rel. error |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for D in map(int, args.D.split(",")):
        for T in map(int, args.T.split(",")):
            base = None
            for backend in backends:
                if args.cmt and backend == "triton-onepass":
                    emit(f"| {T} | {D} | {backend} | no Context Miss Token path | | | | | | |")
                    continue
                r = None if backend in ("reference", "dense") and T > args.max_reference_T else \
                    bench(backend, args.B, args.H, T, D, args.block_size, dtype, device, reps, args.cmt)
                if backend == "sdpa":
                    base = r
                if r is None:
                    emit(f"| {T} | {D} | {backend} | skipped (too large) | | | | | | |")
                    continue
                ratio = (f"{r[0] / base[0]:.2f}x | {r[2] / base[2]:.2f}x" if base else "- | -")
                mib = [f"{m:.0f}" if m == m else "-" for m in (r[1], r[3])]  # no peak memory on CPU
                err = (f"{rel_error(backend, args.B, args.H, T, D, args.block_size, dtype, device, args.cmt):.1e}"
                       if backend != "sdpa" and T <= args.check_T else "-")
                emit(f"| {T} | {D} | {backend} | {r[0]:.2f} | {mib[0]} | {r[2]:.2f} | {mib[1]} | {ratio} | {err} |")

    contexts = args.decode or ("4096,16384,65536,262144,1048576" if device.type == "cuda" else "4096,16384")
    if contexts == "0":
        return
    D = int(args.D.split(",")[-1])
    decoders = ["sdpa", args.decoder or ("triton" if device.type == "cuda" else "auto")]
    emit()
    emit(f"decode, one token, D={D}, top_k={args.top_k}: ms per layer")
    emit("| context | " + " | ".join(decoders) + " | landmark / SDPA |")
    emit("|---|" + "---|" * (len(decoders) + 1))
    for n in map(int, contexts.split(",")):
        r = [bench_decode(b, n, args.B, args.H, D, args.block_size, args.top_k, dtype, device, reps) for b in decoders]
        cells = [f"{x:.3f}" if x is not None else "OOM" for x in r]
        ratio = f"{r[1] / r[0]:.2f}x" if None not in r else "-"
        emit(f"| {n} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
