"""int8 blocks: the stored form of a compact store, and the one way back to floats.

A block's keys and values (2, H, L, D) are quantized symmetrically per key/value head: keys
with one scale per channel (max over the block's L rows), values with one scale per row (max
over its D channels). Keys carry a few channels far larger than the rest (the rotary
embedding's slow pairs), so a scale per channel keeps the small ones; a value row is one
token's vector, so a scale per row keeps quiet tokens apart from loud ones. The scales, (H,
D + L) per block, keys' first, are kept as float16 on disk and float32 in the kernels. Both
kinds of scale fold into the attention for free: a key scale multiplies the query's channel
once per block, a value scale the row's weight.
"""

import torch

QMAX = 127  # symmetric: -127..127, so that negating a value never overflows


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(H, D + L): the scales of one block entry of ``shape`` (2, H, L, D)."""
    _, H, L, D = shape
    return H, D + L


def quantize(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks to their int8 form.

    Parameters
    ----------
    kv : float Tensor (n, 2, H, L, D), keys then values.

    Returns
    -------
    data : int8 Tensor (n, 2, H, L, D); scales : float16 Tensor (n, H, D + L), the keys'
    per-channel scales then the values' per-row scales; ``dequantize(data, scales)`` is within
    half a scale step of ``kv`` everywhere.
    """
    kv = kv.float()
    k, v = kv[:, 0], kv[:, 1]  # (n, H, L, D) each
    scales = torch.cat([k.abs().amax(2), v.abs().amax(3)], -1).div_(QMAX).to(torch.float16)  # (n, H, D + L)
    sk, sv = _split(scales.float(), k.shape[-1])
    data = torch.stack([k / sk.clamp_min(1e-30), v / sv.clamp_min(1e-30)], 1)  # a zero scale goes with zero values
    return data.round_().clamp_(-QMAX, QMAX).to(torch.int8), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 (n, 2, H, L, D) blocks from int8 ``data`` (n, 2, H, L, D) and ``scales`` (n, H, D + L)."""
    return torch.stack(dequantize_kv(data[:, 0], data[:, 1], scales), 1)


def dequantize_kv(k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (n, H, L, D) in ``dtype`` from int8 ``k``, ``v`` (n, H, L, D) and their
    ``scales`` (n, H, D + L)."""
    sk, sv = _split(scales.float(), k.shape[-1])
    return (k.float() * sk).to(dtype), (v.float() * sv).to(dtype)


def _split(scales, D):
    """Scales (n, H, D + L) as factors that broadcast over a block's keys and values (n, H, L, D)."""
    return scales[..., None, :D], scales[..., D:, None]
