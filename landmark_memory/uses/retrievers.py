"""Retrievers: what ranks a memory's blocks for a ``Question``, behind one small protocol, and
the one fusion of their rankings.

    TextRetriever    the memory's text index, BM25 over the question's words (``memory/text.py``)
    HeadsRetriever   the model's retrieval heads, token by token (``evidence.py``), over the block
                     keys' candidates and the text index's; it also quotes the sentence they attend to
    ReaderRetriever  the model's question reader, by the blocks' landmark keys (``models/reader.py``)

``fuse`` is reciprocal rank fusion; ``find_evidence`` is what ``search`` and an answer read with
retrieval heads both do: the text index, the heads, fused, and the quote among the best.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.heads import EvidenceHeads
from ..models.loaded import Reader
from ..models.reader import head_attention, standardised
from .evidence import Quote, candidates, prompt_weights, quotes, rank_blocks, token_attention
from .question import Question

Ranked = list[tuple[int, float]]  # (block, score), best first

# the text index's top blocks that join a question's candidates and its fusion (experiments/exp_search.py)
TEXT_CANDIDATES = 20
# the fusion of rankings: a block's score is the sum over rankings of weight / (FUSION_K + its rank)
# (reciprocal rank fusion), chosen on questions the heads' choice never read (experiments/exp_search.py)
FUSION_K = 60
TEXT_WEIGHT = 2.0


class Retriever(Protocol):
    def rank(self, question: Question, k: int) -> Ranked:
        """The ``k`` of the question's memory blocks (its first ``question.n_blocks``) ranked first."""


def fuse(*rankings: tuple[Ranked, float], k: int = FUSION_K) -> Ranked:
    """The blocks of ``rankings`` (each (ranked, its weight)) by reciprocal rank fusion, best
    first: ``weight / (k + rank)`` from each ranking that holds a block (ranks from 1). Where one
    ranking alone holds blocks, it is the fusion as it is (its own scores)."""
    held = [(ranked, w) for ranked, w in rankings if ranked]
    if len(held) == 1:
        return list(held[0][0])
    score: dict[int, float] = {}
    for ranked, w in held:
        for r, (b, _) in enumerate(ranked, 1):
            score[b] = score.get(b, 0.0) + w / (k + r)
    return sorted(score.items(), key=lambda bs: (-bs[1], bs[0]))


@dataclass(frozen=True)
class Ranking:
    """How a question's candidate blocks ranked, each as (block, score), best first: by its
    retrieval heads' calibrated token attention (``heads``, every candidate), by the text index's
    BM25 (``text``, its top blocks) and by their fusion (``fused``, what ``ask`` reads and reports)."""

    heads: Ranked
    text: Ranked
    fused: Ranked


class TextRetriever:
    """The memory's text index: the blocks BM25 ranks first for the question's asked words."""

    def __init__(self, mem, tokenizer):
        self.mem, self.tokenizer = mem, tokenizer

    def rank(self, question: Question, k: int = TEXT_CANDIDATES) -> Ranked:
        if not question.words or question.n_blocks == 0:
            return []
        return self.mem.text_index.search(self.tokenizer, question.words, k, question.n_blocks)


class HeadsRetriever:
    """The retrieval ``heads``' ranking of a read question's candidate blocks (every block up to
    ``heads.candidates``, else those the heads rank first by block keys, and the blocks of
    ``also``): their calibrated attention mass, token by token (``evidence.token_attention``).
    ``quotes`` then finds the sentences of the best blocks that mass weighs most."""

    def __init__(self, mem, tokenizer, heads: EvidenceHeads, also: Ranked = ()):
        heads.check(mem.shape.n_layer, mem.shape.n_kv_head)
        self.mem, self.tokenizer, self.heads, self.also = mem, tokenizer, heads, list(also)
        self._read: tuple[Question, torch.Tensor, torch.Tensor] | None = None  # (question, mass, its blocks)

    @torch.no_grad()
    def rank(self, question: Question, k: int) -> Ranked:
        got, n = question.states, question.n_blocks
        if not question.own or n == 0:
            return []
        w = prompt_weights(list(question.own), got[0][0].shape[-2])
        blocks = candidates(self.mem, got, w, self.heads.heads, self.heads.candidates, n)
        extra = sorted({b for b, _ in self.also} - set(blocks.tolist()))
        blocks = torch.cat([blocks, torch.tensor(extra, dtype=torch.long)])
        mass = token_attention(self.mem, got, w, self.heads.heads, blocks)  # (2, K, n, bs)
        self._read = (question, mass, blocks)
        return rank_blocks(mass, blocks, min(k, len(blocks)))

    def quotes(self, question: Question, best: Sequence[int], count: int = 1) -> list[Quote]:
        """The ``count`` best quotes of ``question`` among the blocks ``best`` (``evidence.quotes``),
        by the attention ``rank`` read for it."""
        if self._read is None or self._read[0] is not question:
            return []
        _, mass, blocks = self._read
        return quotes(self.mem, self.tokenizer, mass, blocks, list(best), question.n_blocks, question.text, count,
                      question.rarity)


class ReaderRetriever:
    """The model's question ``reader``: every block's block key scored in each memory layer
    the reader weighs, by the read question's own tokens less the template's (a layer at a time:
    the cost grows with the memory's blocks; SmolLM2's shipped reader weighs all 30 layers, and
    over 520 blocks a warm ranking took 0.25 s with the prompt's reading, which alone took 0.2 s)."""

    def __init__(self, mem, reader: Reader):
        self.mem, self.reader, self.calibration = mem, reader.reader, reader.calibration

    @torch.no_grad()
    def rank(self, question: Question, k: int) -> Ranked:
        mem, reader, got, n, own = self.mem, self.reader, question.states, question.n_blocks, list(question.own)
        if n == 0 or not own:
            return []
        c, T = reader.config, question.read_ids
        mine = torch.zeros(1, 1, T)
        mine[..., own] = 1.0
        theirs = (1 - mine) / max(T - len(own), 1)  # the template's tokens (the calibration)
        mine /= len(own)
        mix = reader.weights()  # (L, H_kv)
        heads = reader.heads.view_as(mix) if c.blend else torch.zeros_like(mix)  # by the model's own queries
        total, base = torch.zeros(n), torch.zeros(n)
        for layer, (q, h, cos, sin) in enumerate(got):
            if not (mix[layer].any() or heads[layer].any()):  # a layer the reader does not weigh
                continue
            keys = mem.keys(layer, torch.arange(n)).cpu()[None]  # (1, H_kv, n, D)
            a = reader.attention(q[None, None], h[None, None], cos[None], sin[None], mine, keys, mem.backbone.scale,
                                 layers=[layer])[0, 0]  # (H_kv, n)
            own_a, null = head_attention(q[None, None], cos[None], sin[None], torch.cat([mine, theirs]), keys,
                                         mem.backbone.scale)[:, 0]  # (H_kv, n) each: the model's own queries
            if self.calibration != "template":
                null = torch.zeros_like(null)
            total += (mix[layer, :, None] * (a - null)).sum(0)
            base += (heads[layer, :, None] * (own_a - null)).sum(0)
        if c.blend:
            total = (1 - c.blend) * standardised(total) + c.blend * standardised(base)
        top = total.topk(min(k, n))
        return list(zip(top.indices.tolist(), top.values.tolist()))


def find_evidence(mem, tokenizer, heads: EvidenceHeads, question: Question, k: int,
                  count: int = 1) -> tuple[Ranking, list[Quote]]:
    """The read ``question``'s evidence by its retrieval ``heads``: the text index's ranking, the
    heads' ranking of their candidates and the text's, fused, the fusion's first ``k`` the
    passages, and the ``count`` best quotes among those (the first the quote)."""
    text = TextRetriever(mem, tokenizer).rank(question)
    by_heads = HeadsRetriever(mem, tokenizer, heads, also=text)
    ranked = by_heads.rank(question, question.n_blocks + len(text))  # (every candidate)
    if not ranked:
        return Ranking([], text, text[:k]), []
    fused = fuse((ranked, 1.0), (text, TEXT_WEIGHT))
    return Ranking(ranked, text, fused), by_heads.quotes(question, [b for b, _ in fused[:k]], count)
