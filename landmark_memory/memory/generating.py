"""Generating through a memory: the prompt fed a chunk at a time, then one token at a time,
written over ``LandmarkMemory.forward`` alone (``LandmarkMemory.generate`` is this function)."""

from collections.abc import Callable, Collection

import torch

from ..core.decode import decode


@torch.no_grad()
def generate(mem, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             generator: torch.Generator | None = None, stop_ids: Collection[int] = (),
             until: Callable[[list[int]], bool] | None = None,
             on_token: Callable[[torch.Tensor], None] | None = None,
             on_read: Callable[[list[torch.Tensor]], None] | None = None) -> torch.Tensor:
    """Feed ``idx`` (B, T), then generate up to ``max_new_tokens`` (greedy when temperature
    is 0; ``stop_ids`` and ``until`` end it, as in ``decode.decode``); returns the new tokens
    (B, n). The memory reads the new tokens too, so a later call continues after them.

    ``on_token(t)``: each new token (B,) as the memory is about to read it (streaming);
    ``on_read(retrieved)``: per layer the memory blocks (B, H, 1, top_k) read at each
    position that generating reads, the prompt's last and every new token's (``answer``
    counts them: the passages an answer read)."""
    if idx.shape[-1] == 0:
        raise ValueError("generate needs a prompt of at least one token")

    def read(nxt, told=True):  # (B, T) -> the logits after it, (B, vocab)
        out = mem.forward(nxt, logits="last")
        if on_read is not None and told:
            on_read([r[:, :, -1:] for r in out.retrieved])
        return out.logits[:, -1]

    def step(nxt):  # (B, 1)
        if on_token is not None:
            on_token(nxt[:, -1])
        return read(nxt)

    C = mem.options.chunk_size
    for a in range(0, idx.shape[1], C):  # a chunk at a time: the retrieved ids of a long prompt add up
        last = read(idx[:, a:a + C], told=a + C >= idx.shape[1])
    new = decode(last, step, max_new_tokens, temperature=temperature, generator=generator, stop_ids=stop_ids,
                 until=until)
    if new.shape[1]:
        step(new[:, -1:])
    return new
