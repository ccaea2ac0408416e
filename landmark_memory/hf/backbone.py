"""The layers of a converted Hugging Face Llama-family model, as ``LandmarkMemory`` drives
them (see ``landmark_memory/backbone.py``): the stock modules, called one piece at a time."""


class HFBackbone:
    def __init__(self, model):
        cfg = model.config
        self.model, self.config = model, cfg
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        self.n_layer, self.n_head, self.n_kv_head = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.block_size, self.landmark_id = cfg.landmark_block_size, cfg.landmark_token_id
        self.rope_base = float(cfg.rope_parameters["rope_theta"])
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def embed(self, ids):
        return self.decoder.embed_tokens(ids)

    def qkv(self, layer, h):
        B, T, _ = h.shape
        attn, x = self.layers[layer].self_attn, self.layers[layer].input_layernorm(h)
        return tuple(p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))

    def finish(self, layer, h, y):
        B, H, T, D = y.shape
        block = self.layers[layer]
        h = h + block.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
        return h + block.mlp(block.post_attention_layernorm(h))

    def head(self, h):
        return self.model.lm_head(self.decoder.norm(h))

    def cmt_keys(self):
        return None  # converted models have no Context Miss Token
