"""The inference kernel's test cases: a memory of random blocks and a table that reads them all."""

import torch

from landmark_memory import RotaryEmbedding

TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def memory_setup(B, H, D, block_size, n_mem, Tk, dtype=torch.float64, seed=0):
    """A text of n_mem memory blocks then Tk local positions; the memory as a block pool."""
    g = torch.Generator().manual_seed(seed)
    L = block_size + 1
    T = n_mem * L + Tk
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))
    rope = RotaryEmbedding(D)
    qr, kr = rope(q, torch.arange(T)), rope(k, torch.arange(T))

    def blocks(x):  # (B, H, n_mem * L, D) -> (B * n_mem, H, L, D): one pool entry per (batch, block)
        return x[:, :, :n_mem * L].reshape(B, H, n_mem, L, D).transpose(1, 2).reshape(B * n_mem, H, L, D)

    pool_k = rope(blocks(k), torch.arange(L))  # rotated by the offset inside the block
    return dict(q=qr, k=kr, v=v, pool_k=pool_k, pool_v=blocks(v), T=T, local=n_mem * L)


def all_blocks_table(B, H, T_q, n_mem, block_size, extra_empty=1, perm=None):
    order = torch.arange(n_mem) if perm is None else perm
    table = (torch.arange(B)[:, None, None, None] * n_mem + order).expand(B, H, T_q, n_mem)
    table = torch.cat([table, torch.full((B, H, T_q, extra_empty), -1)], -1)
    return table, (table % n_mem) * (block_size + 1)
