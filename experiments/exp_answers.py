"""Answers from the evidence: does the model answer right once the sentence its heads found is
read into its prompt before the question, and how often without it?

    python experiments/exp_answers.py ask --books BOOKS --work DIR [--model base|landmark] [--split dev|eval]
    python experiments/exp_answers.py quotes --books BOOKS --work DIR [--model base|landmark] [--split dev|eval|fusion]
    python experiments/exp_answers.py choose --work DIR
    python experiments/exp_answers.py signals --work DIR
    python experiments/exp_answers.py report --work DIR [--split dev|eval]

``quotes`` keeps, per answerable question, every sentence the quote is chosen among (with the
model's likelihood of the question after it), so that ``choose`` can choose how to choose it on
the development questions, the package's and the fusion's (``results/quotes.md``).

The questions and memories are ``exp_evidence.py``'s (``fixtures/natural_questions_2.json``; its
development half ships with the package, ``samples/questions.json``): each book's first 8,064 and
32,256 tokens (``--sizes``) read at the defaults into ``DIR/MODEL`` (shared with it: a memory one
of them read is not read again). The model is loaded as the command line loads it, with the
retrieval heads it ships with. Each question is asked of each memory that holds its evidence,
once per evidence policy (``--policies``: ``ask``'s ``evidence``) and wording of the evidence
turn (``--wordings``, ``WORDINGS``), on the same memory, rewound between questions. Beside them,
with ``--baselines``, SmolLM2 as published without a memory: reading the 8K text whole in its
own context, then the question (``exp_natural.answers_in_context``), and reading only the
sentence that answers (the fixture's) before the question, worded as the evidence turn.

right: the answer holds the expected words; quoted: the quote holds them; recall@5: the
evidence's block among the 5 passages; seconds: the whole ``ask``. Policies and wordings are
chosen on the development half; ``--split eval`` reports the evaluation half, which no choice saw.
"""

import argparse
import json
import math
import time
from itertools import product
from pathlib import Path

import numpy as np
import torch
from _common import ROOT, Trials, command_line, write_result
from _texts import is_right
from exp_evidence import SIZES, cases, memory_of
from exp_natural import ASK_NEW, answers_in_context

from landmark_memory.core.names import EVIDENCE
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import in_sequence_logits, load_model
from landmark_memory.uses import answer as answering
from landmark_memory.uses import evidence, retrievers
from landmark_memory.uses.answering import heads as heads_policy
from landmark_memory.uses.evidence import support
from landmark_memory.uses.question import asked_words, word_rarity
from landmark_memory.uses.search import search

NAMES = {"base": "smollm2", "landmark": "smollm2-landmark"}  # the command line's names of the models
WORDINGS = {  # the evidence turn (``answering.heads.EVIDENCE_PROMPT``), chosen on the development half
    "from": 'From the text: "{evidence}"\n\n{question}',
    "plain": "{evidence}\n\n{question}",
    "passage": "Read this passage and answer the question from it.\n\nPassage: {evidence}\n\nQuestion: {question}",
}


def ask_step(args):
    loaded = load_model(NAMES[args.model], "cpu")
    model, tok = loaded.model, loaded.tokenizer
    work = Path(args.work) / args.model
    state = Trials(work / "answers.json", args.command)
    none = unanswerable(args.split)
    for key, ids, asked in cases(args, tok):
        asked = [(q, span) for q, span in asked if span is not None and q["split"] == args.split]
        if not asked:
            continue
        unasked = [q for q in none if q["book"] == key.rsplit("-", 1)[0]]
        with LandmarkMemory.open(memory_of(model, work, key, ids), model, readonly=True) as m:
            bs = m.shape.block_size
            for policy, wording in [(p, w) for p in args.policies for w in (args.wordings if p != "none" else ["-"])]:
                heads_policy.EVIDENCE_PROMPT = WORDINGS.get(wording, heads_policy.EVIDENCE_PROMPT)
                cell = f"{args.split}|{policy}|{wording}|{key}"
                for i, (q, (a, b)) in enumerate(asked):
                    if i < len(state.cell(cell)):
                        continue
                    got, took = asked_of(m, loaded, q["question"], policy)
                    blocks = list(range(a // bs, (b - 1) // bs + 1))
                    state.add(cell, {**got, "seconds": took, "recall5": any(p in blocks for p in got["passages"]),
                                     "right": is_right(got["answer"], q["words"]),
                                     "quoted": bool(got["quote"]) and is_right(got["quote"], q["words"])}, at=i)
                for i, q in enumerate(unasked):  # the memory holds no answer: what does it say?
                    if i < len(state.cell("none-" + cell)):
                        continue
                    got, took = asked_of(m, loaded, q["question"], policy)
                    state.add("none-" + cell, {**got, "seconds": took}, at=i)
                rows = state.cell(cell)
                print(f"{cell}: right {sum(r['right'] for r in rows)}/{len(rows)}, quoted "
                      f"{sum(r['quoted'] for r in rows)}, recall@5 {sum(r['recall5'] for r in rows)}, median "
                      f"{np.median([r['seconds'] for r in rows]):.1f} s", flush=True)
    if args.baselines:
        baselines(args, state)


# what the likelihood reads: a sentence, then the question; of a longer sentence its last LIKELIHOOD_TOKENS tokens
LIKELIHOOD_PROMPT = ("Text: {text}", " Question: {question}")
LIKELIHOOD_TOKENS, LIKELIHOOD_BATCH = 120, 4  # (a batch's logits: its sentences by their tokens by the vocabulary)


@torch.no_grad()
def likelihood(model, tokenizer, question, texts):
    """How likely ``model`` finds ``question`` after each of ``texts``: log P(question | text),
    summed over the question's tokens, the model reading ``LIKELIHOOD_PROMPT`` in sequence with no
    memory (query likelihood: the model as its own reranker of the quote's candidates)."""
    asked = tokenizer.encode(LIKELIHOOD_PROMPT[1].format(question=question)).ids
    read = [tokenizer.encode(LIKELIHOOD_PROMPT[0].format(text=t)).ids[-LIKELIHOOD_TOKENS:] for t in texts]
    out = []
    for at in range(0, len(read), LIKELIHOOD_BATCH):
        batch = read[at:at + LIKELIHOOD_BATCH]
        width = max(len(c) for c in batch) + len(asked)
        # right-padded: a causal model reads a row's own tokens as it would alone
        idx = torch.tensor([c + asked + [asked[-1]] * (width - len(c) - len(asked)) for c in batch])  # (B, T)
        logits = in_sequence_logits(model, idx).float()  # (B, T, V)
        for row, c in zip(logits, batch):
            lp = row[len(c) - 1:len(c) + len(asked) - 1].log_softmax(-1)  # (len(asked), V)
            out.append(float(lp[torch.arange(len(asked)), torch.tensor(asked)].sum()))
    return out


def quotes_step(args):
    """Every sentence ``ask`` chooses its quote among (``evidence.sentences``: those of the fusion's
    first blocks), per answerable question of ``args.split`` at each size: its text, its heads'
    score, the model's likelihood of the question after it (``likelihood``) and whether it
    holds the answer's words, with the question's words' rarity in the memory
    (``question.word_rarity``); in ``DIR/MODEL/quotes.json``."""
    loaded = load_model(NAMES[args.model], "cpu")
    model, tok = loaded.model, loaded.tokenizer
    work = Path(args.work) / args.model
    state = Trials(work / "quotes.json", args.command)
    seen = []

    def every(mem, tokenizer, mass, blocks, best, n, question, count=1, rarity=None):  # (for evidence.quotes)
        seen[:] = evidence.sentences(mem, tokenizer, mass, blocks, best, n)
        return []

    retrievers.quotes = every  # (as the heads retriever quotes)
    for key, ids, asked in cases(args, tok):
        asked = [q for q, span in asked if span is not None and q["split"] == args.split]
        cell = f"{args.split}|{key}"
        with LandmarkMemory.open(memory_of(model, work, key, ids), model, readonly=True) as m:
            k = max(min(loaded.heads.blocks, m.options.top_k), 1)  # as ``ask`` pins and quotes
            for i, q in enumerate(asked):
                done = state.cell(cell)[i] if i < len(state.cell(cell)) else None
                if done and all("likelihood" in s for s in done["sentences"]):
                    continue
                if done:  # recorded before the likelihood was: the same sentences, their likelihood added
                    likely = likelihood(model, tok, q["question"], [s["text"] for s in done["sentences"]])
                    state.add(cell, {**done, "sentences": [{**s, "likelihood": p} for s, p in zip(done["sentences"],
                                                                                                likely)]},
                              at=i, replace=True)
                    continue
                search(m, loaded, q["question"], k=k)
                likely = likelihood(model, tok, q["question"], [s.text for s in seen])
                rarity = word_rarity(m, tok, asked_words(q["question"]), m.n_blocks)
                state.add(cell, {"question": q["question"], "rarity": rarity,
                                 "sentences": [{"text": s.text, "score": s.score, "likelihood": p,
                                                "holds": is_right(s.text, q["words"])} for s, p in zip(seen, likely)]},
                          at=i)
        print(f"{cell}: {len(state.cell(cell))} questions", flush=True)


def unanswerable(split):
    """The questions of ``split`` whose answer the books do not hold (``book``, ``question``)."""
    from exp_evidence import FIXTURE
    path = ROOT / "landmark_memory" / "samples" / "questions.json" if split == "dev" else FIXTURE
    return json.loads(path.read_text())["unanswerable"]


def asked_of(m, loaded, question, policy):
    """(what ``ask`` answered ``question`` from the read-only memory ``m`` with the evidence
    ``policy``, as a trial keeps it; seconds)."""
    m.rewind()
    t0 = time.perf_counter()
    got = answering.ask(m, loaded, question, max_new_tokens=ASK_NEW, passages=5, evidence=policy, refuse=False)
    took = time.perf_counter() - t0
    return {"question": question, "answer": got.text.strip(), "passages": [p.block for p in got.passages],
            "quote": got.quote and got.quote.text, "score": got.quote and got.quote.score, "support": got.support,
            "grounded": got.grounded}, took


@torch.no_grad()
def baselines(args, state):
    """SmolLM2 as published without a memory: the 8K text whole in its context, then the
    question; and the sentence that answers, worded as each evidence turn, then the question."""
    loaded = load_model(NAMES["base"], "cpu")
    base, tok = loaded.model, loaded.tokenizer
    for key, ids, asked in cases(argparse.Namespace(**{**vars(args), "sizes": [SIZES[0]]}), tok):
        asked = [q for q, span in asked if span is not None and q["split"] == args.split]
        if asked and len(state.cell(f"{args.split}|context|-|{key}")) < len(asked):
            got = answers_in_context(base, tok, ids, [q["question"] for q in asked])
            for i, (q, text) in enumerate(zip(asked, got)):
                state.add(f"{args.split}|context|-|{key}", {"question": q["question"], "answer": text.strip(),
                                               "right": is_right(text, q["words"])}, at=i)
        for wording in args.wordings:
            cell = f"{args.split}|sentence|{wording}|{key}"
            for i, q in enumerate(asked):
                if i < len(state.cell(cell)):
                    continue
                turn = WORDINGS[wording].format(evidence=q["sentence"], question=q["question"])
                ids = torch.tensor([tok.encode(tok.chat_prompt(turn)).ids])
                new = base.generate(ids, max_new_tokens=ASK_NEW, do_sample=False,
                                    eos_token_id=list(tok.end_of_turn_ids))[0, ids.shape[1]:]
                text = tok.decode([t for t in new.tolist() if t not in tok.end_of_turn_ids])
                state.add(cell, {"question": q["question"], "answer": text.strip(),
                                 "right": is_right(text, q["words"])}, at=i)


def report(args):
    """``answers_<split>.md`` (and ``answers_<split>.json``, the summary ``exp_natural.py`` reads):
    per model, evidence policy and wording, at each size, the answerable questions answered right
    without the refusal and with it (``ask``'s rule applied to each trial's quote: a quote holding
    none of the question's own words is answered ``NOT_FOUND``), those refused, quoted, recall@5
    and seconds; then the questions the books do not answer, and how many are refused."""
    body, commands, summary = [], [], {}
    for model in sorted(p.name for p in Path(args.work).iterdir() if (p / "answers.json").is_file()):
        state = Trials(Path(args.work) / model / "answers.json")
        commands += state.commands
        cells = {}
        for k, rows in state.cells.items():
            split, policy, wording, key = k.split("|")
            kind = "none" if split.startswith("none-") else "asked"
            if split.removeprefix("none-") == args.split:
                cells.setdefault((policy, wording), {}).setdefault(key.rsplit("-", 1)[1], {}).setdefault(
                    kind, []).extend(rows)
        if not cells:
            continue
        sizes = sorted({s for c in cells.values() for s in c}, key=int)
        body += [f"## {NAMES[model]}", "", "| evidence read before the question | wording | " + " | ".join(
                 f"{int(s):,} tokens: right | right, with the refusal | answerable refused | unanswerable refused "
                 "| quoted | recall@5 | s" for s in sizes) + " |", "|---|---|" + "---|" * 7 * len(sizes)]
        for (policy, wording), by_size in sorted(cells.items()):
            row = []
            for s in sizes:
                rows, none = by_size.get(s, {}).get("asked", []), by_size.get(s, {}).get("none", [])
                if "quoted" not in (rows or [{}])[0]:  # a baseline without a memory
                    row += [frac([r["right"] for r in rows])] + ["-"] * 6
                    continue
                cell = {"right": [r["right"] for r in rows],
                        "right_refusing": [r["right"] and not refused(r) for r in rows],
                        "answerable_refused": [refused(r) for r in rows], "unanswerable_refused":
                        [refused(r) for r in none], "quoted": [r["quoted"] for r in rows],
                        "recall5": [r["recall5"] for r in rows]}
                summary.setdefault(NAMES[model], {}).setdefault(f"{policy}|{wording}", {})[s] = cell
                row += [frac(v) for v in cell.values()] + [f"{np.median([r['seconds'] for r in rows]):.1f}"]
            body.append(f"| {policy} | {wording} | " + " | ".join(row) + " |")
        body.append("")
    Path(args.results, f"answers_{args.split}.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_result(f"answers_{args.split}", f"Answers from the evidence ({args.split} questions)",
                 [__doc__.split("\n\n")[-2].replace("\n", " "), ""] + body, results=args.results,
                 commands=list(dict.fromkeys(commands)) or [args.command])


@torch.no_grad()
def signals(args):
    """``results/refusal_signals.md``: how well what ``ask`` could refuse by tells the questions the
    memory answers from those it cannot (AUC: the chance that an answerable question's signal
    exceeds an unanswerable one's), per model, size and split, over the recorded ``quote`` trials
    of the evidence turn ``plain``: the quote's heads' score; its support (the share of the
    question's own words it holds: today's rule refuses at 0); and how much the quote raises the
    answer's likelihood (the mean over its tokens of log p(answer | quote and question) - log
    p(answer | question), SmolLM2 as published reading each as a chat turn, no memory)."""
    loaded = load_model(NAMES["base"], "cpu")
    base, tok = loaded.model, loaded.tokenizer

    def logp(turn, answer):  # (n,): each answer token's log-probability after the turn
        ids = tok.encode(tok.chat_prompt(turn)).ids
        out = base(torch.tensor([ids + answer])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
        return out[torch.arange(len(answer)), torch.tensor(answer)]

    def signal(r):
        answer = tok.encode(r["answer"]).ids[:ASK_NEW]
        gain = (logp(WORDINGS["plain"].format(evidence=r["quote"], question=r["question"]), answer)
                - logp(r["question"], answer)).mean() if answer else torch.tensor(0.0)
        return {"score": r["score"], "support": support(r["question"], r["quote"]), "gain": float(gain)}

    def auc(pos, neg):
        return float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])) if pos and neg else float("nan")

    intro = signals.__doc__.split("\n\n")[0].replace("\n    ", " ").removeprefix("``results/refusal_signals.md``: ")
    body = [intro[0].upper() + intro[1:], "",
            "| model | split | memory | answerable | unanswerable | heads' score | support | likelihood gain |",
            "|---|---|---|---|---|---|---|---|"]
    commands = []
    for model in NAMES:
        path = Path(args.work) / model / "answers.json"
        if not path.is_file():
            continue
        state = Trials(path)
        commands += state.commands
        for split in ("dev", "eval"):
            for size in map(str, args.sizes):
                got = {kind: [signal(r) for c, rs in state.cells.items() for r in rs
                              if c.startswith(f"{prefix}{split}|quote|plain|") and c.endswith(f"-{size}")
                              and r["quote"]]
                       for kind, prefix in (("yes", ""), ("no", "none-"))}
                if got["yes"] and got["no"]:
                    body.append(f"| {NAMES[model]} | {split} | {int(size):,} tokens | {len(got['yes'])} | "
                                f"{len(got['no'])} | " + " | ".join(
                                    f"{auc([x[f] for x in got['yes']], [x[f] for x in got['no']]):.2f}"
                                    for f in ("score", "support", "gain")) + " |")
    body += ["", "A rule that refuses half the unanswerable questions and under a tenth of the answerable ones needs "
             "an AUC near 0.8 or more; none of these comes near it on the evaluation half."]
    write_result("refusal_signals", "What could tell an unanswerable question", body, results=args.results,
                 commands=list(dict.fromkeys(commands)) + [args.command])


# how the quote may be chosen: the heads' score ** heads times (support + floor) ** power, support weighing the
# question's words by their rarity in the memory or alike; the best candidates so then weighed by the model's
# likelihood of the question after each ** likelihood
QUOTE_GRID = {"heads": (0.25, 0.5, 1.0), "floor": (0.05, 0.1, 0.3), "power": (0.0, 2.0, 4.0, 8.0),
              "rarity": (False, True), "likelihood": (0.0, 0.05, 0.1, 0.2, 0.5), "candidates": (4, 8, 16, 64)}
BEFORE = {"heads": 0.25, "floor": 0.05, "power": 8.0, "rarity": True, "likelihood": 0.0, "candidates": 4}  # (of
# the round before: no likelihood, so the candidates do not count)
DEVELOPMENT = ("dev", "fusion")  # the splits the quote's rule is chosen on
MARGIN = 0.01  # the share of the development questions a rule must gain over the round before's to replace it


def chosen_sentence(row, heads, floor, power, rarity, likelihood, candidates):
    """The sentence of a recorded question (``row``, each sentence's ``support`` by rarity or not
    added) a rule quotes (of equal ones the first); with no likelihood, as ``evidence.quotes``
    chooses it (which reads no likelihood: none was chosen)."""
    def weight(s, by_likelihood=0.0):
        return heads * math.log(max(s["score"], evidence.LEAST_SCORE)) + power * math.log(
            s["support"][rarity] + floor) + by_likelihood * s["likelihood"]

    ahead = sorted(row["sentences"], key=lambda s: -weight(s))[:candidates]
    return max(ahead, default=None, key=lambda s: weight(s, likelihood))


def quote_report(args):
    """``results/quotes.md``: how often the quote holds the answer's words under each way of
    choosing it (``QUOTE_GRID``), the way chosen on the development questions of both models
    (``DEVELOPMENT``: the package's and the fusion's), and the evaluation half under it, the rule
    before it and the heads' score alone."""
    found = {m: Trials(p).cells for m in NAMES if (p := Path(args.work) / m / "quotes.json").is_file()}
    if not found:
        return
    for cells in found.values():
        for r in (r for rs in cells.values() for r in rs):
            for s in r["sentences"]:
                s["support"] = {False: support(r["question"], s["text"]),
                                True: support(r["question"], s["text"], r["rarity"])}
    grid = [dict(zip(QUOTE_GRID, v)) for v in product(*QUOTE_GRID.values())]
    alone = {**BEFORE, "power": 0.0}
    memo = {}

    def holds(splits, rule, model=None, size=None):
        key = (splits, tuple(rule.values()), model, size)
        if key not in memo:
            rows = [r for m, cells in found.items() if model in (None, m) for c, rs in cells.items()
                    if c.split("|")[0] in splits and size in (None, c.rsplit("-", 1)[1]) for r in rs]
            memo[key] = sum(bool((s := chosen_sentence(r, **rule)) and s["holds"]) for r in rows), len(rows)
        return memo[key]

    # of equal ones the fewest candidates (the likelihood's cost), else the first; the round before's unless beaten
    top = max(grid, key=lambda rule: (holds(DEVELOPMENT, rule)[0], -rule["candidates"]))
    gain = holds(DEVELOPMENT, top)[0] - holds(DEVELOPMENT, BEFORE)[0]
    best = top if gain > MARGIN * holds(DEVELOPMENT, BEFORE)[1] else BEFORE
    sizes = sorted({c.rsplit("-", 1)[1] for cells in found.values() for c in cells}, key=int)
    cols = [(m, z) for m in found for z in sizes]
    ceiling = {split: sum(any(s["holds"] for s in r["sentences"]) for cells in found.values()
                          for c, rs in cells.items() if c.split("|")[0] in split for r in rs)
               for split in (DEVELOPMENT, ("eval",))}
    body = ["How `ask` chooses its quote among the sentences of the fusion's first blocks (`evidence.sentences`): "
            "by the heads' score (their calibrated attention summed over the sentence's tokens) `** heads`, times "
            "`(support + floor) ** power`, support the share of the question's own words it holds (a word held "
            "where one of the sentence's words begins with its stem, `evidence.stem`), each word weighing its "
            "rarity in the memory (BM25's inverse document frequency over its blocks, `question.word_rarity`) or "
            "all alike; of the `candidates` best so, times the model's likelihood of the question after the sentence "
            "`** likelihood` (`likelihood`: the memory's own model as a reranker, reading \"Text: {sentence} "
            "Question: {question}\" with no memory, some 0.15 s a sentence on 2 CPU cores). The rule is chosen on "
            "the development questions of both models, the package's and the fusion's "
            f"({holds(DEVELOPMENT, BEFORE)[1]} asked; of equal ones the fewest candidates), and replaces the round "
            f"before's only where it holds the answer for more than {MARGIN:.0%} of them more; figures: the quote "
            "holds the answer's words. Some sentence among those it is chosen from holds them for "
            f"{ceiling[DEVELOPMENT]} development and {ceiling[('eval',)]} evaluation questions.", "",
            "Best on the development questions: " + ", ".join(f"{k} {v}" for k, v in top.items())
            + f" ({gain:+d} on the round before's). Chosen: " + ", ".join(f"{k} {v}" for k, v in best.items())
            + ".", "",
            "| split | rule | " + " | ".join(f"{NAMES[m]} {int(z):,}" for m, z in cols) + " | all |",
            "|---|---|" + "---|" * (len(cols) + 1)]
    for splits in (("dev",), ("fusion",), DEVELOPMENT, ("eval",)):
        for name, rule in (("the heads' score alone", alone), ("the round before's (heads 0.25, floor 0.05, power 8, "
                                                               "by rarity, no likelihood)", BEFORE),
                           ("the development questions' best", top), ("chosen", best)):
            got = [holds(splits, rule, m, z) for m, z in cols] + [holds(splits, rule)]
            body.append(f"| {' + '.join(splits)} | {name} | " + " | ".join(
                f"{h}/{n} ({h / max(n, 1):.0%})" if n else "-" for h, n in got) + " |")
    weighed = [{**BEFORE, "likelihood": w, "candidates": max(QUOTE_GRID["candidates"])}
               for w in QUOTE_GRID["likelihood"]]
    body += ["", "The round before's rule with the likelihood weighed in (every candidate): "
             + "; ".join(f"likelihood {r['likelihood']}: development {holds(DEVELOPMENT, r)[0]}, evaluation "
                         f"{holds(('eval',), r)[0]}" for r in weighed) + "."]
    body += ["", "The development questions' best rules:", ""] + [
        "- " + ", ".join(f"{k} {v}" for k, v in r.items()) + f": {holds(DEVELOPMENT, r)[0]}"
        for r in sorted(grid, key=lambda r: -holds(DEVELOPMENT, r)[0])[:8]]
    commands = list(dict.fromkeys(c for m in found for c in Trials(Path(args.work) / m / "quotes.json").commands))
    write_result("quotes", "Choosing the quote", body, results=args.results, commands=commands + [args.command])
    return best


def refused(row):
    """Whether ``ask`` would have said ``NOT_FOUND`` in this trial (asked with ``refuse=False``)."""
    return row["quote"] is not None and support(row["question"], row["quote"]) == 0


def frac(v):
    return f"{sum(v)}/{len(v)} ({np.mean(v):.0%})" if v else "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["ask", "quotes", "choose", "signals", "report"])
    ap.add_argument("--books")
    ap.add_argument("--work", required=True, help="memories (shared with exp_evidence.py) and the trials")
    ap.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--model", default="base", choices=sorted(NAMES))
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES),
                    help="memory sizes in tokens (default 8064,32256)")
    ap.add_argument("--only", nargs="*", help="these books only")
    ap.add_argument("--split", default="dev", choices=["dev", "eval", "fusion"],
                    help="fusion: the development books' questions past their opening (the quotes step only)")
    ap.add_argument("--policies", nargs="+", default=list(EVIDENCE), choices=EVIDENCE)
    ap.add_argument("--wordings", nargs="+", default=["from"], choices=sorted(WORDINGS))
    ap.add_argument("--baselines", action="store_true", help="and SmolLM2 as published without a memory")
    args = ap.parse_args(argv)
    args.command, args.planted = command_line(argv), False
    if args.split == "fusion" and args.step != "quotes":
        ap.error("--split fusion: only the quotes step records the fusion questions (they have no unanswerable twins)")
    {"ask": ask_step, "quotes": quotes_step, "report": report, "choose": quote_report, "signals": signals}[args.step](
        args)


if __name__ == "__main__":
    main()
