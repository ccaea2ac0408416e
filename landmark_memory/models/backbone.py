"""The layer stack a memory drives, for each kind of model it supports.

``LandmarkMemory`` runs a model one layer at a time (it must attend over retrieved blocks
between the projections and the output), so it needs the pieces of each layer, not the whole
forward. A backbone gives them with one interface:

    h = embed(ids)                        # (B, T, C)
    q, k, v = qkv(layer, h)               # (B, H, T, D), (B, H_kv, T, D) x 2, no RoPE
    h = finish(layer, h, y)               # y (B, H, T, D): output projection, residual, MLP
    logits = head(h)                      # (B, T, vocab)

and what else the memory needs: ``n_layer, n_head, n_kv_head, head_dim, block_size,
landmark_id, vocab_size``, the model's ``rope`` (a ``RotaryEmbedding``: the positions' pure
rotation, with the model's frequencies) and ``scale``, the attention's score scale (``D**-0.5``
unless the model says otherwise; a RoPE that multiplies cos and sin, as YaRN does, multiplies
it by that factor squared). ``n_kv_head < n_head`` is grouped-query attention:
query head ``h`` reads key/value head ``h // (n_head // n_kv_head)``. ``windows`` says per
layer whether it reads the memory (0) or attends only to its last ``windows[layer]`` positions
(a sliding-window layer, Gemma 3's local layers: it keeps no memory), with its own RoPE and
scale, ``window_rope`` and ``window_scale``. A model without landmarks (a Hugging Face model as
published) has ``block_size`` and ``landmark_id`` None. ``kinds.backbone_for``
picks the backbone of a model; ``hf/backbone.py`` is the Hugging Face one.
"""

from typing import Protocol

import torch

from ..core.rope import RotaryEmbedding


class Backbone(Protocol):
    """What a memory needs of a model (see the module docstring)."""

    model: torch.nn.Module
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    block_size: int | None
    landmark_id: int | None
    vocab_size: int
    rope: RotaryEmbedding
    scale: float
    windows: tuple[int, ...]
    window_rope: RotaryEmbedding | None
    window_scale: float

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def finish(self, layer: int, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def head(self, h: torch.Tensor) -> torch.Tensor: ...

    def cmt_keys(self) -> list[torch.Tensor] | None:
        """Per layer the Context Miss Token's key (1, H, 1, D) rotated at -1, or None without one."""


class GPTBackbone:
    """The layers of a ``LandmarkGPT`` with landmark attention."""

    def __init__(self, model):
        cfg = model.config
        self.model, self.config = model, cfg
        self.n_layer, self.n_head, self.n_kv_head, self.head_dim = cfg.n_layer, cfg.n_head, cfg.n_head, cfg.head_dim
        self.block_size, self.landmark_id, self.vocab_size = cfg.block_size, cfg.landmark_id, cfg.vocab_size
        self.rope, self.scale = model.blocks[0].attn.rope, cfg.head_dim ** -0.5
        self.windows, self.window_rope, self.window_scale = (0,) * cfg.n_layer, None, 0.0  # every layer reads memory

    def embed(self, ids):
        return self.model.wte(ids)

    def qkv(self, layer, h):
        block = self.model.blocks[layer]
        return block.attn.heads(block.ln_1(h))

    def finish(self, layer, h, y):
        block = self.model.blocks[layer]
        h = h + block.attn.merge(y)
        return h + block.mlp(block.ln_2(h))

    def head(self, h):
        return self.model.lm_head(self.model.ln_f(h))

    def cmt_keys(self):
        """Per layer the Context Miss Token's key (1, H, 1, D) rotated at -1, or None without one."""
        return self.model.cmt_keys() if self.config.cmt else None
