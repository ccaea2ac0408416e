"""Hugging Face models with landmark attention: the families of ``families.py`` converted
(``convert``, ``from_pretrained``) and their layers as a memory drives them (``backbone.py``).
The memory as a transformers cache is ``uses/hf_cache.py``; ``landmark_memory.hf`` offers both."""

from .convert import ATTENTION, convert, from_pretrained, is_converted, landmark_attention_forward, normal_logits
from .tokenizer import TextTokenizer

__all__ = ["ATTENTION", "TextTokenizer", "convert", "from_pretrained", "is_converted",
           "landmark_attention_forward", "normal_logits"]
