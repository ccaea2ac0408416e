"""SmolLM2 landmark adapters side by side on the same trials in books the fine-tuning never saw:
a pass key in book text through memory, and `ask` answering a fact planted in a book memory.

    python experiments/exp_realtext.py --books BOOKS --adapters stage4=ASSET,stage5=out/smollm2-stage5
    python experiments/exp_realtext.py --books BOOKS --adapters ... --parts ask --lengths 8k,32k --trials 10
    python experiments/exp_realtext.py --report                       # realtext.md from what ran

``passkey``: the paper's prompt with its filler replaced by consecutive text of a held-out book
(a random book, offset, depth and key per trial), read through a fresh memory at its defaults
(top-k 4, stingy positions; ``--top-k`` retrieves more blocks per query) and continued greedily;
right when the first integer is the key.

``ask``: consecutive text of a held-out book with one planted fact (``_common.PLANTED_FACTS``)
after a sentence at a random depth, read into a fresh memory as the passkey's; the fact's
question asked as ``ask`` asks it (the chat template); right when the answer holds the fact's
words.

``ppl``: perplexity in sequence (no memory) over ``--ppl-tokens`` of the held-out books in 2K
segments, for each adapter and for the base model, which it must stay within 5% of.

The baseline, ``base in context``: SmolLM2 without an adapter reads the same passkey and ``ask``
trials up to 8K in its own context, the whole prompt at once: for ``ask`` the text followed by the
same chat turn that ``ask`` feeds a memory, less the text's first tokens where the two overflow
its 8,192 positions (about 40 tokens at 8K, so a fact planted in them, at depth 0.005 or less,
is lost).

Each adapter (``name=folder``; the shipped one is ``landmark_memory/assets/smollm2-landmark``)
reads the same trials: they are drawn from ``--seed``, the part, the length and the trial's
number only; a run with ``--top-k K`` files its trials apart, under the adapter's name followed
by ``(top-k K)``. Every trial is kept in ``--state`` as soon as it is done, so a run resumes and
later runs add trials; ``--report`` writes realtext.md from the state.
"""

import time

import torch
from _common import (
    ADAPTER,
    BASE,
    BASE_WINDOW,
    Trials,
    adapter_specs,
    books_perplexity,
    load_smollm2,
    some_of,
    suite_main,
    top_k_label,
    top_k_memory,
    top_k_option,
    write_result,
)
from _texts import ASK_NEW, ask_case, ask_in_memory, book_filler, held_out, is_right, trial_rng

from landmark_memory.core.passkey import MAX_KEY, PasskeyPrompts, first_int
from landmark_memory.jobs.evaluate import greedy_continuation, parse_lengths

PARTS = ("passkey", "ask", "ppl")
PPL_LENGTH = 2048  # the in-sequence perplexity's segments


def passkey_trial(loaded, books, n, rng, memory):
    model, tok = loaded.model, loaded.tokenizer
    name, _, ids = books[rng.randrange(len(books))]
    prompts = PasskeyPrompts(tok)
    key, depth = rng.randint(1, MAX_KEY), rng.random()
    start = rng.randrange(0, len(ids) - n)
    prompt = prompts.prompt(n, key, depth, book_filler(ids, start))
    got = first_int(tok.decode(greedy_continuation(model, prompt, 8, memory=memory)))
    return {"book": name, "depth": round(depth, 3), "want": str(key), "answer": str(got), "right": got == key}


@torch.no_grad()
def ask_in_context(model, tok, case) -> str:
    """``case``'s answer from a model reading it whole in its own context: the tokens ``ask``
    feeds a memory (the text, then the question as a chat turn where the model has a chat
    template), the text's first ones dropped where they overflow the base model's window; the
    answer ends at an end-of-turn token."""
    chat = tok.chat_prompt(case.question)
    ids = (case.ids + tok.encode(chat or case.question).ids)[-BASE_WINDOW:]
    new, stops = greedy_continuation(model, ids, ASK_NEW), set(tok.end_of_turn_ids if chat else ())
    return tok.decode(new[:next((i for i, t in enumerate(new) if t in stops), len(new))])


def ask_trial(loaded, books, n, rng, memory):
    """``memory``: a memory's ``MemoryOptions``, or None for the model's own context."""
    model, tok = loaded.model, loaded.tokenizer
    case = ask_case(tok, books, n, rng)
    got = (ask_in_context(model, tok, case) if memory is None
           else ask_in_memory(loaded, case, memory=memory)[0].text).strip()
    return {"book": case.book, "depth": case.depth, "want": " / ".join(case.words), "answer": got,
            "right": is_right(got, case.words)}


def ppl_cell(model, books, n_tokens):
    """In-sequence perplexity over ``n_tokens`` of the held-out books in 2K segments."""
    ppl, count = books_perplexity(model, [(name, ids) for name, _, ids in books], PPL_LENGTH, n_tokens)
    return {"perplexity": round(ppl, 3), "tokens": count}


def run(args):
    state, lengths = Trials(args.state, args.command), parse_lengths(args.lengths)
    trial, parts = {"passkey": passkey_trial, "ask": ask_trial}, [p for p in args.parts if p != "ppl"]
    for label, folder in adapter_specs(args.adapters) + [("base", None)]:
        # the base model reads each prompt in its own context, up to its window
        shown, memory = (BASE, None) if folder is None else (top_k_label(label, args.top_k), top_k_memory(args.top_k))
        cells = [(part, n) for part in parts for n in lengths if folder is not None or n <= BASE_WINDOW]
        ppl = "ppl" in args.parts and not state.cell(f"{label}|ppl|{PPL_LENGTH}")
        if not ppl and all(len(state.cell(f"{shown}|{part}|{n}")) >= args.trials for part, n in cells):
            continue
        loaded = load_smollm2(folder)
        model, tok = loaded.model, loaded.tokenizer
        books = held_out(args.books, tok)
        if ppl:
            state.add(f"{label}|ppl|{PPL_LENGTH}", ppl_cell(model, books, args.ppl_tokens), at=0)
        for part, n in cells:
            def timed(i):
                t0 = time.perf_counter()
                row = trial[part](loaded, books, n, trial_rng(args.seed, part, n, i), memory)
                return {**row, "seconds": round(time.perf_counter() - t0, 1)}

            for i, row in state.fill(f"{shown}|{part}|{n}", args.trials, timed):
                print(f"{shown} {part} @{n} trial {i}: {'right' if row['right'] else 'wrong'} "
                      f"(want {row['want']}, got {row['answer'][:60]!r})", flush=True)
        model = None  # freed before the next one loads


def report(args):
    state = Trials(args.state)
    cells = state.cells
    labels = list(dict.fromkeys(k.split("|")[0] for k in cells))
    lengths = sorted({int(k.split("|")[2]) for k in cells if "|ppl|" not in k})
    body = ["Books the fine-tuning never saw (the default split's held-out books). Each cell: right / trials; every "
            "model read the same trials (drawn from the seed, the part, the length and the trial's number). An "
            f"adapter reads through memory; {BASE}: SmolLM2 without one, each prompt whole in its own context (up "
            f"to its {BASE_WINDOW // 1024}K window).", "",
            "| part | model | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
            "|---|---|" + "---|" * len(lengths)]
    for part in PARTS[:2]:
        for label in labels:
            row = []
            for n in lengths:
                got = cells.get(f"{label}|{part}|{n}", [])
                row.append(f"{sum(g['right'] for g in got)}/{len(got)}" if got else "-")
            if any(r != "-" for r in row):
                body.append(f"| {part} | {label} | " + " | ".join(row) + " |")
    key = f"|ppl|{PPL_LENGTH}"
    ppl = {label: cells[label + key][0] for label in labels if cells.get(label + key)}
    if ppl:
        base = ppl.get("base", {}).get("perplexity")
        body += ["", f"Perplexity in sequence (no memory), 2K segments of the held-out books, "
                     f"{next(iter(ppl.values()))['tokens']:,} tokens: "
                 + ", ".join(f"{label} {p['perplexity']:.2f}" + (f" ({p['perplexity'] / base - 1:+.1%} on base)"
                                                                  if base and label != "base" else "")
                             for label, p in ppl.items()) + "."]
    body += ["", "Wrong answers (the first 60 characters):", ""]
    for key, rows in cells.items():
        if "|ppl|" in key:
            continue
        wrong = [f"{r['answer'][:60]!r} for {r['want']}" for r in rows if not r["right"]]
        if wrong:
            body.append(f"- {key.replace('|', ', ')}: " + "; ".join(wrong))
    write_result("realtext", "SmolLM2 adapters on real text: book-text passkey and `ask`", body, results=args.results,
                 commands=state.commands)


def options(ap):
    ap.add_argument("--adapters", default=ADAPTER,
                    help="comma-separated name=folder of LoRA landmark adapters (default: the shipped one)")
    ap.add_argument("--parts", type=some_of(PARTS), default=list(PARTS), help=f"some of {','.join(PARTS)} (default: "
                                                                              "all)")
    ap.add_argument("--ppl-tokens", type=int, default=12288, help="tokens of the in-sequence perplexity "
                                                                  "(shared out over the held-out books)")
    top_k_option(ap, "passkey and ask")


def main(argv=None):
    suite_main(__doc__, "realtext", "8k,16k,32k", run, report, argv, extra=options)


if __name__ == "__main__":
    main()
