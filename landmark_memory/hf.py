"""Hugging Face integration, the public names: landmark attention for the families of
``models/hf/families.py`` (``convert``, ``from_pretrained``), and ``LandmarkMemoryCache`` for
``model.generate``.

    model = landmark_memory.hf.from_pretrained("my-landmark-llama")
    cache = LandmarkMemoryCache.open("my-memory", model, readonly=True)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False)
"""

from .models.hf import (
           ATTENTION,
           TextTokenizer,
           convert,
           from_pretrained,
           is_converted,
           landmark_attention_forward,
           normal_logits,
)
from .uses.hf_cache import LandmarkMemoryCache

__all__ = ["ATTENTION", "LandmarkMemoryCache", "TextTokenizer", "convert", "from_pretrained", "is_converted",
           "landmark_attention_forward", "normal_logits"]
