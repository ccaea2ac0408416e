"""The recall loss: a drill's answers teach the landmarks where to look.

The paper trains retrieval only through the language-model loss: a landmark's key learns to
stand for its block because the grouped softmax weighs the block's tokens by it. At inference
each query retrieves the blocks whose landmarks score highest against it, so what counts is the
landmarks' ranking, which the language-model loss shapes only as far as a wrong ranking costs
the next token. A drill knows more: for every answer token, the window's text the answer is
read from (``data.Answer.sources``: a planted fact, a quoted sentence). The recall loss asks
the landmark scores of each answer token's query to rank the blocks of that text first:

- the query is the one that predicts the answer token (its target), at its in-sequence
  position, with RoPE, as the attention scores it (the backbone's ``scale``);
- per layer and head, a softmax over the landmark scores of the complete blocks before the
  query's own (those the grouped softmax and the memory can weigh), and the probability on the
  source's blocks among them; a source in the query's own block is local and asks nothing;
- per layer, the probability averaged over heads before the log (retrieval is per head: a layer
  does well when some of its heads look there), then ``-log`` averaged over layers and queries.

Layer 0's landmark keys are all equal (a landmark's first-layer key is its embedding), so its
term is a constant of the counts and teaches nothing; it is kept for a plain average.
"""

import math

import torch

from ..core.layout import landmark_mask, landmarked_length, normal_positions
from ..models.backbone import Backbone


def recall_queries(answer: torch.Tensor, source: torch.Tensor, block_size: int):
    """The queries the recall loss scores and the blocks each should find.

    Parameters
    ----------
    answer, source : int64 (B, T), as ``data.Batch`` has them: ``answer[b, t] = j`` > 0 where
        position t predicts a token of row b's j-th answer, ``source[b, t] = j`` where token t is
        text that answer is read from.
    block_size : int, normal tokens per block.

    Returns
    -------
    rows, tokens : int64 (N,), the row and normal-token position of each query that has a
        source block before its own.
    want, visible : bool (N, T // block_size): the source's blocks before the query's own, and
        every block before the query's own.
    """
    B, T = answer.shape
    nb = T // block_size
    rows, tokens = (answer > 0).nonzero(as_tuple=True)  # (N,) each
    j = answer[rows, tokens]  # (N,)
    blocks = source[:, :nb * block_size].view(B, nb, block_size)  # (B, nb, block_size)
    visible = torch.arange(nb, device=answer.device) < (tokens // block_size)[:, None]  # (N, nb)
    want = (blocks[rows] == j[:, None, None]).any(-1) & visible  # (N, nb)
    keep = want.any(1)
    return rows[keep], tokens[keep], want[keep], visible[keep]


def recall_loss(backbone: Backbone, hidden: list[torch.Tensor], answer: torch.Tensor,
                source: torch.Tensor) -> torch.Tensor:
    """The recall loss (module docstring) of one forward pass.

    Parameters
    ----------
    backbone : the model's layers (``Backbone``), whose ``qkv`` makes the queries and keys.
    hidden : one (B, T', C) tensor per layer, that layer's input over the landmarked sequence
        (T' = T + T // block_size).
    answer, source : int64 (B, T), as ``recall_queries`` takes them.

    Returns
    -------
    A scalar tensor, 0 (without a gradient) when no answer has a source block before it.
    """
    bs, H = backbone.block_size, backbone.n_head
    if len(hidden) != backbone.n_layer:
        raise ValueError(f"need one hidden state per layer ({backbone.n_layer}), got {len(hidden)}")
    rows, tokens, want, visible = recall_queries(answer, source, bs)
    if not len(rows):
        return hidden[0].new_zeros(())
    rope = backbone.rope
    T = answer.shape[1]
    q_pos = normal_positions(T, bs, answer.device)[tokens]  # (N,) in the landmarked sequence
    lm_pos = landmark_mask(landmarked_length(T, bs), bs, answer.device).nonzero().squeeze(1)  # (nb,)
    G = H // backbone.n_kv_head
    total = hidden[0].new_zeros(())
    for layer, h in enumerate(hidden):
        q = backbone.qkv(layer, h[rows, q_pos][None])[0][0]  # (H, N, D)
        k = backbone.qkv(layer, h[:, lm_pos])[1]  # (B, H_kv, nb, D)
        q, k = rope(q, q_pos), rope(k, lm_pos).repeat_interleave(G, 1)[rows]  # (H, N, D), (N, H, nb, D)
        s = torch.einsum("hnd,nhcd->nhc", q.float(), k.float()) * backbone.scale  # (N, H, nb)
        logp = s.masked_fill(~visible[:, None], -math.inf).log_softmax(-1)
        found = logp.masked_fill(~want[:, None], -math.inf).logsumexp(-1)  # (N, H): log P(source's blocks)
        total = total - (found.logsumexp(-1) - math.log(H)).mean()
    return total / len(hidden)
