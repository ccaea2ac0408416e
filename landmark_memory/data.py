"""Book text: Gutenberg clean-up, whole-book train/validation splits, tokenized windows,
and the synthetic passkey mix that teaches a small model to retrieve."""

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach for a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)

SAMPLE_DIR = Path(__file__).parent / "samples"


def strip_gutenberg(text):
    """The body of a Project Gutenberg text: licence header and footer removed, newlines
    normalised. Text without the markers is returned as it is (but for newlines)."""
    text = text.replace("\r\n", "\n").lstrip("\ufeff")
    start, end = _START.search(text), _END.search(text)
    if start and end and start.end() < end.start():
        text = text[start.end():end.start()]
    return text.strip() + "\n"


def list_text_files(paths):
    """Every ``.txt`` file named or found (recursively) under ``paths``, sorted."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*.txt") if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory; pass text files or folders of .txt files")
    if not files:
        raise FileNotFoundError(f"no .txt files found under {', '.join(map(str, paths))}")
    return sorted(set(files))


SPLIT_SEED = 0  # the tokenizer and every training run hold out the same books


def split_books(files, n_val=None, seed=SPLIT_SEED):
    """Hold out ``n_val`` whole books for validation, chosen reproducibly by ``seed``.

    ``n_val=None`` holds out 5% of the books (at least one). Returns ``(train_files,
    val_files)``, both sorted."""
    files = sorted(map(Path, files))
    if n_val is None:
        n_val = max(1, round(0.05 * len(files)))
    if not 0 < n_val < len(files):
        raise ValueError(f"cannot hold out {n_val} of {len(files)} books: need at least one book on each side "
                         "(give more files or change the number of validation books)")
    val = set(random.Random(seed).sample(files, n_val))
    return [f for f in files if f not in val], sorted(val)


def tokenize_books(files, tokenizer, eos_id, desc="tokenizing"):
    """Token ids of the books, each followed by ``eos_id``, as one uint16 array.

    The books are read with ``datasets`` (one document per file) so the tokenized result is
    cached by fingerprint and a second run over the same files is instant."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()
    ds = load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")

    def encode(batch):
        enc = tokenizer.encode_batch([strip_gutenberg(t) for t in batch["text"]])
        return {"ids": [e.ids + [eos_id] for e in enc]}

    ds = ds.map(encode, batched=True, batch_size=8, remove_columns=["text"], desc=desc)
    assert tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max
    return np.concatenate([np.asarray(ids, dtype=np.uint16) for ids in ds["ids"]])


class PasskeyMix:
    """Plants a passkey and asks for it again at the end of a training window.

    Window layout: ``book text [pass key sentence] book text [question + answer]``, same
    length as before. A model trained from scratch only learns to use far context when some
    windows reward it, as the passkey task of the paper's Figure 3 does."""

    def __init__(self, tokenizer, rate):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"passkey rate must be in [0, 1], got {rate}")
        self.tokenizer, self.rate = tokenizer, rate

    def _ids(self, text):
        return self.tokenizer.encode(text).ids

    def __call__(self, window, rng):
        """``window`` (T+1,) int64 numpy array, modified in place when this window is picked."""
        if self.rate == 0.0 or rng.random() >= self.rate:
            return window
        key = rng.randint(1, 50000)
        fact = self._ids(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        ask = self._ids(f" What is the pass key? The pass key is {key}.")
        n = len(window)
        if len(fact) + len(ask) + 2 > n:
            raise ValueError(f"window of {n} tokens is too short to plant a passkey; lower the passkey rate to 0")
        window[n - len(ask):] = ask
        at = rng.randint(0, n - len(ask) - len(fact))
        window[at:at + len(fact)] = fact
        return window


class WindowSampler:
    """Random windows of ``seq_len`` + 1 tokens from one token array: (x, y) batches with
    ``y`` the next token of ``x``."""

    def __init__(self, tokens, seq_len, batch_size, seed, passkey=None):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"only {len(tokens)} tokens of text for windows of {seq_len}: "
                             "give more text or a shorter --seq-len")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng, self.passkey = random.Random(seed), passkey

    def batch(self):
        rows = []
        for _ in range(self.batch_size):
            s = self.rng.randrange(len(self.tokens) - self.seq_len - 1)
            w = self.tokens[s:s + self.seq_len + 1].astype(np.int64)
            rows.append(self.passkey(w, self.rng) if self.passkey else w)
        b = torch.from_numpy(np.stack(rows))  # (B, T+1)
        return b[:, :-1], b[:, 1:]
