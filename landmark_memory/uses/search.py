"""Searching a memory: the passages a question's words and its retrieval heads point at, without
generating, and the memory's text index that finds its words (``format/text_index.py``).

A saved memory's index lies in its folder, written by its writer (``keep_text_index``: ``build``,
a corpus's additions, ``landmark-memory index``); a reader (``ask``, ``search``, the server)
uses it as it lies where its seal vouches for it and adds blocks committed since in a copy in
memory, or builds one in memory where there is none. A session's own blocks (its turns) are
indexed in memory as they come, after its memory's. Each process keeps the indexes it opened
for as long as it holds the memory.
"""

import math
import re
import time
import unicodedata
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

import numpy as np

from ..core.tokenizer import encode_prompt, special_ids
from ..format.manifest import MemoryFileError
from ..format.text_index import TextIndex, TextIndexError
from ..memory.engine import LandmarkMemory
from ..models.kinds import tokenizer_digest
from .evidence import Quote, Ranking, own_words, stem
from .evidence import point as point_heads
from .question import check_question, question_tokens, search_states

# the text index's top blocks that join a question's candidates and its fusion (experiments/exp_search.py)
TEXT_CANDIDATES = 20
# the question's own words the text index is asked for, its first ones: a query grows faster than its words
ASKED_WORDS = 64
T = TypeVar("T")


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


# per memory, as long as it lives: its folder's text index and its attached session's, each with its first block
_OPEN: "weakref.WeakKeyDictionary[LandmarkMemory, dict]" = weakref.WeakKeyDictionary()


def _decoder(tokenizer):
    backend = getattr(tokenizer, "backend", tokenizer)  # (an ``hf.TextTokenizer``'s, or a ``tokenizers.Tokenizer``)
    return lambda rows: backend.decode_batch(rows, skip_special_tokens=True)


def _rows(mem: LandmarkMemory, first: int, last: int) -> np.ndarray:
    return mem.tokens(0, first, last).reshape(-1, mem.shape.block_size)  # (last - first, bs)


def keep_text_index(mem: LandmarkMemory, tokenizer, quiet: bool = False, check: bool = False) -> int:
    """Bring the text index in a saved memory's folder up to its committed blocks and seal it
    (its writer's call, after a commit: ``build``, a corpus's additions, ``landmark-memory
    index``, which ``check``s it first and builds it again where it is damaged). Returns the
    blocks it added."""
    if mem.dir is None or mem.readonly:
        raise ValueError("only a saved memory's writer keeps its text index; open it without readonly=True")
    n = mem.manifest.blocks
    with TextIndex.open(mem.dir.path, tokenizer_digest(tokenizer), writable=True, check=check) as index:
        return index.sync(_rows(mem, 0, n), set(special_ids(tokenizer)), _decoder(tokenizer), quiet=quiet)


def _memory_index(mem: LandmarkMemory, tokenizer, n: int) -> tuple[TextIndex, int]:
    """(the text index of the memory's own blocks, kept while the memory lives and brought up
    to its committed blocks, the blocks of the first ``n`` it holds: those before a session's)."""
    kept = _OPEN.setdefault(mem, {})
    a = mem.attachment
    base = min(n, a.base_blocks) if a is not None else n
    digest = kept.get("digest") or kept.setdefault("digest", tokenizer_digest(tokenizer))
    own = kept.get("memory")
    if own is None:
        saved = mem.dir is not None
        own = kept["memory"] = TextIndex.open(mem.dir.path, digest, writable=False) if saved \
            else TextIndex.in_memory(digest)
    if own.blocks != base:  # (blocks committed since it was written, or none indexed yet)
        own.sync(_rows(mem, 0, base), set(special_ids(tokenizer)), _decoder(tokenizer), quiet=False)
    return own, base


def _asked(mem: LandmarkMemory, tokenizer, n: int, query: Callable[[TextIndex, int], T]) -> tuple[T, int]:
    """(``query(index, base)``, ``base``): the memory's text index and the blocks of its first
    ``n`` that it holds, as ``_memory_index`` gives them, asked; where the index's file proves
    damaged as it is read, the index is built again in memory (a warning says so) and asked again."""
    try:
        own, base = _memory_index(mem, tokenizer, n)
        return query(own, base), base
    except TextIndexError as e:
        kept = _OPEN[mem]
        warnings.warn(f"{e}; searching a copy built in memory meanwhile", RuntimeWarning, stacklevel=3)
        kept.pop("memory").close()
        kept["memory"] = TextIndex.in_memory(kept["digest"])
        own, base = _memory_index(mem, tokenizer, n)
        return query(own, base), base


def asked_words(question: str) -> list[str]:
    """The words of ``question`` the text index is asked for: its own (``own_words``), the
    first ``ASKED_WORDS`` of them."""
    return own_words(question)[:ASKED_WORDS]


def word_rarity(mem: LandmarkMemory, tokenizer, question: str, n: int) -> dict[str, float]:
    """{word: its rarity} for ``question``'s asked words (``asked_words``): BM25's inverse
    document frequency, ``log(1 + (N - df + 0.5) / (df + 0.5))`` of the ``df`` of the memory's
    first ``n`` blocks (``N``, a session's turns aside) that hold it; what the quote weighs its
    words by (a word past them weighs 1)."""
    words = asked_words(question)
    if not words or n == 0:
        return {}
    counts, base = _asked(mem, tokenizer, n, lambda index, base: index.frequencies(words, base))
    return {w: math.log(1 + (base - df + 0.5) / (df + 0.5)) for w, df in counts.items()}


def text_ranking(mem: LandmarkMemory, tokenizer, question: str, n: int, k: int = TEXT_CANDIDATES
                 ) -> list[tuple[int, float]]:
    """The ``k`` of the memory's first ``n`` blocks the text index ranks first for
    ``question``'s asked words (``asked_words``; BM25), as (block, score), best first."""
    words = asked_words(question)
    if not words or n == 0:
        return []
    found, base = _asked(mem, tokenizer, n, lambda index, base: index.search(words, k, base))
    kept, a = _OPEN[mem], mem.attachment
    if n > base:  # a session's turns, after the memory's blocks
        turns = kept.get("session")
        if turns is None or turns[0]() is not a.owner:  # (held weakly: a session holds its memory)
            turns = kept["session"] = (weakref.ref(a.owner), TextIndex.in_memory(kept["digest"]))
        turns[1].sync(_rows(mem, base, n), set(special_ids(tokenizer)), _decoder(tokenizer))
        found = sorted(found + [(base + b, s) for b, s in turns[1].search(words, k, n - base)],
                       key=lambda bs: -bs[1])[:k]
    return found


def search(mem: LandmarkMemory, tokenizer, question: str, *, k: int = 5) -> Found:
    """The ``k`` passages of the memory that ``question`` points at, and the quote among them,
    without generating: the text index's blocks for its words and the retrieval heads' ranking
    of those and of the block keys' candidates, fused (``evidence.point``), as ``ask`` reads
    them. A model without retrieval heads (or a chat template or frame) ranks by the text index
    alone. The question is read into the memory as ``ask`` reads it; a read-only memory is
    rewound after it.

    Raises ``QuestionError`` (a ``ValueError``) for a question ``ask`` would refuse
    (``check_question``: empty, too long, no Unicode text), ``ValueError`` for ``k`` < 1."""
    check_question(question)
    if k < 1:
        raise ValueError(f"search needs k >= 1, got k={k}")
    t0, n = time.perf_counter(), mem.n_blocks
    text = text_ranking(mem, tokenizer, question, n)
    heads = getattr(mem.model, "evidence_heads", None)
    chat = getattr(tokenizer, "chat_text", lambda *a, **kw: None)([{"role": "user", "content": question}],
                                                                  first=True, answer=False)
    frame = heads.frame if heads is not None and chat is None else None
    prompt = chat if chat is not None else frame.replace("{question}", question) if frame is not None else None
    found, ranking = None, Ranking([], text, text[:k])
    if heads is not None and prompt is not None and n:
        encoded = encode_prompt(tokenizer, prompt, [question])
        ids = encoded.ids if chat is not None else encoded.ids[:-1]  # (a frame's last token is the answer's first)
        own = question_tokens(encoded.offsets[:len(ids)], prompt, question)
        try:
            ranking, best = point_heads(mem, tokenizer, heads, search_states(mem, ids), own, n, k, text, question,
                                        rarity=word_rarity(mem, tokenizer, question, n))
            found = best[0] if best else None
        finally:
            if mem.readonly and mem.attachment is None:
                mem.rewind()
    passages = [passage(mem, b, tokenizer, s) for b, s in ranking.fused[:k]]
    return Found(question, passages, placed(mem, found, tokenizer), ranking, time.perf_counter() - t0, mem.n_tokens)


def placed(mem: LandmarkMemory, found: Quote | None, tokenizer) -> Quote | None:
    """The quote ``found`` with where it lies, as its block's passage says (its document and
    offset there, or its session's turn)."""
    if found is None:
        return None
    at = passage(mem, found.block, tokenizer, 0.0)
    return replace(found, source=at.source, session=at.session, turn=at.turn,
                   token_offset=at.token_offset + found.token - found.block * mem.shape.block_size)
