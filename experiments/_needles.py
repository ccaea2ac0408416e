"""Needles read several ways: a prompt's memory read once at the defaults, then its question
and the teacher-forced answer read through it with other query options (and, for comparison,
the whole prompt in sequence): the answer per way and how often its lookups held the needle's
blocks. The book-text passkey and RULER's single needle, as ``exp_diagnose.py`` and
``exp_retrieval.py`` read them."""

import numpy as np
import torch
from _ruler_tasks import trial_prompt
from _texts import book_filler

from landmark_memory.core.passkey import MAX_KEY, answer, fact, first_int
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import in_sequence_logits

CONFIGS = [(4, "stingy"), (8, "stingy"), (16, "stingy"), (4, "exact"), (8, "exact"), (16, "exact")]


def greedy_answer(logits, tok):
    """The first integer of the greedy tokens at each answer position (teacher forced)."""
    return first_int(tok.decode(logits.argmax(-1).tolist()))


def key_hits(retrieved, positions, blocks):
    """Share of (layer, head, position) lookups at ``positions`` whose top-k held one of ``blocks``,
    overall and per layer."""
    per_layer = []
    for r in retrieved:  # (1, H, T, k)
        got = r[0][:, positions]  # (H, P, k)
        per_layer.append(float(np.isin(got.numpy(), blocks).any(-1).mean()))
    return float(np.mean(per_layer)), per_layer


@torch.no_grad()
def read_ways(model, tok, ids, q0, ans, key_span, folder, ways=None, in_sequence=True, reading=None):
    """The answer ``ans`` (token ids) to the prompt ``ids`` read in sequence and through memory in
    each of ``ways`` ({name: query options}, default ``CONFIGS`` named "k4 stingy" and so on;
    the memory holds ``ids[:q0]``, read at its defaults for ``model`` with ``reading`` (memory
    options) changed, the question and answer read from it; ``in_sequence``: read the prompt whole too):
    {way: the greedy answer's first integer, way + " hits": the share of lookups of the
    question's last token and the answer's tokens that held one of the memory's blocks that
    hold the tokens ``key_span`` (start, end), way + " layers": that share per layer}."""
    seq, n_p = torch.tensor([ids + ans]), len(ids)
    row = {}
    if in_sequence:
        logits = in_sequence_logits(model, seq[:, :-1])[0, n_p - 1:]  # the answer's positions
        row["in sequence"] = greedy_answer(logits, tok)
    mem = LandmarkMemory(model, path=folder, store="lmdb", **(reading or {}))
    key_blocks = spanned_blocks(*key_span, mem.shape.block_size)
    mem.forward(seq[:, :q0], logits="none")
    mem.commit()
    mem.close()
    asked = list(range(n_p - 1 - q0, seq.shape[1] - 1 - q0))
    ways = ways or {f"k{k} {mapping}": {"top_k": k, "position_mapping": mapping} for k, mapping in CONFIGS}
    for name, options in ways.items():
        with LandmarkMemory.open(folder, model, readonly=True, **options) as m:
            out = m.forward(seq[:, q0:-1])
        row[name] = greedy_answer(out.logits[0, asked], tok)
        row[f"{name} hits"], row[f"{name} layers"] = key_hits(out.retrieved, asked, key_blocks)
    return row


def spanned_blocks(start, end, bs):
    """The memory blocks that hold tokens [start, end)."""
    return list(range(start // bs, (end - 1) // bs + 1))


def passkey_trial(model, tok, prompts, book, rng, length, folder, ways=None, in_sequence=True, reading=None):
    name, _, ids = book
    key, depth = rng.randint(1, MAX_KEY), rng.random()
    n_key = len(prompts.ids(fact(key)))
    n_fill = length - len(prompts.intro) - n_key - len(prompts.question)
    start = rng.randrange(0, len(ids) - n_fill)
    prompt = prompts.prompt(length, key, depth, book_filler(ids, start))
    fact_at = len(prompts.intro) + round(depth * n_fill)
    row = read_ways(model, tok, prompt, len(prompt) - len(prompts.question), tok.encode(answer(key)).ids,
                    (fact_at, fact_at + n_key), folder, ways, in_sequence, reading)
    return {"book": name, "key": key, "depth": round(depth, 3), **row}


def ruler_trial(model, tok, books, i, length, seed, folder, ways=None, in_sequence=True):
    """Trial ``i`` of the RULER-style suite's single needle (``exp_ruler``: the same prompt)."""
    name, p = trial_prompt(tok, books, length, "single", i, seed)
    (start, end), value = p.needles[0], p.want[0]
    row = read_ways(model, tok, p.ids, p.question_at, tok.encode(f" {value}.").ids, (start, end), folder, ways,
                    in_sequence)
    return {"book": name, "key": int(value), "depth": round(start / p.question_at, 3), **row}
