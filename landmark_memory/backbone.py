"""The layer stack a memory drives, for each kind of model it supports.

``LandmarkMemory`` runs a model one layer at a time (it must attend over retrieved blocks
between the projections and the output), so it needs the pieces of each layer, not the whole
forward. A backbone gives them with one interface:

    h = embed(ids)                        # (B, T, C)
    q, k, v = qkv(layer, h)               # (B, H, T, D), (B, H_kv, T, D) x 2, no RoPE
    h = finish(layer, h, y)               # y (B, H, T, D): output projection, residual, MLP
    logits = head(h)                      # (B, T, vocab)

and the sizes the memory needs: ``n_layer, n_head, n_kv_head, head_dim, block_size,
landmark_id, rope_base, vocab_size``. ``n_kv_head < n_head`` is grouped-query attention:
query head ``h`` reads key/value head ``h // (n_head // n_kv_head)``.
"""

import json
from pathlib import Path

from .model import LandmarkGPT


class GPTBackbone:
    """The layers of a ``LandmarkGPT`` with landmark attention."""

    def __init__(self, model):
        cfg = model.config
        self.model, self.config = model, cfg
        self.n_layer, self.n_head, self.n_kv_head, self.head_dim = cfg.n_layer, cfg.n_head, cfg.n_head, cfg.head_dim
        self.block_size, self.landmark_id, self.rope_base = cfg.block_size, cfg.landmark_id, cfg.rope_base
        self.vocab_size = cfg.vocab_size

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


def backbone_for(model):
    """The backbone of ``model``: a ``LandmarkGPT`` with landmark attention, or a Hugging Face
    causal LM converted by ``landmark_memory.hf.convert``."""
    if isinstance(model, LandmarkGPT):
        if model.config.attention != "landmark":
            raise ValueError("a memory needs a model with landmark attention; this LandmarkGPT has "
                             f"attention={model.config.attention!r}")
        return GPTBackbone(model)
    if is_landmark(model):
        from .hf.backbone import HFBackbone

        return HFBackbone(model)
    raise ValueError(f"a memory needs a LandmarkGPT or a Hugging Face model converted with "
                     f"landmark_memory.hf.convert, got {type(model).__name__}")


def is_converted(model):
    """Whether ``model`` is a Hugging Face model converted by ``landmark_memory.hf.convert``."""
    return not isinstance(model, LandmarkGPT) and getattr(getattr(model, "config", None), "landmark_block_size",
                                                          None) is not None


def is_landmark(model):
    """Whether ``model`` uses landmark attention (and so can read through a memory)."""
    if isinstance(model, LandmarkGPT):
        return model.config.attention == "landmark"
    return is_converted(model)


def is_infini(model):
    """Whether ``model`` is a LandmarkGPT with Infini-attention (read by streaming its state)."""
    return isinstance(model, LandmarkGPT) and model.config.attention == "infini"


def in_sequence_logits(model, idx):
    """Logits (B, T, vocab) of one forward over normal token ids ``idx`` (B, T), no memory:
    a LandmarkGPT, a converted Hugging Face model (landmarks inserted), or a plain one."""
    if isinstance(model, LandmarkGPT):
        return model(idx)
    if is_landmark(model):
        from .hf.convert import normal_logits

        return normal_logits(model, idx)
    return model(input_ids=idx, use_cache=False).logits


def hf_config(path):
    """The config.json of a Hugging Face model directory (it names a model_type), else None:
    tells a landmark model (``landmark_block_size`` set) from a plain one without loading it."""
    f = Path(path) / "config.json"
    try:
        doc = json.loads(f.read_text()) if f.is_file() else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "model_type" in doc else None
