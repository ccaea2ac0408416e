"""landmark-memory: random-access memory for transformers by Landmark Attention.

The public names below are imported on first use: ``import landmark_memory`` costs nothing,
so the ``landmark-memory`` command answers Ctrl-C and ``--help`` before torch is loaded.
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_HOMES = {
    "LandmarkConfig": "config", "InfiniState": "infini", "landmark_attention": "kernels",
    "landmark_attention_inference": "kernels", "LandmarkMemory": "memory", "MemoryOutput": "memory",
    "LandmarkGPT": "model", "RotaryEmbedding": "rope", "insert_landmarks": "layout", "landmark_mask": "layout",
    "lm_targets": "layout", "normal_positions": "layout", "strip_landmarks": "layout", "LANDMARK_TOKEN": "tokenizer",
    "load_tokenizer": "tokenizer", "ask": "answer", "Answer": "answer", "Passage": "answer",
}
__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from .answer import Answer, Passage, ask
    from .config import LandmarkConfig
    from .infini import InfiniState
    from .kernels import landmark_attention, landmark_attention_inference
    from .layout import insert_landmarks, landmark_mask, lm_targets, normal_positions, strip_landmarks
    from .memory import LandmarkMemory, MemoryOutput
    from .model import LandmarkGPT
    from .rope import RotaryEmbedding
    from .tokenizer import LANDMARK_TOKEN, load_tokenizer


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'landmark_memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value
