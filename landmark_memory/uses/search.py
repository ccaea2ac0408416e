"""Searching a memory: the passages a question points at, without generating (its retrievers,
``retrievers.py``, fused), and the memory's blocks as passages: their text and where they lie.
The memory's text index, which finds a question's words, is the engine's
(``LandmarkMemory.text_index``, ``memory/text.py``).
"""

import re
import time
import unicodedata
from dataclasses import asdict, dataclass, replace

from ..format.manifest import MemoryFileError
from ..memory.engine import LandmarkMemory
from .asking import Message, chat_prompt, loaded_for
from .evidence import Quote, stem
from .question import Question, asked_words, check_question
from .retrievers import TEXT_CANDIDATES, Ranked, Ranking, TextRetriever, find_evidence


@dataclass(frozen=True)
class Passage:
    """A memory block an answer read: its ``text``, its ``source`` (the document's file, None
    where the memory does not know it), the ``token_offset`` of its first token in that
    source, and its ``share`` of the answer's lookups (a search's: its fused score). A block of
    a session names the ``session`` and its ``turn`` instead (the offset is then in that turn)."""

    block: int
    source: str | None
    token_offset: int
    text: str
    share: float
    session: str | None = None
    turn: int | None = None


def passage(mem: LandmarkMemory, block: int, tokenizer, share: float) -> Passage:
    """The block ``block`` of the memory as a ``Passage``."""
    bs, ids = mem.shape.block_size, mem.tokens(0, block, block + 1)
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < mem.backbone.vocab_size:  # read, not checked, at open
        raise MemoryFileError(f"the token rows of {mem.dir.path if mem.dir else 'the memory'} hold ids outside the "
                              f"model's vocabulary at block {block}; the memory is damaged: restore it from a backup "
                              "or rebuild it (`landmark-memory info --verify` checks every file)")
    at, text = block * bs, tokenizer.decode(ids.tolist())
    a = mem.attachment
    if a is not None and block >= a.base_blocks:
        turn, offset = a.owner.locate(block - a.base_blocks)
        return Passage(block, None, offset, text, share, a.owner.name, turn)
    e = mem.inputs.containing(at)  # (a corpus reads one page of its document list)
    if e is not None:
        return Passage(block, e.path, at - e.start, text, share)
    return Passage(block, None, at, text, share)


def snippet(text: str, question: str, width: int = 100) -> str:
    """About ``width`` characters of ``text`` (white space folded) around the first place it holds
    one of ``question``'s asked words (``asked_words``; a word's first letters, so that "shoes"
    finds "shoe"), else its opening."""
    text = " ".join(unicodedata.normalize("NFC", text).split())  # (as ``own_words`` reads the question)
    hits = [m.start() for w in asked_words(question) if (m := re.search(rf"\b{re.escape(stem(w))}", text, re.I))]
    at = max(min(hits, default=0) - width // 3, 0)
    cut = text[at:at + width]
    return ("..." if at else "") + cut + ("..." if at + width < len(text) else "")


@dataclass(frozen=True)
class Found:
    """What ``search`` found for ``question``: the best ``passages`` (by the fused ranking, their
    ``share`` its score), the ``quote`` among them, the three rankings (``ranking``) and the
    seconds it took (``seconds``)."""

    question: str
    passages: list[Passage]
    quote: Quote | None
    ranking: Ranking
    seconds: float = 0.0
    memory_tokens: int = 0

    def to_json(self) -> dict:
        r = self.ranking
        return {"question": self.question, "passages": [asdict(p) for p in self.passages],
                "quote": None if self.quote is None else asdict(self.quote),
                "ranking": {"heads": [b for b, _ in r.heads[:len(self.passages)]],
                            "text": [b for b, _ in r.text[:len(self.passages)]],
                            "fused": [b for b, _ in r.fused[:len(self.passages)]]},
                "seconds": round(self.seconds, 4), "memory_tokens": self.memory_tokens}


def text_ranking(mem: LandmarkMemory, tokenizer, question: str, n: int, k: int = TEXT_CANDIDATES) -> Ranked:
    """The ``k`` of the memory's first ``n`` blocks the text index ranks first for
    ``question``'s asked words (``asked_words``; BM25), as (block, score), best first."""
    return TextRetriever(mem, tokenizer).rank(Question(question, n, tuple(asked_words(question))), k)


def search(mem: LandmarkMemory, model, question: str, *, k: int = 5) -> Found:
    """The ``k`` passages of the memory that ``question`` points at, and the quote among them,
    without generating: retrieved and fused as ``ask`` reads them (``retrievers.find_evidence``:
    the text index's blocks for its words, the retrieval heads' ranking of those and of the block
    keys' candidates). ``model``: the ``LoadedModel`` the memory reads with, or a bare tokenizer
    (``asking.loaded_for``); one without retrieval heads (or a chat template or frame) ranks by
    the text index alone. The question is read into the memory as ``ask`` reads it; a read-only
    memory is rewound after it.

    Raises ``QuestionError`` (a ``ValueError``) for a question ``ask`` would refuse
    (``check_question``: empty, too long, no Unicode text), ``ValueError`` for ``k`` < 1."""
    check_question(question)
    if k < 1:
        raise ValueError(f"search needs k >= 1, got k={k}")
    loaded = loaded_for(mem, model)
    tok, heads, t0 = loaded.tokenizer, loaded.heads, time.perf_counter()
    chat = chat_prompt(tok, [Message("user", question)], first=True, answer=False)
    frame = heads.frame if heads is not None and chat is None else None
    prompt = chat if chat is not None else frame.replace("{question}", question) if frame is not None else ""
    asked = Question.pose(mem, tok, question, prompt if heads is not None else "", [question])
    found = None
    if heads is not None and prompt and asked.n_blocks:
        try:  # (a frame's last token is the answer's first)
            ranking, best = find_evidence(mem, tok, heads, asked.read(mem, len(asked.ids) - (chat is None)), k)
            found = best[0] if best else None
        finally:
            if mem.readonly and mem.attachment is None:
                mem.rewind()
    else:
        text = TextRetriever(mem, tok).rank(asked)
        ranking = Ranking([], text, text[:k])
    passages = [passage(mem, b, tok, s) for b, s in ranking.fused[:k]]
    return Found(question, passages, placed(mem, found, tok), ranking, time.perf_counter() - t0, mem.n_tokens)


def placed(mem: LandmarkMemory, found: Quote | None, tokenizer) -> Quote | None:
    """The quote ``found`` with where it lies, as its block's passage says (its document and
    offset there, or its session's turn)."""
    if found is None:
        return None
    at = passage(mem, found.block, tokenizer, 0.0)
    return replace(found, source=at.source, session=at.session, turn=at.turn,
                   token_offset=at.token_offset + found.token - found.block * mem.shape.block_size)
