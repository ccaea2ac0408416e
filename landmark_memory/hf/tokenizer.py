"""A transformers tokenizer seen through the ``tokenizers.Tokenizer`` calls the rest of the
package makes (``encode(text).ids``, ``decode``, ``token_to_id``, ``get_vocab_size``).

Text pieces are encoded without special tokens: a passkey prompt is assembled from several
pieces, and a BOS token before each would put stray tokens in the middle of the prompt."""

from ..tokenizer import EOS_TOKEN


class TextTokenizer:
    def __init__(self, tokenizer):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer; save the model with a fast "
                             "(tokenizer.json) tokenizer")
        self.hf = tokenizer
        self.backend = tokenizer.backend_tokenizer

    def encode(self, text):
        return self.backend.encode(text, add_special_tokens=False)

    def encode_batch(self, texts):
        return self.backend.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids):
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token):
        """Id of ``token``; our end-of-text token stands for the model's own EOS."""
        if token == EOS_TOKEN:
            if self.hf.eos_token_id is None:
                raise ValueError("this tokenizer has no EOS token to end each text with; set tokenizer.eos_token")
            return self.hf.eos_token_id
        return self.backend.token_to_id(token)

    def get_vocab_size(self):
        return len(self.hf)

    @classmethod
    def from_pretrained(cls, path):
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))
