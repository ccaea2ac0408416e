"""Helpers several test modules share (fixtures are conftest.py's)."""

import importlib.util
import sqlite3
import sys
from pathlib import Path

import torch

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.format.text_file import TEXT_INDEX, seal_index
from landmark_memory.uses.session import Session

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
BOOK = Path(__file__).parents[1] / "landmark_memory" / "samples" / "book" / "up_from_slavery.txt"


def script(name):
    # the scripts import _common from beside them, as `python experiments/x.py` does
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ChatTokenizer:
    """The shipped tokenizer with a chat template of one line and the given end-of-turn tokens."""

    def __init__(self, end_of_turn_ids):
        self.tok, self.end_of_turn_ids = load_tokenizer(), tuple(end_of_turn_ids)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def chat_text(self, messages, *, first, answer):
        return "".join(f"{m['role']}:{m['content']}\n" for m in messages) + ("assistant:" if answer else "")


BS = 5


def feed(mem, blocks, seed):
    mem.forward(torch.randint(4, 64, (1, 5 * blocks), generator=torch.Generator().manual_seed(seed)))


def files_of(path, model=None):
    """The corpus's own files and every stored block, as bytes (its model: the bundled one)."""
    out = {f.relative_to(path).as_posix(): f.read_bytes() for f in [path / "tokens.bin", *(path / "keys").iterdir()]}
    mem = LandmarkMemory.open(path, model or LandmarkGPT.from_pretrained(), readonly=True)
    keys = [(0, layer, b) for layer in range(mem.shape.n_layer) for b in range(mem.n_blocks)]
    out["blocks"] = b"".join(t.numpy().tobytes() for t in mem.inspection.stored(keys))
    out["index"] = b"".join(ix.to_bytes().tobytes() for ix in mem.inspection.indexes())
    mem.close()
    return out


def snapshot(folder):
    """Every file under ``folder`` with its bytes (lock files aside)."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in ("writer.lock", "lock.mdb")}


@torch.no_grad()
def turns_read_as_one_forward(model, text, full, tmp_path, chunk_size, turns, rtol):
    """A memory of ``text`` up to the first turn with every block retrieved at its own position,
    then each turn (``(start, end)``) held in a session closed and opened again between them:
    each turn's logits equal ``full``'s, the in-sequence forward's (within ``rtol``, 1e-5
    absolute). Returns the last turn's session."""
    exact = dict(top_k=64, position_mapping="exact")  # every block retrieved at its own position
    with LandmarkMemory(model, store="lmdb", path=tmp_path / "m", store_dtype="float32", chunk_size=chunk_size,
                        **exact) as mem:
        mem.forward(text[:, :turns[0][0]], logits="none")  # tokens left in the open chunk: the session takes them
    with LandmarkMemory.open(tmp_path / "m", model, readonly=True) as mem:
        for a, b in turns:
            with Session.open(mem, "s") as s:
                s.attach()
                out = mem.forward(text[:, a:b]).logits
                s.commit([])
                torch.testing.assert_close(out, full[:, a:b], rtol=rtol, atol=1e-5)
        return s


def rewrite_index(path, statements, *, reseal=False):
    """Run SQL ``statements`` on the text index of the memory ``path`` as anyone could (and,
    with ``reseal``, seal it again as its writer would)."""
    db = sqlite3.connect(path / TEXT_INDEX)
    with db:
        for s in statements:
            db.execute(s)
    db.close()
    if reseal:
        seal_index(path / TEXT_INDEX)


def damage_segments(path, how):
    """Every FTS5 segment blob of the text index of the memory ``path`` ``"flipped"`` (an error
    as it is read) or ``"zeroed"`` (it finds nothing), and sealed again."""
    db = sqlite3.connect(path / TEXT_INDEX)
    with db:
        for i, blob in db.execute("SELECT id, block FROM text_data WHERE id > 10").fetchall():
            db.execute("UPDATE text_data SET block = ? WHERE id = ?",
                       (bytes(len(blob)) if how == "zeroed" else bytes(b ^ 0x5A for b in blob), i))
    db.close()
    seal_index(path / TEXT_INDEX)
