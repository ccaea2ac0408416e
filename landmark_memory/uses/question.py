"""A question as its retrievers read it: whether it can be asked (``check_question``, for
``ask``, ``search`` and the server alike), and the ``Question`` value computed once (its words
and their rarity in the memory, the prompt it is read in, which of its tokens are the
question's own, and, once read into the memory, what they search it with: ``search_states``).
``retrievers.py`` ranks blocks for it; experiments and ``choose_heads.py`` record what a
question reads.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..core.names import MAX_TURN_CHARS
from ..core.tokenizer import encode_prompt
from .evidence import own_words

# the question's own words the text index is asked for, its first ones: a query grows faster than its words
ASKED_WORDS = 64


class QuestionError(ValueError):
    """A question ``ask`` refuses; ``field`` says what is wrong: "empty", "text" (not Unicode),
    "seed", "stop" or "role"."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_question(question: str, *, seed: int = 0, stop: Sequence[str] = ()) -> None:
    """Raise ``QuestionError`` for what ``ask`` cannot answer: an empty question, one longer
    than a turn (``MAX_TURN_CHARS``), one that is no Unicode text, a seed outside
    0..2**64 - 1, an empty stop string (a server checks a request here before it answers)."""
    if not question.strip():
        raise QuestionError("empty", "the question is empty")
    if len(question) > MAX_TURN_CHARS:
        raise QuestionError("text", f"the message is {len(question):,} characters long, over the {MAX_TURN_CHARS:,} of "
                            "one turn: send it in parts, or build the text into a memory (`landmark-memory build`)")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (a command line's undecodable bytes, JSON's "\ud800")
        raise QuestionError("text", f"the question is not valid text: {question[e.start:e.end]!r} at character "
                            f"{e.start} is no Unicode character (text must be UTF-8)") from None
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise QuestionError("seed", f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise QuestionError("stop", f"stop strings must be non-empty strings, got {list(stop)!r}")


@torch.no_grad()
def search_states(mem, prompt: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Read ``prompt`` (token ids) into the memory ``mem`` and return, per memory layer, what its
    tokens search the memory with (stream 0, float32 on the CPU): the raw queries (H, T, D), the
    layer's inputs (T, C), and the rotation ``cos``, ``sin`` (T, D) each that moves a raw query
    to where it searches older blocks from (the engine's ``observer``, over every step)."""
    got = [[] for _ in range(mem.shape.n_layer)]

    def observe(layer, h, q, at_search, normal):  # the step's normal rows
        cos, sin = at_search
        got[layer].append((q[0][:, normal], h[0][normal], cos[normal], sin[normal]))

    mem.observer = observe
    try:
        mem.forward(torch.tensor([prompt], device=mem.device), logits="none")
    finally:
        mem.observer = None
    return [tuple(torch.cat(parts, -2).float().cpu() for parts in zip(*steps)) for steps in got]


def question_tokens(offsets: Sequence[tuple[int, int]], prompt: str, question: str) -> list[int]:
    """The positions of the prompt's tokens (their character ``offsets``) that are the
    question's own: the last place the prompt holds its text."""
    start = prompt.rfind(question)
    end = start + len(question)
    return [i for i, (a, b) in enumerate(offsets) if start >= 0 and start <= a < b <= end]


def asked_words(question: str) -> list[str]:
    """The words of ``question`` the text index is asked for: its own (``own_words``), the
    first ``ASKED_WORDS`` of them."""
    return own_words(question)[:ASKED_WORDS]


def word_rarity(mem, tokenizer, words: Sequence[str], n: int) -> dict[str, float]:
    """{word: its rarity} for ``words``: BM25's inverse document frequency,
    ``log(1 + (N - df + 0.5) / (df + 0.5))`` of the ``df`` of the memory's first ``n`` blocks
    (``N``, a session's turns aside) that hold it; what the quote weighs its words by (a word
    past them weighs 1)."""
    if not words or n == 0:
        return {}
    counts, base = mem.text_index.frequencies(tokenizer, words, n)
    return {w: math.log(1 + (base - df + 0.5) / (df + 0.5)) for w, df in counts.items()}


@dataclass(frozen=True)
class Question:
    """A question as its retrievers read it.

    ``text``: the question; ``n_blocks``: the memory's blocks before it (those it is asked of);
    ``words``: its asked words (``asked_words``); ``rarity``: theirs in those blocks
    (``word_rarity``); ``prompt``: the text it is read in (a chat template's turn, a frame),
    ``ids`` its token ids and ``own`` the positions of the question's own tokens among them;
    ``states``: once its first ``read`` ids are read into the memory (``Question.read``), what
    they search it with (``search_states``), else None."""

    text: str
    n_blocks: int
    words: tuple[str, ...] = ()
    rarity: Mapping[str, float] = field(default_factory=dict)
    prompt: str = ""
    ids: tuple[int, ...] = ()
    own: tuple[int, ...] = ()
    read_ids: int = 0
    states: list[tuple[torch.Tensor, ...]] | None = None

    @classmethod
    def pose(cls, mem, tokenizer, text: str, prompt: str = "", texts: Sequence[str] = ()) -> "Question":
        """``text`` asked of everything the memory ``mem`` holds, read in ``prompt`` (built
        around the messages' own ``texts``; ``encode_prompt``), its words' rarity counted."""
        words = tuple(asked_words(text))
        n_blocks = mem.n_blocks
        encoded = encode_prompt(tokenizer, prompt, list(texts)) if prompt else None
        ids = tuple(encoded.ids) if encoded else ()
        own = tuple(question_tokens(encoded.offsets, prompt, text)) if encoded else ()
        return cls(text, n_blocks, words, word_rarity(mem, tokenizer, words, n_blocks), prompt, ids, own)

    def read(self, mem, count: int) -> "Question":
        """This question with its prompt's first ``count`` ids read into the memory ``mem``
        (``states``; ``own`` then its positions among them)."""
        return replace(self, own=tuple(i for i in self.own if i < count), read_ids=count,
                       states=search_states(mem, list(self.ids[:count])))
