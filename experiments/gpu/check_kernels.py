"""Every kernel against the float64 reference on one device: the in-sequence Triton kernels
(two-pass and one-pass; forward and the gradients of q, k, v; fp32, bf16, fp16; block sizes 50
and 64 and one that divides nothing; with a Context Miss Token for the two-pass one), the
inference kernel (float and int8 pools, with and without a CMT) and the training-free block
attention with shared columns (PyTorch on the device).

    python experiments/gpu/check_kernels.py --out OUT            # on a GPU
    TRITON_INTERPRET=1 python experiments/gpu/check_kernels.py --out OUT --small   # on a CPU

Each case's figure is the largest ||x - ref|| / ||ref|| over its outputs; a case fails above its
dtype's bound or on any NaN or infinity. Writes OUT/kernels.md and the cases into
OUT/check.json (merged with what other steps wrote there); exits 1 if any case fails.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from landmark_memory import RotaryEmbedding
from landmark_memory.core.quant import dequantize_kv, quantize
from landmark_memory.kernels import block_attention_inference, landmark_attention, landmark_attention_inference

# fp32 on a GPU: tl.dot and matmul round their inputs to tf32 (10-bit mantissa); under the
# interpreter fp32 is exact. bf16 and fp16: the outputs are rounded to the dtype.
BOUND = {torch.float32: 5e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest relative error, inf where anything is not finite."""
    if not all(torch.isfinite(g).all() for g in got):
        return float("inf")
    return max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref))


def in_sequence(backend, block_size, T, D, dtype, device, B, H, cmt=False, seed=0):
    """Forward and the gradients (q, k, v, and the CMT key with ``cmt``) of a sequence of T."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = [torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(4)]  # q, k, v, dO
    extra = {}
    if cmt:
        extra = dict(cmt_k=torch.randn(B, H, 1, D, generator=g).to(device, dtype),
                     cmt_blocks=(torch.rand(B, T // (block_size + 1), generator=g) < 0.5).to(device))

    def run(be, dt):
        leaves = [t.to(dt).requires_grad_() for t in x[:3]] + ([extra["cmt_k"].to(dt).requires_grad_()] if cmt else [])
        o = landmark_attention(*leaves[:3], block_size, backend=be,
                               **({"cmt_k": leaves[3], "cmt_blocks": extra["cmt_blocks"]} if cmt else {}))
        return [o, *torch.autograd.grad(o, leaves, x[3].to(dt))]

    return rel_error(run(backend, dtype), run("reference", torch.float64))


def inference(block_size, D, dtype, device, int8, cmt, T_q=24, Tk=110, B=2, H=4, H_kv=2, K=4, n_pool=12, seed=0):
    """A chunk of T_q queries over Tk local keys and K blocks each from a pool of H_kv heads."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(device, dtype) for n in (T_q, Tk, Tk))
    kv = torch.randn(n_pool, 2, H_kv, block_size + 1, D, generator=g).to(device)
    table = torch.randint(-1, n_pool, (B, H, T_q, K), generator=g).to(device)
    pos = torch.randint(0, 100_000, (B, H, T_q, K), generator=g).to(device)
    cmt_k = torch.randn(B, H, 1, D, generator=g).to(device, dtype) if cmt else None
    if int8:
        data, scales = quantize(kv)
        pools = dict(pool_k=data[:, 0], pool_v=data[:, 1], pool_scale=scales.float())
        fk, fv = dequantize_kv(data[:, 0], data[:, 1], scales.float(), torch.float64)
    else:
        pools = dict(pool_k=kv[:, 0].to(dtype), pool_v=kv[:, 1].to(dtype))
        fk, fv = kv[:, 0].to(dtype).double(), kv[:, 1].to(dtype).double()
    out = landmark_attention_inference(q, k, v, block_size, block_table=table, block_pos=pos, cmt_k=cmt_k,
                                       backend="triton", **pools)
    ref = landmark_attention_inference(q.double(), k.double(), v.double(), block_size, pool_k=fk, pool_v=fv,
                                       block_table=table, block_pos=pos, backend="reference",
                                       cmt_k=None if cmt_k is None else cmt_k.double())
    return rel_error([out], [ref])


def shared_blocks(D, dtype, device, T_q=40, B=2, H=4, H_kv=2, L=64, K=3, S=3, n_pool=9, seed=0):
    """Training-free attention: K chosen blocks per query, then S columns shared by every query."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(device, dtype) for n in (T_q, T_q + 5, T_q + 5))
    pool_k, pool_v = (torch.randn(n_pool, H_kv, L, D, generator=g).to(device, dtype) for _ in range(2))
    table = torch.randint(-1, n_pool, (B, H, T_q, K + S), generator=g)
    pos = torch.randint(0, 500, (B, H, T_q, K + S), generator=g)
    table[..., K:] = torch.randint(-1, n_pool, (B, H, 1, S), generator=g)
    pos[..., K:] = torch.randint(0, 500, (B, H, 1, S), generator=g)
    args = dict(block_table=table.to(device), block_pos=pos.to(device), rope=RotaryEmbedding(D, 10000.0))
    out = block_attention_inference(q, k, v, pool_k=pool_k, pool_v=pool_v, shared=S, **args)
    ref = block_attention_inference(q.double(), k.double(), v.double(), pool_k=pool_k.double(),
                                    pool_v=pool_v.double(), backend="reference", **args)
    return rel_error([out], [ref])


def cases(small: bool, device: torch.device):
    """(name, dtype, thunk) of every check on ``device``; ``small``: sizes the Triton interpreter
    runs in seconds."""
    T, B, H = (70, 1, 2) if small else (1000, 2, 4)
    dtypes = (torch.float32, torch.bfloat16) if small else (torch.float32, torch.bfloat16, torch.float16)
    block_sizes = (50, 7) if small else (50, 64, 37)
    shape = dict(T_q=3, B=1, H=2, H_kv=1) if small else {}  # the interpreter runs a program per query
    for backend in ("triton", "triton-onepass"):
        for bs in block_sizes:
            for dt in dtypes:
                yield (f"{backend} bs={bs} T={T} D=64", dt,
                       lambda be=backend, bs=bs, dt=dt: in_sequence(be, bs, T, 64, dt, device, B, H))
        yield (f"{backend} bs=50 T={T} D=128", torch.bfloat16,
               lambda be=backend: in_sequence(be, 50, T, 128, torch.bfloat16, device, B, H))
    yield (f"triton bs=50 T={T} D=64 with a CMT", torch.float32,
           lambda: in_sequence("triton", 50, T, 64, torch.float32, device, B, H, cmt=True))
    for bs in block_sizes[::2]:
        for int8 in (False, True):
            for cmt in (False, True):
                dt = torch.float32 if int8 else torch.bfloat16
                yield (f"inference triton bs={bs} {'int8' if int8 else 'bf16'} pool{' CMT' if cmt else ''}", dt,
                       lambda bs=bs, int8=int8, cmt=cmt, dt=dt: inference(bs, 64, dt, device, int8, cmt, **shape))
    yield "training-free blocks, shared columns", torch.float32, lambda: shared_blocks(64, torch.float32, device)


def merge_json(path: Path, key: str, value) -> None:
    """Put ``value`` under ``key`` in the JSON file ``path`` (made if missing)."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[key] = value
    path.write_text(json.dumps(doc, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--small", action="store_true", help="interpreter sizes (a CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, Triton interpreter"
    lines = [f"# Kernels against the float64 reference ({name})", "",
             "| case | dtype | rel. error | bound | |", "|---|---|---|---|---|"]
    results, failed = [], 0
    for case, dt, thunk in cases(args.small, device):
        try:
            err = thunk()
        except Exception as e:  # a case that cannot run fails, and the others still run
            err, note = float("inf"), f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        else:
            note = ""
        ok = err <= BOUND[dt]
        failed += not ok
        results.append(dict(case=case, dtype=str(dt).removeprefix("torch."), rel_error=err, ok=ok, note=note))
        lines.append(f"| {case} | {results[-1]['dtype']} | {err:.1e} | {BOUND[dt]:.0e} | "
                     f"{'ok' if ok else 'FAIL ' + note} |")
        print(lines[-1], flush=True)
    lines += ["", f"{len(results) - failed} of {len(results)} cases within their bounds."]
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    merge_json(args.out / "check.json", "kernels", results)
    print(lines[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
