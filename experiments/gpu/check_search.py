"""The exact search on the GPU (index kind ``flat-torch``) against ``flat`` (FAISS on the CPU) on
the same rows: the ids each returns over the whole range and a part of it, and their time.

    python experiments/gpu/check_search.py --out OUT             # a GPU: 1M keys of 64 dims
    python experiments/gpu/check_search.py --out OUT --small     # a CPU: flat-torch on the CPU

Ids must agree but where two scores tie within float32 rounding (the two sum the products in
different orders). Writes OUT/search.md and merges the figures into OUT/check.json; exits 1 if
the ids disagree.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from landmark_memory.index import new_index

sys.path.insert(0, str(Path(__file__).parent))
from check_kernels import merge_json  # noqa: E402


def timed(index, xq, k, lo, hi, reps):
    """The search's (D, I) and its median seconds over ``reps`` runs after a warm-up."""
    D, I = index.search(xq, k, lo, hi)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        index.search(xq, k, lo, hi)
        times.append(time.perf_counter() - t0)
    return D, I, float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--small", action="store_true", help="20K keys, for a CPU")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    n, dim = (20_000, 64) if args.small else (1_000_000, 64)
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((n, dim), dtype=np.float32)
    exact, gpu = new_index("flat", dim), new_index("flat-torch", dim)
    exact.add(xb)
    gpu.add(xb)
    lines = [f"# Exact search: flat-torch on {gpu.device} against flat (FAISS, CPU), {n:,} keys of {dim} dims, "
             f"k={args.k}", "", "| queries | range | flat ms | flat-torch ms | flat / flat-torch | ids agree |",
             "|---|---|---|---|---|---|"]
    rows, bad = [], 0
    for nq in (1, 64, 1024):
        xq = rng.standard_normal((nq, dim), dtype=np.float32)
        for lo, hi in ((0, n), (n // 3, n - 7)):
            D0, I0, t0 = timed(exact, xq, args.k, lo, hi, args.reps)
            D1, I1, t1 = timed(gpu, xq, args.k, lo, hi, args.reps)
            tied = np.isclose(D0, D1, rtol=1e-5, atol=1e-5).all()
            agree = float((I0 == I1).mean())
            ok = tied and agree > 0.99 and all(set(a) == set(b) for a, b in zip(I0.tolist(), I1.tolist()))
            bad += not ok
            rows.append(dict(queries=nq, lo=lo, hi=hi, flat_ms=t0 * 1e3, torch_ms=t1 * 1e3, ids_equal=agree, ok=ok))
            lines.append(f"| {nq} | [{lo:,}, {hi:,}) | {t0 * 1e3:.2f} | {t1 * 1e3:.2f} | {t0 / t1:.1f}x | "
                         f"{agree:.1%}{'' if ok else ' FAIL'} |")
            print(lines[-1], flush=True)
    (args.out / "search.md").write_text("\n".join(lines) + "\n")
    merge_json(args.out / "check.json", "search", dict(keys=n, dim=dim, k=args.k, device=str(gpu.device), rows=rows))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
