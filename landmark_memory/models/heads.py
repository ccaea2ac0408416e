"""A model's retrieval heads: the few (memory layer, key/value head) pairs whose attention, token
by token, points a question at the text that answers it (``uses/evidence.py`` reads with
them; ``landmark-memory heads`` chooses them for any model on a development set shipped with the
package, QRHead's procedure, arXiv 2506.09944). They are kept as a small JSON file
(``heads_path``): in a Hugging Face model's folder, or, for a named model, in the user's cache,
else as the package ships them for it (``assets/heads/<name>.json``).

A model with a chat template reads a question as a user turn, and the template's tokens around it
calibrate the heads; a model without one reads it in ``PLAIN_FRAME``, whose words do the same,
and its heads file keeps the frame they were chosen with."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.fileio import atomic_write
from ..core.names import ASSETS, is_named_model

HEADS_FILE = "retrieval_heads.json"  # in a Hugging Face model's folder
MAX_HEADS = 256
MAX_FILE_BYTES = 1 << 20  # a heads file of MAX_HEADS pairs and its notes takes a few KB
PLAIN_FRAME = "Question: {question}\nAnswer:"  # a question, where a model has no chat template


@dataclass(frozen=True)
class EvidenceHeads:
    """A model's retrieval heads: ``heads``, (memory layer, key/value head) pairs whose token-level
    attention ranks blocks; ``blocks``, how many of the best every token of an answer reads first
    (pinned: ``LandmarkMemory.reading``); ``candidates``, the most blocks read token by token;
    ``frame``, the text a question is read in (``{question}`` its place) where the model has no
    chat template, None where it has one."""

    heads: tuple[tuple[int, int], ...]
    blocks: int = 4
    candidates: int = 512
    frame: str | None = None
    source: str = ""  # the file they were read from (for messages)

    def check(self, n_layer: int, n_kv_head: int) -> None:
        """``ValueError`` when a head lies outside a memory of ``n_layer`` layers of ``n_kv_head``
        key/value heads (another model's heads)."""
        bad = [lh for lh in self.heads if not (0 <= lh[0] < n_layer and 0 <= lh[1] < n_kv_head)]
        if bad:
            raise ValueError(f"{self.source or 'the retrieval heads'}: heads {bad} lie outside this model's "
                             f"{n_layer} memory layers of {n_kv_head} key/value heads: they are another model's; "
                             "choose them for this one (`landmark-memory heads --model ...`) or remove the file")


def save_heads(heads: EvidenceHeads, path: str | Path, **notes) -> None:
    """``heads`` as a small JSON file, written whole or not at all (``notes``: how they were chosen)."""
    body = {"heads": [list(lh) for lh in heads.heads], "blocks": heads.blocks, "candidates": heads.candidates,
            **({"frame": heads.frame} if heads.frame is not None else {}), **notes}
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # (a named model's: the user's cache, made on first use)
    atomic_write(path, (json.dumps(body, indent=1) + "\n").encode())


def load_heads(path: str | Path) -> EvidenceHeads:
    """``save_heads``'s file; ``ValueError`` saying what is wrong with one that is not."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise ValueError(f"{size:,} bytes, more than a heads file's {MAX_FILE_BYTES:,}")
            body = json.loads(f.read(), parse_constant=_no_constant)
        heads = tuple((int(a), int(b)) for a, b in body["heads"])
        blocks, candidates, frame = body.get("blocks", 4), body.get("candidates", 512), body.get("frame")
        framed = frame is None or (type(frame) is str and frame.count("{question}") == 1
                                   and frame.replace("{question}", "").strip() != "")  # words to calibrate by
        ok = (all(type(a) is int and type(b) is int for a, b in body["heads"]) and type(candidates) is int
              and type(blocks) is int and 1 <= candidates <= 1 << 20 and 0 <= blocks <= 64
              and 0 < len(heads) <= MAX_HEADS and framed)
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        raise ValueError(f"{path}: not a retrieval heads file ({type(e).__name__}: {e}); choose them again "
                         "(`landmark-memory heads`) or remove it") from None
    if not ok:
        raise ValueError(f"{path}: retrieval heads must be 1 to {MAX_HEADS} pairs of integers, blocks a count "
                         "from 0 to 64, candidates one from 1 on and a frame a text with one {question}; choose them "
                         "again (`landmark-memory heads`) or remove it")
    return EvidenceHeads(heads, blocks, candidates, frame, str(path))


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def question_prompt(tokenizer, question: str, frame: str | None = None) -> tuple[str, str | None]:
    """(the text a question is read in for its heads, the frame used): a user turn of the model's
    chat template, else ``frame`` (default ``PLAIN_FRAME``) around it."""
    chat = getattr(tokenizer, "chat_text", None)
    turn = chat([{"role": "user", "content": question}], first=True, answer=True) if chat else None
    if turn is not None:
        return turn, None
    frame = frame or PLAIN_FRAME
    return frame.replace("{question}", question), frame


def heads_path(model: str) -> Path:
    """Where ``landmark-memory heads`` saves the heads of ``model`` (a named model, or a Hugging
    Face model's folder) and ``find_heads`` looks first."""
    if is_named_model(model):
        from .hf.smollm2 import cache_dir
        return cache_dir() / "heads" / f"{model}.json"
    return Path(model) / HEADS_FILE


def find_heads(model: str | None) -> EvidenceHeads | None:
    """The retrieval heads of ``model`` (as ``heads_path`` names it; for a named model, else the
    package's), or None where it has none; ``ValueError`` for a file that is not a heads file."""
    if model is None:
        return None
    # (the package's file for a name it ships: a folder's path never made into a file name)
    shipped = (ASSETS / "heads" / f"{model}.json",) if is_named_model(model) else ()
    for path in (heads_path(str(model)), *shipped):
        if path.is_file():
            return load_heads(path)
    return None
