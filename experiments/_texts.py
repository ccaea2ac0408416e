"""Trial texts the experiment scripts share: the held-out books, book text as passkey filler,
facts planted in book text and asked as ``ask`` asks, and how an answer is judged."""

import random
import time
from dataclasses import dataclass

import torch
from _common import PLANTED_FACTS, sentence_end

from landmark_memory.jobs.build import encode
from landmark_memory.memory import LandmarkMemory
from landmark_memory.training.data import list_text_files, read_text, split_books
from landmark_memory.uses.answer import ask


def held_out(books, tok):
    """[(name, path, token ids)] of the books the fine-tuning held out (its default split)."""
    _, val = split_books(list_text_files([books]))
    return [(f.stem, f, encode(tok, read_text(f))) for f in val]


ASK_NEW = 32  # tokens an answer may take


def trial_rng(seed, part, n, i):
    """Trial ``i`` of ``part`` at ``n`` tokens draws from this, whichever adapter reads it."""
    return random.Random(f"{seed}|{part}|{n}|{i}")


def book_filler(ids, start):
    """``filler(n)`` for ``PasskeyPrompts.prompt``: consecutive book tokens from ``start``, each
    call going on where the last one stopped."""
    at = [start]

    def filler(n):
        out = ids[at[0]:at[0] + n]
        at[0] += n
        return list(out)

    return filler


def planted(tok, ids, n, sentence, depth):
    """``n`` tokens of book text ``ids`` with ``sentence`` after the first full stop at or past
    ``depth`` of the way; (the ids, the sentence's token span [start, end))."""
    fact = tok.encode(" " + sentence).ids
    hay = list(ids[:n - len(fact)])
    cut = sentence_end(tok, hay, round(depth * len(hay)))
    return hay[:cut] + fact + hay[cut:], (cut, cut + len(fact))


@dataclass(frozen=True)
class AskCase:
    """An ``ask`` trial: the memory's text ``ids`` (a held-out book's, the fact planted at token
    span ``fact``), the fact's question and the words a right answer holds."""

    book: str
    depth: float
    ids: list[int]
    fact: tuple[int, int]
    question: str
    words: list[str]


def ask_case(tok, books, n, rng) -> AskCase:
    name, _, ids = books[rng.randrange(len(books))]
    sentence, question, words = PLANTED_FACTS[rng.randrange(len(PLANTED_FACTS))]
    depth, start = rng.random(), rng.randrange(0, len(ids) - n)
    text, span = planted(tok, ids[start:start + n], n, sentence, depth)
    return AskCase(name, round(depth, 3), text, span, question, words)


FACTS = PLANTED_FACTS + [
    ("The blacksmith's grey mare was called Juniper.", "What was the blacksmith's mare called?", ["Juniper"]),
    ("The schoolmaster hid the key to the cellar inside a green teapot.",
     "Where did the schoolmaster hide the key to the cellar?", ["teapot"]),
    ("The widow's cottage had exactly seventeen windows.", "How many windows did the widow's cottage have?",
     ["seventeen"]),
    ("The fisherman's favourite song was called The Silver Herring.", "What was the fisherman's favourite song called?",
     ["Silver Herring"])]


def haystack(tok, books, n, h, seed, facts=None):
    """Haystack ``h`` at ``n`` tokens: (book, ids, [(fact, question, words, span)]) with
    ``facts`` (default ``FACTS``; in a random order) after a random full stop in each of as many
    equal parts of the text."""
    rng = random.Random(f"{seed}|haystack|{n}|{h}")
    name, _, ids = books[rng.randrange(len(books))]
    facts = rng.sample(facts or FACTS, len(facts or FACTS))
    planted = [tok.encode(" " + s).ids for s, _, _ in facts]
    start = rng.randrange(0, len(ids) - n)
    hay = list(ids[start:start + n - sum(map(len, planted))])
    out, spans, last, tenth = [], [], 0, len(hay) / len(facts)
    for i, fact in enumerate(planted):
        cut = sentence_end(tok, hay, int(tenth * (i + rng.uniform(0.05, 0.95))))
        out += hay[last:cut]
        spans.append((len(out), len(out) + len(fact)))
        out += fact
        last = cut
    out += hay[last:]
    return name, out, [(*f, span) for f, span in zip(facts, spans)]


def build(model, ids, folder, **options):
    """The haystack read into a saved memory at the defaults (and ``options``); its block count."""
    with LandmarkMemory(model, path=folder, store="lmdb", **options) as mem:
        mem.forward(torch.tensor([ids]), logits="none")
        mem.commit()
        return mem.n_blocks


def build_timed(model, ids, folder, what, **options):
    """``build``, saying how long reading ``what`` (a haystack, in words) took; its block count."""
    t0 = time.perf_counter()
    n_blocks = build(model, ids, folder, **options)
    print(f"{what}: {n_blocks} blocks read in {time.perf_counter() - t0:.0f} s", flush=True)
    return n_blocks


def is_right(answer, words):
    """Whether ``answer`` holds every one of ``words`` (any case)."""
    return all(w.lower() in answer.lower() for w in words)


@torch.no_grad()
def ask_in_memory(loaded, case, passages=3, memory=None):
    """``case``'s question asked of a fresh memory of its text (``memory``: its ``MemoryOptions``,
    None for the defaults): (the ``Answer`` with its ``passages`` most read, every block
    it read for None; the blocks the memory held before the question)."""
    model = loaded.model
    with LandmarkMemory(model, memory) as mem:
        mem.forward(torch.tensor([case.ids]), logits="none")
        n_blocks = mem.n_blocks
        return ask(mem, loaded, case.question, max_new_tokens=ASK_NEW,
                   passages=n_blocks if passages is None else passages), n_blocks
