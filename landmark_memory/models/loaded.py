"""A model as ``kinds.load_model`` hands it out: the module, its tokenizer, and what asking
through it needs beside them (its retrieval heads, its question reader, its ``AskPolicy``), as
one typed value rather than attributes stuck on the module. ``uses/answering/`` chooses how a
question is answered from it."""

from dataclasses import dataclass, field

import torch

from .config import AskPolicy
from .heads import EvidenceHeads
from .reader import Reader


@dataclass(frozen=True)
class LoadedModel:
    """``model`` (in eval mode) and its ``tokenizer`` (a ``tokenizers.Tokenizer`` or an
    ``hf.TextTokenizer``); ``heads``: its retrieval heads (``heads.find_heads``; None: none
    chosen); ``reader``: its question reader (None: none shipped); ``policy``: how ``ask`` reads
    a question through it, as measured for it (a landmark adapter's ``landmark.json``)."""

    model: torch.nn.Module
    tokenizer: object
    heads: EvidenceHeads | None = None
    reader: Reader | None = None
    policy: AskPolicy = field(default_factory=AskPolicy)

