"""Book text: Gutenberg clean-up, whole-book train/validation splits, tokenized windows,
and the synthetic passkey mix that teaches a small model to retrieve."""

import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.names import SAMPLES
from ..core.passkey import MAX_KEY, PasskeyPrompts, answer

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach for a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)

SAMPLE_DIR = SAMPLES


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


def read_text(path):
    """The text of a UTF-8 file, checked: an empty, binary or non-UTF-8 file raises
    ``ValueError`` saying what is wrong and what to do."""
    path = Path(path)
    data = path.read_bytes()
    if not data.removeprefix(b"\xef\xbb\xbf").strip():  # nothing, or a byte-order mark alone
        raise ValueError(f"{path} is empty: there is no text to read")
    if (nul := data.find(b"\x00")) >= 0:
        raise ValueError(f"{path} looks binary (a NUL byte at offset {nul:,}); give plain UTF-8 text files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         f"convert it first, e.g. iconv -f latin1 -t utf-8") from None


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
    """Token ids of the books, each followed by ``eos_id``, as one array (uint16 when the
    vocabulary fits, else int32).

    The books are read with ``datasets`` (one document per file) so the tokenized result is
    cached by fingerprint and a second run over the same files is instant."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()
    ds = load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")

    def encode(batch):
        enc = tokenizer.encode_batch([strip_gutenberg(t) for t in batch["text"]])
        return {"ids": [e.ids + [eos_id] for e in enc]}

    ds = ds.map(encode, batched=True, batch_size=8, remove_columns=["text"], desc=desc)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max else np.int32
    return np.concatenate([np.asarray(ids, dtype=dtype) for ids in ds["ids"]])


@dataclass(frozen=True)
class Answer:
    """An answer's tokens in a drill window, ``span`` ``[start, end)``, and the spans of the
    window's text that it is read from (``sources``: a planted fact, a quoted sentence; none
    where a mix does not mark them)."""

    span: tuple[int, int]
    sources: tuple[tuple[int, int], ...] = ()


@dataclass
class Batch:
    """Training windows: ``x`` (B, T) int64 token ids, ``y`` (B, T) their next tokens, ``w``
    (B, T) float32 each target's loss weight, ``answer`` (B, T) int64 ``j`` > 0 where the target
    is a token of the row's ``j``-th answer and ``source`` (B, T) int64 ``j`` on the tokens of
    ``x`` that answer is read from (0 elsewhere: the recall loss's targets, ``recall.py``)."""

    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    answer: torch.Tensor
    source: torch.Tensor


class PasskeyMix:
    """Turns a fraction of training windows into passkey prompts (``passkey.py``), each with
    its answer at the end.

    A picked window holds 1 to ``max_prompts`` prompts of equal length (at least 128 tokens
    each), each with its own key: short prompts teach copying a key at all, long ones teach
    finding it blocks away. Each prompt's filler is the window's own book text or the paper's
    filler sentences, at even odds; the window keeps its length. A model trained from scratch
    only learns to use far context when some windows reward it, as the passkey task of the
    paper's Figure 3 does.

    A ``copy_rate`` share of the picked windows are copy drills instead: a random stretch of
    the window's text (16 to 256 tokens) repeated to fill it, so that almost every token is
    a copy of one seen before, near or blocks away: a small model learns to copy (induction
    heads) far sooner from these than from the few answer tokens of passkey prompts."""

    def __init__(self, tokenizer, rate, max_prompts=4, copy_rate=0.25):
        if not 0.0 <= rate <= 1.0 or not 0.0 <= copy_rate <= 1.0:
            raise ValueError(f"passkey and copy rates must be in [0, 1], got {rate} and {copy_rate}")
        self.prompts, self.rate = PasskeyPrompts(tokenizer), rate
        self.max_prompts, self.copy_rate = max_prompts, copy_rate

    def __call__(self, window, rng):
        """``window`` (T+1,) int64 numpy array, modified in place when this window is picked;
        returns its answers (``Answer``, without sources; none for copy drills)."""
        if self.rate == 0.0 or rng.random() >= self.rate:
            return []
        n = len(window)
        if rng.random() < self.copy_rate:
            size = rng.randint(16, max(16, min(256, n // 2)))
            start = rng.randrange(max(1, n - size))
            window[:] = np.resize(window[start:start + size].copy(), n)
            return []
        m = rng.randint(1, max(1, min(self.max_prompts, n // 128)))
        book = iter(window.tolist())
        ids, answers = [], []
        for i in range(m):
            size = n // m + (n % m if i == m - 1 else 0)
            key, depth = rng.randint(1, MAX_KEY), rng.random()
            ans = self.prompts.ids(answer(key))
            filler = None if rng.random() < 0.5 else (lambda k: [next(book) for _ in range(k)])
            try:
                ids += self.prompts.prompt(size - len(ans), key, depth, filler)
            except ValueError:
                raise ValueError(f"a window of {n} tokens is too short to plant a passkey; "
                                 "lower the passkey rate to 0 or lengthen the windows") from None
            answers.append(Answer((len(ids), len(ids) + len(ans))))
            ids += ans
        window[:] = ids
        return answers


class WindowSampler:
    """Random windows of ``seq_len`` + 1 tokens from one token array, as ``Batch``es with ``y``
    the next token of ``x``. ``mix(window, rng)``, when given, may turn a window into a drill in
    place (``PasskeyMix``, ``drills.RetrievalDrills``) and returns its ``Answer``s: their
    targets weigh ``answer_weight``, every other target 1."""

    def __init__(self, tokens, seq_len, batch_size, seed, mix=None, answer_weight=1.0):
        if answer_weight <= 0:
            raise ValueError(f"the answer weight must be positive, got {answer_weight}")
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"only {len(tokens)} tokens of text for windows of {seq_len}: "
                             "give more text or a shorter --seq-len")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng, self.mix, self.answer_weight = random.Random(seed), mix, answer_weight

    def batch(self) -> Batch:
        shape = (self.batch_size, self.seq_len + 1)
        rows, weights = [], np.ones(shape, dtype=np.float32)
        answer, source = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        for i in range(self.batch_size):
            s = self.rng.randrange(len(self.tokens) - self.seq_len - 1)
            rows.append(self.tokens[s:s + self.seq_len + 1].astype(np.int64))
            for j, ans in enumerate(self.mix(rows[-1], self.rng) if self.mix else (), 1):
                a, b = ans.span
                weights[i, a:b], answer[i, a:b] = self.answer_weight, j
                for a, b in ans.sources:
                    source[i, a:b] = j
        b = torch.from_numpy(np.stack(rows))  # (B, T+1)
        # y[:, t] is window token t + 1: targets (weights, answers) drop the first token, inputs the last
        return Batch(b[:, :-1], b[:, 1:], torch.from_numpy(weights[:, 1:]), torch.from_numpy(answer[:, 1:]),
                     torch.from_numpy(source[:, :-1]))
