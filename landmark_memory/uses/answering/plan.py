"""What every answer policy hands ``answer.converse`` (``Plan``), what it is (``AnswerPolicy``),
and the prompt and first blocks most of them share."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ...core.ask_options import AskOptions
from ...models.loaded import LoadedModel
from ..asking import Message, chat_prompt
from ..evidence import Quote
from ..question import Question
from ..retrievers import TextRetriever

# the blocks of the text index a policy without retrieval heads or a question reader reads first
TEXT_BLOCKS = 1


@dataclass(frozen=True)
class Plan:
    """How an answer is read, as a policy planned it once it read what it reads first.

    ``chat``: the prompt went through the chat template (the answer ends at an end-of-turn
    token); ``read``: the prompt's tokens already read into the memory; ``rest``: the token ids
    the answer is generated after; ``pinned``: the blocks every token of the answer reads first
    (``LandmarkMemory.reading``), the first passages; ``quote``: the sentence the evidence rests
    on, placed (``search.placed``); ``evidence``: what was read before the question (None: the
    memory alone); ``rarity``: the question's words' (``Question.rarity``); ``stop``: stop
    strings the policy adds; ``before_refusal``: the ids a refusal is read after (None: ``rest``)."""

    chat: bool
    read: int
    rest: list[int]
    pinned: list[int] = field(default_factory=list)
    quote: Quote | None = None
    evidence: str | None = None
    rarity: Mapping[str, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    before_refusal: list[int] | None = None


class AnswerPolicy(Protocol):
    """How a question is answered from a memory: which retrievers it asks, what it reads before
    the question, which blocks the answer reads first. ``answering.POLICIES`` names each."""

    def fits(self, model: LoadedModel, options: AskOptions) -> bool:
        """Whether the policy can answer through ``model`` asked with ``options``."""

    def plan(self, mem, model: LoadedModel, messages: Sequence[Message], options: AskOptions, first: bool) -> Plan:
        """Read what the policy reads first of ``messages`` (``first``: they open the
        conversation) into the memory ``mem`` and plan the answer."""


def plain_prompt(messages: Sequence[Message], last: str) -> str:
    """The messages' text as written, joined by new lines, the last one's as ``last``."""
    return "\n".join([m.content for m in messages[:-1]] + [last])


def prompt_of(model: LoadedModel, messages: Sequence[Message], options: AskOptions, first: bool) -> tuple[str, bool]:
    """(the prompt ``messages`` are read in, whether through the chat template): its turns with
    the answer's opened, or, ``raw`` or without a template, their text."""
    chat = None if options.raw else chat_prompt(model.tokenizer, messages, first=first, answer=True)
    return (chat, True) if chat is not None else (plain_prompt(messages, messages[-1].content), False)


def text_first(mem, tokenizer, question: Question) -> list[int]:
    """The ``TEXT_BLOCKS`` the text index ranks first for ``question`` (at most ``top_k``; none
    in an empty memory)."""
    return [b for b, _ in TextRetriever(mem, tokenizer).rank(question, min(TEXT_BLOCKS, mem.options.top_k))]
