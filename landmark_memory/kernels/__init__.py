"""Grouped-softmax landmark attention kernels behind one dispatch function, and the ordinary
softmax over local and retrieved blocks of a memory without landmarks (``plain.py``)."""

import torch

from ..core.layout import check_block_size
from ..core.quant import dequantize_kv
from ..core.rope import RotaryEmbedding
from .dense import landmark_attention_dense, landmark_inference_dense, local_group_logsumexp
from .plain import block_inference_dense, block_inference_reference
from .reference import grouped_softmax, landmark_attention_reference, landmark_inference_reference, landmark_weights
from .window import sliding_window_attention

BACKENDS = ("auto", "reference", "dense", "triton", "triton-onepass", "numba")
FEW_QUERIES = 16  # queries per head below which (decoding) "auto" takes the compiled CPU kernel


def landmark_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, *, scale: float
                       | None = None,
                       cmt_k: torch.Tensor | None = None, cmt_blocks: torch.Tensor | None = None,
                       backend: str = "reference") -> torch.Tensor:
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
    cmt_k : Tensor (B, H, 1, D), optional, the Context Miss Token's key (appendix D), rotated
        at position -1 (one before the first key). With it, the landmarks flagged in
        ``cmt_blocks`` leave the query's group for a group of their own, gated by the CMT's
        share of the query's group (equations 5-6).
    cmt_blocks : bool Tensor (B, T // (block_size + 1)), with ``cmt_k``: which landmarks
        (blocks) are CMT-controlled.
    backend : {"auto", "reference", "dense", "triton", "triton-onepass"}
        (``"numba"`` serves ``landmark_attention_inference`` only)
        ``"reference"``: the paper's equations in plain PyTorch with autograd, O(T^2) memory.
        ``"dense"``: one softmax over effective scores in plain PyTorch with autograd, O(T^2)
        memory, about 1.6x faster than the reference on CPUs.
        ``"triton"``: fused forward and backward, O(T) memory; CUDA tensors (or CPU tensors
        under ``TRITON_INTERPRET=1``), head dims 16-256 in powers of two.
        ``"triton-onepass"``: the same contract with one exponential per score
        (``triton_onepass.py``), no Context Miss Token; kept beside ``"triton"`` until a GPU has
        timed both.
        ``"auto"``: Triton on CUDA tensors, dense elsewhere.

    Returns
    -------
    Tensor (B, H, T, D).
    """
    _check_common(q, k, v, block_size, backend)
    if backend == "numba":
        raise ValueError("the numba backend serves landmark_attention_inference only; use auto, dense or triton")
    if q.shape != k.shape:
        raise ValueError(f"q and k shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}")
    _check_cmt(q, cmt_k)
    if (cmt_k is None) != (cmt_blocks is None):
        raise ValueError("cmt_k and cmt_blocks go together: give both (a Context Miss Token model) or neither")
    n_lm = q.shape[-2] // (block_size + 1)
    if cmt_blocks is not None and (cmt_blocks.dtype != torch.bool or tuple(cmt_blocks.shape) != (q.shape[0], n_lm)):
        raise ValueError(f"cmt_blocks must be a bool tensor (B={q.shape[0]}, landmarks={n_lm}), got "
                         f"{cmt_blocks.dtype} {tuple(cmt_blocks.shape)}")
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from .triton_landmark import landmark_attention_triton

        return landmark_attention_triton(q, k, v, block_size, scale, cmt_k, cmt_blocks)
    if backend == "triton-onepass":
        from .triton_landmark import _check_backend
        from .triton_onepass import landmark_attention_onepass

        if cmt_k is not None:
            raise ValueError("the triton-onepass backend has no Context Miss Token path; use backend='triton'")
        default_scale = _check_backend(q)
        return landmark_attention_onepass(q, k, v, block_size, default_scale if scale is None else float(scale))
    if backend == "reference":
        return landmark_attention_reference(q, k, v, block_size, scale, cmt_k, cmt_blocks)
    return landmark_attention_dense(q, k, v, block_size, scale, cmt_k, cmt_blocks)


def landmark_attention_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, *,
                                 pool_k: torch.Tensor, pool_v: torch.Tensor, block_table: torch.Tensor,
                                 block_pos: torch.Tensor, rope: RotaryEmbedding | float = 10000.0, scale: float
                                 | None = None,
                                 cmt_k: torch.Tensor | None = None, pool_scale: torch.Tensor | None = None,
                                 backend: str = "auto", check: bool = True) -> torch.Tensor:
    """Attention of a chunk of queries over its local keys and retrieved memory blocks.

    The local keys ``k``, ``v`` start at a block boundary and follow the in-sequence rules of
    ``landmark_attention``; the queries are their last ``T_q`` positions (``T_q = 1`` while
    decoding: the local keys are then the current block so far). Each query also sees up to
    ``K`` blocks of a shared pool, listed per (batch, head, query) in ``block_table``. A
    retrieved block behaves exactly like an earlier in-sequence block: its landmark joins the
    query's own softmax group and gates the block's normal tokens. The pool may hold fewer
    key/value heads than there are query heads (grouped-query attention): query head ``h``
    reads pool head ``h // (H // H_kv)``.

    Positions: ``q`` and ``k`` come rotated (RoPE) at the positions the caller chose. Pool keys
    are stored rotated by their offset inside their block (row t by ``t``), so one pool entry
    serves every query; ``block_pos`` says where each listed block starts, and the kernel
    rotates the query by ``-block_pos`` (RoPE scores depend only on position differences). No
    per-query copy of any block is made.

    Parameters
    ----------
    q : Tensor (B, H, T_q, D), rotated queries.
    k, v : Tensor (B, H, T_k, D), local keys (rotated) and values, T_k >= T_q.
    block_size : int, normal tokens per block.
    pool_k, pool_v : Tensor (n_pool, H_kv, block_size + 1, D), retrieved blocks, landmark last;
        keys rotated by row offset; H_kv divides H. In q's dtype, or int8 with ``pool_scale``.
    block_table : int Tensor (B, H, T_q, K), pool indices; -1 marks an empty slot.
    block_pos : int Tensor (B, H, T_q, K), start position of each listed block.
    rope : the model's ``RotaryEmbedding`` (``rope.py``), or the base of plain RoPE.
    scale : float, optional; default ``1 / sqrt(D)``.
    cmt_k : Tensor (B, H, 1, D), optional, the Context Miss Token's key rotated at its position
        (appendix D). With it every retrieved landmark is CMT-controlled and every local one
        free; a query whose slots are all empty gives up the CMT's share, which is exactly what
        skipping its retrieval means (``cmt_share`` says how large that share is).
    pool_scale : float32 Tensor (n_pool, H_kv, D + block_size + 1), optional, with int8 pools
        (an int8 store's blocks as the hot cache holds them, ``quant.py``): per block and head
        the keys' channel scales, then the values' row scales. Every backend reads the int8
        rows in place and folds the scales into the query and the weights; the reference
        dequantizes the pool first.
    backend : {"auto", "reference", "dense", "triton", "numba"}, as for ``landmark_attention``; the
        Triton path is inference only (no autograd). ``"numba"``: one compiled loop nest per query
        on the CPU (numba_decode.py), float32 or float64, no autograd; ``"auto"`` takes it for
        fewer than ``FEW_QUERIES`` queries per head (decoding), where the dense path's many
        small operations cost more than its arithmetic; for a chunk, the dense path with its
        retrieved blocks read by compiled loops in parallel over queries (numba_slots.py), where
        grouping slots by block for PyTorch's batched products costs more than they save.
    check : bool, validate the arguments (shapes, dtypes, table entries in range); callers that
        build them by construction (``LandmarkMemory``, at every layer of every step) pass False.

    Returns
    -------
    Tensor (B, H, T_q, D).
    """
    T_q = q.shape[2]
    if backend == "triton-onepass":
        raise ValueError("the triton-onepass backend serves landmark_attention only; use auto or triton")
    if check:
        _check_inference(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, cmt_k, pool_scale, backend)
    if pool_k.shape[0] == 0:  # nothing to retrieve: every slot is empty
        block_table, block_pos = block_table[..., :0], block_pos[..., :0]
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from .triton_inference import landmark_inference_triton

        return landmark_inference_triton(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope, scale,
                                         cmt_k, pool_scale)
    compiled = _compiled_cpu(q, k, v, pool_k, pool_v, cmt_k)
    if backend == "numba" and not compiled:
        raise ValueError(f"the numba backend takes float32 or float64 CPU tensors without autograd, got {q.dtype} "
                         f"on {q.device}{' needing gradients' if torch.is_grad_enabled() else ''}; use auto or dense")
    if backend == "numba" or (backend == "auto" and compiled and T_q < FEW_QUERIES):
        from .numba_decode import landmark_inference_numba

        return landmark_inference_numba(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope, scale,
                                        cmt_k, pool_scale)
    if backend == "reference":
        if pool_scale is not None:
            pool_k, pool_v = dequantize_kv(pool_k, pool_v, pool_scale, q.dtype)
        return landmark_inference_reference(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope,
                                            scale, cmt_k)
    retrieved = None
    if backend == "auto" and compiled:
        from .numba_slots import retrieved_compiled as retrieved
    return landmark_inference_dense(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, rope, scale,
                                    cmt_k, retrieved, pool_scale)


def block_attention_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pool_k: torch.Tensor,
                              pool_v: torch.Tensor, block_table: torch.Tensor, block_pos: torch.Tensor,
                              rope: RotaryEmbedding | float = 10000.0, scale: float | None = None,
                              pool_scale: torch.Tensor | None = None, shared: int = 0, backend: str = "auto",
                              check: bool = True) -> torch.Tensor:
    """Ordinary softmax attention of a chunk of queries over its local keys and retrieved
    blocks without landmarks (``plain.py``): each query's scores against the local keys it sees
    (causal) and against every row of each of its retrieved blocks form one softmax.

    Arguments as ``landmark_attention_inference``'s, except that a block's ``L`` rows are all
    tokens: ``pool_k``, ``pool_v`` (n_pool, H_kv, L, D), keys rotated by row offset; and
    ``pool_scale`` (n_pool, H_kv, D + L) with an int8 pool. ``shared``: the table's last
    ``shared`` columns name, per stream and head, the same blocks at the same positions for every
    query (the sink and local blocks; every column where the retrieval is per head), which the
    fast paths read with the local keys in one product for ``FEW_QUERIES`` queries or more.
    ``backend``: ``"reference"`` gathers each query's blocks (the definition); any other reads
    the blocks in place, their slots scored by compiled loops on CPUs (float32 or float64, no
    autograd) and by PyTorch elsewhere.

    Returns
    -------
    Tensor (B, H, T_q, D).
    """
    if check:
        rows = pool_k.shape[2] if isinstance(pool_k, torch.Tensor) and pool_k.dim() == 4 else 1
        _check_inference(q, k, v, rows, pool_k, pool_v, block_table, block_pos, None, pool_scale, backend,
                         landmarks=False)
        _check_shared(block_table, block_pos, shared)
    if pool_k.shape[0] == 0:  # nothing to retrieve: every slot is empty
        block_table, block_pos, shared = block_table[..., :0], block_pos[..., :0], 0
    if q.shape[2] < FEW_QUERIES:  # a decoding step: its few queries read each block once, as slots
        shared = 0
    if backend == "reference":
        if pool_scale is not None:
            pool_k, pool_v = dequantize_kv(pool_k, pool_v, pool_scale, q.dtype)
        return block_inference_reference(q, k, v, pool_k, pool_v, block_table, block_pos, rope, scale)
    retrieved = None
    if _compiled_cpu(q, k, v, pool_k, pool_v):
        from .numba_slots import retrieved_compiled as retrieved
    return block_inference_dense(q, k, v, pool_k, pool_v, block_table, block_pos, rope, scale, retrieved, pool_scale,
                                 shared)


def cmt_share(q: torch.Tensor, k: torch.Tensor, block_size: int, cmt_k: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """S_{i,-1}: the Context Miss Token's share of each query's own group, from the local keys
    alone (the retrieved landmarks are CMT-controlled and outside that group).

    Parameters
    ----------
    q : Tensor (B, H, T_q, D), rotated queries, the last T_q of the local positions.
    k : Tensor (B, H, T_k, D), rotated local keys starting at a block boundary.
    block_size : int.
    cmt_k : Tensor (B, H, 1, D), the CMT's rotated key.

    Returns
    -------
    Tensor (B, H, T_q) float32 in (0, 1): below a cutoff, the query's retrieval can be
    skipped (appendix D).
    """
    _check_cmt(q, cmt_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, cmt_k = q.float(), k.float(), cmt_k.float()
    lse = local_group_logsumexp((q @ k.transpose(-2, -1)) * scale, block_size)  # (B, H, T_q)
    s_cmt = ((q @ cmt_k.transpose(-2, -1)) * scale)[..., 0]  # (B, H, T_q)
    return torch.sigmoid(s_cmt - lse)


def _compiled_cpu(q, *tensors):
    """Whether the compiled CPU loops can take a call: float32 or float64 on the CPU, nothing
    needing gradients (``tensors`` may hold None)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, *tensors)))


def _check_inference(q, k, v, block_size, pool_k, pool_v, block_table, block_pos, cmt_k, pool_scale, backend,
                     landmarks=True):
    _check_common(q, k, v, block_size, backend)
    B, H, T_q, D = q.shape
    if k.shape[:2] != (B, H) or k.shape[-1] != D or k.shape[-2] < T_q:
        raise ValueError(f"local keys k {tuple(k.shape)} must be (B, H, T_k, D) with T_k >= T_q for q {tuple(q.shape)}")
    L = block_size + landmarks
    for name, t in (("pool_k", pool_k), ("pool_v", pool_v)):
        if t.dim() != 4 or t.shape[2:] != (L, D) or H % max(t.shape[1], 1) or t.shape != pool_k.shape:
            raise ValueError(f"{name} must be (n_pool, H_kv, {'block_size + 1' if landmarks else 'rows'}={L}, D={D}) "
                             f"with H_kv dividing H={H}, pool_k and pool_v alike; got {tuple(t.shape)}")
        if t.dtype != (q.dtype if pool_scale is None else torch.int8) or t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}) in q's dtype ({q.dtype}), or int8 with "
                             f"pool_scale; got {t.dtype} on {t.device}")
    if pool_scale is not None and (tuple(pool_scale.shape) != (*pool_k.shape[:2], D + L) or
                                   pool_scale.dtype != torch.float32 or pool_scale.device != q.device):
        raise ValueError(f"pool_scale must be float32 (n_pool, H_kv, D + rows) = "
                         f"{(*pool_k.shape[:2], D + L)} on q's device, got {pool_scale.dtype} "
                         f"{tuple(pool_scale.shape)}")
    for name, t in (("block_table", block_table), ("block_pos", block_pos)):
        if t.dim() != 4 or t.shape[:3] != (B, H, T_q) or t.dtype.is_floating_point:
            raise ValueError(f"{name} must be an integer tensor (B={B}, H={H}, T_q={T_q}, K), got "
                             f"{t.dtype} {tuple(t.shape)}")
    if block_pos.shape != block_table.shape:
        raise ValueError(f"block_pos {tuple(block_pos.shape)} must match block_table {tuple(block_table.shape)}")
    if not q.is_cuda and block_table.numel() and not (-1 <= (r := torch.aminmax(block_table)).min and
                                                      r.max < pool_k.shape[0]):
        raise ValueError(f"block_table entries must be -1 (empty) or pool indices in [0, {pool_k.shape[0]})")
    _check_cmt(q, cmt_k)


def _check_shared(block_table, block_pos, shared):
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= block_table.shape[-1]:
        raise ValueError(f"shared must be a count of the table's {block_table.shape[-1]} columns, got {shared!r}")
    for name, t in (("block_table", block_table), ("block_pos", block_pos)):
        last = t[..., t.shape[-1] - shared:]
        if not (last == last[:, :, :1]).all():
            raise ValueError(f"the last shared={shared} columns of {name} must be the same for every query of a "
                             "stream and head")


def _check_cmt(q, cmt_k):
    if cmt_k is not None and (cmt_k.dim() != 4 or cmt_k.shape[:2] != q.shape[:2] or cmt_k.shape[2:] != (1, q.shape[-1])
                              or cmt_k.dtype != q.dtype or cmt_k.device != q.device):
        raise ValueError(f"cmt_k must be (B, H, 1, D) = {(*q.shape[:2], 1, q.shape[-1])} with q's dtype and device, "
                         f"got {cmt_k.dtype} {tuple(cmt_k.shape)}")


def _check_common(q, k, v, block_size, backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    check_block_size(block_size)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (B, H, T, D), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share (B, H, T)")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and device")


__all__ = ["landmark_attention", "landmark_attention_inference", "block_attention_inference", "cmt_share",
           "landmark_inference_reference", "landmark_attention_dense", "landmark_inference_dense",
           "landmark_attention_reference", "landmark_weights", "grouped_softmax", "sliding_window_attention",
           "BACKENDS"]
