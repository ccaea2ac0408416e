"""landmark-memory: random-access memory for transformers by Landmark Attention."""

from .config import LandmarkConfig
from .infini import InfiniState
from .kernels import landmark_attention, landmark_attention_inference
from .memory import LandmarkMemory, MemoryOutput
from .model import LandmarkGPT
from .rope import RotaryEmbedding
from .layout import insert_landmarks, landmark_mask, lm_targets, normal_positions, strip_landmarks
from .tokenizer import LANDMARK_TOKEN, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "InfiniState", "LandmarkConfig", "LandmarkGPT", "LandmarkMemory", "MemoryOutput", "RotaryEmbedding", "landmark_attention",
    "landmark_attention_inference", "load_tokenizer", "LANDMARK_TOKEN",
    "insert_landmarks", "strip_landmarks", "lm_targets", "landmark_mask", "normal_positions",
]
