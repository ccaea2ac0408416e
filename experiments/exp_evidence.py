"""Evidence, second round: which blocks and which sentence a question's own attention points at,
for questions nobody planted (``fixtures/natural_questions_2.json``: 78 questions over six books,
three of them development books, three evaluation books).

    python experiments/exp_evidence.py record --books BOOKS --work DIR [--model landmark|base|gemma]
    python experiments/exp_evidence.py choose --work DIR [--model ...]    # heads, on dev books only
    python experiments/exp_evidence.py ask --books BOOKS --work DIR [--model ...]
    python experiments/exp_evidence.py report --work DIR [--out NAME]     # evidence.md

``record``: each book's first 8,064 and 32,256 tokens are read into memories at the defaults
(``--model``: ``landmark``, SmolLM2 with the shipped adapter; ``base``, SmolLM2 as published, a
training-free memory; ``gemma``, Gemma 3 270M as published). Each question is asked of the 8K
memory when its evidence lies there, and of the 32K memory always. Its chat prompt is read as
``ask`` reads it, and for every (layer, key/value head) two attentions are kept, each for the
question's own tokens and for the template's tokens around it (the calibration): over the blocks
by their block keys (``head_attention``, what issue 59's heads read), and over every stored token
of every block (``memory.evidence.token_attention``). The shipped question reader's block scores
are kept beside them (``landmark``). One safetensors file per question in ``DIR/MODEL/rec``.

``choose``: a head's score on the development questions is its mean reciprocal rank of the
evidence's block at 32K, by its calibrated token attention; the number of heads pooled is chosen
by recall@5 on the development questions, as is the quote's rule. ``ask``: the evaluation
questions asked through ``ask`` as it ships and with the chosen heads. ``report``: every table
reports the evaluation books only.
"""

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from _common import ROOT, command_line, load_smollm2, write_result
from _texts import build, haystack, held_out, is_right
from exp_natural import evidence_span
from safetensors import safe_open
from safetensors.torch import save_file

from landmark_memory.jobs.build import encode
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.heads import question_prompt
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.models.reader import head_attention
from landmark_memory.training.data import read_text
from landmark_memory.uses.evidence import prompt_weights, token_attention
from landmark_memory.uses.question import Question, question_tokens, search_states
from landmark_memory.uses.retrievers import HeadsRetriever, ReaderRetriever

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "natural_questions_2.json"
FUSION = Path(__file__).resolve().parent / "fixtures" / "fusion_questions.json"  # (exp_search.py chooses on them)
SIZES = (8064, 32256)  # 128 and 512 blocks of 63


def load_model(name):
    """The ``LoadedModel`` of ``--model``."""
    if name == "landmark":
        return load_smollm2(str(ROOT / "landmark_memory/assets/smollm2-landmark"))
    if name == "base":
        return load_smollm2(None)
    from exp_families import load  # (the registry package's weights)

    from landmark_memory.models.hf.tokenizer import TextTokenizer

    model, tok = load()
    return LoadedModel(model, TextTokenizer(tok))


def questions(split=None):
    """The set's questions (each marked with its ``split``): the development half the package ships,
    then the evaluation half, then the development books' questions the fusion is chosen on
    (``FUSION``, split "fusion"); ``split``: one part only."""
    dev = json.loads((ROOT / "landmark_memory" / "samples" / "questions.json").read_text())["questions"]
    ev = json.loads(FIXTURE.read_text())["questions"]
    fusion = json.loads(FUSION.read_text())["questions"]
    qs = [{**q, "split": "dev"} for q in dev] + [{**q, "split": "eval"} for q in ev] + \
        [{**q, "split": "fusion"} for q in fusion]
    return [q for q in qs if split is None or q["split"] == split]


def prompt_of(tok, question):
    """(the prompt's ids less its last token, as ``ask``'s heads read them: a user turn of the chat
    template, else ``PLAIN_FRAME``; the question's own positions in it)."""
    prompt, _ = question_prompt(tok, question)
    enc = tok.encode(prompt)
    return enc.ids[:-1], question_tokens(enc.offsets[:-1], prompt, question)


def read_as(m, ids, own):
    """The question of the prompt ``ids`` (its own tokens at ``own``) read into the memory ``m``."""
    return Question("", m.n_blocks, own=tuple(own), read_ids=len(ids), states=search_states(m, ids))


@torch.no_grad()
def record_question(m, tok, q, reader):
    """The tensors ``record`` keeps of one question asked of the read-only memory ``m``."""
    m.rewind()
    ids, own = prompt_of(tok, q["question"])
    w = prompt_weights(own, len(ids))
    t0 = time.perf_counter()
    got = search_states(m, ids)
    n, s = m.n_blocks, m.shape
    heads = [(layer, h) for layer in range(s.n_layer) for h in range(s.n_kv_head)]
    blocks = torch.arange(n)
    tokens = token_attention(m, got, w, heads, blocks)  # (2, L*H_kv, n, bs)
    took = time.perf_counter() - t0
    landmarks = torch.stack([head_attention(qq[None, None], cos[None], sin[None], w[:, None],
                                            m.keys(layer, blocks)[None], m.backbone.scale)[:, 0]
                             for layer, (qq, _, cos, sin) in enumerate(got)], 1).flatten(1, 2)  # (2, L*H_kv, n)
    out = {"tokens": tokens.half(), "landmarks": landmarks}
    if reader is not None:
        m.rewind()
        out["reader"] = torch.tensor([v for _, v in sorted(ReaderRetriever(m, reader).rank(read_as(m, ids, own), n))])
    return out, took


PLANTED = ((8192, 4), (32768, 1))  # the retrieval suite's haystacks (``exp_reader.py``'s eval): length, count


def cases(args, tok):
    """What ``record`` and ``ask`` read: (key, ids, [(question, its evidence's token span)]) per
    memory: each book's first ``--sizes`` tokens with its questions whose evidence lies there, and
    with ``--planted`` the retrieval suite's haystacks (held-out books, ten planted facts each)."""
    if args.planted:
        held = held_out(args.books, tok)
        for n, count in PLANTED:
            for h in range(count):
                name, ids, facts = haystack(tok, held, n, h, 0)
                yield f"planted{h}-{n}", ids, [({"question": q, "words": words, "book": name, "split": "planted"}, span)
                                               for _, q, words, span in facts]
        return
    for book in args.only or sorted({q["book"] for q in questions()}):
        text = encode(tok, read_text(Path(args.books) / f"{book}.txt"))
        asked = [q for q in questions() if q["book"] == book]
        for n in args.sizes:
            spans = []
            for q in asked:
                try:
                    spans.append(evidence_span(tok, text[:n], q["evidence"]))
                except ValueError:  # its evidence lies past this memory's tokens
                    spans.append(None)
            yield f"{book}-{n}", text[:n], list(zip(asked, spans))


def memory_of(model, work, key, ids):
    """The saved memory of ``ids`` at ``WORK/MODEL/KEY/m``, read now unless an earlier run did."""
    folder = work / key
    if not (folder / "built").exists():
        t0 = time.perf_counter()
        shutil.rmtree(folder, ignore_errors=True)
        build(model, ids, folder / "m")
        (folder / "built").write_text(f"{time.perf_counter() - t0:.1f}\n")
        print(f"{key}: read in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder / "m"


def record(args):
    loaded = load_model(args.model)
    model, tok, reader = loaded.model, loaded.tokenizer, loaded.reader
    work = Path(args.work) / args.model
    (work / "rec").mkdir(parents=True, exist_ok=True)
    for key, ids, asked in cases(args, tok):
        with LandmarkMemory.open(memory_of(model, work, key, ids), model, readonly=True) as m:
            bs = m.shape.block_size
            for i, (q, span) in enumerate(asked):
                path = work / "rec" / f"{key}-{i}.safetensors"
                if span is None or path.exists() or (span[1] - 1) // bs >= m.n_blocks:
                    continue
                out, took = record_question(m, tok, q, reader)
                a, b = span
                meta = {"question": q["question"], "book": q["book"], "split": q["split"], "size": str(len(ids)),
                        "blocks": json.dumps(list(range(a // bs, (b - 1) // bs + 1))), "span": json.dumps([a, b]),
                        "token_seconds": f"{took:.3f}", "n_kv_head": str(m.shape.n_kv_head)}
                save_file(out, str(path), metadata=meta)
        print(f"{key}: every question of its tokens recorded", flush=True)


def records(work, model, split=None, size=None):
    """[(metadata, tensors)] of every recorded question of ``model`` (of ``split`` and ``size``)."""
    out = []
    for f in sorted((Path(work) / model / "rec").glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            meta = g.metadata()
            if (split is None or meta["split"] == split) and (size is None or int(meta["size"]) == size):
                out.append((meta, {k: g.get_tensor(k) for k in g.keys()}))
    return out


def heads_of(meta, tensors):
    """Every (memory layer, key/value head) in the order of a record's tensors."""
    n_kv = int(meta.get("n_kv_head", 3))
    return [(i // n_kv, i % n_kv) for i in range(tensors["tokens"].shape[1])]


def choose_step(args):
    """Heads chosen on the development books' 32K records (whole books, not the shipped excerpts),
    saved as ``WORK/MODEL/heads32k.json``: how far the shipped choice is from one made at 32K."""
    from landmark_memory.models.heads import EvidenceHeads, save_heads
    from landmark_memory.uses.choose_heads import choose

    dev = records(args.work, args.model, "dev", SIZES[-1])
    masses = [t["tokens"].float() for _, t in dev]
    golds = [json.loads(m["blocks"]) for m, _ in dev]
    chosen, how = choose(masses, golds, heads_of(*dev[0]))
    save_heads(EvidenceHeads(tuple(chosen)), Path(args.work) / args.model / "heads32k.json", chosen_by=how)
    print(f"{len(chosen)} heads chosen on {len(dev)} development questions: {chosen}\n{how}")


VARIANTS = {"landmark": ("stage9", "shipped", "heads"), "base": ("plain", "heads"), "gemma": ("plain", "heads")}


def variant_of(loaded, variant, heads):
    """``loaded`` asking as ``variant`` does: ``stage9`` (no reader, no heads), ``shipped`` (the
    question reader), ``plain`` (a model as published), ``heads`` (the retrieval heads)."""
    return replace(loaded, reader=loaded.reader if variant == "shipped" else None,
                   heads=heads if variant == "heads" else None)


def ask_step(args):
    """The questions (``--split``, or ``--planted``) asked through ``ask`` each way
    (``VARIANTS``) of the memories ``record`` read, each trial kept in ``WORK/MODEL/ask.json`` as
    soon as it is done."""
    from _common import Trials

    from landmark_memory.models.heads import load_heads
    from landmark_memory.uses.answer import ask

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    heads = load_heads(args.heads or Path(args.work) / args.model / "heads.json")
    state = Trials(Path(args.work) / args.model / "ask.json", args.command)
    work = Path(args.work) / args.model
    for key, ids, asked in cases(args, tok):
        asked = [(q, span) for q, span in asked if span is not None and (args.planted or q["split"] == args.split)]
        if not asked:
            continue
        with LandmarkMemory.open(memory_of(model, work, key, ids), model, readonly=True) as m:
            bs = m.shape.block_size
            for variant in VARIANTS[args.model][1:] if args.planted else VARIANTS[args.model]:  # (stage 9's: reader.md)
                asking = variant_of(loaded, variant, heads)
                cell = f"{variant}|{key}"
                for i, (q, (a, b)) in enumerate(asked):
                    if i < len(state.cell(cell)):
                        continue
                    m.rewind()
                    t0 = time.perf_counter()
                    got = ask(m, asking, q["question"], max_new_tokens=32, passages=5)
                    blocks = list(range(a // bs, (b - 1) // bs + 1))
                    state.add(cell, {"question": q["question"], "blocks": blocks, "seconds": time.perf_counter() - t0,
                                     "passages": [p.block for p in got.passages],
                                     "recall5": any(p.block in blocks for p in got.passages),
                                     "answer": got.text.strip(), "right": is_right(got.text, q["words"]),
                                     "quote": got.quote and got.quote.text,
                                     "quoted": bool(got.quote) and is_right(got.quote.text, q["words"])}, at=i)
                rows = state.cell(cell)
                print(f"{cell}: recall@5 {sum(r['recall5'] for r in rows)}/{len(rows)}, right "
                      f"{sum(r['right'] for r in rows)}, quoted {sum(r['quoted'] for r in rows)}", flush=True)


def heads_step(args):
    """The heads ``landmark-memory heads`` chooses (the development set the package ships), saved
    as ``WORK/MODEL/heads.json``: what ``ask`` reads with in the ``heads`` variant."""
    from landmark_memory.models.heads import save_heads
    from landmark_memory.uses.choose_heads import choose_heads, shipped_questions

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    t0 = time.perf_counter()
    heads, how = choose_heads(model, tok, *shipped_questions(), tokens=args.tokens)
    save_heads(heads, Path(args.work) / args.model / "heads.json", chosen_by=how,
               seconds=round(time.perf_counter() - t0))
    print(f"{len(heads.heads)} heads in {time.perf_counter() - t0:.0f} s: {heads.heads}\n{how}")


COST_BOOK = "345_dracula"


def cost_step(args):
    """What pointing costs per question, by memory size (``--sizes`` tokens of ``COST_BOOK``, e.g.
    ``8064,32256,129024``):
    the prompt read alone, then with the retrieval heads' token-level reading and quote
    (``retrievers.HeadsRetriever``) and with the shipped question reader (``ReaderRetriever``), the
    median over the book's evaluation
    questions, each after a warm-up; written to ``WORK/MODEL/cost.json``."""
    from landmark_memory.models.heads import load_heads

    loaded = load_model(args.model)
    model, tok, reader = loaded.model, loaded.tokenizer, loaded.reader
    heads = load_heads(args.heads or Path(args.work) / args.model / "heads.json")
    text = encode(tok, read_text(Path(args.books) / f"{COST_BOOK}.txt"))
    asked = [q for q in questions("eval") if q["book"] == COST_BOOK]
    out = {}
    for n in args.sizes:
        path = memory_of(model, Path(args.work) / args.model, f"{COST_BOOK}-{n}", text[:n])
        with LandmarkMemory.open(path, model, readonly=True) as m:
            nb, times = m.n_blocks, {"prompt": [], "heads": [], "reader": []}
            for i, q in enumerate([asked[0]] + asked):  # the first: a warm-up
                ids, own = prompt_of(tok, q["question"])
                for what in times:
                    if what == "reader" and reader is None:
                        continue
                    m.rewind()
                    t0 = time.perf_counter()
                    if what == "prompt":
                        search_states(m, ids)
                    elif what == "heads":
                        by_heads, asked_now = HeadsRetriever(m, tok, heads), read_as(m, ids, own)
                        best = by_heads.rank(asked_now, nb)[:heads.blocks]
                        by_heads.quotes(asked_now, [b for b, _ in best])
                    else:
                        ReaderRetriever(m, reader).rank(read_as(m, ids, own), 4)
                    if i:
                        times[what].append(time.perf_counter() - t0)
        out[n] = {k: float(np.median(v)) for k, v in times.items() if v}
        print(f"{n} tokens ({nb} blocks): " + ", ".join(f"{k} {v:.2f} s" for k, v in out[n].items()), flush=True)
        (Path(args.work) / args.model / "cost.json").write_text(json.dumps(out, indent=1) + "\n")  # (each size kept)


H59 = ((21, 2), (18, 2), (18, 0), (21, 0), (17, 0), (24, 1), (10, 1), (22, 1))  # issue 59's heads (heads.md)
MODELS = {"landmark": "SmolLM2 with the shipped landmark adapter (stage 9)",
          "base": "SmolLM2 as published, a training-free memory (mean keys)",
          "gemma": "Gemma 3 270M as published, a training-free memory (mean keys)"}
ASKED = {"stage9": "`ask` without reader or heads (stage 9)", "shipped": "`ask` through the question reader "
         "(issue 59's shipped policy)", "plain": "`ask` as published (no heads)",
         "heads": "`ask` through the retrieval heads (token level, 4 blocks read first)"}


def ranking_rows(work, model, split, size):
    """{variant: [rank of the evidence's block per question]} from ``record``'s tensors."""
    from landmark_memory.models.heads import load_heads
    from landmark_memory.uses.choose_heads import pooled_rank

    recs = records(work, model, split, size)
    if not recs:
        return {}
    every = heads_of(*recs[0])
    shipped = load_heads(Path(work) / model / "heads.json").heads
    sets = {"heads": shipped, "every head": every}
    if model == "landmark":
        sets["issue 59's 8 heads"] = H59
    at32 = Path(work) / model / "heads32k.json"
    if at32.exists():
        sets["heads chosen at 32K"] = load_heads(at32).heads
    out = {}
    for name, heads in sets.items():
        ix = [every.index(h) for h in heads]
        out[f"tokens: {name}"] = [pooled_rank(t["tokens"].float(), json.loads(m["blocks"]), ix) for m, t in recs]
        if name != "every head":
            out[f"block keys: {name}"] = [
                int(((lm := (t["landmarks"][0] - t["landmarks"][1])[ix].sum(0))
                     > lm[json.loads(m["blocks"])].max()).sum())
                + 1 for m, t in recs]
    if "reader" in recs[0][1]:
        out["the shipped question reader"] = [int((t["reader"] > t["reader"][json.loads(m["blocks"])].max()).sum()) + 1
                                              for m, t in recs]
    return out


def blocks_of(folder, cell_key):
    """The blocks of the memory ``ask``'s cell ``cell_key`` (variant|memory) was asked of."""
    return json.loads((folder / cell_key.split("|")[1] / "m" / "manifest.json").read_text())["blocks"]


def frac(v):
    return f"{sum(v)}/{len(v)} ({np.mean(v):.0%})" if v else "-"


def report(args):
    """``evidence.md`` (and ``evidence.json``, the summary ``exp_natural.py``'s report shows) from
    the records and ``ask``'s trials of every model run so far."""
    work, body, summary = Path(args.work), [], {}
    groups = [("eval", SIZES[0], "natural, 8K"), ("eval", SIZES[1], "natural, 32K"),
              ("planted", PLANTED[0][0], "planted, 8K"), ("planted", PLANTED[1][0], "planted, 32K")]
    commands = []
    for model in [m for m in MODELS if (work / m / "heads.json").exists()]:
        heads = json.loads((work / model / "heads.json").read_text())
        body += [f"## {MODELS[model]}", "",
                 f"Retrieval heads chosen by `landmark-memory heads` (the development set the package ships, "
                 f"{heads['chosen_by']['questions']} questions over the first {heads['chosen_by']['tokens']:,} tokens "
                 f"of three books): {len(heads['heads'])} (memory layer, key/value head) "
                 f"{', '.join(map(str, map(tuple, heads['heads'])))}; development recall@5 by heads pooled "
                 f"{heads['chosen_by']['recall@5']}.", ""]
        table = {g[2]: ranking_rows(work, model, g[0], g[1]) for g in groups}
        names = list(dict.fromkeys(k for t in table.values() for k in t))
        if names:  # (a model measured for its cost only has none)
            body += ["Ranking recall@5: the evidence's block among the 5 blocks each ranking puts first (the question "
                     "read as `ask` reads it; calibrated by the chat template's tokens, or the plain frame's where a "
                     "model has none).", "",
                     "| ranking | " + " | ".join(g[2] for g in groups) + " |", "|---|" + "---|" * len(groups)]
            for name in names:
                body.append(f"| {name} | " + " | ".join(frac([r <= 5 for r in table[g[2]].get(name, [])])
                                                        for g in groups) + " |")
            summary[model] = {"ranking": {g[2]: {k: [r <= 5 for r in v] for k, v in table[g[2]].items()}
                                          for g in groups}}
        state = work / model / "ask.json"
        if state.exists():
            cells = json.loads(state.read_text())
            commands += cells["commands"]
            body += ["", "`ask` (32 new tokens at most, greedy): recall@5, the evidence's block among the 5 passages "
                     "it reports; right, the answer holds the expected words; quoted, its quote holds them; seconds, "
                     "the median of a whole `ask` (reading the question, pointing, answering).", "",
                     "| `ask` | " + " | ".join(f"{g[2]}: recall@5 | right | quoted | s" for g in groups) + " |",
                     "|---|" + "---|---|---|---|" * len(groups)]
            for variant in VARIANTS[model]:
                row, summary.setdefault(model, {"ranking": {}}).setdefault("ask", {})[variant] = [], {}
                for split, n, label in groups:
                    rows = [r for k, v in cells["cells"].items() if k.startswith(f"{variant}|")
                            and k.endswith(f"-{n}") and k.split("|")[1].startswith("planted") == (split == "planted")
                            for r in v]
                    summary[model]["ask"][variant][label] = {x: [r[x] for r in rows] for x in ("recall5", "right",
                                                                                              "quoted")}
                    row += [frac([r["recall5"] for r in rows]), frac([r["right"] for r in rows]),
                            frac([r["quoted"] for r in rows]) if variant == "heads" else "-",
                            f"{np.median([r['seconds'] for r in rows]):.1f}" if rows else "-"]
                body.append(f"| {ASKED[variant]} | " + " | ".join(row) + " |")
            ends = [b in (0, blocks_of(work / model, k) - 1) for k, v in cells["cells"].items()
                    if k.startswith("heads|") for r in v for b in r["passages"][:4]]
            body += ["", f"The memory's first or last block among the 4 blocks the heads have every answer token "
                     f"read first: {frac(ends)} of them."]
        cost = work / model / "cost.json"
        if cost.exists():
            body += ["", f"What pointing costs per question (`exp_evidence.py cost`, {COST_BOOK}'s evaluation "
                     "questions, the median after a warm-up, 2 CPU cores): reading the prompt alone, and reading it "
                     "with the pointing (the heads read every stored token of up to 512 candidate blocks, chosen "
                     "past that by the same heads' block keys; the reader scores every block's key in every layer "
                     "it weighs).", "", "| memory tokens | prompt alone, s | with the heads, s | with the reader, s |",
                     "|---|---|---|---|"]
            for n, t in json.loads(cost.read_text()).items():
                body.append(f"| {int(n):,} | {t['prompt']:.2f} | {t['heads']:.2f} | "
                            + (f"{t['reader']:.2f} |" if "reader" in t else "- |"))
        body.append("")
    Path(args.results).mkdir(parents=True, exist_ok=True)
    kept = Path(args.results) / "evidence.json"  # every model's summary: those of WORK replace theirs
    summary = {**(json.loads(kept.read_text()) if kept.is_file() else {}), **summary}
    kept.write_text(json.dumps(summary) + "\n")
    write_result(args.out, "Evidence read by retrieval heads, token by token: natural and planted questions",
                 ["Evaluation books only (`fixtures/natural_questions_2.json`: Sherlock Holmes, The Wonderful Wizard "
                  "of Oz, Dracula); 8K: the questions whose evidence lies in a book's first 8,064 tokens, asked of a "
                  "memory of them; 32K: every question, asked of a memory of the first 32,256. Planted: the "
                  "retrieval suite's haystacks (held-out books, ten facts each; 4 at 8K, 1 at 32K). Heads, counts "
                  "and the quote's rule were chosen on the development books only.", "",
                  "The steps, for each model (`--model landmark`, `--model base`, `--model gemma`; the last two at 8K "
                  "only, `--sizes 8064`): `exp_evidence.py record --books $BOOKS --work WORK` (and `--planted`), "
                  "`heads --work WORK` (what `landmark-memory heads` runs), `choose --work WORK` (the heads a choice "
                  "at 32K on the development books' whole memories would make), `ask --books $BOOKS --work WORK` "
                  "(and `--planted`), `cost --books $BOOKS --work WORK --sizes 8064,32256,129024`, `report --work WORK "
                  "[--out NAME]` (the models of WORK, each in its section); the trials' commands are listed "
                  "above.", ""] + body,
                 results=args.results, commands=list(dict.fromkeys(commands)) or [args.command])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["record", "choose", "heads", "ask", "cost", "report"])
    ap.add_argument("--books")
    ap.add_argument("--work", required=True, help="memories and recorded attention (kept between runs)")
    ap.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--model", default="landmark", choices=["landmark", "base", "gemma"])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES),
                    help="memory sizes in tokens (default 8064,32256)")
    ap.add_argument("--only", nargs="*", help="these books only")
    ap.add_argument("--tokens", type=int, default=16128, help="heads: tokens of each development text read")
    ap.add_argument("--planted", action="store_true", help="the retrieval suite's planted facts instead")
    ap.add_argument("--split", default="eval", choices=["dev", "eval"], help="the questions ask asks (default eval)")
    ap.add_argument("--out", default="evidence", help="report: the results file's name (models of WORK only)")
    ap.add_argument("--heads", help="the retrieval heads ask reads with (default: WORK/MODEL/heads.json)")
    args = ap.parse_args(argv)
    args.command = command_line(argv)
    {"record": record, "choose": choose_step, "heads": heads_step, "ask": ask_step, "cost": cost_step,
     "report": report}[args.step](args)


if __name__ == "__main__":
    main()
