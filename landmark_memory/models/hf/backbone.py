"""The layers of a converted Hugging Face model, as ``LandmarkMemory`` drives them (see
``landmark_memory/backbone.py``): the stock modules, called one piece at a time in the order
its family (``hf/families.py``) says."""

from .families import family_of, rotary_of


class HFBackbone:
    def __init__(self, model):
        cfg = model.config
        self.model, self.config, self.family = model, cfg, family_of(model)
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        self.n_layer, self.n_head, self.n_kv_head = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.block_size, self.landmark_id = cfg.landmark_block_size, cfg.landmark_token_id
        self.rope, factor = rotary_of(cfg, self.head_dim)
        self.scale = self.layers[0].self_attn.scaling * factor ** 2  # a factor on cos and sin scales every score
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def embed(self, ids):
        return self.decoder.embed_tokens(ids)

    def qkv(self, layer, h):
        """q (B, H, T, D), k and v (B, H_kv, T, D) of the layer's input ``h`` (B, T, C), no RoPE."""
        B, T, _ = h.shape
        f, block = self.family, self.layers[layer]
        attn, x = block.self_attn, h if f.post_norms else block.input_layernorm(h)
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
        block = self.layers[layer]
        a = block.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
        if self.family.post_norms:
            h = h + block.post_attention_layernorm(a)
            return h + block.post_feedforward_layernorm(block.mlp(h))
        h = h + a
        return h + block.mlp(block.post_attention_layernorm(h))

    def head(self, h):
        return self.model.lm_head(self.decoder.norm(h))

    def cmt_keys(self):
        return None  # converted models have no Context Miss Token
