"""A transformers tokenizer seen through the ``tokenizers.Tokenizer`` calls the rest of the
package makes (``encode(text).ids``, ``decode``, ``token_to_id``, ``get_vocab_size``).

Text pieces are encoded without special tokens: a passkey prompt is assembled from several
pieces, and a BOS token before each would put stray tokens in the middle of the prompt."""

from typing import TYPE_CHECKING

from ..tokenizer import EOS_TOKEN

if TYPE_CHECKING:
    from tokenizers import Encoding


class TextTokenizer:
    def __init__(self, tokenizer):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer; save the model with a fast "
                             "(tokenizer.json) tokenizer")
        self.hf = tokenizer
        self.backend = tokenizer.backend_tokenizer

    def encode(self, text: str) -> "Encoding":
        return self.backend.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list["Encoding"]:
        return self.backend.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token``; our end-of-text token stands for the model's own EOS."""
        if token == EOS_TOKEN:
            if self.hf.eos_token_id is None:
                raise ValueError("this tokenizer has no EOS token to end each text with; set tokenizer.eos_token")
            return self.hf.eos_token_id
        return self.backend.token_to_id(token)

    def get_vocab_size(self) -> int:
        return len(self.hf)

    @classmethod
    def from_pretrained(cls, path: str) -> "TextTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))
