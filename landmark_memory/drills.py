"""Retrieval drills in book text: facts planted in a training window of a book, asked at its
end and answered by copying.

A drill window is the window's own consecutive book text (the haystack) with 1 to
``max_facts`` facts planted at random token positions, followed by 1 to ``max_questions``
questions about different planted facts, each followed by its answer. The facts that are not
asked are distractors of the same shape (another key, another person). The question comes
as a user reads a memory:

- ``chat``: a user turn of the model's chat template, answered in a sentence that ends with
  the end-of-turn token, as ``answer.ask`` asks it (models with a chat template only);
- ``completion``: a prompt that the answer continues, in the paper's passkey form ("What is
  the pass key? The pass key is"), RULER's ("The special magic number for K mentioned in the
  provided text is") or a plain "Question: ... Answer:".

Facts come in three kinds: the paper's pass key (five digits), RULER's special magic numbers
(seven digits; a key may hold several values, asked all at once) and sentences about people
of a village (names, years, counts, colours, codes). Their words are drawn from lists of our
own, apart from the words of the evaluation's planted facts and RULER keys, so that an
evaluation never asks what training saw.
"""

import random
from dataclasses import dataclass

import numpy as np

from .passkey import INTRO as PASSKEY_INTRO
from .passkey import MAX_KEY, QUESTION, answer, fact

RULER_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
READ_INTRO = "Read the following text and answer the questions after it.\n"

FIRST = ("Agnes", "Bertrand", "Clara", "Dmitri", "Elsa", "Florian", "Greta", "Hugo", "Ines", "Jasper", "Katya",
         "Leon", "Mirela", "Nils", "Odile", "Pavel", "Quentin", "Rhea", "Soren", "Tilde", "Ulric", "Vera", "Wendel")
LAST = ("Ashdown", "Brennick", "Castell", "Dunmore", "Everard", "Falk", "Garrow", "Holm", "Ivers", "Jessop",
        "Kettering", "Lindqvist", "Norrey", "Orme", "Pellow", "Quarles", "Rourke", "Stallard", "Thorne")
ROLES = ("blacksmith", "gardener", "schoolmaster", "ferryman", "weaver", "apothecary", "shepherd", "cartographer",
         "glassblower", "bookbinder", "stonemason", "chandler", "cooper", "tanner", "locksmith", "potter")
KIN = ("son", "niece", "cousin", "apprentice", "landlord", "wife", "nephew", "godmother")
ANIMALS = ("horse", "goat", "dog", "mule", "cat", "donkey")
PLACES = ("floorboards", "hearthstone", "woodpile", "cellar steps", "old well", "rain barrel")
COLOURS = ("crimson", "green", "yellow", "violet", "grey", "turquoise", "scarlet", "white")
BUILDINGS = ("cottage", "workshop", "barn", "stable", "shop")
TOWNS = ("Harwick", "Lenmouth", "Corvale", "Ostrin", "Pellbury", "Dunstray", "Marrow Cross", "Fenwold")
COUNTS = ("three", "five", "seven", "nine", "twelve", "fifteen", "twenty", "forty")
ADJECTIVES = ("azure", "bitter", "copper", "distant", "eager", "feral", "gentle", "hollow", "icy", "jagged",
              "lofty", "mellow", "narrow", "opal", "placid", "rustic", "sombre", "tawny", "vivid", "wistful")
THINGS = ("abbey", "beacon", "bridge", "chapel", "compass", "fountain", "granary", "hammer", "lantern-post",
          "mill-wheel", "observatory", "pulpit", "sundial", "tower", "vineyard", "windmill")


@dataclass(frozen=True)
class Fact:
    """One planted fact: its ``sentences`` (planted in this order, each with its leading
    space), the ``question`` asked in words and the sentence that answers it (``chat``), and
    the completion form: ``prompt`` continued by ``completion``. ``key`` names what the fact is
    about; two facts of a window never share one."""

    key: str
    sentences: tuple[str, ...]
    question: str
    chat: str
    prompt: str
    completion: str


def _plain(question: str, sentence: str) -> tuple[str, str]:
    return f"\nQuestion: {question} Answer:", " " + sentence


def passkey_fact(rng: random.Random) -> Fact:
    """The paper's pass key (its sentence, question and answer of ``passkey.py``)."""
    k = rng.randint(1, MAX_KEY)
    return Fact("pass key", (fact(k),), "What is the pass key?", f"The pass key is {k}.", QUESTION, answer(k))


def magic_fact(rng: random.Random, values: int = 1) -> Fact:
    """RULER's needle: ``values`` seven-digit special magic numbers for one key, asked all at
    once when there are several."""
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(THINGS)}"
    vs = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(values)]
    sentences = tuple(f" One of the special magic numbers for {key} is: {v}." for v in vs)
    if values == 1:
        about = f"the special magic number for {key}"
        q, said = f"What is {about}?", f"The special magic number for {key} is {vs[0]}."
        listed = vs[0]
    else:
        about = f"all the special magic numbers for {key}"
        listed = ", ".join(vs[:-1]) + f" and {vs[-1]}"
        q, said = f"What are {about}?", f"The special magic numbers for {key} are {listed}."
    verb = "is" if values == 1 else "are"
    prompt = (f"\nWhat {verb} {about} mentioned in the provided text? The special magic number{'s' * (values > 1)} "
              f"for {key} mentioned in the provided text {verb}")
    return Fact(key, sentences, q, said, prompt, f" {listed}.")


def village_fact(rng: random.Random) -> Fact:
    """A sentence about a person of a village (one of six shapes), its question and answer."""
    role = rng.choice(ROLES)
    shape = rng.randrange(6)
    if shape == 0:
        kin, name = rng.choice(KIN), f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        s, q = f"The {role}'s {kin} was called {name}.", f"What was the {role}'s {kin} called?"
    elif shape == 1:
        n, place = rng.choice(COUNTS), rng.choice(PLACES)
        s, q = f"The {role} hid {n} silver coins under the {place}.", f"How many silver coins did the {role} hide?"
    elif shape == 2:
        town, year = rng.choice(TOWNS), rng.randint(1700, 1899)
        s, q = f"The {role} was born in {town} in the year {year}.", f"In what year was the {role} born?"
    elif shape == 3:
        animal, name = rng.choice(ANIMALS), rng.choice(FIRST)
        s, q = f"The {role}'s {animal} was named {name}.", f"What was the {role}'s {animal} named?"
    elif shape == 4:
        building, colour = rng.choice(BUILDINGS), rng.choice(COLOURS)
        s, q = (f"The door of the {role}'s {building} was painted {colour}.",
                f"What colour was the door of the {role}'s {building}?")
    else:
        code = rng.randint(1000, 999_999)
        s, q = f"The code to the {role}'s strongbox was {code}.", f"What was the code to the {role}'s strongbox?"
    return Fact(role, (" " + s,), q, s, *_plain(q, s))


@dataclass
class Drill:
    """What ``RetrievalDrills.drill`` made of a window: the ``facts`` planted (in order), those
    ``asked`` (in order) and the window spans ``[start, end)`` of their answers' tokens."""

    facts: list[Fact]
    asked: list[Fact]
    answers: list[tuple[int, int]]


class RetrievalDrills:
    """Turns a ``rate`` share of training windows into retrieval drills in their own book
    text (module docstring); the window keeps its length.

    Parameters
    ----------
    tokenizer : a ``tokenizers.Tokenizer`` or ``hf.tokenizer.TextTokenizer``; with
        ``chat_prompt`` (a chat model) a ``chat_share`` of the questions are chat turns.
    rate : float in [0, 1], the share of windows drilled.
    max_facts, max_questions : int, facts planted and questions asked per window (at most).
    """

    def __init__(self, tokenizer, rate: float, max_facts: int = 6, max_questions: int = 3, chat_share: float = 0.5):
        if not 0.0 <= rate <= 1.0 or not 0.0 <= chat_share <= 1.0:
            raise ValueError(f"the drill rate and chat share must be in [0, 1], got {rate} and {chat_share}")
        if not 1 <= max_questions <= max_facts:
            raise ValueError(f"need 1 <= max_questions <= max_facts, got {max_questions} and {max_facts}")
        self.tok, self.rate, self.max_facts, self.max_questions = tokenizer, rate, max_facts, max_questions
        chat = getattr(tokenizer, "chat_prompt", lambda q: None)("?") is not None
        self.chat_share = chat_share if chat else 0.0

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def facts(self, rng: random.Random) -> list[Fact]:
        """1 to ``max_facts`` facts with distinct keys (at most one pass key), in the order planted."""
        n, out = rng.randint(1, self.max_facts), {}
        while len(out) < n:
            kind = rng.random()
            if kind < 0.25:
                f = passkey_fact(rng)
            elif kind < 0.6:
                f = magic_fact(rng, 1 if rng.random() < 0.75 else rng.randint(2, 4))
            else:
                f = village_fact(rng)
            out.setdefault(f.key, f)
        return list(out.values())

    def asking(self, f: Fact, rng: random.Random) -> tuple[list[int], list[int]]:
        """A question about ``f`` and its answer, as token ids (the question's, the answer's)."""
        if rng.random() < self.chat_share:
            question, said, end = self.tok.chat_prompt(f.question), f.chat, [self.tok.end_of_turn_id]
        else:
            question, said, end = f.prompt, f.completion, []
        prompt, both = self.ids(question), self.ids(question + said) + end
        cut = next((i for i, (a, b) in enumerate(zip(prompt, both)) if a != b), len(prompt))
        return both[:cut], both[cut:]  # a token that straddles the seam belongs to the answer

    def __call__(self, window: np.ndarray, rng: random.Random) -> list[tuple[int, int]]:
        """``window`` (T+1,) int64, made a drill in place when picked (``rate``); returns the
        spans ``[start, end)`` of its answer tokens (none when not picked)."""
        if self.rate > 0.0 and rng.random() < self.rate:
            return self.drill(window, rng).answers
        return []

    def drill(self, window: np.ndarray, rng: random.Random) -> Drill:
        """Make ``window`` (T+1,) int64 a drill in place, its first tokens the haystack."""
        n = len(window)
        facts = self.facts(rng)
        asked = rng.sample(facts, rng.randint(1, min(self.max_questions, len(facts))))
        intro = self.ids(rng.choice(("", READ_INTRO, RULER_INTRO, PASSKEY_INTRO + "\n")))
        tail, answers = [], []
        for f in asked:
            question, ans = self.asking(f, rng)
            tail += question
            answers.append((len(tail), len(tail) + len(ans)))
            tail += ans
        pieces = [self.ids(s) for f in facts for s in f.sentences]  # a fact's sentences keep their order
        n_hay = n - len(intro) - len(tail) - sum(map(len, pieces))
        if n_hay < 0:
            raise ValueError(f"a window of {n} tokens is too short for a retrieval drill of {n - n_hay} tokens; "
                             "lengthen the windows (--seq-len) or set the drill rate to 0")
        cuts = sorted(rng.randint(0, n_hay) for _ in pieces)
        hay, out, last = window[:n_hay].tolist(), list(intro), 0
        for cut, piece in zip(cuts, pieces):
            out += hay[last:cut] + piece
            last = cut
        window[:] = out + hay[last:] + tail
        start = n - len(tail)
        return Drill(facts, asked, [(start + a, start + b) for a, b in answers])
