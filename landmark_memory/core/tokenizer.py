"""The shipped byte-level BPE tokenizer and its special tokens (the landmark layout of token
sequences is ``layout.py``)."""

from dataclasses import dataclass
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
        raise ValueError(f"tokenizer {path} lacks the special tokens {missing}; retrain it with "
                         "experiments/train_tokenizer.py")
    return tok


@dataclass(frozen=True)
class Encoded:
    """Token ``ids`` of a text and each one's character ``offsets`` (start, end) in it."""

    ids: list[int]
    offsets: list[tuple[int, int]]


_AS_TEXT: dict[int, tuple[object, "Tokenizer"]] = {}  # id of a backend -> (it, its copy reading specials as text)


def _backend(tokenizer) -> "Tokenizer":
    return getattr(tokenizer, "backend", tokenizer)  # (an ``hf.TextTokenizer``'s, or a ``tokenizers.Tokenizer``)


def encode_text(tokenizer, text: str) -> Encoded:
    """``text`` encoded as text: a special token's text in it (``<|endoftext|>``, ``<|landmark|>``, a
    chat template's ``<|im_start|>``) is read as the characters it is made of, never as the special
    token, so a document or a question cannot end a text, place a landmark or open a turn. The ids
    are ``tokenizer.encode(text)``'s wherever the text holds no such token."""
    backend = _backend(tokenizer)
    kept = _AS_TEXT.get(id(backend))
    if kept is None or kept[0] is not backend:
        copy = type(backend).from_str(backend.to_str())
        copy.encode_special_tokens = True
        kept = _AS_TEXT[id(backend)] = (backend, copy)
    enc = kept[1].encode(text, add_special_tokens=False)
    return Encoded(enc.ids, enc.offsets)


def special_ids(tokenizer) -> list[int]:
    """The ids of ``tokenizer``'s special tokens."""
    return [i for i, t in _backend(tokenizer).get_added_tokens_decoder().items() if t.special]


def special_texts(tokenizer) -> list[str]:
    """The texts of ``tokenizer``'s special tokens."""
    return [t.content for t in _backend(tokenizer).get_added_tokens_decoder().values() if t.special]


def encode_prompt(tokenizer, prompt: str, texts: list[str]) -> Encoded:
    """``prompt``, which the tool framed (a chat template's turns, a question's frame) around
    ``texts`` (the messages' own, in order), encoded with the frame's special tokens as special
    tokens and ``texts`` as text (``encode_text``): the ids are ``tokenizer.encode(prompt)``'s
    unless a text holds a special token's text. ``ValueError`` where the frame changed such a
    text so that it cannot be found in the prompt."""
    specials = special_texts(tokenizer)
    if not any(s in t for t in texts for s in specials):
        enc = tokenizer.encode(prompt)
        return Encoded(enc.ids, enc.offsets)
    ids, offsets, at = [], [], 0

    def add(start: int, end: int, as_text: bool):
        enc = encode_text(tokenizer, prompt[start:end]) if as_text else tokenizer.encode(prompt[start:end])
        ids.extend(enc.ids)
        offsets.extend((a + start, b + start) for a, b in enc.offsets)

    for t in texts:
        found = next(((i, len(s)) for s in (t, t.strip()) if s and (i := prompt.find(s, at)) >= 0), None)
        if found is None:
            if any(s in t for s in specials):
                raise ValueError("the chat template changed a message that holds a special token's text: it cannot "
                                 "be read as text (ask with raw=True)")
            continue
        add(at, found[0], False)
        add(found[0], found[0] + found[1], True)
        at = found[0] + found[1]
    add(at, len(prompt), False)
    return Encoded(ids, offsets)
