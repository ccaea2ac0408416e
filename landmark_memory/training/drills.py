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
of a village in nine shapes (``VILLAGE_SHAPES``: names, years, counts, colours, codes, places,
times). A village fact's value comes from an open set (names made up of syllables, counts from
2 to 99 in words, shades of colours), so that no list learnt by heart answers it: only a copy
does. Their words are our own, apart from the words of the evaluation's planted facts and
RULER keys, so that an evaluation never asks what training saw.

A ``quote_share`` of the drills also ask for a sentence of the window's own book text, named
by a few of its words ("Quote the sentence of the text that contains the words ..."), and
answer it in full. Nothing is planted for it: the question's words and the sentence are as
open as the books, so it trains the landmarks to stand for what their block says, whatever
that is, where the planted facts' shapes can be learnt by heart.
"""

import random
import re
from dataclasses import dataclass

import numpy as np

from ..core.passkey import INTRO as PASSKEY_INTRO
from ..core.passkey import MAX_KEY, QUESTION, answer, fact
from .data import Answer

RULER_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
READ_INTRO = "Read the following text and answer the questions after it.\n"

FIRST = ("Agnes", "Bertrand", "Clara", "Dmitri", "Elsa", "Florian", "Greta", "Hugo", "Ines", "Jasper", "Katya",
         "Leon", "Mirela", "Nils", "Odile", "Pavel", "Quentin", "Rhea", "Soren", "Tilde", "Ulric", "Vera", "Wendel")
LAST = ("Ashdown", "Brennick", "Castell", "Dunmore", "Everard", "Falk", "Garrow", "Holm", "Ivers", "Jessop",
        "Kettering", "Lindqvist", "Norrey", "Orme", "Pellow", "Quarles", "Rourke", "Stallard", "Thorne")
# Made-up names and titles, so that a drill cannot be answered from a list it learnt by heart.
HEADS = ("Ba", "Cor", "Del", "Fen", "Gal", "Hal", "Jor", "Kel", "Lun", "Mar", "Nor", "Per", "Quil", "Sel", "Tam",
         "Vel", "Wil", "Yar", "Zan", "Bri", "Dru", "Eld", "Ith", "Orv", "Ul", "Ged", "Pim", "Tor")
MIDS = ("a", "e", "i", "o", "an", "el", "in", "or", "ar", "u")
TAILS = ("bert", "da", "dric", "gan", "wen", "lis", "mond", "nor", "ra", "ric", "sa", "thea", "vin", "wyn", "zel",
         "mira", "dor", "ley", "ton", "wick", "by", "stead", "holt", "more")
TITLES = ("Sir", "Lady", "Duke", "Baron", "Squire", "Little", "Professor", "General", "Mister", "Madam", "Count")
PET_WORDS = ("Pepper", "Thimble", "Button", "Crumpet", "Walnut", "Pickle", "Marble", "Pudding", "Sprocket",
             "Turnip", "Muffin", "Bramble", "Nutmeg", "Cobweb", "Kettle", "Teacup", "Pebble", "Toffee")
ROLES = ("blacksmith", "gardener", "schoolmaster", "ferryman", "weaver", "apothecary", "shepherd", "cartographer",
         "glassblower", "bookbinder", "stonemason", "chandler", "cooper", "tanner", "locksmith", "potter",
         "saddler", "clockmaker", "fisherman", "midwife", "postmaster", "thatcher", "brewer", "cobbler")
KIN = ("son", "niece", "cousin", "apprentice", "landlord", "wife", "nephew", "godmother", "uncle", "grandson")
ANIMALS = ("horse", "goat", "dog", "mule", "cat", "donkey", "raven", "pony", "hound", "tortoise")
PLACES = ("floorboards", "hearthstone", "woodpile", "cellar steps", "old well", "rain barrel", "loose brick",
          "chimney", "pear tree", "barn door")
COLOURS = ("crimson", "green", "yellow", "violet", "grey", "turquoise", "scarlet", "white", "black", "purple",
           "lemon", "brown", "indigo", "silver", "olive", "pink")
SHADES = ("", "", "pale ", "dark ", "bright ", "deep ")
BUILDINGS = ("cottage", "workshop", "barn", "stable", "shop", "boathouse", "forge", "granary")
HOARDS = ("silver coins", "gold rings", "glass beads", "copper pennies", "brass keys", "old letters")
KEPT = ("letters", "medals", "wages", "maps", "spectacles", "wedding ring", "father's watch")
MATERIALS = ("oak", "copper", "leather", "clay", "brass", "walnut", "wicker", "iron")
CONTAINERS = ("chest", "jar", "pouch", "casket", "crate", "basket", "box", "kettle")
GOODS = ("barrels of cider", "loaves of rye bread", "bundles of wool", "jars of honey", "baskets of apples",
         "wheels of cheese", "bolts of linen", "crates of eggs")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
TIMEPIECES = ("pocket watch", "kitchen clock", "mantel clock", "hall clock")
HOURS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve")  # no eleven
ONES = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
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


def made_up_name(rng: random.Random) -> str:
    """A first name and a surname: from the lists, or made up of syllables."""
    def word():
        return (rng.choice(HEADS) + (rng.choice(MIDS) if rng.random() < 0.5 else "") + rng.choice(TAILS)).capitalize()
    if rng.random() < 0.3:
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    return f"{word()} {word()}"


def count_words(rng: random.Random) -> str:
    """A number from 2 to 99 in words, never eleven (a value the evaluation asks)."""
    n = rng.choice([n for n in range(2, 100) if n != 11])
    if n < 20:
        return ONES[n]
    return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")


def time_words(rng: random.Random) -> str:
    """A time of day in words, never a quarter past (the evaluation's form)."""
    form = rng.choice(("{} o'clock", "half past {}", "ten past {}", "twenty to {}", "five to {}"))
    return form.format(rng.choice(HOURS))


def _kin(rng, role):
    kin, name = rng.choice(KIN), made_up_name(rng)
    return f"The {role}'s {kin} was called {name}.", f"What was the {role}'s {kin} called?"


def _hoard(rng, role):
    n, what, place = count_words(rng), rng.choice(HOARDS), rng.choice(PLACES)
    return f"The {role} hid {n} {what} under the {place}.", f"How many {what} did the {role} hide?"


def _birth(rng, role):
    town, year = rng.choice(HEADS) + rng.choice(TAILS), rng.randint(1700, 1899)
    return f"The {role} was born in {town} in the year {year}.", f"In what year was the {role} born?"


def _pet(rng, role):
    animal = rng.choice(ANIMALS)
    name = f"{rng.choice(TITLES)} {rng.choice(PET_WORDS)}" if rng.random() < 0.5 else made_up_name(rng).split()[0]
    return f"The {role}'s {animal} was named {name}.", f"What was the {role}'s {animal} named?"


def _paint(rng, role):
    building, colour = rng.choice(BUILDINGS), rng.choice(SHADES) + rng.choice(COLOURS)
    if rng.random() < 0.5:
        return (f"The door of the {role}'s {building} was painted {colour}.",
                f"What colour was the door of the {role}'s {building}?")
    return (f"The {role} painted the shutters of his {building} {colour} every autumn.",
            f"What colour did the {role} paint the shutters of his {building}?")


def _code(rng, role):
    code = rng.randint(1000, 999_999)
    return f"The code to the {role}'s strongbox was {code}.", f"What was the code to the {role}'s strongbox?"


def _keep(rng, role):
    what, where = rng.choice(KEPT), f"{rng.choice(MATERIALS)} {rng.choice(CONTAINERS)}"
    a = "an" if where[0] in "aeiou" else "a"
    spot = f"{rng.choice(('under', 'behind', 'beside'))} the {rng.choice(PLACES)}"
    return f"The {role} kept his {what} in {a} {where} {spot}.", f"Where did the {role} keep his {what}?"


def _trade(rng, role):
    day, n, goods = rng.choice(DAYS), count_words(rng), rng.choice(GOODS)
    buyer = rng.choice([r for r in ROLES if r != role])
    return (f"Every {day} the {role} sold {n} {goods} to the {buyer}.",
            f"How many {goods} did the {role} sell to the {buyer} every {day}?")


def _stopped(rng, role):
    piece, when = rng.choice(TIMEPIECES), time_words(rng)
    return f"The {role}'s {piece} had stopped at {when}.", f"At what time had the {role}'s {piece} stopped?"


VILLAGE_SHAPES = (_kin, _hoard, _birth, _pet, _paint, _code, _keep, _trade, _stopped)


def village_fact(rng: random.Random) -> Fact:
    """A sentence about a person of a village (one of ``VILLAGE_SHAPES``), its question and
    answer; names, counts, colours and places are drawn from open sets, so that a right answer
    is a copy."""
    role = rng.choice(ROLES)
    s, q = rng.choice(VILLAGE_SHAPES)(rng, role)
    return Fact(role, (" " + s,), q, s, *_plain(q, s))


QUOTE_ASKS = ('Quote the sentence of the text that contains the words "{}".',
              'Which sentence of the text has the words "{}" in it? Quote it in full.',
              'Find the words "{}" in the text and repeat the whole sentence they are in.')
SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def sentence_spans(tok, ids) -> list[tuple[int, int]]:
    """Token spans ``[start, end)`` of the whole sentences of book text ``ids``: each starts with a
    capital letter after white space that follows the end of a sentence, ends at the next such
    start, and holds 12 to 60 tokens and at least 8 words of one paragraph (line breaks of
    hard-wrapped text are fine), without quotation marks (its words are quoted back)."""
    pieces = [tok.decode([int(t)]) for t in ids]
    starts = [i for i in range(1, len(pieces))
              if pieces[i].lstrip()[:1].isupper() and (pieces[i][:1].isspace() or pieces[i - 1][-1:].isspace())
              and SENTENCE_END.search("".join(pieces[max(0, i - 3):i]).rstrip())]
    spans = []
    for a, b in zip(starts, starts[1:]):
        text = "".join(pieces[a:b])
        if 12 <= b - a <= 60 and len(text.split()) >= 8 and "\n\n" not in text and not set(text) & {'"', "\ufffd"}:
            spans.append((a, b))
    return spans


def quote_fact(tok, ids, span: tuple[int, int], rng: random.Random) -> Fact:
    """A question for the sentence ``ids[span[0]:span[1]]`` naming 4 to 7 of its words, answered
    by the sentence in full. Nothing is planted (``sentences`` is empty): it is the book's."""
    words = tok.decode([int(t) for t in ids[span[0]:span[1]]]).split()
    sentence = " ".join(words)  # one line: hard-wrapped text has line breaks inside
    k = rng.randint(4, min(7, len(words) - 2))
    j = rng.randint(0, len(words) - k)
    given = " ".join(words[j:j + k]).strip(",;:.!?'()")
    question = rng.choice(QUOTE_ASKS).format(given)
    return Fact("quote", (), question, sentence, *_plain(question, sentence))


@dataclass
class Drill:
    """What ``RetrievalDrills.drill`` made of a window: the ``facts`` planted (in order), those
    ``asked`` (in order; a quote question asks a sentence of the book text, no planted fact), the
    window spans ``[start, end)`` of their answers' tokens and, for each, the spans of the text
    it is read from (``sources``: the fact's planted sentences, or the quoted sentence)."""

    facts: list[Fact]
    asked: list[Fact]
    answers: list[tuple[int, int]]
    sources: list[tuple[tuple[int, int], ...]]


class RetrievalDrills:
    """Turns a ``rate`` share of training windows into retrieval drills in their own book
    text (module docstring); the window keeps its length.

    Parameters
    ----------
    tokenizer : a ``tokenizers.Tokenizer`` or ``hf.tokenizer.TextTokenizer``; with
        ``chat_prompt`` (a chat model) a ``chat_share`` of the questions are chat turns.
    rate : float in [0, 1], the share of windows drilled.
    max_facts, max_questions : int, facts planted and questions asked per window (at most).
    quote_share : float in [0, 1], the share of drills that also ask for a sentence of their own
        book text (module docstring).
    """

    def __init__(self, tokenizer, rate: float, max_facts: int = 6, max_questions: int = 3, chat_share: float = 0.5,
                 quote_share: float = 0.0):
        if not all(0.0 <= x <= 1.0 for x in (rate, chat_share, quote_share)):
            raise ValueError(f"the drill rate, chat share and quote share must be in [0, 1], "
                             f"got {rate}, {chat_share} and {quote_share}")
        if not 1 <= max_questions <= max_facts:
            raise ValueError(f"need 1 <= max_questions <= max_facts, got {max_questions} and {max_facts}")
        self.tok, self.rate, self.max_facts, self.max_questions = tokenizer, rate, max_facts, max_questions
        self.quote_share = quote_share
        chat = getattr(tokenizer, "chat_prompt", lambda q: None)("?") is not None
        self.chat_share = chat_share if chat else 0.0

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def facts(self, rng: random.Random) -> list[Fact]:
        """1 to ``max_facts`` facts with distinct keys (at most one pass key), in the order planted."""
        n, out = rng.randint(1, self.max_facts), {}
        while len(out) < n:
            kind = rng.random()
            if kind < 0.2:
                f = passkey_fact(rng)
            elif kind < 0.5:
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

    def __call__(self, window: np.ndarray, rng: random.Random) -> list[Answer]:
        """``window`` (T+1,) int64, made a drill in place when picked (``rate``); returns its
        answers with their sources (none when not picked)."""
        if self.rate > 0.0 and rng.random() < self.rate:
            d = self.drill(window, rng)
            return [Answer(span, sources) for span, sources in zip(d.answers, d.sources)]
        return []

    def drill(self, window: np.ndarray, rng: random.Random) -> Drill:
        """Make ``window`` (T+1,) int64 a drill in place, its first tokens the haystack."""
        n = len(window)
        facts = self.facts(rng)
        asked = rng.sample(facts, rng.randint(1, min(self.max_questions, len(facts))))
        intro = self.ids(rng.choice(("", READ_INTRO, RULER_INTRO, PASSKEY_INTRO + "\n")))
        pieces = [self.ids(s) for f in facts for s in f.sentences]  # a fact's sentences keep their order
        quoted = None
        if self.quote_share > 0.0 and rng.random() < self.quote_share:
            # room left for the haystack, bounding each asked fact's question and answer by its
            # words plus 60 tokens (chat template or completion prompt); the quote's own question
            # and answer by twice the sentence plus 120
            room = n - len(intro) - sum(map(len, pieces)) - sum(len(self.ids(f.question + f.chat)) + 60 for f in asked)
            spans = [(a, b) for a, b in sentence_spans(self.tok, window[:max(0, room)]) if b + 2 * (b - a)
                     + 120 <= room]
            if spans:
                quoted = rng.choice(spans)
                asked.insert(rng.randint(0, len(asked)), quote_fact(self.tok, window, quoted, rng))
        tail, answers = [], []
        for f in asked:
            question, ans = self.asking(f, rng)
            tail += question
            answers.append((len(tail), len(tail) + len(ans)))
            tail += ans
        n_hay = n - len(intro) - len(tail) - sum(map(len, pieces))
        if n_hay < 0:
            raise ValueError(f"a window of {n} tokens is too short for a retrieval drill of {n - n_hay} tokens; "
                             "lengthen the windows (--seq-len) or set the drill rate to 0")
        assert quoted is None or quoted[1] <= n_hay, "the quoted sentence must stay in the haystack"
        cuts = sorted(rng.randint(0, n_hay) for _ in pieces)
        if quoted is not None:  # no fact planted inside the quoted sentence
            cuts = [quoted[0] if quoted[0] < c < quoted[1] else c for c in cuts]
        hay, out, last, planted = window[:n_hay].tolist(), list(intro), 0, []
        for cut, piece in zip(cuts, pieces):
            out += hay[last:cut]
            planted.append((len(out), len(out) + len(piece)))
            out += piece
            last = cut
        window[:] = out + hay[last:] + tail
        owners = [f for f in facts for _ in f.sentences]  # the fact of each planted piece
        sources = [tuple(span for span, g in zip(planted, owners) if g is f) for f in asked]
        if quoted is not None:  # the pieces cut in at or before its start push it on
            at = len(intro) + sum(len(piece) for cut, piece in zip(cuts, pieces) if cut <= quoted[0])
            sources[next(i for i, f in enumerate(asked) if f.key == "quote")] = ((at + quoted[0], at + quoted[1]),)
        start = n - len(tail)
        return Drill(facts, asked, [(start + a, start + b) for a, b in answers], sources)
