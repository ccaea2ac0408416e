"""Which blocks a question retrieves: the rank of the planted fact's block, not what the model copies.

    python experiments/exp_retrieval.py --books BOOKS                          # every part at its defaults
    python experiments/exp_retrieval.py --books BOOKS --parts questions --lengths 8k --haystacks 2
    python experiments/exp_retrieval.py --books BOOKS --parts ppl --ppl-variants k4,"k4 sink local"
    python experiments/exp_retrieval.py --report                              # retrieval.md from the state

``questions``: ``--haystacks`` stretches of held-out book text per length, each with ten facts
planted as plain sentences (one per tenth of the text, at a random full stop in it). The text is
read into a saved memory at the defaults; then each fact's question is asked as ``ask`` asks it
(the chat template, greedy, ``ASK_NEW`` tokens) from the memory opened read-only in each variant,
rewound between questions. For every question: where the fact's block ranks among the blocks the
question's last token and the answer's tokens chose (by their share of the lookups, every layer
and head: the order of ``ask``'s passages), overall and per layer; whether it is among the 5
passages ``ask`` reports (recall@5); the share of the chosen lookups on the memory's first block
and its last three; and whether the answer holds the fact's words.

``passkey``, ``ruler``: ``exp_diagnose.py``'s book-text passkey and RULER single-needle trials
(the same prompts), the prompt up to its question read into a memory at the defaults, the question
and the teacher-forced answer read in each variant: right when the greedy answer is the key
(the prompt is not read in sequence here: ``exp_diagnose.py`` does that).

``ppl``: perplexity through memory (the variant read while reading every token) over
``--ppl-tokens`` of the first ``--ppl-books`` held-out books in segments of each length.

A variant is named by its words: ``kN`` (top-k N), ``sink`` (the memory's first block read by
every query besides its top-k), ``local`` (its last two blocks likewise), ``centred`` (blocks
chosen by scores against the landmark keys less their mean), ``per_head`` (one set per head for
a step's tokens: the question's tokens pooled), ``exact`` (every landmark scored at its true
position, by brute force, instead of stingy's slot 0); ``deep`` reads as the rest of its name says
and ranks the passages by the lookups of the deeper half of the layers alone, as ``ask`` does
now (``k4 centred deep`` is ``ask``'s default; every variant asks with ``centre=False``, so that
only its own options decide what is read). Every trial is kept
in ``--state`` as soon as it is done, so a run resumes and later runs add trials.
"""

import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from _common import (
    ADAPTER,
    HEADS_READER,
    ROOT,
    SHIPPED_READER,
    Trials,
    books_perplexity,
    load_smollm2,
    plt,
    some_of,
    suite_main,
    write_result,
)
from _needles import passkey_trial, ruler_trial
from _texts import FACTS, build, build_timed, haystack, held_out, is_right

from landmark_memory.core.passkey import PasskeyPrompts
from landmark_memory.format import MemoryOptions
from landmark_memory.jobs.evaluate import parse_lengths
from landmark_memory.memory import LandmarkMemory
from landmark_memory.uses.answer import ask

PARTS = ("questions", "oracle", "passkey", "ruler", "ppl")
VARIANTS = ("k4,k4 sink,k4 local,k4 sink local,k4 centred,k4 sink local centred,k4 per_head,k4 sink local per_head,"
            "k4 exact,k8,k8 sink local,k8 sink local centred,k16,k16 sink local,k16 sink local centred")
ASK_NEW = 16  # answer tokens: the facts' words come first
EDGE = 3  # the last blocks before the question counted with the first one
LOCAL = 2  # blocks ``local`` reads besides the top-k
TARGETS = (0.75, 0.60)  # the recall@5 targets at 8K and 32K
ORACLE_SCORES = ("landmark", "best token", "mean token", "question landmark", "question best token")
WORDS = {"sink": {"sink_blocks": 1}, "local": {"local_blocks": LOCAL}, "centred": {"centre": True},
         "per_head": {"retrieval": "per_head"}, "exact": {"position_mapping": "exact"}, "deep": {}}


def variant_options(name: str) -> dict:
    """``LandmarkMemory`` query options of a variant's name ("k8 sink local centred")."""
    opts = {}
    for word in name.split():
        if word[0] == "k" and word[1:].isdigit():
            opts["top_k"] = int(word[1:])
        elif word in WORDS:
            opts.update(WORDS[word])
        else:
            raise SystemExit(f"variant {name!r}: {word!r} is none of kN, {', '.join(WORDS)}")
    return opts


def variants(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        variant_options(v)
    return names


class Lookups:
    """Per layer, how often each memory block was chosen at the last position of each forward
    (what ``ask`` counts: the question's last token, then each answer token)."""

    def __init__(self, mem, n_blocks):
        self.layers, forward = [Counter() for _ in range(mem.shape.n_layer)], mem.forward

        def counting(idx, *a, **kw):
            out = forward(idx, *a, **kw)
            for c, r in zip(self.layers, out.retrieved):
                c.update(b for b in r[0, :, -1].flatten().tolist() if 0 <= b < n_blocks)
            return out

        mem.forward = counting

    @staticmethod
    def rank(counts, blocks):
        """1-based rank of the first of ``blocks`` by lookups (None: never chosen)."""
        return next((i + 1 for i, (b, _) in enumerate(counts.most_common()) if b in blocks), None)

    def total(self, first=0):
        """The lookups of layers ``first`` and up, pooled."""
        return sum(self.layers[first:], Counter())


def question_rows(loaded, folder, n_blocks, facts, variant, bs):
    """One row per fact of a haystack asked from its memory in ``variant``."""
    model = loaded.model
    rows = []
    with LandmarkMemory.open(folder, model, readonly=True, **variant_options(variant)) as m:
        for _, question, words, (a, b) in facts:
            m.rewind()
            blocks = set(range(a // bs, (b - 1) // bs + 1))
            looks = Lookups(m, n_blocks)
            got = ask(m, loaded, question, max_new_tokens=ASK_NEW, passages=5, centre=False)
            del m.forward  # the class's again
            total = looks.total()
            deep = "deep" in variant.split()  # the passages ranked by the deeper half of the layers
            ranked = looks.total(len(looks.layers) // 2) if deep else total
            n = sum(total.values()) or 1
            edge = sum(c for blk, c in total.items() if blk == 0 or blk >= n_blocks - EDGE) / n
            in_memory = max(blocks) < n_blocks
            rows.append({"question": question, "answer": got.text.strip(), "right": is_right(got.text, words),
                         "blocks": sorted(blocks), "in_memory": in_memory,
                         "rank": Lookups.rank(ranked, blocks),
                         "recall5": (Lookups.rank(ranked, blocks) or 6) <= 5,
                         "layer_ranks": [Lookups.rank(c, blocks) for c in looks.layers],
                         "edge": round(edge, 4), "share": round(sum(total[x] for x in blocks) / n, 4)})
    return rows


def part_questions(args, state, loaded, books):
    model, tok = loaded.model, loaded.tokenizer
    bs = model.config.landmark_block_size
    for n in parse_lengths(args.lengths):
        for h in range(args.haystacks):
            todo = [v for v in args.variants if len(state.cell(f"questions|{n}|{v}")) < (h + 1) * len(FACTS)]
            if not todo:
                continue
            name, ids, facts = haystack(tok, books, n, h, args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                n_blocks = build_timed(model, ids, Path(tmp) / "m", f"haystack {h} @{n}, {name}")
                for v in todo:
                    key = f"questions|{n}|{v}"
                    if len(state.cell(key)) != h * len(FACTS):  # another run is filling it
                        continue
                    t0 = time.perf_counter()
                    for i, row in enumerate(question_rows(loaded, Path(tmp) / "m", n_blocks, facts, v, bs)):
                        state.add(key, {"haystack": h, "book": name, **row}, at=h * len(FACTS) + i)
                    rows = state.cell(key)[-len(FACTS):]
                    print(f"  {v}: recall@5 {np.mean([r['recall5'] for r in rows]):.0%}, right "
                          f"{np.mean([r['right'] for r in rows]):.0%}, edge {np.mean([r['edge'] for r in rows]):.0%} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)


class Queries:
    """Per layer, the rotated query (H, D) at the last position of each block choice made inside
    ``mem.inspection.choosing(queries.wrap)`` (what ``Lookups`` counts the choices of), and every query of
    the first, the prompt (H, T, D)."""

    def __init__(self, mem):
        self.layers, self.prompt = [[] for _ in range(mem.shape.n_layer)], [None] * mem.shape.n_layer

    def wrap(self, choose):
        def recording(layer, q, qr, *a):
            self.layers[layer].append(qr[0, :, -1].float())
            if self.prompt[layer] is None:
                self.prompt[layer] = qr[0].float()
            return choose(layer, q, qr, *a)

        return recording


def oracle_rows(loaded, folder, n_blocks, facts, bs, k=4):
    """Per fact, how three scores of every memory block, all at stingy's slot 0 (the same
    distance for every block), rank the fact's block for the queries ``ask`` reads with (the
    question's last token, each answer token; every layer and head): the landmark's score
    (what the index searches), the best of its tokens' scores (an oracle of what the model's own
    keys tell), and their mean. For each: the share of (layer, head, query) whose top ``k``
    holds the fact's block, and its rank by how many of them chose it. The same for the
    question's own tokens ("question" scores: a question pooled to choose the answer's blocks)."""
    model, tok = loaded.model, loaded.tokenizer
    rows = []
    with LandmarkMemory.open(folder, model, readonly=True) as m:
        G, scale, every = m.backbone.n_head // m.shape.n_kv_head, m.shape.head_dim ** -0.5, torch.arange(n_blocks)
        keys = []
        for layer in range(m.shape.n_layer):  # (n_blocks, H, L, D) keys rotated by their offset in the block
            keys.append(m.keys(layer, every, rows=True).repeat_interleave(G, 1))
        for _, question, _, (a, b) in facts:
            m.rewind()
            blocks = set(range(a // bs, (b - 1) // bs + 1))
            qs = Queries(m)
            with m.inspection.choosing(qs.wrap):
                got = ask(m, loaded, question, max_new_tokens=ASK_NEW, passages=0, centre=False)
            prompt, asked = tok.encode(tok.chat_prompt(question)).ids, tok.encode(question).ids
            at = next(i for i in range(len(prompt)) if prompt[i:i + len(asked)] == asked)  # the question's tokens
            assert got.prompt_tokens == len(prompt)
            hits, counts = {}, {}
            for layer, q in enumerate(qs.layers):
                q = torch.stack(q)  # (N, H, D)
                s = torch.einsum("nhd,chld->nhcl", q, keys[layer]) * scale  # (N, H, n_blocks, L)
                s_q = torch.einsum("htd,chld->thcl", qs.prompt[layer][:, at:at + len(asked)], keys[layer]) * scale
                for name, score in (("landmark", s[..., bs]), ("best token", s[..., :bs].amax(-1)),
                                    ("mean token", s[..., :bs].mean(-1)), ("question landmark", s_q[..., bs]),
                                    ("question best token", s_q[..., :bs].amax(-1))):
                    top = score.topk(min(k, n_blocks), -1).indices  # (N, H, k)
                    chosen = torch.isin(top, torch.tensor(sorted(blocks)))
                    hits.setdefault(name, []).append(float(chosen.any(-1).float().mean()))
                    counts.setdefault(name, Counter()).update(top.flatten().tolist())
            rows.append({"question": question, "blocks": sorted(blocks), "in_memory": max(blocks) < n_blocks,
                         **{f"{name} hits": round(float(np.mean(h)), 4) for name, h in hits.items()},
                         **{f"{name} layer hits": [round(x, 3) for x in h] for name, h in hits.items()},
                         **{f"{name} rank": Lookups.rank(c, blocks) for name, c in counts.items()}})
    return rows


def part_oracle(args, state, loaded, books):
    model, tok = loaded.model, loaded.tokenizer
    bs = model.config.landmark_block_size
    for n in parse_lengths(args.lengths):
        for h in range(args.oracle_haystacks):
            key = f"oracle|{n}|k4"
            if len(state.cell(key)) >= (h + 1) * len(FACTS):
                continue
            name, ids, facts = haystack(tok, books, n, h, args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                n_blocks = build(model, ids, Path(tmp) / "m", store_dtype="float32")  # every key as the model made it
                for i, row in enumerate(oracle_rows(loaded, Path(tmp) / "m", n_blocks, facts, bs)):
                    state.add(key, {"haystack": h, "book": name, **row}, at=h * len(FACTS) + i)
            rows = state.cell(key)[-len(FACTS):]
            print(f"oracle haystack {h} @{n}: " + ", ".join(
                f"{s} hits {np.mean([r[s + ' hits'] for r in rows]):.1%} top-5 "
                f"{np.mean([(r[s + ' rank'] or 10 ** 6) <= 5 for r in rows]):.0%}"
                for s in ORACLE_SCORES), flush=True)


def part_needles(args, state, model, tok, books, part):
    """``passkey`` or ``ruler`` trials at ``--needle-length``, every variant on the same prompt."""
    n, ways = args.needle_length, {v: variant_options(v) for v in args.variants}
    prompts, rng = PasskeyPrompts(tok), random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(args.needle_trials):
            folder = Path(tmp) / str(t)
            if part == "passkey":  # the draws of trial t follow those of the trials before it
                row = passkey_trial(model, tok, prompts, books[t % len(books)], rng, n, folder, ways, in_sequence=False)
            elif all(len(state.cell(f"{part}|{n}|{v}")) > t for v in ways):
                continue
            else:
                row = ruler_trial(model, tok, books, t, n, args.seed, folder, ways, in_sequence=False)
            for v in ways:
                if len(state.cell(f"{part}|{n}|{v}")) == t:
                    state.add(f"{part}|{n}|{v}", {"book": row["book"], "key": row["key"], "answer": row[v],
                                                  "right": row[v] == row["key"], "hits": row[f"{v} hits"]}, at=t)
            print(f"{part} trial {t}: key {row['key']}; " + ", ".join(f"{v} {row[v]}" for v in ways), flush=True)


def part_ppl(args, state, model, tok, books):
    named = [(b, ids) for b, _, ids in books[:args.ppl_books]]
    for n in parse_lengths(args.lengths):
        for v in args.ppl_variants:
            key = f"ppl|{n}|{v}"
            if state.cell(key):
                continue
            t0 = time.perf_counter()
            ppl, count = books_perplexity(model, named, n, args.ppl_tokens,
                                          memory=MemoryOptions.of(**variant_options(v)))
            state.add(key, {"perplexity": round(ppl, 4), "tokens": count}, at=0)
            print(f"ppl @{n} {v}: {ppl:.4f} over {count} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)


def run(args):
    state = Trials(args.state, args.command)
    loaded = load_smollm2(args.adapter)
    model, tok = loaded.model, loaded.tokenizer
    books = held_out(args.books, tok)
    if "questions" in args.parts:
        part_questions(args, state, loaded, books)
    if "oracle" in args.parts:
        part_oracle(args, state, loaded, books)
    for part in ("passkey", "ruler"):
        if part in args.parts:
            part_needles(args, state, model, tok, books, part)
    if "ppl" in args.parts:
        part_ppl(args, state, model, tok, books)


def summary(rows):
    """recall@5, mean rank (never chosen: counted as 100), right, edge share of question rows in memory."""
    kept = [r for r in rows if r["in_memory"]]
    return {"n": len(kept), "recall5": np.mean([r["recall5"] for r in kept]),
            "top1": np.mean([r["rank"] == 1 for r in kept]),
            "median_rank": float(np.median([r["rank"] or 10 ** 6 for r in kept])),
            "right": np.mean([r["right"] for r in kept]), "edge": np.mean([r["edge"] for r in kept]),
            "layers": np.mean([[x is not None and x <= 5 for x in r["layer_ranks"]] for r in kept], 0)}


def report(args):
    trials = Trials(args.state)
    cells = trials.cells
    keys = [k.split("|") for k in cells]
    lengths = sorted({int(n) for p, n, _ in keys if p == "questions"})
    names = list(dict.fromkeys(v for p, _, v in keys if p == "questions"))
    body = ["Planted facts in held-out book text (SmolLM2 with the shipped landmark adapter), each asked as `ask` asks "
            "it from a memory read at the defaults; the variants change only how the question and its answer choose "
            "blocks. recall@5: the fact's block among the 5 passages `ask` reports (the blocks chosen most by the "
            "question's last token and the answer's tokens over every layer and head); rank: its place in that order "
            "(median; a block never chosen counts as last); edge: the share of chosen lookups on the memory's first "
            f"block and its last {EDGE}; right: the answer holds the fact's words. Questions whose fact stood in the "
            "open chunk after the memory's last block are left out (n counts the rest).", "",
            "vs k4: the questions whose fact's block the variant has among its 5 passages and k4 has not, and the "
            "reverse (the same questions, paired).", "",
            "| variant | " + " | ".join(f"{n // 1024}K recall@5 | vs k4 | rank | edge | right | n" for n in lengths)
            + " |", "|---|" + "---|---|---|---|---|---|" * len(lengths)]
    got = {}
    for v in names:
        cells_v = []
        for n in lengths:
            rows = cells.get(f"questions|{n}|{v}", [])
            if not rows:
                cells_v.append("- | - | - | - | - | 0")
                continue
            s = got[v, n] = summary(rows)
            rank = "never" if s["median_rank"] >= 10 ** 6 else f"{s['median_rank']:.0f}"
            base = cells.get(f"questions|{n}|k4", [])[:len(rows)]
            pairs = [(r["recall5"], b["recall5"]) for r, b in zip(rows, base) if r["in_memory"]]
            vs = f"+{sum(a and not b for a, b in pairs)} / -{sum(b and not a for a, b in pairs)}"
            cells_v.append(f"{s['recall5']:.0%} | {vs} | {rank} | {s['edge']:.0%} | {s['right']:.0%} | {s['n']}")
        body.append(f"| {v} | " + " | ".join(cells_v) + " |")
    body += heads_rows(Path(args.results), lengths, cells)
    needles = [(p, n) for p, n in dict.fromkeys((p, int(n)) for p, n, _ in keys) if p in ("passkey", "ruler")]
    if needles:
        body += ["", "Needles at their length, the prompt up to the question read at the defaults, the question and "
                 "the teacher-forced answer in each variant (right: the greedy answer is the key; hits: the share of "
                 "lookups whose top-k held the key's sentence).", "",
                 "| variant | " + " | ".join(f"{p} {n // 1024}K right | hits" for p, n in needles) + " |",
                 "|---|" + "---|---|" * len(needles)]
        for v in dict.fromkeys(v for p, _, v in keys if p in ("passkey", "ruler")):
            cols = []
            for p, n in needles:
                rows = cells.get(f"{p}|{n}|{v}", [])
                cols.append(f"{sum(r['right'] for r in rows)}/{len(rows)} | {np.mean([r['hits'] for r in rows]):.0%}"
                            if rows else "- | -")
            body.append(f"| {v} | " + " | ".join(cols) + " |")
    oracle = sorted({int(n) for p, n, _ in keys if p == "oracle"})
    if oracle:
        body += ["", "The oracle: every memory block scored at stingy's slot 0 (the same distance for every block) "
                 "against the queries `ask` reads with (the question's last token and each answer token, k4 "
                 "defaults), or against the question's own tokens; three scores of a block: its landmark's (what "
                 "the index searches), the best of its tokens' (what the model's own keys could tell, at any cost), "
                 "their mean. hits: the share of (layer, head, query) whose top 4 holds the fact's block (chance: "
                 "4 / blocks); top-5: the fact's block among the 5 chosen most over them all.", "",
                 "| length | questions | " + " | ".join(f"{s} hits | top-5" for s in ORACLE_SCORES) + " | chance |",
                 "|---|---|" + "---|---|" * len(ORACLE_SCORES) + "---|"]
        for n in oracle:
            rows = [r for r in cells[f"oracle|{n}|k4"] if r["in_memory"]]
            body.append(f"| {n // 1024}K | {len(rows)} | " + " | ".join(
                f"{np.mean([r[s + ' hits'] for r in rows]):.1%} | "
                f"{np.mean([(r[s + ' rank'] or 10 ** 6) <= 5 for r in rows]):.0%}" for s in ORACLE_SCORES)
                + f" | {4 / (n // 63):.1%} |")
    ppl = sorted({int(n) for p, n, _ in keys if p == "ppl"})
    if ppl:
        body += ["", "Perplexity through memory (the variant read while reading every token), held-out books.", "",
                 "| variant | " + " | ".join(f"{n // 1024}K" for n in ppl) + " |", "|---|" + "---|" * len(ppl)]
        for v in dict.fromkeys(v for p, _, v in keys if p == "ppl"):
            row = [cells.get(f"ppl|{n}|{v}") for n in ppl]
            body.append(f"| {v} | " + " | ".join(f"{r[0]['perplexity']:.3f}" if r else "-" for r in row) + " |")
    body += verdict(cells, got, names, lengths)
    if got:
        pyplot = plt()
        fig, axes = pyplot.subplots(1, 2, figsize=(11, 0.32 * len(names) + 1.5))
        for i, n in enumerate(lengths):
            xs = [got[v, n]["recall5"] if (v, n) in got else 0 for v in names]
            axes[0].barh(np.arange(len(names)) + 0.4 * i, xs, height=0.4, label=f"{n // 1024}K")
        axes[0].set_yticks(np.arange(len(names)) + 0.2, names, fontsize=8)
        axes[0].invert_yaxis()
        axes[0].set_xlabel("recall@5 of the fact's block (dashed: the targets)")
        axes[0].legend(fontsize=8)
        for _, target in zip(lengths, TARGETS):
            axes[0].axvline(target, ls="--", lw=0.8, color="grey")
        n = lengths[0]
        for v in [v for v in names if (v, n) in got][:6]:
            axes[1].plot(got[v, n]["layers"], label=v)
        axes[1].set_xlabel("layer")
        axes[1].set_ylabel(f"fact's block in the layer's top 5 ({n // 1024}K)")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(args.results) / "retrieval.png", dpi=110)
        body += ["", "![recall@5 by variant, and per layer](retrieval.png)", ""]
    write_result("retrieval", "Retrieval that depends on the question: where the fact's block ranks", body,
                 results=args.results, commands=trials.commands)


def heads_rows(results, lengths, suite):
    """Rows of the retrieval heads (``exp_heads.py``'s state) and of the question reader
    (``exp_reader.py``'s), where they exist: their haystacks are this suite's (same books, facts
    and seeds), so their questions are the table's and pair with k4's (``suite``: this suite's
    cells)."""
    k4 = {n: {(r["haystack"], r["question"]): r["recall5"] for r in suite.get(f"questions|{n}|k4", [])}
          for n in lengths}
    out = []

    def row(label, by_length):  # by_length: n -> [((haystack, question), found, rank or None, right or None)]
        cols = []
        for n in lengths:
            rows = by_length.get(n, [])
            pairs = [(found, k4[n][q]) for q, found, _, _ in rows if q in k4[n]]
            vs = f"+{sum(a and not b for a, b in pairs)} / -{sum(b and not a for a, b in pairs)}"
            ranks = [r for _, _, r, _ in rows if r is not None]
            rights = [r for _, _, _, r in rows if r is not None]
            cols.append(f"{np.mean([f for _, f, _, _ in rows]):.0%} | {vs} | "
                        f"{f'{np.median(ranks):.0f}' if ranks else '-'} | - | "
                        f"{f'{np.mean(rights):.0%}' if rights else '-'} | {len(rows)}" if rows else "- | - | - | - | - "
                                                                                                    "| 0")
        return f"| {label} | " + " | ".join(cols) + " |"

    heads = results / "heads.json"
    if heads.is_file() and "heads" in (cells := json.loads(heads.read_text())["cells"]):
        count = cells["heads"][0]["count"]
        out.append(row(f"{count} retrieval heads", {n: [((r["haystack"], r["question"]), r["ranks"][str(count)] <= 5,
                                                       r["ranks"][str(count)], None)
                                                      for k, rs in cells.items() if k.startswith(f"eval|{n}|")
                                                      for r in rs] for n in lengths}))
    reader = results / "reader.json"
    if reader.is_file():
        cells = json.loads(reader.read_text())["cells"]
        for name in (t["name"] for t in cells.get("reader", [])):
            out.append(row(f"stage 11 `{name}`'s 5 blocks", {n: [((int(k.split("|")[3]), r["question"]),
                                                                 r["ranks"][name] <= 5, r["ranks"][name], None)
                                                                for k, rs in cells.items()
                                                                if k.startswith(f"ranks|eval|{n}|") for r in rs]
                                                            for n in lengths}))
        for tag, label in ((SHIPPED_READER, "`ask` through `aboutH24-blend` (shipped)"),
                           (HEADS_READER, "`ask` through the retrieval heads (shipped before)"),
                           ("reader30-pin4", "`ask` through `reader30`")):
            out.append(row(label, {n: [((int(k.split("|")[2]), r["question"]), r["recall5"], None, r["right"])
                                       for k, rs in cells.items() if k.startswith(f"eval|{n}|") and k.endswith(tag)
                                       for r in rs] for n in lengths}))
    if not out:
        return []
    return ["", "Retrieval heads, training-free (`exp_heads.py`, `heads.md`: the question's own tokens' landmark "
            "attention of the heads chosen on development questions, calibrated by a content-free question), and the "
            "question readers of stage 11 (`exp_reader.py`, `reader.md`: a trained retrieval query of every layer, "
            "calibrated by the chat template's tokens; `aboutH24-blend`, what SmolLM2's adapter ships, blends its "
            "ranking with the retrieval heads'): the blocks each ranks first, and `ask` reading the 4 blocks a reader "
            "or the heads (calibrated by the template's tokens) rank first at every answer token (its passages: those "
            "4 first). Their haystacks are this table's "
            f"({' and '.join(f'{n // 1024}K' for n in lengths)} on its first haystacks).", "",
            "| variant | " + " | ".join(f"{n // 1024}K recall@5 | vs k4 | rank | edge | right | n" for n in lengths)
            + " |", "|---|" + "---|---|---|---|---|---|" * len(lengths), *out]


def verdict(cells, got, names, lengths):
    """The issue's rule, read off the state: a variant may become the default when it raises
    recall@5 over k4 at every length without losing a needle (passkey, RULER) or more than 1%
    perplexity through memory; how many questions it gains and loses, paired, says how far
    chance could explain the raise (the table's "vs k4")."""
    if ("k4", lengths[0]) not in got:
        return []
    out = ["", "## Verdict", ""]
    for n in lengths:
        if (names[0], n) in got:
            best = max((v for v in names if (v, n) in got), key=lambda v: (got[v, n]["recall5"], v == "k4"))
            edge = [v for v in names if (v, n) in got and got[v, n]["edge"] < 0.15]
            out.append(f"- {n // 1024}K: recall@5 {got['k4', n]['recall5']:.0%} at the defaults (k4), best {best} "
                       f"{got[best, n]['recall5']:.0%}; first and last blocks hold {got['k4', n]['edge']:.0%} of the "
                       f"defaults' lookups, under 15% for {len(edge)} variants"
                       + (f" ({', '.join(edge)})" if edge else "") + ".")

    n = lengths[0]
    layers = got["k4", n]["layers"]
    top = int(np.argmax(layers))
    late = float(np.mean(layers[len(layers) // 2:]))
    out.append(f"- Per layer at {n // 1024}K (k4): the fact's block is among a layer's 5 most chosen blocks in up to "
               f"{layers[top]:.0%} of the questions (layer {top}), {late:.0%} on average over the deeper half of the "
               f"layers and {float(np.mean(layers[:len(layers) // 2])):.0%} over the first half, against "
               f"{got['k4', n]['recall5']:.0%} for every layer's lookups pooled, as `ask` ranks its passages.")

    def needles_kept(v):  # (``deep`` reads as its name without it: its needles are that variant's)
        def right(u, p):
            return sum(r["right"] for r in cells.get(f"{p}|8192|{u}", []))

        u = " ".join(w for w in v.split() if w != "deep")
        return all(cells.get(f"{p}|8192|{u}") and right(u, p) >= right("k4", p) for p in ("passkey", "ruler"))

    def ppl_kept(v):
        pairs = [(cells.get(f"ppl|{n}|{v}"), cells.get(f"ppl|{n}|k4")) for n in lengths]
        return all(a and b and a[0]["perplexity"] <= 1.01 * b[0]["perplexity"] for a, b in pairs)

    def net(v, n):  # questions the variant finds among its 5 passages and k4 not, less the reverse
        pairs = [(a["recall5"], b["recall5"]) for a, b in zip(cells.get(f"questions|{n}|{v}", []),
                                                              cells.get(f"questions|{n}|k4", [])) if a["in_memory"]]
        return sum(a and not b for a, b in pairs) - sum(b and not a for a, b in pairs)

    raised = [v for v in names if v != "k4" and all((v, n) in got and got[v, n]["recall5"] > got["k4", n]["recall5"]
                                                    for n in lengths)]
    kept = [v for v in raised if needles_kept(v) and ppl_kept(v)]
    out.append("- Raising recall@5 at every length: " + (", ".join(
        f"{v} (net " + ", ".join(f"{net(v, n):+d}" for n in lengths) + " questions)" for v in raised) or "none")
        + "; of them keeping the needles and perplexity through memory within 1% (one not measured is not kept): "
        + (", ".join(kept) or "none") + ".")
    asked = [v for v in raised if needles_kept(v)]
    out.append("- As `ask`'s policy for the question and its answer alone (the memory read at the defaults, so that "
               "perplexity through memory is the defaults'), keeping the needles: " + (", ".join(asked) or "none")
               + ".")
    return out


def options(ap):
    ap.add_argument("--adapter", default=str(ROOT / ADAPTER.partition("=")[2]),
                    help="the LoRA landmark adapter (default: the shipped one)")
    ap.add_argument("--parts", type=some_of(PARTS), default=list(PARTS), help=f"some of {','.join(PARTS)}")
    ap.add_argument("--variants", type=variants, default=variants(VARIANTS), help="comma-separated variant names")
    ap.add_argument("--haystacks", type=int, default=4, help=f"haystacks per length, {len(FACTS)} questions each")
    ap.add_argument("--oracle-haystacks", type=int, default=2, help="haystacks per length the oracle reads")
    ap.add_argument("--needle-length", type=int, default=8192)
    ap.add_argument("--needle-trials", type=int, default=6)
    ap.add_argument("--ppl-variants", type=variants,
                    default=variants("k4,k4 centred,k4 sink local"))
    ap.add_argument("--ppl-tokens", type=int, default=16384, help="tokens predicted per perplexity cell, at least "
                                                                  "a segment per book")
    ap.add_argument("--ppl-books", type=int, default=1, help="held-out books the perplexity reads")


def main(argv=None):
    suite_main(__doc__, "retrieval", "8k,32k", run, report, argv, extra=options)


if __name__ == "__main__":
    main()
