"""A question read into a memory: whether it can be asked (``check_question``, for ``ask``,
``search`` and the server alike), what its tokens search the memory with, which of them are the
question's own, and the blocks a question reader ranks first (``answer.converse`` reads a
question through these; ``evidence.py`` scores it with retrieval heads; experiments and
``choose_heads.py`` record what a question reads).
"""

from collections.abc import Sequence

import torch

from ..core.names import MAX_TURN_CHARS
from ..models.reader import QuestionReader, head_attention, standardised


class QuestionError(ValueError):
    """A question ``ask`` refuses; ``field`` says what is wrong: "empty", "text" (not Unicode),
    "seed", "stop" or "role"."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_question(question: str, *, seed: int = 0, stop: Sequence[str] = ()) -> None:
    """Raise ``QuestionError`` for what ``ask`` cannot answer: an empty question, one longer
    than a turn (``MAX_TURN_CHARS``), one that is no Unicode text, a seed outside
    0..2**64 - 1, an empty stop string (a server checks a request here before it answers)."""
    if not question.strip():
        raise QuestionError("empty", "the question is empty")
    if len(question) > MAX_TURN_CHARS:
        raise QuestionError("text", f"the message is {len(question):,} characters long, over the {MAX_TURN_CHARS:,} of "
                            "one turn: send it in parts, or build the text into a memory (`landmark-memory build`)")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (a command line's undecodable bytes, JSON's "\ud800")
        raise QuestionError("text", f"the question is not valid text: {question[e.start:e.end]!r} at character "
                            f"{e.start} is no Unicode character (text must be UTF-8)") from None
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise QuestionError("seed", f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise QuestionError("stop", f"stop strings must be non-empty strings, got {list(stop)!r}")


@torch.no_grad()
def point(mem, reader: QuestionReader, calibration: str, prompt: list[int], own: list[int],
          k: int) -> list[tuple[int, float]]:
    """Read ``prompt`` (token ids: a question at the positions ``own``, the chat template's
    tokens around it) into the memory ``mem`` and rank the blocks the memory held before it by
    ``reader``: the best ``k`` as (block, score), best first.

    Every block's landmark key is scored in each memory layer the reader weighs (a layer at a
    time): the cost grows with the memory's blocks (SmolLM2's shipped reader weighs all 30 layers;
    over 520 blocks a warm ``point`` took 0.25 s with the prompt's reading, which alone took 0.2 s)."""
    n, c = mem.n_blocks, reader.config
    got = search_states(mem, prompt)
    if n == 0 or not own:
        return []
    mine = torch.zeros(1, 1, len(prompt))
    mine[..., own] = 1.0
    theirs = (1 - mine) / max(len(prompt) - len(own), 1)  # the template's tokens (the calibration)
    mine /= len(own)
    mix = reader.weights()  # (L, H_kv)
    heads = reader.heads.view_as(mix) if c.blend else torch.zeros_like(mix)  # by the model's own queries
    total, base = torch.zeros(n), torch.zeros(n)
    for layer, (q, h, cos, sin) in enumerate(got):
        if not (mix[layer].any() or heads[layer].any()):  # a layer the reader does not weigh
            continue
        keys = mem.keys(layer, torch.arange(n)).cpu()[None]  # (1, H_kv, n, D)
        a = reader.attention(q[None, None], h[None, None], cos[None], sin[None], mine, keys, mem.backbone.scale,
                             layers=[layer])[0, 0]  # (H_kv, n)
        own_a, null = head_attention(q[None, None], cos[None], sin[None], torch.cat([mine, theirs]), keys,
                                     mem.backbone.scale)[:, 0]  # (H_kv, n) each: the model's own queries
        if calibration != "template":
            null = torch.zeros_like(null)
        total += (mix[layer, :, None] * (a - null)).sum(0)
        base += (heads[layer, :, None] * (own_a - null)).sum(0)
    if c.blend:
        total = (1 - c.blend) * standardised(total) + c.blend * standardised(base)
    top = total.topk(min(k, n))
    return list(zip(top.indices.tolist(), top.values.tolist()))


@torch.no_grad()
def search_states(mem, prompt: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Read ``prompt`` (token ids) into the memory ``mem`` and return, per memory layer, what its
    tokens search the memory with (stream 0, float32 on the CPU): the raw queries (H, T, D), the
    layer's inputs (T, C), and the rotation ``cos``, ``sin`` (T, D) each that moves a raw query
    to where it searches older blocks from (the engine's ``observer``, over every step)."""
    got = [[] for _ in range(mem.shape.n_layer)]

    def observe(layer, h, q, at_search, normal):  # the step's normal rows
        cos, sin = at_search
        got[layer].append((q[0][:, normal], h[0][normal], cos[normal], sin[normal]))

    mem.observer = observe
    try:
        mem.forward(torch.tensor([prompt], device=mem.device), logits="none")
    finally:
        mem.observer = None
    return [tuple(torch.cat(parts, -2).float().cpu() for parts in zip(*steps)) for steps in got]


def question_tokens(offsets: Sequence[tuple[int, int]], prompt: str, question: str) -> list[int]:
    """The positions of the prompt's tokens (their character ``offsets``) that are the
    question's own: the last place the prompt holds its text."""
    start = prompt.rfind(question)
    end = start + len(question)
    return [i for i, (a, b) in enumerate(offsets) if start >= 0 and start <= a < b <= end]
