"""What a question is asked with: ``Message``, a message of a conversation; the model asked, a
``models.loaded.LoadedModel`` (``loaded_for``); and its chat template's prompt. The options it
is answered by are ``core.ask_options.AskOptions``."""

from dataclasses import dataclass

from ..models.loaded import LoadedModel


@dataclass(frozen=True)
class Message:
    """A message of a conversation: ``role`` is system, user or assistant."""

    role: str
    content: str


def loaded_for(mem, model) -> LoadedModel:
    """``model`` as the ``LoadedModel`` the memory ``mem`` is asked through: a ``LoadedModel``
    (``kinds.load_model``'s) of the memory's own module, or a bare tokenizer of it (asked with
    no retrieval heads, no question reader and the default ``AskPolicy``)."""
    if not isinstance(model, LoadedModel):
        return LoadedModel(mem.model, model)
    if model.model is not mem.model:
        raise ValueError("the model asked is not the one this memory reads with: open the memory with "
                         "LandmarkMemory.open(path, loaded.model) and ask it with that same loaded model")
    return model


def chat_prompt(tokenizer, messages, first: bool, answer: bool) -> str | None:
    """``messages`` as turns of ``tokenizer``'s chat template (``first``: the conversation's
    opening goes first; ``answer``: the assistant's turn opened after them), or None for a
    tokenizer without one."""
    chat_text = getattr(tokenizer, "chat_text", None)
    if chat_text is None:
        return None
    return chat_text([{"role": m.role, "content": m.content} for m in messages], first=first, answer=answer)


def has_chat(tokenizer) -> bool:
    """Whether ``tokenizer`` has a chat template."""
    return chat_prompt(tokenizer, [Message("user", ".")], first=True, answer=True) is not None

