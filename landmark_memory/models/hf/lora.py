"""Landmark LoRA adapters: a converted model's fine-tuning kept as a small peft adapter (LoRA on
every attention and MLP projection, plus the landmark token's embedding row) that applies on
top of the base weights, with ``landmark.json`` beside it naming the conversion it was trained on."""

import json
import warnings
from pathlib import Path

from ..config import AskPolicy
from ..reader import READER_FILE, Reader, load_reader

ADAPTER_CONFIG = "adapter_config.json"  # peft's
LANDMARK_FILE = "landmark.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_lora(model, rank: int, alpha: int):
    """A converted model (``hf.convert``) with fresh LoRA adapters of ``rank`` and scale
    ``alpha / rank``, and its landmark embedding row trainable (with tied embeddings one row
    serves input and output). Returns a peft ``PeftModel`` whose adapter alone trains."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=TARGETS,
                     trainable_token_indices={"embed_tokens": [model.config.landmark_token_id]},
                     ensure_weight_tying=bool(getattr(model.config, "tie_word_embeddings", False)))
    return get_peft_model(model, cfg)


def adapter_settings(adapter: str | Path) -> dict:
    """The conversion an adapter was trained on (``{"block_size": ...}``), and how to ask
    through it where that was measured (``"ask"``: ``AskPolicy``), from its ``landmark.json``."""
    f = Path(adapter) / LANDMARK_FILE
    if not f.is_file() or not (Path(adapter) / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{adapter} is not a landmark adapter: it needs {ADAPTER_CONFIG} and {LANDMARK_FILE}")
    return json.loads(f.read_text())


def apply_adapter(model, adapter: str | Path, trainable: bool = False):
    """``model`` (converted with the adapter's settings) with the adapter applied: merged into
    the weights for inference, so the model runs at the base model's speed, or, with
    ``trainable``, a ``PeftModel`` whose adapter alone trains (resuming its fine-tuning)."""
    from peft import PeftModel

    block = adapter_settings(adapter)["block_size"]
    if model.config.landmark_block_size != block:
        raise ValueError(f"the adapter at {adapter} was trained with blocks of {block} tokens, the model has "
                         f"{model.config.landmark_block_size}")
    with warnings.catch_warnings():  # peft's notes on its own internals, nothing a user can act on
        warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)
    if trainable:
        return model
    return model.merge_and_unload()


def adapter_asking(model, adapter: str | Path) -> tuple[AskPolicy, Reader | None]:
    """(how to ask through ``model`` with the adapter applied, its question reader): the
    adapter's ``AskPolicy`` (its ``landmark.json``'s ``"ask"``) and ``question_reader``."""
    policy = AskPolicy.from_dict(adapter_settings(adapter).get("ask", {}), str(Path(adapter) / LANDMARK_FILE))
    return policy, question_reader(model, adapter, policy)


def question_reader(model, adapter: str | Path, policy: AskPolicy) -> Reader | None:
    """The adapter's question reader and its calibration (``models/reader.py``), or None where
    ``policy`` (its ``landmark.json``'s) asks for none; ``ValueError`` for one that is missing or
    is another model's."""
    n, path = policy.reader_blocks, Path(adapter) / READER_FILE
    if not n:
        return None
    if not path.is_file():
        raise ValueError(f"{Path(adapter) / LANDMARK_FILE} asks for {n} blocks of a question reader, but {path} "
                         "is missing: restore it, or set reader_blocks to 0 to answer without one")
    reader, calibration = load_reader(path)
    c, cfg = reader.config, model.config
    want = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size)
    if (c.n_layer, c.n_head, c.n_kv_head, c.n_embd) != want:
        raise ValueError(f"{path} reads a model of (layers, heads, key/value heads, width) "
                         f"{(c.n_layer, c.n_head, c.n_kv_head, c.n_embd)}, this one has {want}")
    return Reader(reader, calibration)


def write_settings(folder: str | Path, block_size: int) -> None:
    (Path(folder) / LANDMARK_FILE).write_text(json.dumps({"block_size": block_size}, indent=1) + "\n")
