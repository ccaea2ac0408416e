"""Grouped-softmax landmark attention kernels behind one dispatch function."""

import torch

from .reference import grouped_softmax, landmark_attention_reference, landmark_weights

BACKENDS = ("auto", "reference", "triton")


def landmark_attention(q, k, v, block_size, *, scale=None, backend="reference"):
    """Causal landmark attention with the grouped softmax (paper section 3.1).

    The sequence is laid out as blocks of ``block_size`` normal tokens, each followed by one
    landmark: position ``j`` is a landmark when ``j % (block_size + 1) == block_size``; a
    trailing incomplete block has none. For query ``i`` the normal tokens of its own block and
    the landmarks of earlier blocks form one softmax group; each earlier block's normal tokens
    are softmaxed among themselves and gated by the weight of that block's landmark. Landmark
    tokens get weight 0 in the output, and the query's own block landmark is ignored.

    Parameters
    ----------
    q, k, v : Tensor (B, H, T, D), same dtype and device.
    block_size : int, normal tokens per block (>= 1).
    scale : float, optional, score scale; default ``1 / sqrt(D)``.
    backend : {"reference", "triton", "auto"}
        ``"reference"``: plain PyTorch with autograd, O(T^2) memory.
        ``"triton"``: fused forward and backward, O(T) memory; CUDA tensors (or CPU tensors
        under ``TRITON_INTERPRET=1``), head dims 16-256 in powers of two.
        ``"auto"``: Triton on CUDA tensors, the reference elsewhere.

    Returns
    -------
    Tensor (B, H, T, D).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (B, H, T, D), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.shape != k.shape or q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"q, k, v shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         "q and k must match and v must share (B, H, T)")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and device")
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from .triton_landmark import landmark_attention_triton

        return landmark_attention_triton(q, k, v, block_size, scale)
    return landmark_attention_reference(q, k, v, block_size, scale)


__all__ = ["landmark_attention", "landmark_attention_reference", "landmark_weights", "grouped_softmax", "BACKENDS"]
