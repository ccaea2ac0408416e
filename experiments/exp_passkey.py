"""Passkey retrieval vs context length (paper Figure 3b analog): the landmark model through
memory (chunks of 250, top-4) and in sequence, the full-attention baseline in sequence, and
Infini-attention streamed (when its model exists).

Besides accuracy, for the landmark model through memory: how often the retrieval finds the
key. At the prompt's last token, the share of (layer, head) pairs whose top-k blocks include
a block holding the pass key sentence, over trials where that sentence has left the local
chunk, beside the share that k blocks drawn at random would reach. It tells retrieval
failures from copying failures.

    python experiments/exp_passkey.py --books BOOKS
"""

import math
import time

import torch
from _common import load, load_optional, parse, parser, plt, publish

from landmark_memory.core.passkey import PasskeyPrompts, run_passkey
from landmark_memory.core.tokenizer import load_tokenizer
from landmark_memory.jobs.evaluate import parse_lengths, passkey_accuracy
from landmark_memory.memory import LandmarkMemory

MEMORY = dict(chunk_size=250, top_k=4)


def find(ids, piece):
    return next(i for i in range(len(ids) - len(piece) + 1) if ids[i:i + len(piece)] == piece)


def memory_run(model, tok, lengths, trials, seed, progress):
    """passkey accuracy through memory, and the key-block retrieval rate per length."""
    prompts, bs, hits = PasskeyPrompts(tok), model.config.block_size, {}
    marker = prompts.ids(" The pass key is")

    def generate(ids):
        mem = LandmarkMemory(model, **MEMORY)
        out = mem.forward(torch.tensor([ids]), logits="last")
        start = find(ids, marker)
        key_blocks = set(range(start // bs, (start + 24) // bs + 1))  # the sentence is about 22 tokens
        if max(key_blocks) < mem.n_blocks:  # the sentence is in memory, not in the local chunk
            last = torch.stack([r[0, :, -1] for r in out.retrieved])  # (layers, H, k)
            share = torch.isin(last, torch.tensor(sorted(key_blocks))).any(-1).float().mean().item()
            k, n = MEMORY["top_k"], mem.n_blocks  # chance: k blocks drawn at random from n
            chance = 1 - math.comb(n - len(key_blocks), k) / math.comb(n, k)
            hits.setdefault(len(ids), []).append((share, chance))
        logits, new = out.logits[:, -1], []
        for _ in range(8):
            nxt = logits.argmax(-1)
            new.append(int(nxt))
            logits = mem.inspection.step(nxt)
        mem.close()
        return tok.decode(new)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(lengths) * trials, desc="passkey (memory)", unit="trial")
    rows = run_passkey(generate, tok, lengths, trials, seed, progress=bar)
    if bar:
        bar.close()
    for r in rows:
        got = hits.get(r["length"], [])
        r["key_retrieved"] = sum(s for s, _ in got) / len(got) if got else None
        r["key_chance"] = sum(c for _, c in got) / len(got) if got else None
        r["trials_in_memory"] = len(got)
    return rows


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--lengths", default="1k,2k,4k,8k,16k,32k", help="prompt lengths through memory")
    ap.add_argument("--full-lengths", default="256,512,1k,2k,4k,8k",
                    help="prompt lengths in sequence (full attention re-reads the whole prompt per token)")
    ap.add_argument("--trials", type=int, default=10, help="prompts per length (the paper: 50)")
    ap.add_argument("--seed", type=int, default=0)
    args = parse(ap, argv)
    t0 = time.time()
    tok = load_tokenizer()
    landmark, full, infini = load(args.landmark_model), load(args.full_model), load_optional(args.infini_model)
    lengths, full_lengths = parse_lengths(args.lengths), parse_lengths(args.full_lengths)
    series = {"landmark + memory (chunk 250, top-4)": memory_run(landmark, tok, lengths, args.trials, args.seed,
                                                                  not args.quiet)}
    short = [n for n in full_lengths if n <= 512]
    series["landmark in sequence"] = passkey_accuracy(landmark, tok, short, args.trials, args.seed,
                                                      progress=not args.quiet)
    series["full attention in sequence"] = passkey_accuracy(full, tok, full_lengths, args.trials, args.seed,
                                                            progress=not args.quiet)
    if infini is not None:  # streamed: its state does not grow, so every length is affordable
        series["Infini-attention (streamed)"] = passkey_accuracy(infini, tok, lengths, args.trials, args.seed,
                                                                 progress=not args.quiet)
    body = [f"{args.trials} trials per length (the paper uses 50), seed {args.seed}; the key is a random integer in "
            "1..50000 at a random depth of the paper's filler (Figure 3a prompt); a trial is correct when the first "
            "integer generated (greedy) equals the key. Training length: 512 tokens.", "",
            "| model | length | accuracy | key block retrieved (share of layer-heads) | by chance |",
            "|---|---|---|---|---|"]
    for label, rows in series.items():
        for r in rows:
            kr, kc = r.get("key_retrieved"), r.get("key_chance")
            kr = "-" if "key_retrieved" not in r else ("(key in local chunk)" if kr is None else
                                                       f"{100 * kr:.0f}% ({r['trials_in_memory']} trials)")
            kc = "-" if kc is None else f"{100 * kc:.0f}%"
            body.append(f"| {label} | {r['length']:,} | {100 * r['accuracy']:.0f}% ({r['correct']}/{r['trials']}) | "
                        f"{kr} "
                        f"| {kc} |")
    p = plt()
    fig, ax = p.subplots(figsize=(6.5, 4))
    for label, rows in series.items():
        ax.plot([r["length"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=label)
    mem_rows = [r for r in series["landmark + memory (chunk 250, top-4)"] if r.get("key_retrieved") is not None]
    ax.plot([r["length"] for r in mem_rows], [100 * r["key_retrieved"] for r in mem_rows], marker="x", linestyle=":",
            label="key block retrieved (share of layer-heads)")
    ax.axvline(512, color="gray", linewidth=0.8)
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="%", ylim=(-3, 103), title="Passkey vs context length")
    publish(fig, ax, "passkey", "Passkey retrieval vs context length (Figure 3b analog)", body, args, t0, argv,
            "passkey accuracy vs prompt length", notes=["", "The gray line marks the training length."])


if __name__ == "__main__":
    main()
