"""Questions about text nobody planted: does the memory hand a reader's question the block that
answers it, and is the answer right?

    python experiments/exp_natural.py --books BOOKS
    python experiments/exp_natural.py --report                     # natural_questions.md from the state

``fixtures/natural_questions.json``: questions a reader would ask (who, where, when, what) about
the first ``TOKENS`` tokens of each book the fine-tuning held out, each with the words of the text
that answer it. Each book's text is read into a memory at the defaults (SmolLM2 with the shipped
landmark adapter, stage 9), and each question is asked of it three ways on the same memory:

- ``ask`` as it is today: recall@5, the answer's block among its five passages, and whether the
  answer holds the fact's words;
- the retrieval heads ``exp_heads.py`` chose on its development questions (``--heads``, its
  state): recall@5 of the blocks ranked by their calibrated attention (``_attention.py``);
- the base model without an adapter reading the same text whole in its own context (the text,
  then the question as ``ask`` feeds it: the chat template): whether its answer is right.
"""

import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _attention import NULL, block_attention, pooled_rank
from _common import ADAPTER, HEADS_READER, RESULTS, ROOT, SHIPPED_READER, Trials, load_smollm2, suite_main, write_result
from _texts import build, is_right

from landmark_memory.jobs.build import encode
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import cache_keyword
from landmark_memory.training.data import read_text
from landmark_memory.uses.answer import ask

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "natural_questions.json"
TOKENS = 8064  # 128 blocks of 63: with a question and its answer, within the base model's 8,192 positions
ASK_NEW = 32


def evidence_span(tok, ids, evidence):
    """Token span [start, end) of ``ids`` whose text holds ``evidence`` (any run of white space
    between its words); ``ValueError`` when the text lacks it."""
    text = tok.decode(ids)
    found = re.search(r"\s+".join(map(re.escape, evidence.split())), text)
    if found is None:
        raise ValueError(f"the text lacks the evidence {evidence!r}")

    def token_at(char):  # the first token whose text reaches past ``char``
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(ids[:mid + 1])) > char:
                hi = mid
            else:
                lo = mid + 1
        return lo

    return token_at(found.start()), token_at(found.end() - 1) + 1


@torch.no_grad()
def answers_in_context(model, tok, ids, questions):
    """Each question's answer from ``model`` reading ``ids`` whole in its own context, then the
    question as ``ask`` feeds it (the chat template), greedy, ending at an end-of-turn token;
    the text is read once into the model's KV cache, cut back to it after each question."""
    from transformers import DynamicCache

    cache, name = DynamicCache(config=model.config), cache_keyword(model)

    def read(x):  # (1, T) -> (vocab,), the cache grown by x
        return model(input_ids=torch.tensor([x]), use_cache=True, **{name: cache}).logits[0, -1]

    read(ids)
    out, stops = [], set(tok.end_of_turn_ids)
    for q in questions:
        logits, new = read(tok.encode(tok.chat_prompt(q)).ids), []
        while len(new) < ASK_NEW and int(logits.argmax()) not in stops:
            new.append(int(logits.argmax()))
            logits = read(new[-1:])
        out.append(tok.decode(new))
        cache.crop(len(ids) - cache.get_seq_length())  # (a negative count: the tokens to drop)
    return out


def run(args):
    state = Trials(args.state, args.command)
    fixture = json.loads(FIXTURE.read_text())
    heads = json.loads(Path(args.heads).read_text())["cells"]["heads"][0]
    chosen = [tuple(lh) for lh in heads["order"][:heads["count"]]]
    books = sorted({q["book"] for q in fixture["questions"]})
    loaded = load_smollm2(args.adapter)
    model, tok = loaded.model, loaded.tokenizer
    bs = model.config.landmark_block_size
    texts = {}
    for book in books:
        ids = encode(tok, read_text(Path(args.books) / f"{book}.txt"))[:TOKENS]
        asked = [q for q in fixture["questions"] if q["book"] == book]
        texts[book] = ids, asked
        if len(state.cell(f"memory|{book}")) == len(asked):
            continue
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            n_blocks = build(model, ids, Path(tmp) / "m")
            with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as m:
                null = block_attention(m, tok, NULL, n_blocks)
                for i, q in enumerate(asked):
                    a, b = evidence_span(tok, ids, q["evidence"])
                    blocks = list(range(a // bs, (b - 1) // bs + 1))
                    att = block_attention(m, tok, q["question"], n_blocks) - null
                    m.rewind()
                    got = ask(m, loaded, q["question"], max_new_tokens=ASK_NEW, passages=5)
                    state.add(f"memory|{book}", {
                        "question": q["question"], "blocks": blocks, "in_memory": max(blocks) < n_blocks,
                        "ask_recall5": any(p.block in blocks for p in got.passages),
                        "ask_answer": got.text.strip(), "ask_right": is_right(got.text, q["words"]),
                        "heads_rank": pooled_rank(att, chosen, blocks)}, at=i)
        print(f"{book}: {len(asked)} questions through memory in {time.perf_counter() - t0:.0f} s", flush=True)
    base_model = load_smollm2(None)
    base, tok = base_model.model, base_model.tokenizer
    for book, (ids, asked) in texts.items():
        if len(state.cell(f"base|{book}")) == len(asked):
            continue
        t0 = time.perf_counter()
        for i, (q, got) in enumerate(zip(asked, answers_in_context(base, tok, ids, [q["question"] for q in asked]))):
            state.add(f"base|{book}", {"question": q["question"], "answer": got.strip(),
                                       "right": is_right(got, q["words"])}, at=i)
        print(f"{book}: {len(asked)} questions in the base model's context in {time.perf_counter() - t0:.0f} s",
              flush=True)


def report(args):
    trials = Trials(args.state)
    cells = trials.cells
    books = sorted({k.split("|")[1] for k in cells if k.startswith("memory|")})
    if not books:
        return
    heads = json.loads(Path(args.heads).read_text())["cells"]["heads"][0]
    body = [f"Questions a reader would ask about the first {TOKENS:,} tokens of each held-out book "
            f"(`experiments/fixtures/natural_questions.json`), asked of a memory of that text (SmolLM2 with the "
            "shipped adapter, stage 9, at the defaults) and of the base model reading the same text whole in its "
            "own context. recall@5: the block of the words that answer it among the 5 passages `ask` reports, or "
            f"among the 5 blocks ranked first by the {heads['count']} retrieval heads `exp_heads.py` chose "
            "(`experiments/results/heads.md`; their choice is not what `ask` reads, so they have no answers); right: "
            "the answer holds the expected words. `reader.md` (`exp_reader.py`): the 5 blocks each trained question "
            "reader of stage 11 ranks first, and `ask` as SmolLM2's adapter now asks (through `aboutH24-blend`: "
            "reading the 4 blocks it ranks first at every answer token, its passages those 4 first) and as it asked "
            "before (through the retrieval heads alone, calibrated by the chat template's tokens).", ""]
    reader = Path(args.results) / "reader.json"
    reader = json.loads(reader.read_text())["cells"] if reader.is_file() else {}
    trained = [t["name"] for t in reader.get("reader", [])]
    body += ["| book | questions | `ask` recall@5 | `ask` right | heads recall@5 | " + " | ".join(
             f"`{name}` recall@5" for name in trained) + " | `ask` through `aboutH24-blend` (shipped): recall@5 | "
             "right | `ask` through the heads (before): recall@5 | right | base model right |",
             "|---|---|---|---|---|" + "---|" * len(trained) + "---|---|---|---|---|"]
    every = {}
    for book in books:
        rows, base = cells[f"memory|{book}"], cells.get(f"base|{book}", [])
        shipped = reader.get(f"natural|{book}|{SHIPPED_READER}", [])
        before = reader.get(f"natural|{book}|{HEADS_READER}", [])
        cols = {"ask_recall5": [r["ask_recall5"] for r in rows], "ask_right": [r["ask_right"] for r in rows],
                "heads": [r["heads_rank"] <= 5 for r in rows],
                **{name: [r["ranks"][name] <= 5 for r in reader.get(f"ranks|natural|{book}", [])] for name in trained},
                "shipped": [r["recall5"] for r in shipped], "shipped_right": [r["right"] for r in shipped],
                "before": [r["recall5"] for r in before], "before_right": [r["right"] for r in before],
                "base": [r["right"] for r in base]}
        for k, v in cols.items():
            every.setdefault(k, []).extend(v)
        body.append(f"| {book} | {len(rows)} | " + " | ".join(
            f"{sum(v)}/{len(v)}" if v else "-" for v in cols.values()) + " |")
    body.append(f"| all | {len(every['ask_right'])} | " + " | ".join(
        f"**{sum(v)}/{len(v)} ({np.mean(v):.0%})**" if v else "-" for v in every.values()) + " |")
    body += ["", "Each question's answers (`ask` through memory, then the base model in its own context):", ""]
    for book in books:
        for r, b in zip(cells[f"memory|{book}"], cells.get(f"base|{book}", [{}] * 999)):
            body.append(f"- {r['question']} ask: {r['ask_answer']!r} ({'right' if r['ask_right'] else 'wrong'}, "
                        f"block {'found' if r['ask_recall5'] else 'not found'}); base: {b.get('answer', '-')!r}")
    write_result("natural_questions", "Natural questions: the answer's block and the answer, through memory and in "
                 "context", body + second_set(args.results) + answers_set(args.results) + search_set(args.results),
                 results=args.results,
                 commands=trials.commands)


def second_set(results):
    """The second set's evaluation table (``exp_evidence.py``'s summary, ``evidence.json``), or nothing."""
    f = Path(results) / "evidence.json"
    if not f.is_file():
        return []
    summary = json.loads(f.read_text())
    groups = ["natural, 8K", "natural, 32K", "planted, 8K", "planted, 32K"]
    body = ["", "## The second set (`fixtures/natural_questions_2.json`, `exp_evidence.py`)", "",
            "78 questions over six books other than the three above: 38 about three development books (shipped with "
            "the package, `landmark_memory/samples/questions.json`), by which heads and counts were chosen, and 40 "
            "about three evaluation books, reported here (8K: those whose evidence lies in a book's first 8,064 "
            "tokens, asked of a memory of them; 32K: all 40, asked of a memory of the first 32,256), with the "
            "retrieval suite's planted facts beside them. `ask` recall@5: the evidence's block among the 5 passages "
            "`ask` "
            "reports; ranking: among the 5 blocks a ranking puts first; right: the answer holds the expected words; "
            "quoted: the quote holds them. Every figure with its trials: `evidence.md`.", "",
            "| model, variant | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    names = {"stage9": "`ask`, stage 9 (no reader)", "shipped": "`ask` through issue 59's question reader",
             "plain": "`ask` as published", "heads": "`ask` through its retrieval heads (token level)"}
    for model, s in summary.items():
        for variant, cells in s.get("ask", {}).items():
            body.append(f"| {model}: {names[variant]} | " + " | ".join(
                "; ".join(f"{x} {sum(v)}/{len(v)}" for x, v in cells[g].items() if v and (x != "quoted" or
                                                                                            variant == "heads"))
                or "-" for g in groups) + " |")
        for ranking in dict.fromkeys(k for g in groups for k in s["ranking"].get(g, {})):
            body.append(f"| {model}: ranking by {ranking} | " + " | ".join(
                (lambda v: f"recall5 {sum(v)}/{len(v)}" if v else "-")(s["ranking"][g].get(ranking, []))
                for g in groups) + " |")
    return body


def answers_set(results):
    """The second set's evaluation half answered from the evidence (``exp_answers.py``'s summary,
    ``answers_eval.json``), or nothing."""
    f = Path(results) / "answers_eval.json"
    if not f.is_file():
        return []
    summary = json.loads(f.read_text())
    body = ["", "## Answers from the evidence (`exp_answers.py`, the second set's evaluation half)", "",
            "The same 40 evaluation questions (22 at 8K) and 24 questions the books do not answer, asked through `ask` "
            "with the quote its heads found read into the prompt before the question (`evidence=\"quote\"`, the "
            "default) and without (`\"none\"`); with the refusal, a quote holding none of the question's own words is "
            "answered \"not found\". Each figure with its trials; the base model reading the text whole and the "
            "answering sentence alone: `answers_eval.md`.", "",
            "| model | evidence | 8K: right | right, refusing | answerable refused | unanswerable refused | "
            "32K: right | right, refusing | answerable refused | unanswerable refused |", "|---|---|" + "---|" * 8]
    for model, policies in summary.items():
        for policy, sizes in policies.items():
            body.append(f"| {model} | {policy.split('|')[0]} | " + " | ".join(
                (lambda c: " | ".join(f"{sum(c[k])}/{len(c[k])}" for k in ("right", "right_refusing",
                                                                          "answerable_refused",
                                                                          "unanswerable_refused")))(
                    sizes[size]) if size in sizes else "- | - | - | -" for size in ("8064", "32256")) + " |")
    return body


def search_set(results):
    """The second set's questions ranked by the heads alone, the text index alone and their fusion
    (``exp_search.py``'s summary, ``search.json``), or nothing."""
    f = Path(results) / "search.json"
    if not f.is_file():
        return []
    from exp_search import described

    summary = json.loads(f.read_text())
    c = summary["chosen"]
    body = ["", "## The evidence by the heads, the text index and their fusion (`exp_search.py`)", "",
            "recall@5 of the second set's questions: the answer's block among the first five of the retrieval heads' "
            "ranking alone, of the memory's text index (BM25 over each block's words) alone, and of their fusion, "
            f"what `search` and `ask` report (reciprocal rank fusion, k = {c['k']}, text weight {c['weight']}, the "
            f"text index's first {c['text_depth']} blocks: chosen on the fusion questions, which the heads' choice "
            "never read). Each figure with its trials; the development half and the fusion questions beside it: "
            "`search.md`.", "",
            "| model | memory | questions | heads alone | text index alone | fusion |", "|---|---|---|---|---|---|"]
    for model, cells in summary["models"].items():
        for cell, got in cells.items():
            split, kind = cell.split("|", 1)
            if split != "eval":
                continue
            n = got["questions"]
            body.append(f"| {model} | {described(int(kind) if kind.isdigit() else kind)} | {n} | " + " | ".join(
                f"{got[k]}/{n} ({got[k] / n:.0%})" for k in ("heads", "text", "fused")) + " |")
    return body


def options(ap):
    ap.add_argument("--adapter", default=str(ROOT / ADAPTER.partition("=")[2]),
                    help="the LoRA landmark adapter (default: the shipped one)")
    ap.add_argument("--heads", default=str(RESULTS / "heads.json"), help="exp_heads.py's state: the heads it chose")


def main(argv=None):
    suite_main(__doc__, "natural_questions", "8k", run, report, argv, extra=options)


if __name__ == "__main__":
    main()
