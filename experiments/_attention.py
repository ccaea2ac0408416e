"""A question's own landmark attention over a memory's blocks, per (layer, key/value head), and
block rankings by it (``exp_heads.py`` chooses retrieval heads by it, ``exp_natural.py`` ranks
the passages of natural questions by them)."""

import torch

NULL = "N/A"  # the content-free question whose block attention is subtracted (QRHead's and ICR's calibration)


@torch.no_grad()
def question_states(m, tok, question):
    """What a question's prompt searches the memory ``m`` with, read as ``ask`` reads it (the
    chat template) after the memory (rewound first): per memory layer the raw queries of every
    prompt token float32 (n_layer, H, T, D), the layer inputs (the residual stream) float32
    (n_layer, T, C), the rotation ``(cos, sin)`` (T, D) each that moves a raw query to where it
    searches older blocks from (stingy's slot 0: the same distance for every block), and the
    slice of the prompt that is the question's own tokens (the rest is the template's)."""
    m.rewind()
    prompt, asked = tok.encode(tok.chat_prompt(question)).ids, tok.encode(question).ids
    at = next(i for i in range(len(prompt)) if prompt[i:i + len(asked)] == asked)
    P, bs = m.pending_count, m.shape.block_size
    # rows of the prompt's tokens among the step's positions (landmarks sit after every bs tokens)
    rows = [P + j + (P + j) // bs - (P + P // bs) for j in range(len(prompt))]
    layers = m.shape.n_layer
    queries, inputs, angles = [None] * layers, [None] * layers, []
    retrieve, qkv = m._retrieve, m.backbone.qkv

    def recording_qkv(layer, h):
        if inputs[layer] is None:
            inputs[layer] = h[0, rows].float()  # (T, C)
        return qkv(layer, h)

    def recording(layer, q, qr, at_search, *a):
        if queries[layer] is None:
            if rows[-1] >= q.shape[2]:
                raise ValueError("the prompt crossed a chunk boundary: its positions are not one step's")
            queries[layer] = q[0, :, rows].float()  # (H, T, D)
            angles.append(tuple(x[rows].float() for x in at_search))
        return retrieve(layer, q, qr, at_search, *a)

    m._retrieve, m.backbone.qkv = recording, recording_qkv
    try:
        m.forward(torch.tensor([prompt]), logits="none")
    finally:
        del m._retrieve, m.backbone.qkv  # the classes' again
    return torch.stack(queries), torch.stack(inputs), angles[0], slice(at, at + len(asked))


def landmark_keys(m, n_blocks):
    """float32 (n_layer, H_kv, n_blocks, D): the raw landmark keys of the memory's first blocks."""
    ids = torch.arange(n_blocks)
    return torch.stack([m.blocks.landmark_keys(layer, ids)[0].float() for layer in range(m.shape.n_layer)])


def attention_of(queries, angles, keys, scale):
    """float32 (n_layer, H_kv, n): each (layer, key/value head)'s attention over the blocks by
    landmark score of the rotated ``queries`` (n_layer, H, t, D) against ``keys`` (n_layer, H_kv,
    n, D): a softmax over the blocks, averaged over the tokens and the head's query heads."""
    cos, sin = angles
    x1, x2 = queries.chunk(2, -1)
    qs = queries * cos + torch.cat((x2, x1), -1) * sin  # (n_layer, H, t, D), as ``RoPE.rotate``
    G = queries.shape[1] // keys.shape[1]
    s = torch.einsum("lhtd,lhnd->lhtn", qs, keys.repeat_interleave(G, 1)) * scale  # (n_layer, H, t, n)
    return s.softmax(-1).mean(2).unflatten(1, (-1, G)).mean(2)


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
