"""The passkey retrieval test of the paper's Figure 3, and the prompts it is trained on.

Prompt (Figure 3a): an instruction, filler sentences, ``The pass key is KEY. Remember it. KEY is
the pass key.`` at a random depth, more filler, then ``What is the pass key? The pass key is``.
A trial is correct when the first integer the model generates equals the key (1..50000).
"""

import random
import re

import torch

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
         "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"
MAX_KEY = 50000


def fact(key):
    return f" The pass key is {key}. Remember it. {key} is the pass key."


def answer(key):
    return f" {key}."


class PasskeyPrompts:
    """Token ids of passkey prompts for one tokenizer (pieces encoded once)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.intro, self.filler, self.question = (self.ids(t) for t in (INTRO, FILLER, QUESTION))

    def ids(self, text):
        return self.tok.encode(text).ids

    def filler_ids(self, n):
        """``n`` filler tokens (the filler repeated and cut)."""
        reps = n // len(self.filler) + 1
        return (self.filler * reps)[:n]

    def prompt(self, n_tokens, key, depth, filler=None):
        """Exactly ``n_tokens`` ids ending with the question; the fact starts ``depth`` (0..1) of
        the way through the filler. ``filler(n)`` gives ``n`` filler ids (default: the paper's)."""
        filler = filler or self.filler_ids
        key_ids = self.ids(fact(key))
        n_fill = n_tokens - len(self.intro) - len(key_ids) - len(self.question)
        if n_fill < 0:
            raise ValueError(f"a passkey prompt needs more than {n_tokens - n_fill} tokens, asked for {n_tokens}")
        before = round(depth * n_fill)
        return self.intro + filler(before) + key_ids + filler(n_fill - before) + self.question


def first_int(text):
    """The first integer in ``text``, or None."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


@torch.no_grad()
def run_passkey(generate, tokenizer, lengths, trials=10, seed=0, progress=None):
    """Accuracy of the passkey test at each prompt length.

    Parameters
    ----------
    generate : callable(ids: list[int]) -> str, the model's greedy continuation of a prompt
        (a few tokens are enough).
    tokenizer : tokenizers.Tokenizer.
    lengths : list of int, prompt lengths in tokens.
    trials : int, prompts per length (random key and depth each).
    seed : int, the keys and depths are reproducible from it.
    progress : optional tqdm-like bar, advanced once per trial.

    Returns
    -------
    list of dicts ``{"length", "accuracy", "trials", "correct", "answers"}``; ``answers`` holds
    one ``{"key", "depth", "answer"}`` per trial (``answer``: the first integer generated, or
    None), so that a miss can be traced to where its key sat.
    """
    prompts, rng, out = PasskeyPrompts(tokenizer), random.Random(seed), []
    for n in lengths:
        answers = []
        for _ in range(trials):
            key, depth = rng.randint(1, MAX_KEY), rng.random()
            answers.append({"key": key, "depth": round(depth, 4),
                            "answer": first_int(generate(prompts.prompt(n, key, depth)))})
            if progress is not None:
                progress.update(1)
        correct = sum(a["answer"] == a["key"] for a in answers)
        out.append({"length": n, "accuracy": correct / trials, "trials": trials, "correct": correct,
                    "answers": answers})
    return out
