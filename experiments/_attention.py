"""A question's own landmark attention over a memory's blocks, per (layer, key/value head), and
block rankings by it (``exp_heads.py`` chooses retrieval heads by it, ``exp_natural.py`` ranks
the passages of natural questions by them)."""

import torch

from landmark_memory.models.reader import NULL, head_attention
from landmark_memory.uses.question import question_tokens, search_states

__all__ = ["NULL", "attention_of", "block_attention", "landmark_keys", "pooled_rank", "question_states", "rank_of"]


@torch.no_grad()
def question_states(m, tok, question):
    """What a question's prompt searches the memory ``m`` with, read as ``ask`` reads it (the
    chat template) after the memory (rewound first): per memory layer the raw queries of every
    prompt token float32 (n_layer, H, T, D), the layer inputs (the residual stream) float32
    (n_layer, T, C), the rotation ``(cos, sin)`` (T, D) each that moves a raw query to where it
    searches older blocks from (stingy's slot 0: the same distance for every block), and the
    slice of the prompt that is the question's own tokens (the rest is the template's)."""
    m.rewind()
    prompt = tok.chat_prompt(question)
    encoded = tok.encode(prompt)
    own = question_tokens(encoded.offsets, prompt, question)
    q, h, cos, sin = zip(*search_states(m, encoded.ids))
    return torch.stack(q), torch.stack(h), (cos[0], sin[0]), slice(own[0], own[-1] + 1)


def landmark_keys(m, n_blocks):
    """float32 (n_layer, H_kv, n_blocks, D): the raw landmark keys of the memory's first blocks."""
    ids = torch.arange(n_blocks)
    return torch.stack([m.keys(layer, ids) for layer in range(m.shape.n_layer)])


def attention_of(queries, angles, keys, scale):
    """float32 (n_layer, H_kv, n): each (layer, key/value head)'s attention over the blocks by
    landmark score of the ``queries`` (n_layer, H, t, D), not rotated, against ``keys``
    (n_layer, H_kv, n, D) (``models.reader.head_attention``, the tokens alike)."""
    cos, sin = angles
    alike = torch.full((1, 1, queries.shape[2]), 1 / queries.shape[2])
    return head_attention(queries[None], cos[None], sin[None], alike, keys,
                          scale)[0, 0].unflatten(0, (keys.shape[0], -1))


@torch.no_grad()
def block_attention(m, tok, question, n_blocks):
    """float32 (n_layer, n_kv_head, n_blocks): each (layer, key/value head)'s attention over the
    memory's first ``n_blocks`` blocks by landmark score at stingy's slot 0, of the question's
    own tokens read as ``ask`` reads them (``question_states``)."""
    queries, _, (cos, sin), own = question_states(m, tok, question)
    return attention_of(queries[:, :, own], (cos[own], sin[own]), landmark_keys(m, n_blocks), m.backbone.scale)


def rank_of(scores, blocks):
    """1-based rank of the best of ``blocks`` in ``scores`` (n,), higher first."""
    order = torch.argsort(scores, descending=True).tolist()
    return min(order.index(b) for b in blocks) + 1


def pooled_rank(att, heads, blocks):
    """Rank of the fact's ``blocks`` by the calibrated attention ``att`` (n_layer, H_kv, n) of ``heads`` pooled."""
    return rank_of(sum(att[layer, h] for layer, h in heads), blocks)
