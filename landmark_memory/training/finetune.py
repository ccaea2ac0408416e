"""A converted Hugging Face model behind the training interface of ``LandmarkGPT``, so that
one training loop (``landmark_memory.training.train``) serves both: ``model(idx, targets)`` over normal
token ids returns ``(logits, loss)``, landmarks inserted inside (paper section 4.2: targets
that fall on a landmark move to the next normal token, landmarks carry no loss)."""

import json
import os
import tempfile
from pathlib import Path

from torch import nn

from ..models.hf.backbone import HFBackbone
from ..models.hf.convert import convert, from_pretrained, normal_logits
from ..models.hf.lora import ADAPTER_CONFIG, adapter_settings, add_lora, apply_adapter, write_settings
from ..models.hf.tokenizer import TextTokenizer
from ..models.kinds import NO_CODE, check_no_code, hf_config
from ..models.model import LandmarkGPT, lm_loss
from .recall import recall_loss


class HFLandmarkLM(nn.Module):
    def __init__(self, model, tokenizer):
        super().__init__()
        self.hf, self.tokenizer, self.config = model, tokenizer, model.config

    def forward(self, idx, targets=None, weights=None, answer=None, source=None):
        """Logits (B, T, V); with ``targets`` ``(logits, loss)``; with ``answer`` and ``source``
        too (``data.Batch``'s) ``(logits, loss, recall)``, ``recall`` the recall loss (``recall.py``)."""
        if answer is None:
            logits = normal_logits(self.hf, idx)  # (B, T, V)
            return logits if targets is None else (logits, lm_loss(logits, targets, weights))
        logits, hidden = normal_logits(self.hf, idx, hidden_states=True)
        return logits, lm_loss(logits, targets, weights), recall_loss(HFBackbone(self.hf), hidden, answer, source)

    generate = LandmarkGPT.generate  # it only calls self(idx)

    def num_params(self):
        return sum(p.numel() for p in self.hf.parameters())

    def text_tokenizer(self):
        return TextTokenizer(self.tokenizer)

    @classmethod
    def load(cls, path, block_size, lora_rank=0, lora_alpha=0, start_from=None, grad_checkpoint=False):
        """The model to fine-tune: ``path`` (a local Hugging Face folder, or ``"smollm2"``) as a
        landmark model with blocks of ``block_size`` (converted here when it is a plain one).
        With ``lora_rank`` > 0 only LoRA adapters and the landmark embedding train.
        ``start_from``: weights to start from, a checkpoint of this training or an earlier stage's
        (under LoRA an adapter of the same rank, else a whole saved landmark model).
        ``grad_checkpoint``: keep one layer's activations at a time, recomputing them in the
        backward pass (the grouped softmax holds (T, T) scores per head: windows of 4K tokens
        need this to fit in memory)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..models.hf.smollm2 import BASE, base_model_dir

        if path == BASE:
            path = base_model_dir()
        if start_from is not None and not lora_rank:
            path = start_from  # the whole model was saved
        config = hf_config(path)
        if config is None:
            raise FileNotFoundError(f"no Hugging Face model at {path} (config.json with a model_type)")
        check_no_code(path, config)
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        saved_block = config.get("landmark_block_size")
        if saved_block:
            if saved_block != block_size:
                raise ValueError(f"{path} is a landmark model with blocks of {saved_block} tokens; "
                                 f"pass --block-size {saved_block}")
            model = from_pretrained(path, dtype="float32", **NO_CODE)
        else:
            model = convert(AutoModelForCausalLM.from_pretrained(path, dtype="float32", **NO_CODE), tok, block_size)
        model.config.use_cache = False
        if grad_checkpoint:  # non-reentrant: no input needs a gradient for LoRA's to flow. (The name that
            # 5.23 prefers, activation_checkpointing_enable, is missing from the transformers of GPU images.)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora_rank and start_from is not None:
            adapter_settings(start_from)  # says so when it is not an adapter
            rank = json.loads((Path(start_from) / ADAPTER_CONFIG).read_text())["r"]
            if rank != lora_rank:
                raise ValueError(f"the adapter at {start_from} has LoRA rank {rank}; pass --lora-rank {rank}")
            model = apply_adapter(model, start_from, trainable=True)
        elif lora_rank:
            model = add_lora(model, lora_rank, lora_alpha)
        return cls(model, tok)

    def save_pretrained(self, path):
        """Model and tokenizer (or, under LoRA, the adapter and its ``landmark.json``) written to
        a temporary folder, then moved in file by file, the config last: an interrupted save
        leaves the previous files usable."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path, prefix=".save-") as tmp:
            for c in getattr(self.hf, "peft_config", {}).values():  # the base model's name, not where it lies here
                c.base_model_name_or_path = Path(c.base_model_name_or_path or "").name
            self.hf.save_pretrained(tmp)
            if (Path(tmp) / ADAPTER_CONFIG).is_file():  # the base model and tokenizer are rebuilt from their source
                write_settings(tmp, self.config.landmark_block_size)
            else:
                self.tokenizer.save_pretrained(tmp)
            files = sorted(Path(tmp).iterdir(), key=lambda f: f.name in ("config.json", ADAPTER_CONFIG))
            for f in files:
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                os.replace(f, path / f.name)
