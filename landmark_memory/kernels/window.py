"""Sliding-window attention: the plain causal softmax of a layer that attends only to its last
``window`` positions (Gemma 3's local layers). Such a layer keeps no memory: in sequence and
through a memory alike it reads the same positions, so one function serves both."""

import torch
import torch.nn.functional as F


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention over the last ``window`` positions, each query's own included
    (transformers' sliding window: key ``j`` is seen by query ``i`` when ``i - window < j <= i``).

    Parameters
    ----------
    q : Tensor (B, H, T_q, D), rotated queries: the last ``T_q`` of the ``T_k`` key positions.
    k, v : Tensor (B, H_kv, T_k, D), rotated keys and values, T_k >= T_q; H_kv divides H
        (grouped-query attention: query head ``h`` reads key/value head ``h // (H // H_kv)``).
    window : int >= 1, positions each query reads.
    scale : float, optional; default ``1 / sqrt(D)``.

    Returns
    -------
    Tensor (B, H, T_q, D).
    """
    B, H, T_q, D = q.shape
    Tk, G = k.shape[2], H // k.shape[1]
    if window < 1 or Tk < T_q or k.shape[1] * G != H:
        raise ValueError(f"sliding_window_attention needs window >= 1 (got {window}), T_k >= T_q "
                         f"(k {tuple(k.shape)}, q {tuple(q.shape)}) and H_kv dividing H")
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (B, H, Tk, D)
    if T_q == 1 and Tk <= window:  # a decoding step over its window: every key is seen, no mask to build
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    i = torch.arange(Tk - T_q, Tk, device=q.device)[:, None]  # (T_q, 1) the queries' positions
    j = torch.arange(Tk, device=q.device)  # (Tk,)
    seen = (j <= i) & (j > i - window)  # (T_q, Tk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale)
