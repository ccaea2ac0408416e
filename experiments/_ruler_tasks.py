"""The RULER-style tasks (single needle, several keys or values, variable tracking, a question
on a planted fact) over held-out book text: each trial's prompt drawn from the seed, the task,
the length and the trial's number only, the same for every model and script that reads it."""

import random
from dataclasses import dataclass

from _common import PLANTED_FACTS

TASKS = ("single", "multikey", "multivalue", "multiquery", "vartrack", "qa")


WORDS = ("amber", "brisk", "cedar", "dusky", "ember", "frost", "gleam", "hazel", "ivory", "jolly", "keen", "lunar",
         "maple", "noble", "olive", "pearl", "quiet", "raven", "silver", "tulip", "umber", "velvet", "willow", "zephyr")


NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pillow", "quarry", "ribbon", "saddle", "timber", "valley", "wagon")


INTRO = "Some special magic numbers are hidden within the following text. Make sure to memorize it. " \
        "I will quiz you about the numbers afterwards.\n"


def number(rng):
    return str(rng.randint(1_000_000, 9_999_999))


def key(rng, taken=()):
    while True:
        k = f"{rng.choice(WORDS)}-{rng.choice(NOUNS)}"
        if k not in taken:
            return k


def needle(k, v):
    return f" One of the special magic numbers for {k} is: {v}."


def task(name, rng):
    """(needles, question with its answer prefix, the strings a right answer holds, intro)."""
    if name in ("single", "multikey", "multiquery"):
        keys = [key(rng)]
        while len(keys) < (1 if name == "single" else 4):
            keys.append(key(rng, keys))
        values = [number(rng) for _ in keys]
        if name == "multiquery":
            asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
            return ([needle(k, v) for k, v in zip(keys, values)],
                    f"\nWhat are all the special magic numbers for {asked} mentioned in the provided text? The "
                    f"special magic numbers for {asked} mentioned in the provided text are", values, INTRO)
        return ([needle(k, v) for k, v in zip(keys, values)],
                f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text? The special magic "
                f"number for {keys[0]} mentioned in the provided text is", values[:1], INTRO)
    if name == "multivalue":
        k, values = key(rng), [number(rng) for _ in range(4)]
        return ([needle(k, v) for v in values],
                f"\nWhat are all the special magic numbers for {k} mentioned in the provided text? The special magic "
                f"numbers for {k} mentioned in the provided text are", values, INTRO)
    if name == "vartrack":
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
        v = number(rng)
        chain = [f" VAR {names[0]} = {v}."] + [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        return (chain, f"\nQuestion: Find all variables that are assigned the value {v} in the text above. Answer: "
                       f"According to the chain(s) of variable assignment in the text above, 5 variables are assigned "
                       f"the value {v}, they are:", names,
                "Memorize and track the chain(s) of variable assignment hidden in the following text.\n")
    sentence, question, words = PLANTED_FACTS[rng.randrange(len(PLANTED_FACTS))]
    return [" " + sentence], f"\nAnswer the question from the text above. Question: {question} Answer:", words, \
        "Read the following text and answer the question after it.\n"


@dataclass(frozen=True)
class Prompt:
    """A trial's prompt: ``ids`` (exactly the length asked), the strings a right answer holds,
    the token span [start, end) of each needle in ``ids`` (in the order they stand), and where
    the question (with its answer prefix) starts."""

    ids: list[int]
    want: list[str]
    needles: list[tuple[int, int]]
    question_at: int


def prompt(tok, book_ids, length, name, rng) -> Prompt:
    """The prompt of task ``name`` over ``book_ids`` from ``rng``."""
    needles, question, want, intro = task(name, rng)
    head, tail = tok.encode(intro).ids, tok.encode(question).ids
    pieces = [tok.encode(n).ids for n in needles]
    n_hay = length - len(head) - len(tail) - sum(map(len, pieces))
    start = rng.randrange(0, len(book_ids) - n_hay)
    hay = list(book_ids[start:start + n_hay])
    cuts = sorted(rng.randint(0, n_hay) for _ in pieces)
    if name != "vartrack":  # a chain keeps its order: each link comes after the one it names
        rng.shuffle(pieces)
    out, last, spans = list(head), 0, []
    for cut, piece in zip(cuts, pieces):
        out += hay[last:cut]
        spans.append((len(out), len(out) + len(piece)))
        out += piece
        last = cut
    out += hay[last:]
    return Prompt(out + tail, want, spans, len(out))


def trial_prompt(tok, books, length, name, i, seed) -> tuple[str, Prompt]:
    """Trial ``i`` of task ``name`` at ``length``: its book's name and its prompt, the same for
    every model and every script that reads it (``books``: ``held_out``'s list)."""
    rng = random.Random(f"{seed}|{name}|{length}|{i}")
    book, _, ids = books[i % len(books)]
    return book, prompt(tok, ids, length, name, rng)
