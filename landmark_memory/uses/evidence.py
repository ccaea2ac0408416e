"""Evidence: the stored tokens a question's retrieval heads attend to, token by token, and the
sentence that answers it.

A question read into a memory (the chat prompt, as ``ask`` reads it) is scored by a few chosen
(layer, key/value head) pairs, its retrieval heads, against every stored token key of candidate
blocks: per head a softmax over all the candidates' tokens of each prompt token's scores, averaged
over the question's own tokens and the head's query heads, less the same average over the chat
template's tokens around it (a content-free prompt read in the same forward: the calibration of
QRHead and ICR, arXiv 2506.09944 and 2410.02642, attention over the full context rather than a
summary per block). A block's score is the attention mass of its tokens; the quote is the sentence
of the best blocks whose tokens hold the most. It needs no training and reads keys the store
already holds, so a stock checkpoint's training-free memory reads its evidence the same way as a
landmark memory.

Candidates: every block up to ``EvidenceHeads.candidates``; past that, the blocks the same heads
rank first by their block keys (landmarks, or a training-free memory's mean keys), and with them
the blocks the memory's text index ranks first for the question's words. ``retrievers.py``
ranks and quotes with these (``HeadsRetriever``), and fuses the heads' ranking with the text
index's.
"""

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..models.reader import head_attention


@dataclass(frozen=True)
class Quote:
    """The sentence a question's heads attend to most inside the passages read: its ``text``, the
    ``block`` it starts in, its first token's place in the memory (``token``) and the attention
    mass of its tokens (``score``); where ``ask`` found it, like a ``Passage``: its document
    (``source``) and first token's offset there, or its session's ``turn``."""

    text: str
    block: int
    token: int
    score: float
    source: str | None = None
    token_offset: int | None = None
    session: str | None = None
    turn: int | None = None

    def cited(self) -> str:
        """The quote as a terminal shows it: in quotation marks, then where it lies."""
        where = f"session {self.session}, turn {self.turn + 1}" if self.session else self.source or "the memory"
        at = self.token if self.token_offset is None else self.token_offset
        return f"\u201c{self.text}\u201d ({where}, token {at:,})"


def prompt_weights(own: list[int], n: int) -> torch.Tensor:
    """float32 (2, n): the average over a prompt's ``n`` tokens of its question's own (positions
    ``own``), and of the rest, the chat template's (the calibration)."""
    w = torch.zeros(2, n)
    mine = torch.zeros(n, dtype=torch.bool)
    mine[own] = True
    w[0, mine], w[1, ~mine] = 1 / max(int(mine.sum()), 1), 1 / max(int((~mine).sum()), 1)
    return w


@torch.no_grad()
def token_attention(mem, got, weights: torch.Tensor, heads, blocks: torch.Tensor) -> torch.Tensor:
    """float32 (M, K, n, block_size): each of the K ``heads``' attention over the normal tokens of
    ``blocks`` (n,), for M averages over the prompt's tokens ``weights`` (M, T) (rows summing to 1).

    ``got``: per memory layer what the prompt's tokens search with (``question.search_states``). A
    query is rotated to where it would read a block at slot 0 (its search position plus the
    block's key row), each stored key sits at its offset in the block: the scores the attention
    gives a retrieved block's tokens."""
    s, bb = mem.shape, mem.backbone
    G, bs, n = bb.n_head // s.n_kv_head, s.block_size, len(blocks)
    out = torch.zeros(weights.shape[0], len(heads), n, bs)
    if n == 0:
        return out
    shift = mem.backbone.rope.angles(torch.tensor([s.key_row]))  # from the search position to the key row's
    by_layer = {}
    for i, (layer, h) in enumerate(heads):
        by_layer.setdefault(layer, []).append((i, h))
    for layer, hs in by_layer.items():
        q, _, cos, sin = got[layer]  # (H, T, D) raw, (T, D) x 2
        qr = mem.backbone.rope.rotate(shift, mem.backbone.rope.rotate((cos, sin), q.float()))  # (H, T, D)
        keys = mem.keys(layer, blocks, rows=True)[:, :, :bs]  # (n, H_kv, bs, D), rotated by offset
        for i, h in hs:
            sc = torch.einsum("gtd,nld->gtnl", qr[h * G:(h + 1) * G], keys[:, h]) * bb.scale  # (G, T, n, bs)
            a = sc.flatten(2).softmax(-1).view_as(sc).mean(0)  # (T, n, bs)
            out[:, i] = torch.einsum("mt,tnl->mnl", weights, a)
    return out


@torch.no_grad()
def candidates(mem, got, weights: torch.Tensor, heads, limit: int, nb: int) -> torch.Tensor:
    """int64 (n,): which of the memory's first ``nb`` blocks are read token by token: every one
    up to ``limit``, else the ``limit`` the ``heads`` rank first by block keys (the question's
    tokens less the template's, ``weights`` (2, T))."""
    if nb <= limit:
        return torch.arange(nb)
    total = torch.zeros(nb)
    for layer in sorted({lh[0] for lh in heads}):
        q, _, cos, sin = got[layer]
        keys = mem.keys(layer, torch.arange(nb))[None]  # (1, H_kv, n, D)
        a = head_attention(q[None, None], cos[None], sin[None], weights[:, None], keys, mem.backbone.scale)[:, 0]
        for h in [h for lh, h in heads if lh == layer]:
            total += a[0, h] - a[1, h]
    return total.topk(limit).indices.sort().values


def rank_blocks(mass: torch.Tensor, blocks: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The best ``k`` of ``blocks`` as (block, score), best first, by the calibrated token
    attention ``mass`` (2, K, n, bs) (the question's, the template's) summed over heads and tokens."""
    score = (mass[0] - mass[1]).sum((0, 2))  # (n,)
    top = score.topk(min(k, len(blocks)))
    return [(int(blocks[i]), float(v)) for v, i in zip(top.values, top.indices)]


# a sentence ends at . ! or ? (and closing quotes or brackets) before white space, but not at an initial or a
# title (P. M., Mr.), or at a paragraph's end
SENTENCE_END = re.compile(r"(?<!\b[A-Z])(?<!\bM[rs])(?<!\bMrs)(?<!\b[DS][rt])[.!?][\"'\u201d\u2019_)\]]*(?=\s)|\n\s*\n")


def sentences(mem, tokenizer, mass: torch.Tensor, blocks: torch.Tensor, best: list[int], n: int) -> list[Quote]:
    """Every sentence that starts or ends in one of the ``best`` blocks (of ``blocks``, the
    memory's first ``n``, whose token attention ``mass`` (2, K, len(blocks), bs) is), in the
    order of ``best`` then of the text, each scored by the calibrated mass of its tokens summed."""
    bs = mem.shape.block_size
    at = {int(b): i for i, b in enumerate(blocks)}
    score = (mass[0] - mass[1]).sum(0)  # (n, bs)
    out = []
    for b in best:
        lo, hi = max(b - 1, 0), min(b + 2, n)  # a sentence may cross into a neighbour
        ids = [int(t) for t in mem.tokens(0, lo, hi)]
        w = torch.cat([score[at[c]] if c in at else torch.zeros(bs) for c in range(lo, hi)])  # (len(ids),)
        # where each token ends in the text, from prefixes: a token alone may hold part of a character
        ends = np.array([len(tokenizer.decode(ids[:i + 1])) for i in range(len(ids))])
        text = tokenizer.decode(ids)
        cuts = [0] + [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]
        for a, z in zip(cuts, cuts[1:]):
            first, last = np.searchsorted(ends, a, "right"), np.searchsorted(ends, z, "left")
            if not text[a:z].strip() or last < first:
                continue
            if not any((b - lo) * bs <= t < (b - lo + 1) * bs for t in range(first, last + 1)):
                continue  # a sentence of a neighbour only
            out.append(Quote(" ".join(text[a:z].split()), int(lo + first // bs), int(lo * bs + first),
                             float(w[first:last + 1].sum())))
    return out


# the quote: the sentence of best heads' score ** QUOTE_HEADS times (support + QUOTE_FLOOR) ** QUOTE_POWER, the
# share of the question's own words it holds, each weighed by its rarity in the memory (chosen on development
# questions: experiments/results/quotes.md)
QUOTE_HEADS, QUOTE_FLOOR, QUOTE_POWER = 0.25, 0.05, 8.0
LEAST_SCORE = 1e-9  # a sentence the heads score at or below zero counts as scored this


def quotes(mem, tokenizer, mass: torch.Tensor, blocks: torch.Tensor, best: list[int], n: int,
           question: str = "", count: int = 1, rarity: Mapping[str, float] | None = None) -> list[Quote]:
    """The ``count`` sentences among the ``best`` blocks (``sentences``; one crossing two of them
    once) the heads attend to most, weighed by how much of ``question`` they speak of
    (``support`` with ``rarity``: at equal heads' scores, a sentence holding all its words
    outweighs one holding none 21 ** 8 times), best first, of equal ones the first; the first is
    the quote (none where there is no sentence)."""
    found: dict[int, Quote] = {}
    for q in sentences(mem, tokenizer, mass, blocks, best, n):
        found.setdefault(q.token, q)

    def weight(q: Quote) -> float:
        held = support(question, q.text, rarity)
        return max(q.score, LEAST_SCORE) ** QUOTE_HEADS * (held + QUOTE_FLOOR) ** QUOTE_POWER

    return sorted(found.values(), key=lambda q: -weight(q))[:count]


def around(mem, tokenizer, found: Quote, n: int, sentences: int = 1) -> str:
    """The quote ``found`` with the ``sentences`` sentences before and after it, as the memory's
    first ``n`` blocks hold them (white space folded); the quote alone where its sentence is cut
    differently in the wider text."""
    lo, hi = max(found.block - 2, 0), min(found.block + 3, n)
    text = tokenizer.decode([int(t) for t in mem.tokens(0, lo, hi)])
    cuts = [0] + [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]
    said = [s for s in (" ".join(text[a:z].split()) for a, z in zip(cuts, cuts[1:])) if s]
    if found.text not in said:
        return found.text
    i = said.index(found.text)
    return " ".join(said[max(i - sentences, 0):i + sentences + 1])


# words an answer shares with any text, which say nothing of where it came from
COMMON = frozenset("""a about after again all also am an and any are as at be because been before being but by can
could did do does done each for from had has have he her here him his how i if in into is it its just may me
might more most must my no not now of on one ones only or other our out over own said same she should so some
such than that the their them then there these they this those to too up us very was we were what when where
which while who whom why will with would yet you your""".split())


# words a question asks with, which its evidence need not hold ("What was the name of ...")
ASKING = frozenset("name named called many much kind sort old age year long far".split())


def _words(text: str) -> list[str]:
    """The words of ``text``, lower case, its composed form first (NFC: a letter and the accent
    typed after it, "o\u0308", are one letter, "\u00f6", not a word cut in two)."""
    return re.findall(r"\w+", unicodedata.normalize("NFC", text).lower())


def own_words(text: str) -> list[str]:
    """The words of ``text`` that say what it is about (lower case, in order, once each): those
    of three letters or more, common words and those a question asks with aside."""
    return list(dict.fromkeys(w for w in _words(text) if w not in COMMON and w not in ASKING and len(w) > 2))


def stem(word: str) -> str:
    """The first letters of ``word`` that its other forms share: all but its last two past four
    letters ("shoes", "married": "shoe", "marri"), else the word without a plural ``s``."""
    return word[:max(4, len(word) - 2)] if len(word) > 4 else word.removesuffix("s")


def support(question: str, evidence: str, rarity: Mapping[str, float] | None = None) -> float:
    """The share of ``question``'s own words (``own_words``) that ``evidence`` holds, a word held
    where one of the evidence's own words begins with its ``stem``; each word weighs its
    ``rarity`` (1 where it has none): 0 where the evidence speaks of nothing asked."""
    held = own_words(evidence)
    weights = {w: (rarity or {}).get(w, 1.0) for w in own_words(question)}
    total = sum(weights.values())
    if not total:
        return 1.0
    return sum(v for w, v in weights.items() if any(h.startswith(stem(w)) for h in held)) / total


def shared_words(answer: str, evidence: str, question: str) -> list[str]:
    """The words of ``answer`` (in its order, once each, lower case) that ``evidence`` holds and
    ``question`` does not, common words aside: what the answer took from its evidence."""
    held, asked, out = set(_words(evidence)), set(_words(question)), []
    for w in _words(answer):
        if w in held and w not in asked and w not in COMMON and w not in out:
            out.append(w)
    return out
