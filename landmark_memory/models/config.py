"""Model configuration."""

from dataclasses import asdict, dataclass, fields

from ..core.tokenizer import LANDMARK_TOKEN, load_tokenizer
from .infini import UPDATES

ATTENTIONS = ("landmark", "full", "infini")


@dataclass(frozen=True)
class AskPolicy:
    """How ``uses.answer.ask`` reads a question through a memory for one model, as measured
    for it (``experiments/results/retrieval.md``): ``centre``, the question and its answer
    choose blocks by centred landmark scores; ``deep_passages``, the passages are ranked by
    the lookups of the deeper half of the layers; ``reader_blocks``, how many of the blocks
    the model's question reader (``models/reader.py``, in the adapter's folder) ranks first
    every token of the answer reads, and the passages name first (0: no reader). A loaded
    model carries it (``LoadedModel.policy``: a landmark adapter's, from its ``landmark.json``);
    the default changes nothing."""

    centre: bool = False
    deep_passages: bool = False
    reader_blocks: int = 0

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "AskPolicy":
        types = {f.name: type(f.default) for f in fields(cls)}
        if not isinstance(d, dict) or set(d) - set(types) or any(
                type(v) is not types[k] or isinstance(v, int) and not 0 <= v <= 64 for k, v in d.items()):
            raise ValueError(f"{where}: 'ask' must map some of centre and deep_passages to true or false and "
                             f"reader_blocks to a count from 0 to 64, got {d!r}")
        return cls(**d)


@dataclass
class LandmarkConfig:
    """A GPT-style decoder with RoPE and pre-LayerNorm.

    ``attention="landmark"`` inserts a landmark after every ``block_size`` normal tokens and
    uses the grouped softmax; ``"full"`` is standard causal attention on the same model, with
    no landmarks (the baseline). ``"infini"`` is Infini-attention (the rival design,
    ``infini.py``): causal attention inside segments of ``segment_size`` tokens plus a
    compressive memory per head, updated by ``infini_update``.
    """

    vocab_size: int = 8192
    n_layer: int = 12
    n_head: int = 8
    n_embd: int = 1024
    ffn_hidden: int = 4096
    attention: str = "landmark"
    block_size: int = 50  # normal tokens per landmark block (paper: 50)
    landmark_id: int = 1  # id of LANDMARK_TOKEN in the shipped tokenizer
    rope_base: float = 10000.0
    dropout: float = 0.0
    bias: bool = False
    kernel_backend: str = "auto"  # Triton on CUDA, dense PyTorch elsewhere (kernels.BACKENDS)
    segment_size: int = 128  # Infini-attention only: tokens per segment
    infini_update: str = "linear+delta"  # Infini-attention only: "linear" (eq. 4) or "linear+delta" (eq. 5)
    cmt: bool = False  # a Context Miss Token (appendix D) that gates retrieval from memory
    p_cmt: float = 0.5  # training: chance that a landmark is CMT-controlled
    p_jump: int = 1  # training: after each landmark, positions advance by a random 1..p_jump (appendix E)

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head dim n_embd / n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if self.segment_size < 1:
            raise ValueError(f"segment_size must be >= 1, got {self.segment_size}")
        if self.infini_update not in UPDATES:
            raise ValueError(f"infini_update must be one of {UPDATES}, got {self.infini_update!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if (self.cmt or self.p_jump != 1) and self.attention != "landmark":
            raise ValueError("cmt and p_jump apply to landmark attention only")
        if not 0.0 <= self.p_cmt <= 1.0:
            raise ValueError(f"p_cmt must be a probability in [0, 1], got {self.p_cmt}")
        if not isinstance(self.p_jump, int) or self.p_jump < 1:
            raise ValueError(f"p_jump must be an int >= 1 (1 = no jumps), got {self.p_jump!r}")
        if not 0 <= self.landmark_id < self.vocab_size:
            raise ValueError(f"landmark_id {self.landmark_id} is outside the vocabulary (size {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LandmarkConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}: this config was written by a newer landmark-memory; "
                             "upgrade the package to load it")
        return cls(**d)

    @classmethod
    def for_tokenizer(cls, tokenizer=None, **kw) -> "LandmarkConfig":
        """A config whose vocabulary and landmark id match ``tokenizer`` (default: the shipped one)."""
        tok = tokenizer or load_tokenizer()
        return cls(vocab_size=tok.get_vocab_size(), landmark_id=tok.token_to_id(LANDMARK_TOKEN), **kw)
