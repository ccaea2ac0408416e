"""Where SmolLM2 loses a fact in book text: the model or the memory.

    python experiments/exp_diagnose.py --books BOOKS                     # both parts
    python experiments/exp_diagnose.py --books BOOKS --parts passkey --length 8192 --trials 10
    python experiments/exp_diagnose.py --books BOOKS --parts questions --adapters stage6=out/a,stage7=out/b

``passkey``: the paper's passkey prompt with its filler replaced by consecutive text of a held-out
book (a random book, offset, depth and key per trial). Each trial is read four ways:
- in sequence: the whole prompt in one forward of the landmark model, every block in its
  grouped softmax, no memory;
- through memory: the prompt up to its question read into a memory (the defaults: top-k 4,
  stingy positions), then the question read from it with top-k 4, 8 and 16, stingy and exact.
The answer is taken greedily with the key's own digits fed back (teacher forcing), which is
right exactly when greedy decoding is right. For the question's last token and the answer's
tokens, the share of (layer, head) lookups whose top-k held a block of the key's sentence says
whether the memory found it. So a trial that is right in sequence and wrong through memory
lost the key in retrieval; wrong in sequence, in the model.

``questions``: four facts in plain sentences planted in the first ``--question-tokens`` tokens of
a held-out novel, each asked as ``ask`` asks it (chat template). For each question: the answer;
the 20 blocks its lookups read most, and where the fact's block stands among them; per layer,
the share of heads whose top-k at the question's last token held the fact's block; and how much
the questions' blocks overlap, and how much of their lookups go to the first block and the last
few (sink-like landmarks would win for every question).
"""

import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from _common import ADAPTER, PLANTED_FACTS, adapter_specs, load_smollm2, write_result
from exp_smollm2 import held_out
from landmark_memory.answer import ask
from landmark_memory.data import read_text
from landmark_memory.kinds import in_sequence_logits
from landmark_memory.memory import LandmarkMemory
from landmark_memory.passkey import MAX_KEY, PasskeyPrompts, answer, fact, first_int

CONFIGS = [(4, "stingy"), (8, "stingy"), (16, "stingy"), (4, "exact"), (8, "exact"), (16, "exact")]
FACTS = PLANTED_FACTS[:4]  # (sentence planted, question, the words a right answer holds)
DEPTHS = (0.2, 0.45, 0.65, 0.85)


def book_filler(ids, start):
    """``filler(n)`` for ``PasskeyPrompts.prompt``: consecutive book tokens from ``start``, each
    call going on where the last one stopped."""
    at = [start]

    def filler(n):
        out = ids[at[0]:at[0] + n]
        at[0] += n
        return list(out)

    return filler


def greedy_answer(logits, tok):
    """The first integer of the greedy tokens at each answer position (teacher forced)."""
    return first_int(tok.decode(logits.argmax(-1).tolist()))


def key_hits(retrieved, positions, blocks):
    """Share of (layer, head, position) lookups at ``positions`` whose top-k held one of ``blocks``,
    overall and per layer."""
    per_layer = []
    for r in retrieved:  # (1, H, T, k)
        got = r[0][:, positions]  # (H, P, k)
        per_layer.append(float(np.isin(got.numpy(), blocks).any(-1).mean()))
    return float(np.mean(per_layer)), per_layer


@torch.no_grad()
def passkey_trial(model, tok, prompts, book, rng, length, folder):
    name, _, ids = book
    key, depth = rng.randint(1, MAX_KEY), rng.random()
    n_key = len(prompts.ids(fact(key)))
    n_fill = length - len(prompts.intro) - n_key - len(prompts.question)
    start = rng.randrange(0, len(ids) - n_fill)
    prompt = prompts.prompt(length, key, depth, book_filler(ids, start))
    fact_at = len(prompts.intro) + round(depth * n_fill)
    ans = tok.encode(answer(key)).ids
    seq = torch.tensor([prompt + ans])
    n_p, q0 = len(prompt), len(prompt) - len(prompts.question)
    row = {"book": name, "key": key, "depth": round(depth, 3)}
    t0 = time.perf_counter()
    logits = in_sequence_logits(model, seq[:, :-1])[0, n_p - 1:]  # the answer's positions
    row["in sequence"] = greedy_answer(logits, tok)
    row["in sequence s"] = time.perf_counter() - t0
    mem = LandmarkMemory(model, path=folder, store="lmdb")
    bs = mem.shape.block_size
    key_blocks = list(range(fact_at // bs, (fact_at + n_key - 1) // bs + 1))  # the sentence's blocks
    mem.forward(seq[:, :q0], logits="none")
    mem.commit()
    mem.close()
    asked = list(range(n_p - 1 - q0, seq.shape[1] - 1 - q0))  # the question's last token and the answer's
    for k, mapping in CONFIGS:
        with LandmarkMemory.open(folder, model, readonly=True, top_k=k, position_mapping=mapping) as m:
            out = m.forward(seq[:, q0:-1])
        row[f"k{k} {mapping}"] = greedy_answer(out.logits[0, asked], tok)
        row[f"k{k} {mapping} hits"], row[f"k{k} {mapping} layers"] = key_hits(out.retrieved, asked, key_blocks)
    return row


def part_passkey(args, model, tok, books):
    prompts, rng, rows = PasskeyPrompts(tok), random.Random(args.seed), []
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(args.trials):
            rows.append(passkey_trial(model, tok, prompts, books[t % len(books)], rng, args.length, Path(tmp) / str(t)))
            r = rows[-1]
            print(f"trial {t}: key {r['key']} at {r['depth']:.2f} of {r['book']}: in sequence {r['in sequence']}, "
                  + ", ".join(f"k{k} {m} {r[f'k{k} {m}']} ({r[f'k{k} {m} hits']:.0%})" for k, m in CONFIGS), flush=True)
    right = {c: sum(r[c] == r["key"] for r in rows) for c in ["in sequence"] + [f"k{k} {m}" for k, m in CONFIGS]}
    body = [f"## Book-text passkey at {args.length:,} tokens", "",
            f"{args.trials} trials (seed {args.seed}): a held-out book, a random offset, depth and key each. The memory "
            "read the prompt up to its question with its defaults (top-k 4, stingy); the columns change how the "
            "question and the answer read it. A cell is the answer (teacher-forced greedy) and the share of (layer, "
            "head) lookups of the question's last token and the answer's tokens whose top-k held the key's sentence.",
            "", "| book | depth | key | in sequence | " + " | ".join(f"top-{k} {m}" for k, m in CONFIGS) + " |",
            "|---|---|---|---|" + "---|" * len(CONFIGS)]
    for r in rows:
        cells = [f"{'**' if r[c] != r['key'] else ''}{r[c]}{'**' if r[c] != r['key'] else ''} ({r[c + ' hits']:.0%})"
                 for c in (f"k{k} {m}" for k, m in CONFIGS)]
        mark = "" if r["in sequence"] == r["key"] else "**"
        body.append(f"| {r['book'][:24]} | {r['depth']:.2f} | {r['key']} | {mark}{r['in sequence']}{mark} | "
                    + " | ".join(cells) + " |")
    body.append(f"| right | | | {right['in sequence']}/{len(rows)} | "
                + " | ".join(f"{right[f'k{k} {m}']}/{len(rows)}" for k, m in CONFIGS) + " |")
    lost_in_memory = sum(r["in sequence"] == r["key"] and r["k4 stingy"] != r["key"] for r in rows)
    lost_in_model = sum(r["in sequence"] != r["key"] for r in rows)
    mean_layers = np.mean([r["k16 exact layers"] for r in rows], 0)
    body += ["", f"- Wrong in sequence (the model loses the key with every block in view): {lost_in_model} of "
                 f"{len(rows)}.",
             f"- Right in sequence, wrong through memory at the defaults (retrieval loses it): {lost_in_memory}.",
             "- Share of lookups holding the key's sentence, top-16 exact, by layer (0 first): "
             + ", ".join(f"{x:.0%}" for x in mean_layers), ""]
    return body, rows


def plant(text, tok, n_tokens):
    """The first ``n_tokens`` tokens of ``text`` with ``FACTS`` planted at ``DEPTHS`` (each at
    the paragraph break nearest its depth); (ids, [token offset of each fact])."""
    ids = tok.encode(text).ids[:n_tokens]
    body = tok.decode(ids)
    cuts = []
    for d in DEPTHS:
        at = body.find("\n\n", int(d * len(body)))
        cuts.append(at if at >= 0 else int(d * len(body)))
    pieces, last = [], 0
    for (sentence, _, _), at in zip(FACTS, cuts):
        pieces += [body[last:at], "\n\n" + sentence]
        last = at
    pieces.append(body[last:])
    planted = "".join(pieces)
    offsets = [len(tok.encode("".join(pieces[:2 * i + 1]) + "\n\n").ids) for i in range(len(FACTS))]
    return tok.encode(planted).ids, offsets


@torch.no_grad()
def part_questions(args, model, tok, books):
    name, path, _ = books[0]
    ids, offsets = plant(read_text(path)[3000:], tok, args.question_tokens)  # past the Gutenberg front matter
    body = [f"## Natural questions over the first {len(ids):,} tokens of {name}", "",
            "Four facts planted as plain sentences at paragraph breaks; each question asked as `ask` asks it (the "
            "chat template), from the memory as it was before any question.", ""]
    sets, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        mem = LandmarkMemory(model, path=Path(tmp) / "m", store="lmdb")
        bs = mem.shape.block_size
        n = len(ids) - len(ids) % bs
        for a in range(0, n, mem.options.chunk_size):
            mem.forward(torch.tensor([ids[a:min(n, a + mem.options.chunk_size)]]), logits="none")
        mem.commit()
        n_blocks = mem.n_blocks
        mem.close()
        for (sentence, question, expect), at in zip(FACTS, offsets):
            fact_blocks = list(range(at // bs, (at + len(tok.encode(sentence).ids)) // bs + 1))
            with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as m:
                got = ask(m, tok, question, max_new_tokens=24, passages=20)
            with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as m:
                out = m.forward(torch.tensor([tok.encode(tok.chat_prompt(question)).ids]), logits="last")
            _, layers = key_hits(out.retrieved, [-1], fact_blocks)
            top = [p.block for p in got.passages]
            rank = next((i + 1 for i, b in enumerate(top) if b in fact_blocks), None)
            edge = sum(p.share for p in got.passages if p.block == 0 or p.block >= n_blocks - 3)
            sets.append(set(top))
            rows.append((question, got.text.strip().replace("|", "/").replace("\n", " ")[:70],
                         all(w.lower() in got.text.lower() for w in expect), fact_blocks, rank, edge, layers))
    body += ["| question | answer | right | fact's block | its rank in the top 20 | lookups on block 0 and the "
             "last 3 | layers where most heads find it |", "|---|---|---|---|---|---|---|"]
    for q, a, ok, fb, rank, edge, layers in rows:
        best = ", ".join(f"{i} ({x:.0%})" for i, x in sorted(enumerate(layers), key=lambda t: -t[1])[:3])
        body.append(f"| {q} | {a} | {'yes' if ok else 'no'} | {fb} | {rank or '-'} | {edge:.0%} | {best} |")
    overlap = np.mean([len(a & b) / len(a | b) for i, a in enumerate(sets) for b in sets[i + 1:]])
    common = Counter(b for s in sets for b in s)
    body += ["", f"- The questions' top-20 blocks overlap by {overlap:.0%} on average (Jaccard); blocks in every "
                 f"question's top 20: {sorted(b for b, c in common.items() if c == len(sets))} of {n_blocks}.", ""]
    return body


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus (held-out books chosen as training chose them)")
    ap.add_argument("--adapters", default=ADAPTER,
                    help="comma-separated name=folder of LoRA landmark adapters, each diagnosed in turn "
                         "(default: the shipped one)")
    ap.add_argument("--parts", default="passkey,questions")
    ap.add_argument("--length", type=int, default=8192, help="passkey prompt length (default 8192)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--question-tokens", type=int, default=8192, help="tokens of the novel the questions read")
    ap.add_argument("--out", default="diagnosis", help="results file name (default diagnosis)")
    args = ap.parse_args(argv)
    started, specs, body = time.time(), adapter_specs(args.adapters), []
    for name, folder in specs:
        model, tok = load_smollm2(folder)
        books = held_out(args.books, tok)
        part = []
        if "questions" in args.parts:
            part += part_questions(args, model, tok, [b for b in books if "bovary" in b[0]] or books)
        if "passkey" in args.parts:
            part += part_passkey(args, model, tok, books)[0]
        if len(specs) > 1:  # each adapter's sections under its name
            part = [f"## Adapter {name}", ""] + [("#" + line if line.startswith("## ") else line) for line in part]
        body += part
    write_result(args.out, "Diagnosis: where SmolLM2 loses a fact in book text", body, started=started)


if __name__ == "__main__":
    main()
