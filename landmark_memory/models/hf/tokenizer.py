"""A transformers tokenizer seen through the ``tokenizers.Tokenizer`` calls the rest of the
package makes (``encode(text).ids``, ``decode``, ``token_to_id``, ``get_vocab_size``).

Text pieces are encoded without special tokens: a passkey prompt is assembled from several
pieces, and a BOS token before each would put stray tokens in the middle of the prompt."""

from typing import TYPE_CHECKING

from ...core.tokenizer import EOS_TOKEN

if TYPE_CHECKING:
    from tokenizers import Encoding


_EXCHANGE = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello."}]


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

    def chat_prompt(self, question: str) -> str | None:
        """``question`` as a user turn of the model's chat template, ready for the assistant's
        answer; None when the model has no chat template."""
        return self.chat_text([{"role": "user", "content": question}], first=True, answer=True)

    def chat_text(self, messages: list[dict], *, first: bool, answer: bool) -> str | None:
        """``messages`` (``{"role", "content"}``) in the model's chat template as they follow a
        conversation (``first``: they open it, with what the template puts first, such as a
        default system message), ending with the assistant's turn opened when ``answer``; None
        when the model has no chat template. Later turns are rendered after a one-exchange
        conversation and cut from it, so a turn costs the same however long the conversation."""
        if not getattr(self.hf, "chat_template", None):
            return None

        def render(m, gen):
            return self.hf.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)

        if first:
            return render(messages, answer)
        before = render(_EXCHANGE, False)
        after = render(_EXCHANGE + messages, answer)
        if not after.startswith(before):
            raise ValueError("this model's chat template renders a turn otherwise after an earlier one: its turns "
                             "cannot be read one by one (ask with raw=True)")
        return after[len(before):]

    @property
    def end_of_turn_id(self) -> int | None:
        """The token a chat model ends its answer with (its EOS)."""
        return self.hf.eos_token_id

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The tokens that end a chat answer: its EOS and every other special token (a new
        turn's start, the end of the text), none of which is text of the answer."""
        eos = () if self.hf.eos_token_id is None else (self.hf.eos_token_id,)
        return eos + tuple(sorted(set(self.hf.all_special_ids) - set(eos)))

    def get_vocab_size(self) -> int:
        return len(self.hf)
