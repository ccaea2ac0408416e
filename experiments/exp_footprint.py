"""Memory footprint per token of context: full attention (its KV cache), landmark (what must
sit near the compute: landmark keys, indexes, the open chunk, the hot blocks; and the total
with every block's keys and values in the store) and Infini-attention (its bounded state).

Landmark and Infini-attention are measured after really reading the text (``LandmarkMemory.
memory_usage()``, ``InfiniState.nbytes()``); full attention's KV cache is what it must hold,
2 x layers x embedding x bytes per token, computed.

    python experiments/exp_footprint.py --books BOOKS
"""

import time

import torch
from _common import held_out_books, load, load_optional, parse, parser, plt, publish

from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.infini import InfiniState


@torch.no_grad()
def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--contexts", default="4096,16384,65536", help="context lengths in tokens")
    args = parse(ap, argv)
    t0 = time.time()
    contexts = [int(x) for x in args.contexts.split(",")]
    landmark, full, infini = load(args.landmark_model), load(args.full_model), load_optional(args.infini_model)
    ids = torch.cat([torch.as_tensor(b, dtype=torch.long) for _, b in held_out_books(args.books)])
    if len(ids) < max(contexts):
        raise SystemExit(f"the held-out books hold {len(ids):,} tokens, fewer than the longest context asked for")
    cfg = full.config
    rows = []
    for n in contexts:
        x = ids[None, :n]
        kv = 2 * cfg.n_layer * cfg.n_embd * 4 * n  # float32 keys and values of every layer
        mem = LandmarkMemory(landmark, chunk_size=250, top_k=4, cache_bytes=32 << 20)
        mem.forward(x, logits="none")
        use = mem.inspection.usage()
        mem.close()
        row = {"context": n, "full": kv, "landmark_fast": use.fast, "landmark_total": use.fast + use.store}
        if infini is not None:
            state = InfiniState()
            infini(x, state=state)
            row["infini"] = state.nbytes()
        rows.append(row)
        print({k: (v if k == "context" else round(v / n, 1)) for k, v in row.items()})
    labels = {"full": "full attention (KV cache)", "landmark_fast": "landmark, near the compute",
              "landmark_total": "landmark, total (with the store)", "infini": "Infini-attention (state)"}
    keys = [k for k in labels if k in rows[0]]
    body = [f"Models `{args.landmark_model}`, `{args.full_model}`" + (f", `{args.infini_model}`" if infini else "")
            + f": {cfg.n_layer} layers, {cfg.n_head} heads of {cfg.head_dim}, float32. Text: the held-out books. "
            "Landmark: chunks of 250, top-4, flat index, a 32 MiB hot-block cache on the compute device (counted "
            "as far as it is filled). Bytes per token of context:", "",
            "| context | " + " | ".join(labels[k] for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for r in rows:
        body.append(f"| {r['context']:,} | " + " | ".join(f"{r[k] / r['context']:,.1f}" for k in keys) + " |")
    p = plt()
    fig, ax = p.subplots(figsize=(6.5, 4))
    for k in keys:
        ax.plot(contexts, [r[k] / r["context"] for r in rows], marker="o", label=labels[k])
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="bytes per token of context",
           title="Memory footprint")
    publish(fig, ax, "footprint", "Memory footprint per token of context", body, args, t0, argv,
            "bytes per token of context")


if __name__ == "__main__":
    main()
