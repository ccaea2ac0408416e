"""Sessions that grow: what a turn costs after 10, 100 and 1,000 turns of about 100 tokens, and
whether a fact told in the first turns is still found, measured in one run.

    python experiments/bench_sessions.py --books BOOKS --work WORK                     # bundled and SmolLM2
    python experiments/bench_sessions.py --books BOOKS --work WORK --models bundled --checkpoints 10,100

Per model, a corpus is built once from a held-out book (``--corpus-tokens``, as ``landmark-memory
build`` builds it) into ``--work``. A session over it is told five facts (``_common.PLANTED_FACTS``),
one a turn, then filled with turns of about 80 tokens of another held-out book, each answered
(``--answer-tokens`` at most), in one process with the memory kept open, as a server keeps it.
At each checkpoint the five questions are asked, each a turn of its own, three times over: the
median time of a turn (``say``: following the corpus, reading the turn, answering, committing),
and of the first five, how many answers hold the fact and how often a passage the answer read
holds it. After the last checkpoint the
session is closed and opened again, and its first turn timed (the open included: a restart,
less loading the model and the corpus; five times, the median). Against it, SmolLM2 as published (full attention) reads
the whole conversation and the question in its own context and answers with transformers'
``DynamicCache``, where the conversation fits its 8,192 tokens; the bundled model has no
cache of its own and no such baseline.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PLANTED_FACTS, command_line, held_out_books, load_smollm2, machine, write_result  # noqa: E402

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer  # noqa: E402
from landmark_memory.models.hf.smollm2 import ADAPTER_DIR, LANDMARK  # noqa: E402
from landmark_memory.models.loaded import LoadedModel  # noqa: E402
from landmark_memory.uses.answer import say  # noqa: E402
from landmark_memory.uses.session import Session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FACTS = PLANTED_FACTS[:5]
CLOZES = ["The innkeeper's daughter was called", "The old clock in the church tower had stopped at",
          "Every Sunday the miller sold", "The notary kept his savings in", "The captain's parrot was named"]


def corpus(args, name, model_name, text_ids, tok) -> Path:
    """The corpus of ``name`` in the work folder, built by ``landmark-memory build`` once."""
    path = Path(args.work) / name / "corpus"
    if (path / "manifest.json").is_file():
        return path
    inputs = Path(args.work) / name / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    (inputs / "book.txt").write_text(tok.decode(text_ids[:args.corpus_tokens]))
    cmd = [sys.executable, "-m", "landmark_memory.app.entry", "build", str(path), "--input", str(inputs), "--quiet"]
    subprocess.run(cmd + (["--model", model_name] if model_name else []), check=True)
    return path


def fillers(tok, ids, n_tokens=80):
    """Endless turns of about ``n_tokens`` tokens of book text, cut at spaces."""
    at = 0
    while True:
        if at + n_tokens >= len(ids):
            at = 0
        text = tok.decode(ids[at:at + n_tokens])
        at += n_tokens
        yield text[text.find(" ") + 1:text.rfind(" ")].replace("\n", " ")


def timed_turn(session, loaded, text, options):
    t0 = time.perf_counter()
    a = say(session, loaded, text, **options)
    return time.perf_counter() - t0, a


def ask_facts(session, loaded, chat, options, rounds):
    """The five questions (clozes for a model without a chat template), a turn each, ``rounds``
    times: ``[(seconds, answer has the fact, a passage holds it, answer tokens)]``."""
    rows = []
    for (_, question, words), cloze in list(zip(FACTS, CLOZES)) * rounds:
        seconds, a = timed_turn(session, loaded, question if chat else cloze, options)
        rows.append((seconds, any(w.lower() in a.text.lower() for w in words),
                     any(any(w in p.text for w in words) for p in a.passages), len(a.tokens)))
    return rows


def full_attention_turn(base, tok, session, question, n_new):
    """Seconds for SmolLM2 as published to read the whole conversation and the question in its
    own context and answer (``generate`` with a ``DynamicCache``); None where it does not fit."""
    from transformers import DynamicCache

    mem = session.mem
    pending = mem.open_chunk().ids
    ids = mem.tokens(0, mem.attachment.base_blocks).tolist() + ([] if pending is None else pending[0].tolist())
    prompt = ids + tok.encode(tok.chat_text([{"role": "user", "content": question}], first=False, answer=True)).ids
    if len(prompt) + n_new > base.config.max_position_embeddings:
        return None, len(prompt)
    t0 = time.perf_counter()
    with torch.no_grad():
        base.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                      past_key_values=DynamicCache(), pad_token_id=tok.hf.eos_token_id)
    return time.perf_counter() - t0, len(prompt)


def run_model(args, name):
    smol = name == "smollm2"
    loaded = load_smollm2(ADAPTER_DIR) if smol else LoadedModel(LandmarkGPT.from_pretrained(), load_tokenizer())
    model, tok = loaded.model, loaded.tokenizer
    books = held_out_books(args.books)  # (bundled tokenizer ids: the text is decoded again below)
    btok = load_tokenizer()
    book_a, book_b = list(books[0][1]), list(books[1][1])
    path = corpus(args, name, LANDMARK if smol else None, book_a, btok)
    filler_ids = tok.encode(btok.decode(book_b[:200_000])).ids
    options = dict(raw=not smol, max_new_tokens=args.answer_tokens, passages=5)
    base = load_smollm2(None).model if smol else None
    folder = path / "sessions" / "bench"
    if folder.exists():
        shutil.rmtree(folder)
    rows, turns, filler = [], 0, fillers(tok, filler_ids)
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        session = Session.open(mem, "bench")
        for fact, _, _ in FACTS:
            say(session, loaded, f"Remember this: {fact}" if smol else fact, **options)
            turns += 1
        for checkpoint in args.checkpoints:
            while turns < checkpoint:
                say(session, loaded, next(filler), **options)
                turns += 1
                if turns % 50 == 0:
                    print(f"{name}: {turns} turns, {session.n_tokens:,} session tokens", flush=True)
            facts = ask_facts(session, loaded, smol, options, args.rounds)
            full = full_attention_turn(base, tok, session, FACTS[0][1], args.answer_tokens) if smol else (None, 0)
            rows.append({"turns": checkpoint, "tokens": session.n_tokens, "facts": facts, "full": full})
            turns += len(facts)
            print(f"{name} @ {checkpoint}: {rows[-1]}", flush=True)
        resumed = []
        for _ in range(args.resumes):  # closed and opened again: a restart, but for loading the model and corpus
            session.close()
            t0 = time.perf_counter()
            session = Session.open(mem, "bench")
            timed_turn(session, loaded, FACTS[0][1] if smol else CLOZES[0], options)
            resumed.append(time.perf_counter() - t0)
        session.close()
    return rows, statistics.median(resumed)


def table(name, run):
    """The markdown of one model's run (as ``sessions.json`` keeps it)."""
    rows, resumed, answer_tokens, resumes = run["rows"], run["resumed"], run["answer_tokens"], run.get("resumes", 1)
    first, n = statistics.median(r[0] for r in rows[0]["facts"]), len(rows[0]["facts"])
    out = [f"## {name}", "", f"`{run['command']}`, {run['date']}", "",
           f"| turns before | session tokens | turn (median of {n}) | vs the first row | answer tokens (mean) | "
           "answers with the fact | a passage holds it | full attention: prompt tokens | full attention: turn | "
           "memory / full |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = statistics.median(f[0] for f in r["facts"])
        full, prompt = r["full"]
        out.append(f"| {r['turns']:,} | {r['tokens']:,} | {t:.3f} s | {t / first:.2f}x | "
                   f"{statistics.mean(f[3] for f in r['facts']):.1f} | {sum(f[1] for f in r['facts'][:5])}/5 | "
                   f"{sum(f[2] for f in r['facts'][:5])}/5 | "
                   + (f"{prompt:,} | {full:.3f} s | {t / full:.2f}x |" if full else
                      f"{prompt:,} | does not fit |  |" if prompt else "no baseline |  |  |"))
    last = statistics.median(f[0] for f in rows[-1]["facts"])
    repeats = f"the median of {resumes}" if resumes > 1 else "once"
    out += ["", f"Resumed after the last row (session closed and opened again, the open included; {repeats}): "
                f"first turn {resumed:.3f} s, {resumed / last:.2f}x a turn of the session that never "
                f"stopped. Answers of at most {answer_tokens} tokens.", ""]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus (held-out books are read from it)")
    ap.add_argument("--work", required=True, help="a folder for the corpora (kept: a later run builds nothing)")
    ap.add_argument("--models", default="bundled,smollm2",
                    help="bundled, smollm2 or both (default both; '' writes the report again from the runs kept)")
    ap.add_argument("--checkpoints", default="10,100,1000",
                    type=lambda s: sorted(int(x) for x in s.split(",")), help="turns before each measurement")
    ap.add_argument("--corpus-tokens", type=int, default=20_000, help="tokens of the corpus (default 20,000)")
    ap.add_argument("--answer-tokens", type=int, default=16, help="the most tokens of an answer (default 16)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times the five questions are asked at each checkpoint (timed; the first round counts "
                         "the facts found; default 3)")
    ap.add_argument("--resumes", type=int, default=5, help="times the session is closed, opened and asked at the "
                    "end (the median is reported; default 5)")
    ap.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    args = ap.parse_args()
    models = [name for name in args.models.split(",") if name]  # (none: the report written again from the runs kept)
    started, runs = time.time() if models else None, Path(args.results) / "sessions.json"
    done = json.loads(runs.read_text()) if runs.is_file() else {}  # each model's last run: one can run again alone
    for name in models:
        rows, resumed = run_model(args, name)
        done[name] = {"rows": rows, "resumed": resumed, "resumes": args.resumes, "answer_tokens": args.answer_tokens,
                      "command": command_line(), "date": time.strftime("%Y-%m-%d")}
        runs.write_text(json.dumps(done, indent=1) + "\n")
    body = []
    for name, run in done.items():
        body += table(name, run)
    body += [f"Machine: {machine()}. Each turn of the filler is about 80 tokens of a held-out book and an "
             "answer; a measured turn is one of the five questions, the answer's passages 5."]
    write_result("sessions", "Sessions: the cost of a turn as a conversation grows", body, args.results,
                 started=started, commands=sorted({run["command"] for run in done.values()}))


if __name__ == "__main__":
    main()
