"""Landmark attention for Hugging Face causal LMs of the families in ``hf/families.py`` (Llama,
Mistral, Qwen2, Qwen3, OLMo2, Phi-3, Gemma 3; paper section 4.2).

``convert`` adds the landmark token and routes attention through our grouped-softmax kernels
by transformers' own attention registry (``AttentionInterface``): embeddings, norms, MLPs,
RoPE and the weights stay stock. In sequence, the input must carry a landmark after every
``block_size`` normal tokens (``insert_landmarks``); with a ``LandmarkMemoryCache``, the
model reads normal tokens and the memory places the landmarks itself.

The landmark settings live in the model's config (``landmark_block_size``,
``landmark_token_id``), so ``save_pretrained`` keeps them and ``from_pretrained`` below (or
``AutoModelForCausalLM.from_pretrained(path, attn_implementation="landmark")`` once this
module is imported) restores the model, no remote code needed.
"""

import inspect
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache

from ...core.layout import check_block_size, insert_landmarks, normal_positions
from ...core.tokenizer import LANDMARK_TOKEN
from ...kernels import BACKENDS, landmark_attention, landmark_attention_inference, sliding_window_attention
from .families import SLIDING, family_of, layer_types

ATTENTION = "landmark"


def is_converted(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model converted by ``convert`` (its config carries
    the landmark settings)."""
    return getattr(getattr(model, "config", None), "landmark_block_size", None) is not None


class MemoryBackedCache(Cache):
    """A ``past_key_values`` that reads the model's input itself (``memory.hf_cache.LandmarkMemoryCache``
    over a landmark memory): a converted model's forward hands it the input and returns what
    its ``forward`` returns. Declared here so that conversion does not depend on the memory."""

    def forward(self, input_ids: torch.Tensor, *args, **kwargs):
        raise NotImplementedError


def landmark_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                               sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: grouped-softmax landmark attention (causal); a layer of
    type "sliding_attention" (Gemma 3's local layers) keeps its plain softmax over its
    ``sliding_window``, landmarks read as any token, as it reads through a memory. (Mistral
    passes a ``sliding_window`` for every layer: landmark attention replaces it there, the
    memory being what reads beyond any window.)

    query (B, H, T_q, D), key and value (B, H_kv, T_k, D) with RoPE applied; the queries are
    the last T_q of T_k positions laid out in blocks from position 0. Returns (B, T_q, H, D)."""
    if dropout:
        raise ValueError("landmark attention has no attention dropout; set config.attention_dropout = 0")
    cfg = module.config
    if not query.dtype == key.dtype == value.dtype:  # under autocast RoPE may have upcast some of them
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if sliding_window and layer_types(cfg)[module.layer_idx] == SLIDING:
        return sliding_window_attention(query, key, value, sliding_window, scaling).transpose(1, 2).contiguous(), None
    G = query.shape[1] // key.shape[1]
    if G > 1:  # grouped-query attention: each key/value head serves G query heads
        key, value = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    backend = getattr(cfg, "landmark_backend", "auto")
    if query.shape[-2] == key.shape[-2]:
        out = landmark_attention(query, key, value, cfg.landmark_block_size, scale=scaling, backend=backend)
    else:  # queries after cached keys: no retrieved blocks, the cached keys are the local ones
        B, H, T_q, _ = query.shape
        none = query.new_zeros((0, H, cfg.landmark_block_size + 1, query.shape[-1]))
        empty = torch.zeros((B, H, T_q, 0), dtype=torch.long, device=query.device)
        out = landmark_attention_inference(query, key, value, cfg.landmark_block_size, pool_k=none, pool_v=none,
                                           block_table=empty, block_pos=empty, scale=scaling, backend=backend)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, landmark_attention_forward)


def _check_supported(model):
    if not isinstance(model, PreTrainedModel) or not hasattr(model, "lm_head"):
        raise ValueError(f"convert needs a transformers causal LM (e.g. LlamaForCausalLM), got {type(model).__name__}")
    family_of(model)


def convert(model: PreTrainedModel, tokenizer, block_size: int = 63, backend: str = "auto") -> PreTrainedModel:
    """Turn a causal LM of a supported family into a landmark model, in place.

    Parameters
    ----------
    model : a transformers causal LM of a family in ``hf/families.py`` (Llama, Mistral, Qwen2,
        Qwen3, OLMo2, Phi-3, Gemma 3 text) with a RoPE of fixed frequencies, any number of
        key/value heads.
    tokenizer : its transformers tokenizer; gains the landmark token.
    block_size : int, normal tokens per landmark block (the paper's code: 63, so that a 512-token
        window holds 8 whole blocks).
    backend : kernel backend, one of ``kernels.BACKENDS`` ("auto": Triton on CUDA, dense PyTorch
        elsewhere).

    Returns
    -------
    The same model object, now an instance of a ``Landmark<Class>`` subclass whose forward
    reads through a ``LandmarkMemoryCache`` when one is passed as ``cache`` (``past_key_values``
    before transformers 5.24; both names work).
    The landmark embedding (and output row, when untied) starts as the mean of the others.
    """
    check_block_size(block_size)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if is_converted(model):
        raise ValueError(f"this model is already a landmark model (block size {model.config.landmark_block_size})")
    _check_supported(model)
    tokenizer.add_special_tokens({"extra_special_tokens": [LANDMARK_TOKEN]}, replace_extra_special_tokens=False)
    landmark_id = tokenizer.convert_tokens_to_ids(LANDMARK_TOKEN)
    n_old = model.get_input_embeddings().weight.shape[0]
    if landmark_id >= n_old:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            for emb in {id(m.weight): m.weight
                        for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
                emb[n_old:] = emb[:n_old].mean(0)
    model.config.landmark_block_size, model.config.landmark_token_id = block_size, landmark_id
    model.config.landmark_backend = backend
    return _activate(model)


def _activate(model):
    model.set_attn_implementation(ATTENTION)
    model.__class__ = _landmark_class(type(model))
    return model


_CLASSES = {}


def _landmark_class(cls):
    """``cls`` with a forward that reads through a ``MemoryBackedCache`` when one is given."""
    if cls in _CLASSES.values():
        return cls
    if cls not in _CLASSES:
        def forward(self, input_ids=None, *args, **kwargs):
            given = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 renamed it "cache"
            if isinstance(given, MemoryBackedCache):
                rest = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
                return given.forward(input_ids, *args, **rest)
            return cls.forward(self, input_ids, *args, **kwargs)

        forward.__signature__ = inspect.signature(cls.forward)  # generate() reads it to pick its inputs
        forward.__doc__ = cls.forward.__doc__
        _CLASSES[cls] = type(f"Landmark{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return _CLASSES[cls]


def from_pretrained(path: str | Path, **kwargs) -> PreTrainedModel:
    """A landmark model saved with ``save_pretrained`` (``kwargs`` go to
    ``AutoModelForCausalLM.from_pretrained``: dtype, device_map, ...; the folder's own code is
    never run unless ``trust_remote_code=True`` is given)."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face model at {path}: config.json is missing")
    kwargs.setdefault("trust_remote_code", False)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTENTION, **kwargs)
    if not is_converted(model):
        raise ValueError(f"{path} holds a plain {type(model).__name__}, not a landmark model: "
                         "convert it with landmark_memory.models.hf.convert and fine-tune it "
                         "(experiments/finetune_hf.py)")
    return _activate(model)


def normal_logits(model: PreTrainedModel, idx: torch.Tensor, hidden_states: bool = False):
    """Logits (B, T, vocab) at the normal positions of a converted model's in-sequence forward
    over normal token ids ``idx`` (B, T): landmarks are inserted first. With ``hidden_states``,
    ``(logits, hidden)``: ``hidden`` holds each layer's input over the landmarked sequence, one
    (B, T', C) tensor per layer."""
    cfg = model.config
    x = insert_landmarks(idx, cfg.landmark_block_size, cfg.landmark_token_id)
    out = model(input_ids=x, use_cache=False, output_hidden_states=hidden_states)
    logits = out.logits[:, normal_positions(idx.shape[1], cfg.landmark_block_size, idx.device)]  # (B, T, V)
    return (logits, out.hidden_states[:-1]) if hidden_states else logits  # n_layer + 1: the last is no layer's input
