"""The shipped byte-level BPE tokenizer and its special tokens (the landmark layout of token
sequences is ``layout.py``)."""

from pathlib import Path
from typing import TYPE_CHECKING

from .names import ASSETS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_PATH = ASSETS / "tokenizer.json"

EOS_TOKEN = "<|endoftext|>"
LANDMARK_TOKEN = "<|landmark|>"
CONTEXT_MISS_TOKEN = "<|context_miss|>"  # reserved for the Context Miss Token (paper appendix D)
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, LANDMARK_TOKEN, CONTEXT_MISS_TOKEN, PAD_TOKEN]


def load_tokenizer(path: str | Path | None = None) -> "Tokenizer":
    """The byte-level BPE tokenizer shipped with the package (a ``tokenizers.Tokenizer``).

    Its special tokens are ``SPECIAL_TOKENS``; ``tok.token_to_id(LANDMARK_TOKEN)`` is the
    landmark id. ``path`` loads another tokenizer file of the same kind instead."""
    from tokenizers import Tokenizer

    path = Path(path) if path is not None else TOKENIZER_PATH
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} is missing; train one with experiments/train_tokenizer.py")
    tok = Tokenizer.from_file(str(path))
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"tokenizer {path} lacks the special tokens {missing}; retrain it with experiments/train_tokenizer.py")
    return tok
