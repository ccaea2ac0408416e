"""Evidence past 8K: the retrieval heads alone, the memory's text index alone (BM25) and their
fusion, ranking the blocks of the natural questions' memories (``fixtures/natural_questions_2.json``,
the development half the package ships, and the development books' fusion questions,
``fixtures/fusion_questions.json``).

    python experiments/exp_search.py record --books BOOKS --work DIR [--model base|landmark] [--split dev eval fusion]
    python experiments/exp_search.py six|library --books BOOKS --work DIR [--model base|landmark] [--split ...]
    python experiments/exp_search.py report --work DIR

``record``: each question is read as ``search`` reads it (``uses/search.py``) into the read-only
memory of its book's first 8,064 or 32,256 tokens (``exp_evidence.py``'s memories, read now where
missing); kept per question: the text index's first ``DEPTH`` blocks for its words, the blocks the
heads' block keys choose (every block up to ``EvidenceHeads.candidates``) and the heads' token-level
ranking of those and the text index's blocks together, in ``DIR/MODEL/search.json``. Nothing is
generated.

``report``: the fusion (``retrievers.fuse``: its ``k``, the text index's weight, and how many of its
blocks join the candidates) is chosen by recall@5 on the fusion questions only (the retrieval heads
were chosen on the development half, so its questions flatter them), then every table gives the
heads alone, the text index alone and the fusion side by side, with trial counts:
``results/search.md`` and ``results/search.json``.
"""

import argparse
import json
import shutil
import time
from itertools import product
from pathlib import Path

import torch
from _common import Trials, command_line, write_result
from bench_library import small_documents
from exp_answers import NAMES
from exp_evidence import SIZES, cases, memory_of, questions
from exp_natural import evidence_span

from landmark_memory.app.cli import main as cli
from landmark_memory.jobs.build import encode
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.heads import EvidenceHeads
from landmark_memory.models.kinds import load_model
from landmark_memory.training.data import read_text
from landmark_memory.uses.evidence import candidates, prompt_weights, rank_blocks, token_attention
from landmark_memory.uses.question import question_tokens, search_states
from landmark_memory.uses.retrievers import fuse
from landmark_memory.uses.search import text_ranking

DEPTH = 200  # the text index's blocks kept per question
KS = (1, 3, 10, 30, 60)
WEIGHTS = (0.5, 1.0, 2.0, 4.0)
TEXT_DEPTHS = (10, 20, 50, 100)


@torch.no_grad()
def ranked(m, loaded, question):
    """(the heads' ranking of their candidates with the text index's, the block keys' candidates,
    the text index's ranking, seconds) for ``question`` read as ``search`` reads it."""
    heads, tok, n = loaded.heads, loaded.tokenizer, m.n_blocks
    t0 = time.perf_counter()
    text = text_ranking(m, tok, question, n, DEPTH)
    prompt = tok.chat_text([{"role": "user", "content": question}], first=True, answer=False)
    enc = tok.encode(prompt)
    own = question_tokens(enc.offsets, prompt, question)
    got = search_states(m, enc.ids)
    w = prompt_weights(own, len(enc.ids))
    keyed = candidates(m, got, w, heads.heads, heads.candidates, n)
    blocks = torch.cat([keyed, torch.tensor(sorted({b for b, _ in text} - set(keyed.tolist())), dtype=torch.long)])
    mass = token_attention(m, got, w, heads.heads, blocks)
    out = rank_blocks(mass, blocks, len(blocks))
    m.rewind()
    return out, keyed.tolist(), text, time.perf_counter() - t0


def record(args):
    loaded = load_model(NAMES[args.model], "cpu")
    model, tok = loaded.model, loaded.tokenizer
    work = Path(args.work) / args.model
    state = Trials(work / "search.json", command_line())
    for key, ids, asked in cases(args, tok):
        asked = [(q, span) for q, span in asked if span is not None and q["split"] in args.split]
        if not asked:
            continue
        with LandmarkMemory.open(memory_of(model, work, key, ids), model, readonly=True) as m:
            bs = m.shape.block_size
            for q, (a, b) in asked:
                cell = f"{q['split']}|{key}"
                if any(r["question"] == q["question"] for r in state.cell(cell)):
                    continue
                heads, keyed, text, took = ranked(m, loaded, q["question"])
                state.add(cell, {"question": q["question"], "blocks": list(range(a // bs, (b - 1) // bs + 1)),
                                 "heads": [[b, round(s, 6)] for b, s in heads], "keyed": keyed,
                                 "text": [[b, round(s, 4)] for b, s in text], "seconds": round(took, 3)},
                          at=len(state.cell(cell)))
        print(f"{key}: recorded", flush=True)


SIX = "six-32256"  # the six books' first 32,256 tokens, each a document of one corpus memory


def six_books(args, model, tok, work):
    """(key, the corpus memory of the six books' first 32,256 tokens (``landmark-memory build``,
    read now unless an earlier run did), [(question, its evidence's blocks there)])."""
    folder = work / SIX
    if not (folder / "built").exists():
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "docs").mkdir(parents=True)
        for book in sorted({q["book"] for q in questions()}):
            ids = encode(tok, read_text(Path(args.books) / f"{book}.txt"))[:SIZES[1] - 1]
            (folder / "docs" / f"{book}.txt").write_text(tok.decode(ids.tolist()))
        t0 = time.perf_counter()
        assert cli(["build", str(folder / "m"), "--input", str(folder / "docs"), "--model", NAMES[args.model],
                    "--quiet"]) == 0
        (folder / "built").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return SIX, folder / "m", excerpt_questions(folder / "m", model, tok)


def library(args, model, tok, work):
    """(key, the six books' excerpts (``six_books``'s documents) inside a library of ``--library``
    small documents, built by ``landmark-memory build --workers 2`` (Ray), [(question, its
    evidence's blocks there)])."""
    key = f"library{args.library}"
    folder = work / key
    if not (folder / "built").exists():
        six_books(args, model, tok, work)  # (its excerpts' files)
        small_documents(Path(args.books), folder / "docs", args.library)
        for f in (work / SIX / "docs").glob("*.txt"):
            shutil.copy(f, folder / "docs" / f.name)
        t0 = time.perf_counter()
        assert cli(["build", str(folder / "m"), "--input", str(folder / "docs"), "--model", NAMES[args.model],
                    "--workers", "2", "--quiet"]) == 0
        (folder / "built").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return key, folder / "m", excerpt_questions(folder / "m", model, tok)


def excerpt_questions(path, model, tok):
    """[(question, the blocks of its evidence)] of the questions about the books whose excerpts
    the corpus memory ``path`` holds as documents (named by their book)."""
    asked, books = [], {q["book"] for q in questions()}
    with LandmarkMemory.open(path, model, readonly=True) as m:
        bs = m.shape.block_size
        for e in m.inputs:
            if Path(e.path).stem not in books:
                continue
            doc = m.tokens(0, e.start // bs, (e.start + e.ingested) // bs).tolist()
            for q in questions():
                if q["book"] == Path(e.path).stem:
                    a, b = evidence_span(tok, doc, q["evidence"])
                    asked.append((q, list(range((e.start + a) // bs, (e.start + b - 1) // bs + 1))))
    return asked


def record_corpus(args):
    """``six`` and ``library``: the questions asked of a corpus memory of the books' excerpts."""
    loaded = load_model(NAMES[args.model], "cpu")
    model, tok = loaded.model, loaded.tokenizer
    work = Path(args.work) / args.model
    state = Trials(work / "search.json", command_line())
    key, path, asked = (six_books if args.step == "six" else library)(args, model, tok, work)
    with LandmarkMemory.open(path, model, readonly=True) as m:
        for q, blocks in asked:
            cell = f"{q['split']}|{key}"
            if q["split"] not in args.split or any(r["question"] == q["question"] for r in state.cell(cell)):
                continue
            heads, keyed, text, took = ranked(m, loaded, q["question"])
            state.add(cell, {"question": q["question"], "blocks": blocks, "heads": [[b, round(s, 6)] for b, s in heads],
                             "keyed": keyed, "text": [[b, round(s, 4)] for b, s in text], "seconds": round(took, 3)},
                      at=len(state.cell(cell)))
    print(f"{key}: recorded", flush=True)


def rankings(row, k, weight, depth, keyed=True):
    """{name: the first five blocks} of the three rankings of a recorded question, the fusion
    with ``k``, ``weight`` and the text index's first ``depth`` blocks among the candidates (and,
    ``keyed``, the blocks the block keys chose in a memory of more blocks than the heads read)."""
    text = [tuple(x) for x in row["text"]]
    allowed = (set(row["keyed"]) if keyed or not chosen_by_keys(row) else set()) | {b for b, _ in text[:depth]}
    heads = [tuple(x) for x in row["heads"] if x[0] in allowed]
    return {"heads": [b for b, _ in heads[:5]], "text": [b for b, _ in text[:5]],
            "fused": [b for b, _ in fuse((heads, 1.0), (text[:depth], weight), k=k)[:5]]}


def chosen_by_keys(row) -> bool:
    """Whether the block keys chose the heads' candidates (a memory of more blocks than they read)."""
    return len(row["keyed"]) != max(row["keyed"], default=-1) + 1


def hits(rows, name, *fusion):
    return sum(bool(set(rankings(r, *fusion)[name]) & set(r["blocks"])) for r in rows)


def reciprocal_rank(rows, *fusion):
    """The mean over ``rows`` of 1 / the fused rank of the evidence's first block (0 where absent)."""
    total = 0.0
    for r in rows:
        text = [tuple(x) for x in r["text"]]
        allowed = set(r["keyed"]) | {b for b, _ in text[:fusion[2]]}
        heads = [tuple(x) for x in r["heads"] if x[0] in allowed]
        fused = [b for b, _ in fuse((heads, 1.0), (text[:fusion[2]], fusion[1]), k=fusion[0])]
        at = [i for i, b in enumerate(fused) if b in r["blocks"]]
        total += 1 / (at[0] + 1) if at else 0.0
    return total / max(len(rows), 1)


CHOSEN_ON = "fusion"  # the questions that choose the fusion (``fixtures/fusion_questions.json``)


def kind_of(cell):
    """What memory a cell's questions were asked of: a book's first N tokens (N), or a corpus (its key)."""
    key = cell.split("|", 1)[1]
    return key if key == SIX or key.startswith("library") else int(key.rsplit("-", 1)[1])


def kinds(cells):
    """The kinds of memory recorded, in the tables' order: per book by size, then the corpora."""
    found = {kind_of(c) for c in cells}
    return sorted(k for k in found if isinstance(k, int)) + sorted(k for k in found if isinstance(k, str))


def described(kind):
    if kind == SIX:
        return "the six books' first 32,256 tokens, one corpus"
    if isinstance(kind, str):
        return f"the same inside a library of {int(kind.removeprefix('library')):,} small documents"
    return f"a book's first {kind:,} tokens"


def report(args):
    paths = {m: p for m in args.models if (p := Path(args.work) / m / "search.json").exists()}
    cells = {m: Trials(p).cells for m, p in paths.items()}
    # (the choice reads the fusion questions only: about the development books, never read by the heads' choice)
    dev = {m: [r for c, rs in cs.items() if c.startswith(f"{CHOSEN_ON}|") for r in rs] for m, cs in cells.items()}

    def score(f):  # every model's fusion questions: one default ships for all
        return (-sum(hits(rows, "fused", *f) for rows in dev.values()),
                -sum(reciprocal_rank(rows, *f) for rows in dev.values()), f)

    grid = sorted(product(KS, WEIGHTS, TEXT_DEPTHS), key=score)
    chosen, n_dev = grid[0], sum(map(len, dev.values()))
    kinds_seen = ", ".join(described(k) for k in kinds({c for cs in cells.values() for c in cs
                                                          if c.startswith(f"{CHOSEN_ON}|")}))
    out = {"chosen": {"k": chosen[0], "weight": chosen[1], "text_depth": chosen[2]}, "models": {}}
    body = [f"The fusion, chosen on the fusion questions of both models ({n_dev} recorded: {kinds_seen}): "
            f"k = {chosen[0]}, text weight {chosen[1]}, the text index's first {chosen[2]} blocks among the "
            f"candidates and in the fusion (recall@5 {-score(chosen)[0]}/{n_dev}; of the settings tied on it, the "
            "evidence's best mean reciprocal rank; the next: "
            + ", ".join(f"k {f[0]}, weight {f[1]}, depth {f[2]}: {-score(f)[0]}" for f in grid[1:4]) + ").", ""]
    # memories of more blocks than the heads read: does dropping the block keys' candidates, or another fusion, do
    # better on their fusion questions?
    large = {m: [r for c, rs in cs.items() if c.startswith(f"{CHOSEN_ON}|") for r in rs if chosen_by_keys(r)]
             for m, cs in cells.items()}
    n_large = sum(map(len, large.values()))
    if n_large:
        big = sorted(product(KS, WEIGHTS, TEXT_DEPTHS, (True, False)),
                     key=lambda f: (-sum(hits(rows, "fused", *f) for rows in large.values()), f != (*chosen, True)))
        text_alone = sum(hits(rows, "text", *chosen) for rows in large.values())
        out["large"] = {"questions": n_large, "chosen": sum(hits(rows, "fused", *chosen) for rows in large.values()),
                        "best": {"k": big[0][0], "weight": big[0][1], "text_depth": big[0][2], "keyed": big[0][3],
                                 "hits": sum(hits(rows, "fused", *big[0]) for rows in large.values())},
                        "text": text_alone}
        body += [f"Memories of more than {EvidenceHeads.candidates} blocks, where the block keys choose the heads' "
                 f"candidates ({n_large} fusion questions of both models: the six-book memory and the library): "
                 f"the fusion above finds {out['large']['chosen']}, the text index alone {text_alone}; the best of "
                 f"the same grid, with and without the block keys' candidates, k = {big[0][0]}, weight {big[0][1]}, "
                 f"depth {big[0][2]}, {'with' if big[0][3] else 'without'} them: {out['large']['best']['hits']} "
                 "(ties to the fusion above).", ""]
    for model, cs in cells.items():
        out["models"][model] = {}
        body += [f"## {model}: {MODELS[model]}", "",
                 "| split | memory | questions | heads alone | text index alone | fusion | median s |",
                 "|---|---|---|---|---|---|---|"]
        for split in ("dev", CHOSEN_ON, "eval"):
            for kind in kinds(cs):
                rows = [r for c, rs in cs.items() if c.startswith(f"{split}|") and kind_of(c) == kind for r in rs]
                if not rows:
                    continue
                got = {name: hits(rows, name, *chosen) for name in ("heads", "text", "fused")}
                secs = sorted(r["seconds"] for r in rows)[len(rows) // 2]
                out["models"][model][f"{split}|{kind}"] = {**got, "questions": len(rows), "median_s": secs}
                body.append(f"| {split} | {described(kind)} | {len(rows)} | "
                            + " | ".join(f"{got[n]}/{len(rows)} ({got[n] / len(rows):.0%})"
                                         for n in ("heads", "text", "fused")) + f" | {secs:.2f} |")
        body.append("")
    write_result("search", "Evidence past 8K: the retrieval heads, the text index and their fusion",
                 INTRO + body, commands=sorted({c for p in paths.values() for c in Trials(p).commands}))
    (Path(__file__).parent / "results" / "search.json").write_text(json.dumps(out, indent=1) + "\n")


MODELS = {"base": "SmolLM2 as published, its shipped retrieval heads, a training-free memory",
          "landmark": "SmolLM2 with the shipped landmark adapter and its retrieval heads"}
INTRO = ["recall@5: one of the five blocks a ranking puts first holds the words that answer (the blocks of "
         "the question's `evidence` span). Heads alone: the retrieval heads' calibrated token attention over "
         "their candidates (every block up to 512, past that the 512 their block keys rank first, and the text "
         "index's blocks); text index alone: SQLite FTS5's BM25 over each block's text for the question's own "
         "words; fusion: reciprocal rank fusion of the two, what `search` and `ask` report. The fusion "
         "questions (`fixtures/fusion_questions.json`: 51 about the development books' text past its opening, which "
         "the heads' choice never read) chose the fusion; the evaluation questions saw no choice.", ""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["record", "six", "library", "report"])
    ap.add_argument("--library", type=int, default=10_000, help="small documents around the excerpts")
    ap.add_argument("--books")
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default="base", choices=sorted(NAMES))
    ap.add_argument("--models", nargs="+", default=["base", "landmark"])
    ap.add_argument("--split", nargs="+", default=["dev", "eval", CHOSEN_ON])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES))
    ap.add_argument("--only", nargs="+", help="only these books")
    args = ap.parse_args(argv)
    args.planted = False
    {"record": record, "six": record_corpus, "library": record_corpus, "report": report}[args.step](args)


if __name__ == "__main__":
    main()
