"""Asking a memory: the answer, and the passages it read.

``ask`` feeds a question after everything the memory holds (through the model's chat template
where it has one) and generates the answer, counting which memory blocks the answer's tokens
retrieved: the passages of the answer, most read first, each named by its document and token
offset (the paper's interpretability claim), or by its session's turn. ``converse`` does the
same for a conversation sent whole (a server's stateless request), ``say`` for a turn of a
session kept in memory (``uses/session.py``). The memory reads the question and the answer
too, as any text fed to it; for an answer that no earlier question sees, ``rewind()`` a
read-only memory (``LandmarkMemory.open(path, model, readonly=True)``) between questions.
"""

import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace

import torch

from ..core.ask_options import AskOptions
from ..core.tokenizer import encode_prompt
from ..format.session_files import ROLES, Turn
from ..memory.engine import LandmarkMemory
from ..models.config import AskPolicy
from .answering import choose_policy
from .asking import Message, chat_prompt, loaded_for
from .evidence import Quote, shared_words, support
from .question import QuestionError, check_question
from .search import Passage, passage
from .session import Session

NOT_FOUND = "The memory does not seem to hold the answer to this question."  # said where the quote is off the point


@dataclass(frozen=True)
class Answer:
    """``text``: the answer (without the end-of-turn token); ``tokens``: its token ids;
    ``chat``: whether the question went through the chat template; ``passages``: most read
    first; ``memory_tokens``: the tokens the memory held before the question; ``stop``: the
    stop string that ended it (cut from ``text``; its tokens stay in ``tokens``), or None."""

    question: str
    text: str
    tokens: list[int]
    chat: bool
    passages: list[Passage] = field(default_factory=list)
    memory_tokens: int = 0
    stop: str | None = None
    session: str | None = None  # the session it was said in (``say``)
    prompt_tokens: int = 0  # the tokens the question was read as (through the chat template)
    end_of_turn: int | None = None  # the end-of-turn token that ended it (read by the memory, not in ``tokens``)
    quote: Quote | None = None  # the sentence of the memory the question's retrieval heads attend to most
    evidence: str | None = None  # what was read into the prompt before the question (None: the memory alone)
    grounded: list[str] | None = None  # the answer's words its quote holds (``shared_words``; None: no quote)
    support: float | None = None  # the share of the question's own words the quote holds, by rarity (None: no quote)
    refused: bool = False  # ``NOT_FOUND`` said: the quote holds none of the question's own words

    def to_json(self) -> dict:
        return asdict(self)

    def evidence_fields(self) -> dict:
        """What the answer rests on, as the command line's, the chat's and the server's JSON give
        it: the quote, the evidence read before the question, the answer's words the quote holds,
        how much of the question the quote speaks of, whether it said the memory holds no answer."""
        return {"quote": self.quote and asdict(self.quote), "evidence": self.evidence, "grounded": self.grounded,
                "support": self.support, "refused": self.refused}

    def evidence_lines(self) -> list[str]:
        """The quote and the answer held against it, as a terminal shows them: the words the
        answer took from it, or a warning that it took none; where the memory held no answer,
        the closest text it holds."""
        if self.quote is None:
            return []
        if self.refused:
            return [f"Closest text: {self.quote.cited()}"]
        return [f"Quote: {self.quote.cited()}", "From the quote: " + ", ".join(self.grounded) if self.grounded
                else "Check this answer: none of its words comes from the quote"]


def ask(mem: LandmarkMemory, model, question: str, options: AskOptions | None = None, **changes) -> Answer:
    """Answer ``question`` from the memory ``mem``: ``converse`` with one user message
    (``options``, or the defaults with ``changes``: ``ask(mem, model, q, max_new_tokens=64)``)."""
    return converse(mem, model, [Message("user", question)], options, **changes)


def converse(mem: LandmarkMemory, model, messages: Sequence[Message], options: AskOptions | None = None, *,
             on_token: Callable[[int], None] | None = None, first: bool = True, **changes) -> Answer:
    """Read ``messages`` after everything the memory ``mem`` holds and generate the answer.

    Parameters
    ----------
    model : the ``LoadedModel`` the memory reads with (``kinds.load_model``'s: its retrieval
        heads, question reader and ``AskPolicy`` come with it), or a bare tokenizer of it
        (``asking.loaded_for``).
    options : ``AskOptions`` (default: its defaults), changed by ``changes``.
    on_token : called with each new token id of the answer as it is generated (streaming; not
        with an end-of-turn token).
    first : the messages open the conversation (the template's opening, e.g. a default system
        message, goes first); else they follow turns the memory has read.

    The answer policy (``answering/``: the first that fits the model, or ``options.policy``)
    reads what it reads first and plans the answer: a model with retrieval heads finds the quote
    and reads it before the question; one with a question reader pins the blocks it ranks first;
    any other pins the blocks of the question's words the text index ranks first. Every token of
    the answer reads the pinned blocks as the first of its top-k (``LandmarkMemory.reading``):
    those are the first passages, then the blocks the answer's lookups read most, of every layer
    or of the deeper half where the model's ``AskPolicy`` says so (SmolLM2's first layers'
    choices say little of the question: ``experiments/results/retrieval.md``). Where the quote
    holds none of the question's own words (``Answer.support`` 0; the rule chosen on development
    questions the books answer and questions they do not) and ``options.refuse``, the answer is
    ``NOT_FOUND`` (``Answer.refused``; the quote and passages still name the closest text).
    """
    options = replace(options or AskOptions(), **changes)
    check_messages(messages, seed=options.seed, stop=options.stop)
    loaded = loaded_for(mem, model)
    tokenizer = loaded.tokenizer
    # (a model's policy was measured on its landmark keys: a memory without landmarks asks as a new model does)
    asking = loaded.policy if mem.shape.landmarks else AskPolicy()
    centre = asking.centre if options.centre is None else options.centre
    policy = choose_policy(loaded, options)
    question, n_blocks, n_tokens = messages[-1].content, mem.n_blocks, mem.n_tokens  # (the question's blocks: none)
    plan = policy.plan(mem, loaded, messages, options, first)
    stop = (*options.stop, *plan.stop)
    uses = Counter()
    stops = set(tokenizer.end_of_turn_ids) if plan.chat else set()

    def read(retrieved):  # per layer (1, H, 1, k): the blocks a position read
        for r in retrieved[mem.shape.n_layer // 2 if asking.deep_passages else 0:]:
            uses.update(b for b in r[0].flatten().tolist() if 0 <= b < n_blocks)

    def told(t):  # (1,): a new token, streamed unless it ends the turn
        if on_token is not None and int(t[0]) not in stops:
            on_token(int(t[0]))

    def stopped(tokens):  # the answer so far holds a stop string
        text = tokenizer.decode([t for t in tokens if t not in stops])
        return any(s in text for s in stop)

    found, rest, said = plan.quote, plan.rest, plan.evidence
    backing = None if found is None else support(question, found.text, plan.rarity)
    refused = options.refuse and backing == 0
    if refused:  # the memory reads the refusal as the answer it gave: a session goes on after it
        said, rest = None, rest if plan.before_refusal is None else plan.before_refusal
        new = tokenizer.encode(NOT_FOUND).ids
        mem.forward(torch.tensor([rest + new], device=mem.device), logits="none")
        for t in new:
            told([t])
    else:
        new = _generated(mem, rest, plan.pinned, centre, options, stops, stopped if stop else None, told, read)
    total = sum(uses.values()) or 1
    ranked = plan.pinned + [b for b, _ in uses.most_common() if b not in plan.pinned]  # the pinned blocks first
    most_read = [passage(mem, b, tokenizer, uses[b] / total) for b in ranked[:options.passages]]
    answer = new[:-1] if new and new[-1] in stops else new
    text, cut = tokenizer.decode(answer), None
    hits = [(text.find(s), s) for s in stop if s in text]
    if hits:
        at, cut = min(hits)
        text = text[:at]
    return Answer(question, text, answer, plan.chat, most_read, n_tokens, cut,
                  prompt_tokens=plan.read + len(rest), end_of_turn=new[-1] if new and new[-1] in stops else None,
                  quote=found, evidence=said, support=backing, refused=refused,
                  grounded=None if found is None or refused else shared_words(text, said or found.text, question))


def _generated(mem, rest, pinned, centre, options: AskOptions, stops, until, told, read) -> list[int]:
    """The answer's token ids, generated after ``rest`` with every token reading the ``pinned`` blocks first."""
    with mem.querying(centre=True) if centre else nullcontext():
        with mem.reading(pinned):
            return mem.generate(torch.tensor([rest], device=mem.device), options.max_new_tokens,
                                temperature=options.temperature, generator=torch.Generator().manual_seed(options.seed),
                                stop_ids=stops, until=until, on_token=told, on_read=read)[0].tolist()


def check_messages(messages: Sequence[Message], *, seed: int = 0, stop: Sequence[str] = ()) -> None:
    """Raise ``QuestionError`` for a conversation ``converse`` cannot answer: none, a role that
    is not system, user or assistant, a message that is no text, an empty last message."""
    if not messages:
        raise QuestionError("empty", "there is no message to answer")
    for m in messages:
        if m.role not in ROLES:
            raise QuestionError("role", f"a message's role must be one of {', '.join(ROLES)}, got {m.role!r}")
        check_question(m.content or ".", seed=seed, stop=stop)
    check_question(messages[-1].content, seed=seed, stop=stop)


def say(session: Session, model, messages: str | Sequence[Message], options: AskOptions | None = None, *,
        on_token: Callable[[int], None] | None = None, **changes) -> Answer:
    """A turn of ``session``: ``messages`` (a string: one user message) read after the
    conversation so far, over the memory at its newest commit, and answered (``converse``'s
    ``model``, ``options`` and ``changes``, ``on_token``); the turn is committed to the session
    before this returns."""
    options = replace(options or AskOptions(), **changes)
    messages = [Message("user", messages)] if isinstance(messages, str) else list(messages)
    check_messages(messages, seed=options.seed, stop=options.stop)
    mem = session.mem
    tokenizer = loaded_for(mem, model).tokenizer
    mem.refresh()  # every document committed before the turn (a new commit lets the session go: attach again)
    session.attach()
    first, said, turns = not session.n_turns, time.strftime("%Y-%m-%dT%H:%M:%S%z"), []
    for m in messages[:-1]:  # messages that ask for no answer: read, a turn each
        start = session.n_tokens
        text = None if options.raw else chat_prompt(tokenizer, [m], first=first and not turns, answer=False)
        mem.forward(torch.tensor([encode_prompt(tokenizer, text if text is not None else m.content + "\n",
                                                [m.content]).ids]), logits="none")
        turns.append(Turn(m.role, m.content, start, session.n_tokens - start, said))
    start = session.n_tokens
    a = converse(mem, model, messages[-1:], options, on_token=on_token, first=first and not turns)
    turns.append(Turn(messages[-1].role, messages[-1].content, start, a.prompt_tokens, said))
    start += a.prompt_tokens
    if a.chat:  # the assistant's turn closed as the template closes it (what its end token left of it)
        opened = tokenizer.chat_text([], first=False, answer=True) + tokenizer.decode(a.tokens)
        whole = tokenizer.chat_text([{"role": "assistant", "content": tokenizer.decode(a.tokens)}], first=False,
                                    answer=False)
        rest = whole[len(opened):] if whole.startswith(opened) else ""
        end = "" if a.end_of_turn is None else tokenizer.decode([a.end_of_turn])
        rest = rest[len(end):] if rest.startswith(end) else ""
        if rest:
            mem.forward(torch.tensor([tokenizer.encode(rest).ids]), logits="none")
    turns.append(Turn("assistant", a.text, start, session.n_tokens - start, said, [asdict(p) for p in a.passages]))
    session.commit(turns)
    return replace(a, session=session.name)
