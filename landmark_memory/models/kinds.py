"""The kinds of model the package runs, in one place: telling them apart, loading them, their
in-sequence logits, and the backbone a memory drives.

- ``LandmarkGPT`` (``model.py``) with ``attention="landmark"`` (reads through a memory),
  ``"full"`` (the baseline) or ``"infini"`` (Infini-attention, streamed);
- a Hugging Face causal LM converted by ``landmark_memory.models.hf.convert`` (reads through a
  memory), or a plain one (full attention).

The Hugging Face side is imported only when a Hugging Face model is at hand: importing
transformers takes seconds, and a LandmarkGPT needs none of it.
"""

import hashlib
import inspect
import json
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open

from ..core.names import is_named_model
from ..core.tokenizer import load_tokenizer
from .backbone import Backbone, GPTBackbone
from .config import AskPolicy
from .heads import find_heads
from .loaded import LoadedModel
from .model import BUNDLED_MODEL, LandmarkGPT


def is_converted(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model converted by ``landmark_memory.models.hf.convert``."""
    if isinstance(model, LandmarkGPT):
        return False
    from .hf.convert import is_converted as converted

    return converted(model)


def is_landmark(model: torch.nn.Module) -> bool:
    """Whether ``model`` uses landmark attention (and so can read through a memory)."""
    if isinstance(model, LandmarkGPT):
        return model.config.attention == "landmark"
    return is_converted(model)


def reads_through_memory(model: torch.nn.Module) -> bool:
    """Whether a memory can read ``model``: through its landmarks, or, a Hugging Face model of a
    family ``hf/families.py`` reads as published, through its blocks' own keys (no training)."""
    if is_landmark(model):
        return True
    if isinstance(model, LandmarkGPT) or not hasattr(model, "get_decoder"):
        return False
    from .hf.families import family_of

    try:
        family_of(model)
    except ValueError:
        return False
    return True


def is_infini(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a LandmarkGPT with Infini-attention (read by streaming its state)."""
    return isinstance(model, LandmarkGPT) and model.config.attention == "infini"


def is_plain_hf(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM with its own attention (not converted)."""
    return not isinstance(model, LandmarkGPT) and not is_converted(model)


def kv_cache_decoder(model: torch.nn.Module, idx: torch.Tensor):
    """``(logits, feed)`` for ``decode.decode``: a plain Hugging Face model reads ``idx`` (B, T)
    into a ``DynamicCache``, and ``feed`` extends it by one token at a time."""
    from transformers import DynamicCache

    cache, name = DynamicCache(config=model.config), cache_keyword(model)

    def feed(nxt):  # (B, 1) -> (B, vocab)
        return model(input_ids=nxt, use_cache=True, **{name: cache}).logits[:, -1]

    return feed(idx), feed


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword of a Hugging Face model's forward for its KV cache (transformers 5.24 renamed
    ``past_key_values`` to ``cache``; the old name goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def reading_mode(model: torch.nn.Module) -> str:
    """How ``model`` reads a text without a memory."""
    if is_landmark(model):
        return "in-sequence"
    if is_infini(model):
        return "infini-attention (streamed)"
    return "full attention"


def backbone_for(model: torch.nn.Module) -> Backbone:
    """The layer stack a memory drives: a ``LandmarkGPT`` with landmark attention, or a Hugging
    Face causal LM of a family ``hf/families.py`` reads, converted by
    ``landmark_memory.models.hf.convert`` or as published (its ``block_size`` None: no landmarks)."""
    if isinstance(model, LandmarkGPT):
        if model.config.attention != "landmark":
            raise ValueError("a memory needs a model with landmark attention; this LandmarkGPT has "
                             f"attention={model.config.attention!r}")
        return GPTBackbone(model)
    if is_converted(model) or hasattr(model, "get_decoder"):
        from .hf.backbone import HFBackbone

        return HFBackbone(model)  # (a family it does not read is refused there, in one line)
    raise ValueError(f"a memory needs a LandmarkGPT or a Hugging Face causal LM, got {type(model).__name__}")


def in_sequence_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, vocab) of one forward over normal token ids ``idx`` (B, T), no memory:
    a LandmarkGPT, a converted Hugging Face model (landmarks inserted), or a plain one."""
    if isinstance(model, LandmarkGPT):
        return model(idx)
    if is_converted(model):
        from .hf.convert import normal_logits

        return normal_logits(model, idx)
    return model(input_ids=idx, use_cache=False).logits


def hf_config(path: str | Path) -> dict | None:
    """The config.json of a Hugging Face model directory (it names a model_type), else None:
    tells a landmark model (``landmark_block_size`` set) from a plain one without loading it."""
    f = Path(path) / "config.json"
    try:
        doc = json.loads(f.read_text()) if f.is_file() else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "model_type" in doc else None



def _hf_ready(model, tokenizer, name, device: str, block_size: int | None):
    """A loaded Hugging Face model in eval mode on ``device`` with its ``TextTokenizer``, once
    ``block_size`` (if given) is found to be its own where it has landmarks (a model without them
    reads blocks of any size: the memory's options say which)."""
    from .hf.tokenizer import TextTokenizer

    saved_block = getattr(model.config, "landmark_block_size", None)
    if block_size and saved_block and block_size != saved_block:
        raise ValueError(f"{name} was fine-tuned with blocks of {saved_block} tokens; its block size cannot change")
    return model.to(device).eval(), TextTokenizer(tokenizer)


def model_name(path: str | Path | None) -> str:
    """A model as memories record it: "bundled", a name of ``NAMED_MODELS``, or a folder's
    absolute path."""
    if path is None:
        return "bundled"
    return str(path) if is_named_model(path) else str(Path(path).resolve())


def check_device(device: str) -> str:
    """``device`` if torch knows it and this machine has it; else ``ValueError`` saying so."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: give cpu, cuda, cuda:1 ... or auto") from None
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"device {device!r} is not on this machine ({torch.cuda.device_count()} CUDA devices): "
                         "use --device cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: give cpu, cuda, cuda:1 ... or auto")
    return device


def load_model(path: str | Path | None = None, device: str = "auto", block_size: int | None = None) -> LoadedModel:
    """The ``LoadedModel`` at ``path``: a LandmarkGPT directory (default: the bundled model)
    with the shipped tokenizer, a Hugging Face model directory (converted or plain) with its
    own tokenizer (a ``hf.TextTokenizer``), or a name of ``NAMED_MODELS`` (``hf/smollm2.py``;
    the landmark one with its adapter's policy and question reader), in eval mode on
    ``device`` ("auto": cuda when available), with its retrieval heads (``heads.find_heads``),
    the module tagged with its ``model_name`` as ``landmark_name``. ``block_size`` must match a
    landmark model's own, except that a LandmarkGPT may be read with another (its trained
    blocks may suit it less)."""
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else check_device(device)
    try:
        model, tok, asking = _load(path, dev, block_size)
    except _DAMAGE as e:  # a cut weights file, a config field of the wrong type
        raise damaged_model(path, e) from None
    model.landmark_name = model_name(path)  # what a memory built with it records
    model.tokenizer_digest = tokenizer_digest(tok)  # and what turned its text into ids
    policy, reader = asking or (AskPolicy(), None)
    return LoadedModel(model, tok, find_heads(path), reader, policy)


def tokenizer_digest(tok) -> str:
    """sha256 of what turns text into ids for ``tok`` (a ``tokenizers.Tokenizer`` or an
    ``hf.TextTokenizer``): its whole definition (vocabulary, merges, normalisation, special
    tokens) and, where it has one, its chat template."""
    h = hashlib.sha256(getattr(tok, "backend", tok).to_str().encode())
    template = getattr(getattr(tok, "hf", None), "chat_template", None)
    if template:
        h.update((template if isinstance(template, str) else json.dumps(template, sort_keys=True)).encode())
    return h.hexdigest()


# what a Hugging Face folder is loaded with: never the folder's own Python (``auto_map``), never a pickle
NO_CODE = {"trust_remote_code": False, "use_safetensors": True}
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # torch.save's files: unpickling one can run code


def check_no_code(path: str | Path, config: dict) -> None:
    """``ValueError`` in one line for a Hugging Face folder (``config``: its config.json) that
    loading would make run code: a model type transformers does not know (the folder's own
    Python, named by ``auto_map``), or weights kept only as pickles. A folder that names its own
    code beside a model type transformers knows is read with transformers' own classes."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    folder = Path(path)
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
        raise ValueError(f"{folder / 'config.json'}: model type {kind!r} is not one transformers knows; such a model "
                         "runs its folder's own Python code, which landmark-memory never runs: use a model of a "
                         "family transformers ships")
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(f for pattern in PICKLES for f in folder.glob(pattern))
        what = f"{pickled[0]}: weights saved as a pickle" if pickled else f"{folder}: no *.safetensors weights"
        raise ValueError(f"{what}, which landmark-memory never loads (unpickling can run code); save the model "
                         "with safetensors (model.save_pretrained(folder)) and use that folder")


def _load(path, dev: str, block_size: int | None):
    """(model, tokenizer, (its ``AskPolicy``, its question reader) or None where it has neither)."""
    config = hf_config(path) if path else None
    asking = None
    named = is_named_model(path)
    if config is not None or named:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from .hf.convert import from_pretrained
        from .hf.lora import adapter_asking
        from .hf.smollm2 import ADAPTER_DIR, LANDMARK, load_base, load_landmark

        hf_logging.disable_progress_bar()  # our own bars report the work
        if named:
            model, tok = load_landmark() if path == LANDMARK else load_base()
            asking = adapter_asking(model, ADAPTER_DIR) if path == LANDMARK else None
        else:
            check_no_code(path, config)
            load = from_pretrained if config.get("landmark_block_size") else AutoModelForCausalLM.from_pretrained
            try:
                model, tok = load(path, **NO_CODE), AutoTokenizer.from_pretrained(path, trust_remote_code=False)
            except ValueError as e:  # (transformers: a tokenizer that needs the folder's code, among others)
                raise ValueError(f"{path}: transformers cannot load it without running its code "
                                 f"({' '.join(str(e).split())[:300]})") from None
        model, tok = _hf_ready(model, tok, path, dev, block_size)
    else:
        model, tok = LandmarkGPT.from_pretrained(path or BUNDLED_MODEL, device=dev).eval(), load_tokenizer()
        if block_size and block_size != model.config.block_size:
            if model.config.attention != "landmark":
                raise ValueError("--block-size applies to landmark models only")
            model.config.block_size = block_size  # shared by every layer
    return model, tok, asking


_DAMAGE = (SafetensorError, StrictDataclassError, TypeError, KeyError, RuntimeError)


def damaged_model(path, e: Exception) -> ValueError:
    """One line for a model that could not be read (``e``): the weights file of its folder that
    does not open, else its config.json, and why."""
    folder = Path(path or BUNDLED_MODEL)
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(f), "pt"):
                pass
        except (SafetensorError, OSError) as bad:
            return ValueError(f"{f}: damaged weights ({bad}); restore the model's files or save it again")
    why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    where = folder / "config.json" if folder.is_dir() else f"the model {path}"
    return ValueError(f"{where}: the model cannot be built from it ({why}); restore the model's files or save it again")
