"""Choosing a model's retrieval heads on development questions (QRHead's procedure, arXiv
2506.09944, at token level): every (memory layer, key/value head) reads each question's prompt
against every stored token of a memory of the question's text (``evidence.token_attention``,
calibrated by the template's tokens); a head scores the mean reciprocal rank of the block that
holds the question's evidence; the best heads are pooled, as many as rank the evidence's block
among the first five most often.

``landmark-memory heads`` runs it on the development set shipped with the package
(``samples/questions.json``: questions about the opening of three books, each with the words of
the text that answer it) and saves the heads where ``ask`` finds them (``models/heads.py``).
"""

import json
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from ..memory.engine import LandmarkMemory
from ..models.heads import EvidenceHeads, question_prompt
from .evidence import prompt_weights, token_attention
from .question import question_tokens, search_states

COUNTS = (2, 4, 8, 16, 32)  # heads pooled: the count is chosen by development recall@5
RECALL_AT = 5


@dataclass(frozen=True)
class DevQuestion:
    """A development question about ``text`` (a file of the package's samples), the ``evidence``
    that answers it (words of that text), and the words a right answer holds."""

    text: str
    question: str
    evidence: str
    words: tuple[str, ...]


def shipped_questions() -> tuple[list[DevQuestion], dict[str, str]]:
    """The development set shipped with the package: its questions, and each text by its name."""
    root = resources.files("landmark_memory") / "samples"
    body = json.loads((root / "questions.json").read_text())
    qs = [DevQuestion(q["text"], q["question"], q["evidence"], tuple(q["words"])) for q in body["questions"]]
    return qs, {name: (root / name).read_text(encoding="utf-8") for name in sorted({q.text for q in qs})}


def evidence_blocks(text: str, offsets, evidence: str, block_size: int) -> list[int]:
    """The blocks whose tokens (their character ``offsets`` in ``text``) hold ``evidence`` (any
    run of white space between its words); ``ValueError`` where the text lacks it."""
    found = re.search(r"\s+".join(map(re.escape, evidence.split())), text)
    if found is None:
        raise ValueError(f"the text lacks the evidence {evidence!r}")
    return sorted({i // block_size for i, (a, b) in enumerate(offsets) if a < found.end() and b > found.start()})


def head_ranks(mass: torch.Tensor, gold: list[int]) -> torch.Tensor:
    """int64 (K,): per head the 1-based rank of the best of the ``gold`` blocks by its calibrated
    token attention ``mass`` (2, K, n, bs) summed over each block's tokens."""
    score = (mass[0] - mass[1]).sum(-1)  # (K, n)
    better = score > score[:, gold].max(1, keepdim=True).values  # (K, n)
    return better.sum(1) + 1


def pooled_rank(mass: torch.Tensor, gold: list[int], chosen: list[int]) -> int:
    """The rank of the ``gold`` blocks by the ``chosen`` heads' calibrated attention pooled."""
    score = (mass[0, chosen] - mass[1, chosen]).sum((0, 2))  # (n,)
    return int((score > score[gold].max()).sum()) + 1


def choose(masses: list[torch.Tensor], golds: list[list[int]], heads: list[tuple[int, int]],
           counts=COUNTS) -> tuple[list[tuple[int, int]], dict]:
    """The heads to pool, best first, and how they were chosen (each head's mean reciprocal
    rank, and recall@5 by count), from each development question's token attention ``masses``
    (2, K, n, bs) of every head of ``heads`` and its evidence's blocks ``golds``."""
    rr = torch.stack([1.0 / head_ranks(m, g).float() for m, g in zip(masses, golds)]).mean(0)  # (K,)
    order = torch.argsort(rr, descending=True).tolist()
    sizes = [n for n in counts if n < len(order)] + ([len(order)] if len(order) <= max(counts) else [])
    recall = {n: sum(pooled_rank(m, g, order[:n]) <= RECALL_AT for m, g in zip(masses, golds)) / len(masses)
              for n in sizes}
    best = max(recall, key=lambda n: (recall[n], -n))
    return [heads[i] for i in order[:best]], {"count": best, f"recall@{RECALL_AT}": recall,
                                              "mrr": {f"{heads[i][0]},{heads[i][1]}": round(float(rr[i]), 4)
                                                      for i in order[:32]}}


@torch.no_grad()
def choose_heads(model, tokenizer, questions: list[DevQuestion], texts: dict[str, str], *, tokens: int = 8064,
                 progress: bool = True, **options) -> tuple[EvidenceHeads, dict]:
    """Read the first ``tokens`` tokens of each text into a memory (``options``: its
    ``MemoryOptions`` settings, the model's defaults for the rest), ask each question about it as
    ``ask`` reads a question (a user turn of the chat template, else in ``PLAIN_FRAME``), and
    ``choose`` the heads; a question whose evidence lies past ``tokens`` is left out. Returns the
    heads (with the frame, where there is no template) and how they were chosen (``choose``'s
    record and the questions used)."""
    masses, golds, used, heads, frame = [], [], [], None, None
    bar = tqdm(total=len(questions), desc="choosing heads", unit="question", disable=not progress)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, text) in enumerate(texts.items()):
            enc = tokenizer.encode(text)
            ids, offsets = enc.ids[:tokens], enc.offsets[:tokens]
            folder = Path(tmp) / str(i)
            bar.set_description(f"reading {Path(name).stem} ({len(ids):,} tokens)")
            with LandmarkMemory(model, path=folder, store="lmdb", **options) as mem:
                mem.forward(torch.tensor([ids]), logits="none")
                mem.commit()
            bar.set_description("asking its questions")
            with LandmarkMemory.open(folder, model, readonly=True) as mem:
                s = mem.shape
                heads = [(layer, h) for layer in range(s.n_layer) for h in range(s.n_kv_head)]
                for q in [q for q in questions if q.text == name]:
                    bar.update()
                    try:
                        gold = evidence_blocks(text, offsets, q.evidence, s.block_size)
                    except ValueError:
                        continue
                    if not gold or max(gold) >= mem.n_blocks:  # past the tokens read, or in the open chunk
                        continue
                    mem.rewind()
                    prompt, frame = question_prompt(tokenizer, q.question)
                    p = tokenizer.encode(prompt)
                    own = question_tokens(p.offsets[:-1], prompt, q.question)
                    got = search_states(mem, p.ids[:-1])
                    masses.append(token_attention(mem, got, prompt_weights(own, len(p.ids) - 1), heads,
                                                  torch.arange(mem.n_blocks)))
                    golds.append(gold)
                    used.append(q.question)
    bar.close()
    if len(masses) < 4:
        raise ValueError(f"only {len(masses)} development questions have their evidence in the first {tokens:,} "
                         "tokens of their texts: choosing heads needs at least 4")
    chosen, record = choose(masses, golds, heads)
    return EvidenceHeads(tuple(chosen), frame=frame), {**record, "questions": len(used), "tokens": tokens}
