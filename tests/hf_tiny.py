"""Tiny randomly initialised Hugging Face models of every family we convert, their tokenizer's
text, and the command line run on them (no downloads)."""

import os
import subprocess
import sys

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from landmark_memory import hf
from landmark_memory.models.hf.families import FULL, SLIDING

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "olmo2": (Olmo2Config, Olmo2ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
            "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}


# what a family's tiny config sets beyond the common sizes: Gemma 3 with local layers of a 12-position
# window around a global one whose RoPE is scaled (as Gemma 3 4B's), its own score scale and a logit cap
SETTINGS = {"gemma3": dict(num_hidden_layers=3, layer_types=[SLIDING, FULL, SLIDING], sliding_window=12,
                           query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                           rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                            SLIDING: {"rope_type": "default", "rope_theta": 1e4}})}


# scaled RoPE on a Llama, each past an original window of 16 positions in every test's inputs
ROPES = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16},
         "linear": {"rope_type": "linear", "factor": 4.0},
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}


CASES = sorted(FAMILIES) + [f"llama:{r}" for r in ROPES]  # a family, or a family with a scaled RoPE


TOL = dict(rtol=1e-4, atol=1e-5)


def tiny(tokenizer_object, case="llama", block_size=7, seed=0, landmarks=True):
    """A tiny model of a family, "family:rope" for one with a scaled RoPE (``CASES``; 4 query
    heads sharing 2 key/value heads), converted to landmarks (or as published), and its tokenizer."""
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, bos_token="<s>", eos_token="</s>")
    family, _, rope = case.partition(":")
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    scaled = {"rope_parameters": {"rope_theta": 10000.0, **ROPES[rope]}} if rope else {}
    cfg = config_cls(**{**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=1 << 16,
                               tie_word_embeddings=family == "qwen2", pad_token_id=0), **scaled,
                        **SETTINGS.get(family, {})})
    model = model_cls(cfg)
    return (hf.convert(model, tok, block_size=block_size) if landmarks else model).eval(), tok


def ids_of(tok, text, n):
    return torch.tensor([tok(text, add_special_tokens=False).input_ids[:n]])


def cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "landmark_memory.app.cli", *map(str, args)], capture_output=True,
                       text=True,
                       env=env, cwd=cwd, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
