"""Retrieval heads, training-free: which (layer, key/value head) of the landmark adapter finds a
question's evidence by the question's own landmark scores, and how well blocks ranked by those
heads alone are found (QRHead, arXiv 2506.09944; retrieval heads, arXiv 2404.15574).

    python experiments/exp_heads.py --books BOOKS                 # development, then the suite's 8K and 32K
    python experiments/exp_heads.py --report                      # heads.md from the state

``dev``: ``--dev-haystacks`` stretches of 8K tokens of the books the adapter was trained on, each
with the ten ``DEV_FACTS`` planted (other shapes and wordings than the suite's). Each question is
read as ``ask`` reads it (the chat template) after the memory (read at the defaults); for every
(layer, key/value head), each of the question's own tokens scores every memory block by its
landmark key at stingy's slot 0 (the same distance for every block: what the index searches), a
softmax over the blocks gives its attention, averaged over the question's tokens and the head's
query heads; the same for a content-free question (``NULL``) is subtracted (the calibration of
QRHead and ICR). A head is scored by how often the fact's block ranks first (then by the mean
reciprocal rank). How many of the best heads to pool (``COUNTS``) is chosen on the development
questions too, by recall@5.

``eval``: the retrieval suite's haystacks (``exp_retrieval.py``'s, same seeds: held-out books,
its ten facts) at ``--lengths``; for each question, recall@5 of the fact's block ranked by the
chosen heads, by every head pooled (the same calibration), and by ``ask`` as it is today (its
five passages: the shipped adapter's policy), measured in the same run on the same memory.
Every trial is kept in ``--state`` as soon as it is done.
"""

import tempfile
import time
from pathlib import Path

import numpy as np
from _attention import NULL, block_attention, pooled_rank, rank_of
from _common import ADAPTER, ROOT, Trials, load_smollm2, plt, suite_main, write_result
from _texts import build, haystack, held_out, is_right

from landmark_memory.jobs.build import encode
from landmark_memory.jobs.evaluate import parse_lengths
from landmark_memory.memory import LandmarkMemory
from landmark_memory.training.data import list_text_files, read_text, split_books
from landmark_memory.uses.answer import ask

DEV_FACTS = [
    ("The baker's youngest son was named Theodore Quill.", "What was the name of the baker's youngest son?",
     ["Theodore"]),
    ("The carriage from Dover always arrived at half past nine.", "When did the carriage from Dover arrive?",
     ["half past nine"]),
    ("The squire owned exactly forty-two sheep.", "How many sheep did the squire own?", ["forty-two"]),
    ("The vicar buried the silver candlesticks beneath the old yew tree.",
     "Where were the silver candlesticks buried?", ["yew"]),
    ("The governess came from a small town called Ashbury.", "Which town did the governess come from?",
     ["Ashbury"]),
    ("The tailor's shop was painted a deep shade of green.", "What colour was the tailor's shop?", ["green"]),
    ("The sailor's dog was a spaniel named Pepper.", "What was the sailor's dog called?", ["Pepper"]),
    ("The doctor's journey to London took nine days.", "How long did the doctor's journey to London take?",
     ["nine days"]),
    ("The mayor's wife grew purple tulips in her front garden.", "What flowers did the mayor's wife grow?",
     ["tulips"]),
    ("The old soldier kept his medals in a leather pouch.", "Where did the old soldier keep his medals?",
     ["pouch"])]
COUNTS = (1, 2, 4, 8, 16, 32)  # heads pooled, chosen among on the development questions
DEV_SEED = 1000  # development haystacks draw apart from the suite's
ASK_NEW = 16  # answer tokens of today's ``ask`` (exp_retrieval.py's)


def trained_books(books, tok):
    """[(name, path, token ids)] of the books the adapter was fine-tuned on (never the suite's)."""
    train, _ = split_books(list_text_files([books]))
    return [(f.stem, f, encode(tok, read_text(f))) for f in train]


def haystack_rows(loaded, ids, facts, folder, order=None):
    """One row per fact in memory and the calibrated attention (n_layer, H_kv, n_blocks) of
    each: the rank of the fact's block per head; given the development ``order`` of the heads,
    its rank by the best ``COUNTS`` of them pooled and by every head pooled, and today's ``ask``
    (its five passages, its answer)."""
    model, tok = loaded.model, loaded.tokenizer
    bs = model.config.landmark_block_size
    n_blocks = build(model, ids, folder)
    rows, attention = [], []
    with LandmarkMemory.open(folder, model, readonly=True) as m:
        null = block_attention(m, tok, NULL, n_blocks)
        for _, question, words, (a, b) in facts:
            blocks = list(range(a // bs, (b - 1) // bs + 1))
            if max(blocks) >= n_blocks:  # in the open chunk after the memory's last block
                continue
            att = block_attention(m, tok, question, n_blocks) - null  # (n_layer, H_kv, n)
            row = {"question": question, "blocks": blocks, "n_blocks": n_blocks,
                   "head_ranks": [[rank_of(a_h, blocks) for a_h in a_l] for a_l in att]}
            if order is not None:
                m.rewind()
                got = ask(m, loaded, question, max_new_tokens=ASK_NEW, passages=5)
                row |= {"ranks": {str(c): pooled_rank(att, order[:c], blocks) for c in COUNTS},
                        "every_rank": rank_of(att.sum((0, 1)), blocks),
                        "ask_recall5": any(p.block in blocks for p in got.passages), "ask_answer": got.text.strip(),
                        "ask_right": is_right(got.text, words)}
            rows.append(row)
            attention.append(att)
    return rows, attention


def head_table(rows):
    """Per (layer, head): the share of rows whose fact's block it ranks first, and the mean
    reciprocal rank, float (n_layer, n_kv) each."""
    r = np.array([row["head_ranks"] for row in rows], float)  # (N, n_layer, n_kv)
    return (r == 1).mean(0), (1 / r).mean(0)


def best_heads(rows):
    """[(layer, head)] every head, the best for the development ``rows`` first."""
    top1, mrr = head_table(rows)
    return sorted(np.ndindex(top1.shape), key=lambda lh: (-top1[lh], -mrr[lh]))


def run(args):
    state = Trials(args.state, args.command)
    loaded = load_smollm2(args.adapter)
    tok = loaded.tokenizer
    if not state.cell("heads"):  # the development questions, then the heads they choose
        books, rows, attention = trained_books(args.books, tok), [], []
        for h in range(args.dev_haystacks):
            name, ids, planted = haystack(tok, books, 8192, h, DEV_SEED, DEV_FACTS)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                got, att = haystack_rows(loaded, ids, planted, Path(tmp) / "m")
            rows += [{"haystack": h, "book": name, **r} for r in got]
            attention += att
            print(f"dev haystack {h}: {name}, {len(got)} questions in {time.perf_counter() - t0:.0f} s", flush=True)
        order = [tuple(map(int, lh)) for lh in best_heads(rows)]
        recall = {c: float(np.mean([pooled_rank(a, order[:c], r["blocks"]) <= 5 for a, r in zip(attention, rows)]))
                  for c in COUNTS}
        for i, row in enumerate(rows):
            state.add("dev|8192", row, at=i)
        state.add("heads", {"order": order, "dev_recall5": recall,
                            "count": max(COUNTS, key=lambda c: (recall[c], -c))}, at=0)
    order = [tuple(lh) for lh in state.cell("heads")[0]["order"]]
    books = held_out(args.books, tok)
    for n in parse_lengths(args.lengths):
        for h in range(args.haystacks):
            key = f"eval|{n}|{h}"
            if state.cell(key):
                continue
            name, ids, planted = haystack(tok, books, n, h, args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                rows, _ = haystack_rows(loaded, ids, planted, Path(tmp) / "m", order)
            for i, row in enumerate(rows):
                state.add(key, {"haystack": h, "book": name, **row}, at=i)
            print(f"{key}: {name}, {len(rows)} questions in {time.perf_counter() - t0:.0f} s", flush=True)


def report(args):
    trials = Trials(args.state)
    cells = trials.cells
    if not cells.get("heads"):
        return
    heads, dev = cells["heads"][0], cells["dev|8192"]
    order, count, dev_recall = [tuple(lh) for lh in heads["order"]], heads["count"], heads["dev_recall5"]
    top1, mrr = head_table(dev)
    lengths = sorted({int(k.split("|")[1]) for k in cells if k.startswith("eval|")})
    body = [f"Development: {len(dev)} questions ({len({r['haystack'] for r in dev})} haystacks of 8K tokens of books "
            "the adapter was trained on, ten facts of other shapes and wordings than the suite's). Heads ranked by "
            "how often the question's own tokens rank the fact's block first by calibrated landmark attention; "
            f"heads pooled, chosen by development recall@5: {count} ("
            + ", ".join(f"{c}: {dev_recall[str(c)]:.0%}" for c in COUNTS) + ").", "",
            "The best heads on the development questions (layer, key/value head: fact's block first, mean "
            "reciprocal rank): "
            + ", ".join(f"({layer}, {h}) {top1[layer, h]:.0%} {mrr[layer, h]:.2f}" for layer, h in order[:8]) + ".",
            "", "Evaluation: the retrieval suite's haystacks (held-out books, its ten facts, its seeds). recall@5: the "
            "fact's block among the 5 blocks ranked first by the heads' calibrated attention pooled; today's `ask`: "
            "its five passages (the shipped adapter's policy: centred, the deeper half of the layers) and whether "
            "its answer holds the fact's words, on the same memory in the same run.", "",
            "| length | questions | " + " | ".join(f"{c} heads" for c in COUNTS)
            + " | every head | today's ask | ask right |", "|---|---|" + "---|" * (len(COUNTS) + 3)]
    got = {}
    for n in lengths:
        rows = [r for k, rs in cells.items() if k.startswith(f"eval|{n}|") for r in rs]
        by_count = {c: float(np.mean([r["ranks"][str(c)] <= 5 for r in rows])) for c in COUNTS}
        today = float(np.mean([r["ask_recall5"] for r in rows]))
        got[n] = by_count, today
        body.append(f"| {n // 1024}K | {len(rows)} | " + " | ".join(
            f"**{by_count[c]:.0%}**" if c == count else f"{by_count[c]:.0%}" for c in COUNTS)
            + f" | {np.mean([r['every_rank'] <= 5 for r in rows]):.0%} | {today:.0%} | "
            f"{np.mean([r['ask_right'] for r in rows]):.0%} |")
    if got:
        pyplot = plt()
        fig, axes = pyplot.subplots(1, 2, figsize=(11, 3.6))
        im = axes[0].imshow(top1.T, aspect="auto", cmap="viridis")
        axes[0].set_xlabel("layer")
        axes[0].set_ylabel("key/value head")
        axes[0].set_title("development: the fact's block ranked first", fontsize=9)
        fig.colorbar(im, ax=axes[0])
        for n, (by_count, today) in got.items():
            line = axes[1].plot(COUNTS, [by_count[c] for c in COUNTS], marker="o", label=f"{n // 1024}K heads")[0]
            axes[1].axhline(today, ls="--", color=line.get_color(), lw=0.8, label=f"{n // 1024}K today's ask")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("best development heads pooled")
        axes[1].set_ylabel("evaluation recall@5")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(args.results) / "heads.png", dpi=110)
        body += ["", "![heads on the development questions, and recall@5 by heads pooled](heads.png)", ""]
    write_result("heads", "Retrieval heads, training-free: the question's own landmark attention", body,
                 results=args.results, commands=trials.commands)


def options(ap):
    ap.add_argument("--adapter", default=str(ROOT / ADAPTER.partition("=")[2]),
                    help="the LoRA landmark adapter (default: the shipped one)")
    ap.add_argument("--dev-haystacks", type=int, default=4, help="development haystacks of 8K tokens, ten facts each")
    ap.add_argument("--haystacks", type=int, default=4, help="evaluation haystacks per length, ten facts each")


def main(argv=None):
    suite_main(__doc__, "heads", "8k,32k", run, report, argv, extra=options)


if __name__ == "__main__":
    main()
