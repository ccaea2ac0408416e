"""Landmark search: latency vs recall@k for each index kind, against exact (flat) search.

    python experiments/bench_index.py                        # 10K, 100K, 1M keys of dim 64
    python experiments/bench_index.py --sizes 10000 --keys keys.npy

Keys are synthetic unless ``--keys`` gives an (n, D) float32 .npy file of real landmark keys:
a mixture of Gaussian clusters (real landmark keys are clustered; isotropic random vectors are
the worst case for every approximate index). Queries come from the same mixture. Each kind is
timed at a few search settings (HNSW efSearch, IVF nprobe) to trace its latency/recall curve;
the ratio is flat search time over this kind's, measured in the same run.
"""

import argparse
import time

import faiss
import numpy as np

from landmark_memory.index import new_index, recall_at_k


def clustered(n, dim, rng, n_clusters=256):
    centers = rng.standard_normal((n_clusters, dim)).astype(np.float32) * 2
    return centers[rng.integers(0, n_clusters, n)] + rng.standard_normal((n, dim)).astype(np.float32)


def timed_search(index, xq, k):
    index.search(xq[:10], k)  # warm up
    t0 = time.perf_counter()
    _, I = index.search(xq, k)
    return (time.perf_counter() - t0) * 1e3, I


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--keys", default=None, help="an (n, D) float32 .npy of real landmark keys")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    real = np.load(args.keys).astype(np.float32) if args.keys else None
    dim = real.shape[1] if real is not None else args.dim
    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} threads, dim {dim}, {args.queries} queries, "
          f"k={args.k}, keys: {args.keys or 'synthetic clustered'}")
    print("| keys | index | setting | build s | search ms | recall@k | flat / this |")
    print("|---|---|---|---|---|---|---|")
    for n in map(int, args.sizes.split(",")):
        if real is not None:
            xb = real[rng.permutation(len(real))[:n]]
            noise = 0.1 * rng.standard_normal((args.queries, dim)).astype(np.float32)
            xq = xb[rng.integers(0, len(xb), args.queries)] + noise
        else:
            xb, xq = clustered(n, dim, rng), clustered(args.queries, dim, rng)
        n = len(xb)
        flat = new_index("flat", dim)
        flat.add(xb)
        flat_ms, I_exact = timed_search(flat, xq, args.k)
        print(f"| {n} | flat | exact | - | {flat_ms:.1f} | 1.000 | 1.00x |")
        settings = {"hnsw": [("ef_search", e) for e in (16, 64, 128)],
                    "ivf": [("nprobe", p) for p in (4, 16, 64)],
                    "ivfpq": [("nprobe", p) for p in (4, 16, 64)]}
        for kind, options in settings.items():
            t0 = time.perf_counter()
            index = new_index(kind, dim, train_size=min(n, 100_000))
            for part in np.array_split(xb, max(1, n // 50_000)):  # incremental, as memory grows
                index.add(part)
            build = time.perf_counter() - t0
            for name, value in options:
                setattr(index, name, value)
                ms, I = timed_search(index, xq, args.k)
                print(f"| {n} | {kind} | {name}={value} | {build:.1f} | {ms:.1f} | {recall_at_k(I, I_exact):.3f} | "
                      f"{flat_ms / ms:.1f}x |")


if __name__ == "__main__":
    main()
