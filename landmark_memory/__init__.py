"""landmark-memory: random-access memory for transformers by Landmark Attention.

The package is built in layers, each a folder that imports only from those below it: ``core/``
(leaf utilities); ``kernels/``, ``index/``, ``storage/``; ``models/``; ``format/`` (a memory's files);
``memory/`` (the engine); ``uses/`` (asking, sessions, corpora) and ``training/``; ``jobs/`` (what
users run over a memory); ``app/`` (the command line and the server). The
public names below are imported on first use: ``import landmark_memory`` costs nothing, so the
``landmark-memory`` command answers Ctrl-C and ``--help`` before torch is loaded.
"""

import importlib
import os
from typing import TYPE_CHECKING

# MKL (torch's CPU BLAS) may take a different path by where an array happens to lie in memory, and so
# round differently from one process to the next; AUTO keeps its results the same run to run (for the
# same threads), which a memory or session resumed bit for bit in a new process needs. Read at MKL's
# first call; a user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"

_HOMES = {
    "LandmarkConfig": "models.config", "InfiniState": "models.infini", "landmark_attention": "kernels",
    "landmark_attention_inference": "kernels", "LandmarkMemory": "memory", "MemoryOutput": "memory",
    "LandmarkGPT": "models.model", "RotaryEmbedding": "core.rope", "insert_landmarks": "core.layout",
    "landmark_mask": "core.layout", "lm_targets": "core.layout", "normal_positions": "core.layout",
    "strip_landmarks": "core.layout", "LANDMARK_TOKEN": "core.tokenizer", "load_tokenizer": "core.tokenizer",
    "ask": "uses.answer", "Answer": "uses.answer", "Passage": "uses.search", "search": "uses.search",
    "Found": "uses.search",
}
__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from .core.layout import insert_landmarks, landmark_mask, lm_targets, normal_positions, strip_landmarks
    from .core.rope import RotaryEmbedding
    from .core.tokenizer import LANDMARK_TOKEN, load_tokenizer
    from .kernels import landmark_attention, landmark_attention_inference
    from .memory import LandmarkMemory, MemoryOutput
    from .models.config import LandmarkConfig
    from .models.infini import InfiniState
    from .models.model import LandmarkGPT
    from .uses.answer import Answer, ask
    from .uses.search import Found, Passage, search

def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'landmark_memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value
