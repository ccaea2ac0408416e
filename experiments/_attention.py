"""A question's own landmark attention over a memory's blocks, per (layer, key/value head), and
block rankings by it (``exp_heads.py`` chooses retrieval heads by it, ``exp_natural.py`` ranks
the passages of natural questions by them)."""

import torch

NULL = "N/A"  # the content-free question whose block attention is subtracted (QRHead's and ICR's calibration)


@torch.no_grad()
def block_attention(m, tok, question, n_blocks):
    """float32 (n_layer, n_kv_head, n_blocks): each (layer, key/value head)'s attention over the
    memory's first ``n_blocks`` blocks by landmark score at stingy's slot 0, of the question's
    own tokens read as ``ask`` reads them (the chat template) after the memory ``m`` (rewound
    first): a softmax over the blocks, averaged over the question's tokens and the head's
    query heads."""
    m.rewind()
    prompt, asked = tok.encode(tok.chat_prompt(question)).ids, tok.encode(question).ids
    at = next(i for i in range(len(prompt)) if prompt[i:i + len(asked)] == asked)
    queries, retrieve = [None] * m.shape.n_layer, m._retrieve

    def recording(layer, q, qr, *a):
        if queries[layer] is None:
            queries[layer] = qr[0, :, at:at + len(asked)].float()  # (H, t, D), rotated where they stand
        return retrieve(layer, q, qr, *a)

    m._retrieve = recording
    try:
        m.forward(torch.tensor([prompt]), logits="none")
    finally:
        del m._retrieve  # the class's again
    bs, G, ids = m.shape.block_size, m.group, torch.arange(n_blocks)
    out = []
    for layer, q in enumerate(queries):
        keys = m.rope(m.blocks.landmark_keys(layer, ids), torch.full((n_blocks,), bs)).float()[0]  # (H_kv, n, D)
        s = torch.einsum("htd,hnd->htn", q, keys.repeat_interleave(G, 0)) * m.backbone.scale  # (H, t, n)
        out.append(s.softmax(-1).mean(1).view(-1, G, n_blocks).mean(1))  # (H_kv, n)
    return torch.stack(out)


def rank_of(scores, blocks):
    """1-based rank of the best of ``blocks`` in ``scores`` (n,), higher first."""
    order = torch.argsort(scores, descending=True).tolist()
    return min(order.index(b) for b in blocks) + 1


def pooled_rank(att, heads, blocks):
    """Rank of the fact's ``blocks`` by the calibrated attention ``att`` (n_layer, H_kv, n) of ``heads`` pooled."""
    return rank_of(sum(att[layer, h] for layer, h in heads), blocks)
