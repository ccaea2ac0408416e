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

from ..core.names import EVIDENCE
from ..core.tokenizer import encode_prompt
from ..format.session_files import ROLES, Turn
from ..memory.engine import LandmarkMemory
from ..models.config import AskPolicy
from .evidence import Quote, around, shared_words, support
from .evidence import point as point_heads
from .question import QuestionError, check_question, point, question_tokens, search_states
from .search import Passage, passage, placed, text_ranking, word_rarity
from .session import Session

# the turn the evidence and the question are read in (chosen on development questions: experiments/exp_answers.py)
EVIDENCE_PROMPT = "{evidence}\n\n{question}"
QUOTES = 2  # the sentences the "quotes" evidence reads
TEXT_BLOCKS = 1  # the blocks of the text index a model without retrieval heads or a question reader reads first
NOT_FOUND = "The memory does not seem to hold the answer to this question."  # said where the quote is off the point


@dataclass(frozen=True)
class Message:
    """A message of a conversation: ``role`` is system, user or assistant."""

    role: str
    content: str


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


def ask(mem: LandmarkMemory, tokenizer, question: str, **options) -> Answer:
    """Answer ``question`` from the memory ``mem`` read by its model (``tokenizer`` its own):
    ``converse`` with one user message (its options: raw, max_new_tokens, temperature, seed,
    passages, stop, on_token)."""
    return converse(mem, tokenizer, [Message("user", question)], **options)


def converse(mem: LandmarkMemory, tokenizer, messages: Sequence[Message], *, max_new_tokens: int = 32,
             temperature: float = 0.0, seed: int = 0, raw: bool = False, passages: int = 3,
             stop: Sequence[str] = (), on_token: Callable[[int], None] | None = None, first: bool = True,
             centre: bool | None = None, evidence: str = EVIDENCE[0], refuse: bool = True) -> Answer:
    """Read ``messages`` after everything the memory ``mem`` holds and generate the answer.

    Parameters
    ----------
    raw : bool, continue the messages' text as written (joined by new lines); by default a
        chat model (a tokenizer with ``chat_text``) gets them as turns of its chat template,
        and its answer ends at any of its end-of-turn tokens (``end_of_turn_ids``); a model
        without one whose retrieval heads were chosen in a plain frame (``EvidenceHeads.frame``)
        gets the question in it, and its answer ends where it writes the frame's words again.
    passages : int, how many of the passages read to report.
    stop : strings that end the answer where it first produces one of them (cut from its text).
    on_token : called with each new token id of the answer as it is generated (streaming; not
        with an end-of-turn token).
    first : the messages open the conversation (the template's opening, e.g. a default system
        message, goes first); else they follow turns the memory has read.
    centre : the messages and the answer choose their blocks by landmark scores centred
        (``MemoryOptions.centre``), whatever the memory reads other text with; False: as it
        reads; None: as the model's ``AskPolicy`` says.
    evidence : what a chat model with retrieval heads reads before the question once its heads
        have found the quote (``EVIDENCE``): ``"quote"``, the quote; ``"quotes"``, the ``QUOTES``
        best sentences (the quote first, ``evidence.quotes``), in the memory's order; ``"around"``,
        the quote with the sentence before and after it; ``"none"``, nothing (the answer reads the
        memory alone).
        The messages are first read as a closed turn, which the heads score; then the evidence
        and the question are read as the next user turn (``EVIDENCE_PROMPT``), and the answer
        follows it. ``Answer.evidence`` says what was read.
    refuse : where the quote holds none of the question's own words (``Answer.support`` 0,
        ``evidence.support``; the rule chosen on development questions the books answer and
        questions they do not), say ``NOT_FOUND`` instead of generating (``Answer.refused``; the
        quote and passages still name the closest text); False: always generate.

    The passages are ranked by the lookups of every layer, or of the deeper half of them where
    the model's ``AskPolicy`` says so (SmolLM2's first layers' choices say little of the
    question: ``experiments/results/retrieval.md``). A model with a question reader whose
    policy asks for ``reader_blocks`` (SmolLM2's: its question reader blended with its retrieval heads) reads
    a chat prompt first, ranks the memory's blocks by the reader (``point``), and every token of
    the answer reads the best of them as the first of its top-k (``LandmarkMemory.reading``):
    those are the first passages. A model with neither (the bundled one; any model asked
    ``raw``) reads first the ``TEXT_BLOCKS`` the memory's text index ranks first for the
    question's words (``search.text_ranking``), the first passages too.
    """
    check_messages(messages, seed=seed, stop=stop)
    # (a model's policy was measured on its landmark keys: a memory without landmarks asks as a new model does)
    policy = (getattr(mem.model, "ask_policy", None) if mem.shape.landmarks else None) or AskPolicy()
    centre = policy.centre if centre is None else centre
    if max_new_tokens < 0 or passages < 0:
        raise ValueError(f"max_new_tokens and passages must be >= 0, got {max_new_tokens} and {passages}")
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence must be one of {', '.join(EVIDENCE)}, got {evidence!r}")
    question = messages[-1].content
    chat = None if raw else getattr(tokenizer, "chat_text", lambda *a, **k: None)(
        [asdict(m) for m in messages], first=first, answer=True)
    heads = getattr(mem.model, "evidence_heads", None)
    # a model without a chat template reads the question in the frame its heads were chosen with
    frame = heads.frame if heads is not None and chat is None and not raw else None
    if chat is None and frame is None:
        heads = None
    last = question if frame is None else frame.replace("{question}", question)
    if frame is not None:  # a model that writes the frame's words again has ended its answer
        stop = (*stop, *[w.strip() for w in frame.split("{question}") if w.strip()])
    n_saved, n_tokens = mem.n_blocks, mem.n_tokens  # blocks the question adds are no passages of the memory
    reads_evidence = evidence != "none" and heads is not None and chat is not None and n_saved > 0
    if reads_evidence:  # the messages a closed turn: the heads score it, the evidence and question follow
        chat = tokenizer.chat_text([asdict(m) for m in messages], first=first, answer=False)
    prompt = chat if chat is not None else "\n".join([m.content for m in messages[:-1]] + [last])
    uses = Counter()
    stops = set(tokenizer.end_of_turn_ids) if chat else set()

    def read(retrieved):  # per layer (1, H, 1, k): the blocks a position read
        for r in retrieved[mem.shape.n_layer // 2 if policy.deep_passages else 0:]:
            uses.update(b for b in r[0].flatten().tolist() if 0 <= b < n_saved)

    def told(t):  # (1,): a new token, streamed unless it ends the turn
        if on_token is not None and int(t[0]) not in stops:
            on_token(int(t[0]))

    def stopped(tokens):  # the answer so far holds a stop string
        text = tokenizer.decode([t for t in tokens if t not in stops])
        return any(s in text for s in stop)

    encoded = encode_prompt(tokenizer, prompt, [m.content for m in messages])  # (their text never a special token)
    ids, rest = encoded.ids, encoded.ids
    reader = getattr(mem.model, "question_reader", None) if chat is not None and policy.reader_blocks else None
    pointed, found, best, scored, said, rarity = [], None, [], [], None, None
    if (heads or reader) and n_saved and len(ids) > 1:  # the prompt is read first (by the memory's own options),
        scored = ids if reads_evidence else ids[:-1]  # then the answer reads the blocks it points at
        own = question_tokens(encoded.offsets[:len(scored)], prompt, question)
        if heads is not None:
            rarity = word_rarity(mem, tokenizer, question, n_saved)
            ranking, best = point_heads(mem, tokenizer, heads, search_states(mem, scored), own, n_saved,
                                        max(min(heads.blocks, mem.options.top_k), 1),
                                        text_ranking(mem, tokenizer, question, n_saved), question,
                                        QUOTES if evidence == "quotes" else 1, rarity)
            pointed = [b for b, _ in ranking.fused][:heads.blocks]
            found = placed(mem, best[0] if best else None, tokenizer)
        else:
            pointed = [b for b, _ in point(mem, *reader, scored, own, min(policy.reader_blocks, mem.options.top_k))]
        rest = ids[len(scored):]
    elif n_saved:  # neither heads nor a reader: the blocks of the question's words read first
        pointed = [b for b, _ in text_ranking(mem, tokenizer, question, n_saved, min(TEXT_BLOCKS, mem.options.top_k))]
    if reads_evidence:  # the next turn: the evidence and the question (or, with no quote, the answer's opening)
        said = _evidence(mem, tokenizer, evidence, best, n_saved) if best else None
        turn = [{"role": "user", "content": EVIDENCE_PROMPT.format(evidence=said, question=question)}] if said else []
        rest = encode_prompt(tokenizer, tokenizer.chat_text(turn, first=False, answer=True),
                             [t["content"] for t in turn]).ids
    backing = None if found is None else support(question, found.text, rarity)
    refused = refuse and backing == 0
    if refused:  # the memory reads the refusal as the answer it gave: a session goes on after it
        said, rest = None, encode_prompt(tokenizer, tokenizer.chat_text([], first=False, answer=True), []).ids \
            if reads_evidence else rest
        new = tokenizer.encode(NOT_FOUND).ids
        mem.forward(torch.tensor([rest + new], device=mem.device), logits="none")
        for t in new:
            told([t])
    else:
        new = _generated(mem, rest, pointed, centre, max_new_tokens, temperature, seed, stops,
                         stopped if stop else None, told, read)
    total = sum(uses.values()) or 1
    ranked = pointed + [b for b, _ in uses.most_common() if b not in pointed]  # the reader's blocks first
    most_read = [passage(mem, b, tokenizer, uses[b] / total) for b in ranked[:passages]]
    answer = new[:-1] if new and new[-1] in stops else new
    text, cut = tokenizer.decode(answer), None
    hits = [(text.find(s), s) for s in stop if s in text]
    if hits:
        at, cut = min(hits)
        text = text[:at]
    return Answer(question, text, answer, chat is not None, most_read, n_tokens, cut,
                  prompt_tokens=len(scored) + len(rest), end_of_turn=new[-1] if new and new[-1] in stops else None,
                  quote=found, evidence=said, support=backing, refused=refused,
                  grounded=None if found is None or refused else shared_words(text, said or found.text, question))


def _evidence(mem, tokenizer, policy: str, best: list[Quote], n: int) -> str:
    """What the evidence ``policy`` reads before the question, of the quotes ``best`` (the quote
    first; as many as the policy asks for) of the memory's first ``n`` blocks."""
    if policy == "around":
        return around(mem, tokenizer, best[0], n)
    return " ".join(q.text for q in sorted(best, key=lambda q: q.token))  # in the memory's order


def _generated(mem, rest, pointed, centre, max_new_tokens, temperature, seed, stops, until, told, read) -> list[int]:
    """The answer's token ids, generated after ``rest`` with every token reading the ``pointed`` blocks first."""
    with mem.querying(centre=True) if centre else nullcontext():
        with mem.reading(pointed):
            return mem.generate(torch.tensor([rest], device=mem.device), max_new_tokens, temperature=temperature,
                                generator=torch.Generator().manual_seed(seed), stop_ids=stops, until=until,
                                on_token=told, on_read=read)[0].tolist()


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


def say(session: Session, tokenizer, messages: str | Sequence[Message], **options) -> Answer:
    """A turn of ``session``: ``messages`` (a string: one user message) read after the
    conversation so far, over the memory at its newest commit, and answered (``converse``'s
    options); the turn is committed to the session before this returns."""
    messages = [Message("user", messages)] if isinstance(messages, str) else list(messages)
    check_messages(messages, seed=options.get("seed", 0), stop=options.get("stop", ()))
    raw, mem = options.get("raw", False), session.mem
    mem.refresh()  # every document committed before the turn (a new commit lets the session go: attach again)
    session.attach()
    first, said, turns = not session.n_turns, time.strftime("%Y-%m-%dT%H:%M:%S%z"), []
    chat_text = None if raw else getattr(tokenizer, "chat_text", None)
    for m in messages[:-1]:  # messages that ask for no answer: read, a turn each
        start = session.n_tokens
        text = chat_text([asdict(m)], first=first and not turns, answer=False) if chat_text else None
        mem.forward(torch.tensor([encode_prompt(tokenizer, text if text is not None else m.content + "\n",
                                                [m.content]).ids]), logits="none")
        turns.append(Turn(m.role, m.content, start, session.n_tokens - start, said))
    start = session.n_tokens
    a = converse(mem, tokenizer, messages[-1:], first=first and not turns, **options)
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
