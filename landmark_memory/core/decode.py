"""The one decoding loop: every generator in the package (a model re-reading its context, a
memory, the CLI's ask, the passkey test) picks tokens here and feeds them back its own way."""

import math
from collections.abc import Callable, Collection

import torch


def next_token(logits: torch.Tensor, temperature: float = 0.0, sample_top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each stream, int64 (B,), from ``logits`` (B, vocab): the argmax when
    ``temperature`` is 0, else a sample of softmax(logits / temperature), restricted to the
    ``sample_top_k`` most likely tokens when given."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    # in float64 with the best logit at 0 before dividing: a tiny temperature sends the others to
    # -inf (never inf - inf, nor a temperature that float32 rounds to 0)
    logits = (logits.double() - logits.amax(-1, keepdim=True)) / temperature
    if sample_top_k is not None:
        kth = torch.topk(logits, min(sample_top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def decode(logits: torch.Tensor, feed: Callable[[torch.Tensor], torch.Tensor], max_new_tokens: int, *,
           temperature: float = 0.0, sample_top_k: int | None = None, generator: torch.Generator | None = None,
           stop_ids: Collection[int] = (), until: Callable[[list[int]], bool] | None = None) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens.

    Parameters
    ----------
    logits : Tensor (B, vocab), the logits of the next token after the prompt.
    feed : callable taking the new tokens (B, 1) and returning the logits (B, vocab) after
        them; it is not called after the last token.
    temperature, sample_top_k, generator : as for ``next_token``.
    stop_ids : token ids; generation ends once every stream has produced one of them (a chat
        model's ends of turn); that token is kept.
    until : called with the first stream's tokens so far after each one; generation ends when
        it returns True (stop strings: ``answer.ask``).

    Returns
    -------
    int64 Tensor (B, n), n <= max_new_tokens.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    out = []
    stopped = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
    for i in range(max_new_tokens):
        out.append(next_token(logits, temperature, sample_top_k, generator))
        if len(stops):
            stopped |= torch.isin(out[-1], stops)
            if bool(stopped.all()):
                break
        if until is not None and until([int(t[0]) for t in out]):
            break
        if i + 1 < max_new_tokens:
            logits = feed(out[-1][:, None])
    return torch.stack(out, 1) if out else torch.zeros((logits.shape[0], 0), dtype=torch.long, device=logits.device)


def decode_rereading(logits_of: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, max_new_tokens: int,
                     **options) -> torch.Tensor:
    """``decode`` for a model without a cache: ``logits_of(context)`` returns the logits
    (B, T, vocab) of the whole context (B, T), re-read for every new token. ``options`` as
    for ``decode``; returns the new tokens (B, max_new_tokens)."""
    context = idx

    def feed(nxt):
        nonlocal context
        context = torch.cat([context, nxt], 1)
        return logits_of(context)[:, -1]

    return decode(logits_of(idx)[:, -1], feed, max_new_tokens, **options)
