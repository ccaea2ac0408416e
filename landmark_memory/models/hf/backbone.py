"""The layers of a Hugging Face model of a family we read (``hf/families.py``), converted to
landmarks or as published, as ``LandmarkMemory`` drives them (see ``models/backbone.py``): the
stock modules, called one piece at a time in the order its family says. A model as published has
no landmark token (``block_size`` and ``landmark_id`` are None): a memory reads it by its
blocks' own keys (``MemoryOptions.block_keys``)."""

import torch

from .families import FULL, SLIDING, family_of, layer_types, rotary_of


class HFBackbone:
    def __init__(self, model):
        cfg = model.config
        self.model, self.config, self.family = model, cfg, family_of(model)
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        self.n_layer, self.n_head = cfg.num_hidden_layers, cfg.num_attention_heads
        self.n_kv_head = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.block_size = getattr(cfg, "landmark_block_size", None)
        self.landmark_id = getattr(cfg, "landmark_token_id", None)
        types = layer_types(cfg)
        self.windows = tuple(cfg.sliding_window if t == SLIDING else 0 for t in types)
        self.rope, self.scale = self._rope(types.index(FULL), FULL)
        self.window_rope, self.window_scale = (self._rope(types.index(SLIDING), SLIDING) if SLIDING in types
                                               else (None, 0.0))
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def _rope(self, layer, layer_type):
        rope, factor = rotary_of(self.config, self.head_dim, layer_type)
        return rope, self.layers[layer].self_attn.scaling * factor ** 2  # a factor on cos and sin scales every score

    def embed(self, ids):
        return self.decoder.embed_tokens(ids)

    def qkv(self, layer, h):
        """q (B, H, T, D), k and v (B, H_kv, T, D) of the layer's input ``h`` (B, T, C), no RoPE."""
        B, T, _ = h.shape
        f, block = self.family, self.layers[layer]
        attn, x = block.self_attn, h if f.norms == "post" else block.input_layernorm(h)
        if f.fused_qkv:
            q, k, v = attn.qkv_proj(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                              self.n_kv_head * self.head_dim], -1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if f.qk_norm == "all":  # over every head's projection at once
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))  # (B, T, H, D)
        if f.qk_norm == "head":
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, layer, h, y):
        """The layer's output from its input ``h`` (B, T, C) and attention ``y`` (B, H, T, D)."""
        B, H, T, D = y.shape
        norms, block = self.family.norms, self.layers[layer]
        a = block.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
        if norms == "pre":
            h = h + a
            return h + block.mlp(block.post_attention_layernorm(h))
        h = h + block.post_attention_layernorm(a)
        x = block.pre_feedforward_layernorm(h) if norms == "sandwich" else h
        return h + block.post_feedforward_layernorm(block.mlp(x))

    def head(self, h):
        logits = self.model.lm_head(self.decoder.norm(h))
        if self.softcap:  # as the model's own forward caps them
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def cmt_keys(self):
        return None  # converted models have no Context Miss Token
