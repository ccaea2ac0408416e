"""Where SmolLM2 loses a fact in book text: the model or the memory.

    python experiments/exp_diagnose.py --books BOOKS                     # both parts
    python experiments/exp_diagnose.py --books BOOKS --parts passkey --length 8192 --trials 10
    python experiments/exp_diagnose.py --books BOOKS --parts questions --adapters stage6=out/a,stage7=out/b
    python experiments/exp_diagnose.py --books BOOKS --parts ruler,ask --length 4096 --trials 10 --out diagnosis_ruler

``passkey``: the paper's passkey prompt with its filler replaced by consecutive text of a held-out
book (a random book, offset, depth and key per trial). Each trial is read seven ways:
- in sequence: the whole prompt in one forward of the landmark model, every block in its
  grouped softmax, no memory;
- through memory: the prompt up to its question read into a memory (the defaults: top-k 4,
  stingy positions), then the question read from it with top-k 4, 8 and 16, stingy and exact.
The answer is taken greedily with the key's own digits fed back (teacher forcing), which is
right exactly when greedy decoding is right. For the question's last token and the answer's
tokens, the share of (layer, head) lookups whose top-k held a block of the key's sentence says
whether the memory found it. So a trial that is right in sequence and wrong through memory
lost the key in retrieval; wrong in sequence, in the model.

``ruler``: the same seven readings of the first ``--trials`` trials of the RULER-style suite's
single needle (``exp_ruler.py``, the same prompts): a seven-digit value for a word-pair key.

``ask``: the first ``--trials`` trials of ``exp_realtext.py``'s ``ask`` cell (the same memories
and questions), each answer with the rank of the fact's block among the blocks it read: a
wrong answer whose fact's block was read most lost the fact in the copy, one whose block was
hardly read lost it in retrieval.

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
from _common import ADAPTER, PLANTED_FACTS, adapter_specs, load_smollm2, some_of, write_result
from _needles import CONFIGS, key_hits, passkey_trial, ruler_trial, spanned_blocks
from _texts import ask_case, ask_in_memory, held_out, is_right, trial_rng

from landmark_memory.core.passkey import PasskeyPrompts
from landmark_memory.memory import LandmarkMemory
from landmark_memory.training.data import read_text
from landmark_memory.uses.answer import ask

FACTS = PLANTED_FACTS[:4]  # (sentence planted, question, the words a right answer holds)
DEPTHS = (0.2, 0.45, 0.65, 0.85)
RUN = 4  # digits of the key in a row that an answer holds only by reading the key
PARTS = ("questions", "passkey", "ruler", "ask")  # in the order they run


def read_the_key(got, key):
    """Whether the answer ``got`` (an int or None) holds ``RUN`` digits of ``key`` in a row."""
    a, k = str(got), str(key)
    return got is not None and any(k[i:i + RUN] in a for i in range(len(k) - RUN + 1))


WAYS = ["in sequence"] + [f"k{k} {m}" for k, m in CONFIGS]


def trials_table(rows, title, what):
    """The markdown section of read-ways trials ``rows`` (each with book, key and depth)."""
    right = {c: sum(r[c] == r["key"] for r in rows) for c in WAYS}
    body = [title, "", what + " The memory read the prompt up to its question with its defaults (top-k 4, stingy); "
            "the columns change how the question and the answer read it. A cell is the answer (teacher-forced "
            "greedy) and the share of (layer, head) lookups of the question's last token and the answer's tokens "
            "whose top-k held the key's sentence.",
            "", "| book | depth | key | in sequence | " + " | ".join(f"top-{k} {m}" for k, m in CONFIGS) + " |",
            "|---|---|---|---|" + "---|" * len(CONFIGS)]
    def shown(r, c):  # a wrong answer in bold; through memory, with its share of lookups
        mark = "" if r[c] == r["key"] else "**"
        return f"{mark}{r[c]}{mark}" + (f" ({r[c + ' hits']:.0%})" if c != "in sequence" else "")

    for r in rows:
        body.append(f"| {r['book'][:24]} | {r['depth']:.2f} | {r['key']} | " + " | ".join(shown(r, c) for c in WAYS)
                    + " |")
    body.append("| right | | | " + " | ".join(f"{right[c]}/{len(rows)}" for c in WAYS) + " |")
    lost_in_memory = sum(r["in sequence"] == r["key"] and r["k4 stingy"] != r["key"] for r in rows)
    lost_in_model = sum(r["in sequence"] != r["key"] for r in rows)
    missed = [r for r in rows if r["k4 stingy"] != r["key"]]
    read = sum(read_the_key(r["k4 stingy"], r["key"]) for r in missed)
    mean_layers = np.mean([r["k16 exact layers"] for r in rows], 0)
    return body + [
        "", f"- Wrong in sequence (the model loses the key with every block in view): {lost_in_model} of {len(rows)}.",
        f"- Right in sequence, wrong through memory at the defaults (the memory's reading loses it): {lost_in_memory}.",
        f"- Wrong through memory at the defaults: {len(missed)}. The answer holds {RUN} or more of the key's digits "
        f"in a row (the key was read, then miscopied) in {read} of them, and not (the key was not read) in "
        f"{len(missed) - read}.",
        "- Share of lookups holding the key's sentence, top-16 exact, by layer (0 first): "
        + ", ".join(f"{x:.0%}" for x in mean_layers), ""]


def run_trials(args, trial):
    """``args.trials`` rows of ``trial(t, folder)``, each printed as it is done."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(args.trials):
            r = trial(t, Path(tmp) / str(t))
            rows.append(r)
            print(f"trial {t}: key {r['key']} at {r['depth']:.2f} of {r['book']}: in sequence {r['in sequence']}, "
                  + ", ".join(f"{c} {r[c]} ({r[c + ' hits']:.0%})" for c in WAYS[1:]), flush=True)
    return rows


def part_passkey(args, model, tok, books):
    prompts, rng = PasskeyPrompts(tok), random.Random(args.seed)
    rows = run_trials(args, lambda t, folder: passkey_trial(model, tok, prompts, books[t % len(books)], rng,
                                                            args.length, folder))
    return trials_table(rows, f"## Book-text passkey at {args.length:,} tokens",
                        f"{args.trials} trials (seed {args.seed}): a held-out book, a random offset, depth and key "
                        "each.")


def part_ruler(args, model, tok, books):
    rows = run_trials(args, lambda t, folder: ruler_trial(model, tok, books, t, args.length, args.seed, folder))
    return trials_table(rows, f"## RULER's single needle at {args.length:,} tokens",
                        f"The first {args.trials} trials of `exp_ruler.py`'s single-needle cell at this length (seed "
                        f"{args.seed}, the same prompts): a seven-digit value for a word-pair key, in held-out book "
                        "text.")


def ask_row(loaded, case):
    """``exp_realtext``'s ``ask`` trial ``case`` with every block the answer read, ranked."""
    model = loaded.model
    blocks = spanned_blocks(*case.fact, model.config.landmark_block_size)
    got, n_blocks = ask_in_memory(loaded, case, passages=None)
    read = [p.block for p in got.passages]
    rank = "local" if blocks[0] >= n_blocks else next((i + 1 for i, b in enumerate(read) if b in blocks), None)
    return {"book": case.book, "depth": case.depth, "question": case.question, "answer": got.text.strip(),
            "right": is_right(got.text, case.words), "blocks": blocks, "rank": rank,
            "share": sum(p.share for p in got.passages if p.block in blocks),
            "edge": sum(p.share for p in got.passages if p.block == 0 or p.block >= n_blocks - 3)}


def part_ask(args, loaded, books):
    model, tok = loaded.model, loaded.tokenizer
    rows = []
    for t in range(args.trials):
        rows.append(ask_row(loaded, ask_case(tok, books, args.length, trial_rng(args.seed, "ask", args.length, t))))
        r = rows[-1]
        print(f"trial {t}: {r['question']} {r['answer'][:50]!r} right {r['right']}, fact's block rank {r['rank']} "
              f"({r['share']:.1%} of the lookups), first and last blocks {r['edge']:.0%}", flush=True)
    body = [f"## `ask` over {args.length:,} tokens of book text", "",
            f"The first {args.trials} trials of `exp_realtext.py`'s `ask` cell at this length (seed {args.seed}, the "
            "same memories and questions): one fact planted after a sentence of a held-out book, asked as `ask` "
            "asks it. The blocks the answer read are ranked by their share of its lookups (every layer and head, "
            "the question's last token and each answer token, top-k 4).", "",
            "| book | depth | question | answer | right | fact's block | its rank | its share of the lookups | "
            "block 0 and the last 3 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        answer = r["answer"].replace("|", "/").replace("\n", " ")[:60]
        body.append(f"| {r['book'][:24]} | {r['depth']:.2f} | {r['question']} | {answer} | "
                    f"{'yes' if r['right'] else 'no'} | {r['blocks']} | {r['rank'] or '-'} | {r['share']:.1%} | "
                    f"{r['edge']:.0%} |")
    local = [r for r in rows if r["rank"] == "local"]
    kept = [r for r in rows if r["rank"] != "local"]  # the fact in memory
    wrong, right = [r for r in kept if not r["right"]], [r for r in kept if r["right"]]
    top = [sum(r["rank"] is not None and r["rank"] <= k for r in wrong) for k in (4, 20)]
    n_blocks = args.length // model.config.landmark_block_size

    def mean_share(rs):
        return f"{np.mean([r['share'] for r in rs]):.1%}" if rs else "-"

    body += ["", f"- Right: {sum(r['right'] for r in rows)} of {len(rows)}. In {len(local)} of the trials "
                 f"({sum(r['right'] for r in local)} right) the fact stood in the local window, after the memory's "
                 "last block, where it is read without retrieval.",
             f"- Of the {len(wrong)} wrong answers with the fact in memory, its block was among the 4 blocks the "
             f"answer read most in {top[0]}, among the 20 in {top[1]}, and further down or never read in "
             f"{len(wrong) - top[1]} (the memory holds about {n_blocks} blocks).",
             f"- Mean share of the lookups on the fact's block, the fact in memory: {mean_share(right)} where the "
             f"answer was right, {mean_share(wrong)} where it was wrong; on block 0 and the last three: "
             f"{np.mean([r['edge'] for r in rows]):.0%}.", ""]
    return body


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
def part_questions(args, loaded, books):
    model, tok = loaded.model, loaded.tokenizer
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
                got = ask(m, loaded, question, max_new_tokens=24, passages=20)
            with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as m:
                out = m.forward(torch.tensor([tok.encode(tok.chat_prompt(question)).ids]), logits="last")
            _, layers = key_hits(out.retrieved, [-1], fact_blocks)
            top = [p.block for p in got.passages]
            rank = next((i + 1 for i, b in enumerate(top) if b in fact_blocks), None)
            edge = sum(p.share for p in got.passages if p.block == 0 or p.block >= n_blocks - 3)
            sets.append(set(top))
            rows.append((question, got.text.strip().replace("|", "/").replace("\n", " ")[:70],
                         is_right(got.text, expect), fact_blocks, rank, edge, layers))
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
    ap.add_argument("--parts", type=some_of(PARTS), default=["passkey", "questions"],
                    help=f"some of {','.join(PARTS)} (default: passkey,questions)")
    ap.add_argument("--length", type=int, default=8192, help="passkey and RULER prompt and ask memory length (default "
                                                             "8192)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--question-tokens", type=int, default=8192, help="tokens of the novel the questions read")
    ap.add_argument("--out", default="diagnosis", help="results file name (default diagnosis)")
    args = ap.parse_args(argv)
    started, specs, body = time.time(), adapter_specs(args.adapters), []
    for name, folder in specs:
        loaded = load_smollm2(folder)
        model, tok = loaded.model, loaded.tokenizer
        books = held_out(args.books, tok)
        part = []
        if "questions" in args.parts:
            part += part_questions(args, loaded, [b for b in books if "bovary" in b[0]] or books)
        if "passkey" in args.parts:
            part += part_passkey(args, model, tok, books)
        if "ruler" in args.parts:
            part += part_ruler(args, model, tok, books)
        if "ask" in args.parts:
            part += part_ask(args, loaded, books)
        if len(specs) > 1:  # each adapter's sections under its name
            part = [f"## Adapter {name}", ""] + [("#" + line if line.startswith("## ") else line) for line in part]
        body += part
    write_result(args.out, "Diagnosis: where SmolLM2 loses a fact in book text", body, started=started)


if __name__ == "__main__":
    main()
