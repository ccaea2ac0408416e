"""The files of a saved memory, and the commit protocol that keeps them consistent.

A memory directory holds (docs/DESIGN.md, "On-disk format"):

- ``manifest.json``: format version, model fingerprint and config, options, counts, the
  commit counter, the inputs ingested; written last, atomically: it *is* the commit;
- ``state.<commit>.safetensors``: every FAISS index (FAISS's own serialisation, as uint8
  tensors) and the incomplete chunk (its token ids, keys and values);
- ``tokens.bin`` / ``landmarks.bin``: append-only raw rows, one per block (token ids as int32;
  landmark keys of every layer and head in the model's dtype); only the first ``blocks`` rows
  count, a writer cuts any tail a crash left;
- ``store/lmdb`` or ``store/mmap``: block keys and values, written when a chunk completes,
  one transaction per chunk; blocks past the committed count are ignored and rewritten;
- ``writer.lock``: held (``flock``) by the one process that may write.

Commit order: store transactions (already done), raw rows (fsync), the state file (temp file,
fsync, rename), the manifest (same), then older state files go. A process killed at any
instant leaves the previous manifest pointing at files that are all complete.
"""

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..fileio import atomic_write
from .manifest import Manifest, MemoryFileError, StateFile

MANIFEST, LOCK = "manifest.json", "writer.lock"

# config entries that say where or how a model was loaded, not what it computes (Hugging Face),
# or how it was trained: p_cmt and p_jump change nothing at inference, and a Context Miss Token
# (cmt) shows in the weights, so memories built before these entries existed still open
UNFINGERPRINTED = {"transformers_version", "architectures", "use_cache", "landmark_backend", "cmt", "p_cmt", "p_jump"}


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of a model's config and weights: a memory only makes sense with the model that
    computed its keys and values."""
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in UNFINGERPRINTED}
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemoryDir:
    """One memory directory, opened for reading or for writing (``writable``: takes the
    writer lock)."""

    def __init__(self, path: str | Path, writable: bool):
        self.path, self.writable, self._lock = Path(path), writable, None
        if writable:
            self._take_lock()

    # ---- creation and locking -----------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, manifest: Manifest) -> "MemoryDir":
        """A new memory at ``path`` (absent or empty), its manifest at commit 0."""
        path = Path(path)
        if (path / MANIFEST).exists():
            raise MemoryFileError(f"{path} already holds a memory; open it with LandmarkMemory.open(path, model) "
                                  "to continue it, or choose another path")
        if path.exists() and not path.is_dir():
            raise MemoryFileError(f"{path} is a file; a memory is a directory: choose another path")
        if path.is_dir() and any(p.name not in (LOCK,) for p in path.iterdir()):
            raise MemoryFileError(f"{path} is not empty and holds no memory (no {MANIFEST}); "
                                  "choose a new or empty directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MemoryFileError(f"cannot create the memory directory {path}: {e.strerror}") from None
        d = cls(path, writable=True)
        d.write_manifest(manifest)
        return d

    def _take_lock(self):
        try:
            fh = open(self.path / LOCK, "a+")
        except OSError as e:
            raise MemoryFileError(f"cannot write to the memory {self.path} ({e.strerror}); open it read-only "
                                  "(readonly=True; the CLI's info and ask do) or fix its permissions") from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            who = fh.read().strip() or "another process"
            fh.close()
            raise MemoryFileError(f"the memory {self.path} is being written by {who}; only one writer at a time: "
                                  "wait for it to finish, or open the memory read-only") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"process {os.getpid()}\n")
        fh.flush()
        self._lock = fh

    def close(self):
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    # ---- manifest -----------------------------------------------------------------------
    def read_manifest(self) -> Manifest:
        f = self.path / MANIFEST
        if not self.path.is_dir():
            raise MemoryFileError(f"no memory at {self.path}: the directory does not exist "
                                  "(build one with `landmark-memory build`)")
        if not f.is_file():
            raise MemoryFileError(f"{self.path} is not a memory: {MANIFEST} is missing "
                                  "(build one with `landmark-memory build`, or restore the directory from a backup)")
        try:
            doc = json.loads(f.read_text())
        except PermissionError:
            raise MemoryFileError(f"cannot read {f}: permission denied; fix the memory's permissions") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MemoryFileError(f"{f} is damaged ({e}); restore the memory from a backup or rebuild it") from None
        return Manifest.from_json(doc, str(f))

    def write_manifest(self, manifest: Manifest) -> None:
        """Write ``manifest`` (its ``updated`` time set now) atomically: this is the commit."""
        manifest.updated = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        doc = manifest.to_json()
        atomic_write(self.path / MANIFEST, lambda f: Path(f).write_text(json.dumps(doc, indent=1) + "\n"))
        _fsync_dir(self.path)

    # ---- raw append-only rows -----------------------------------------------------------
    def write_rows(self, name: str, offset: int, data: bytes) -> None:
        """Write ``data`` at byte ``offset`` of file ``name``, drop anything after it, fsync."""
        with open(self.path / name, "ab+") as f:
            f.truncate(offset)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def read_rows(self, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of file ``name``; a writer cuts what follows (an uncommitted tail)."""
        f = self.path / name
        size = f.stat().st_size if f.is_file() else -1
        if size < nbytes:
            raise MemoryFileError(f"{f} is {'missing' if size < 0 else f'truncated ({size} of {nbytes} bytes)'}; "
                                  "the memory is damaged: restore it from a backup or rebuild it")
        with open(f, "rb") as fh:
            data = fh.read(nbytes)
        if self.writable and size > nbytes:
            os.truncate(f, nbytes)
        return data

    def read_block_rows(self, manifest: Manifest) -> dict[str, bytes]:
        """``{name: bytes}``, the committed rows of ``tokens.bin`` and ``landmarks.bin``."""
        return {name: self.read_rows(name, manifest.blocks * n) for name, n in manifest.rows.sizes.items()}

    # ---- per-commit state files ---------------------------------------------------------
    def read_commit(self) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """``(manifest, state tensors)`` of the last commit, sizes and checksums checked. A
        reader retries when a writer replaces the state file between the two reads."""
        for attempt in range(3):
            manifest = self.read_manifest()
            try:
                return manifest, (self.read_state(manifest.state) if manifest.state else {})
            except FileNotFoundError as e:
                if attempt == 2 or self.writable:
                    raise MemoryFileError(f"{e} is missing; the memory is damaged: restore it from a backup "
                                          "or rebuild it") from None

    def write_state(self, commit: int, tensors: dict[str, torch.Tensor]) -> StateFile:
        """Write ``state.<commit>.safetensors``; returns its manifest entry."""
        name = f"state.{commit}.safetensors"
        atomic_write(self.path / name, lambda f: save_file({k: t.contiguous() for k, t in tensors.items()}, f))
        return StateFile(name, (self.path / name).stat().st_size, _sha256(self.path / name))

    def read_state(self, entry: StateFile) -> dict[str, torch.Tensor]:
        f = self.path / entry.name
        if not f.is_file():
            raise FileNotFoundError(f)
        if f.stat().st_size != entry.bytes or _sha256(f) != entry.sha256:
            raise MemoryFileError(f"{f} is truncated or corrupted (its size or checksum differs from the manifest); "
                                  "restore the memory from a backup or rebuild it")
        return load_file(f)

    def drop_old_states(self, keep: str | None) -> None:
        for f in self.path.glob("state.*.safetensors"):
            if f.name != keep:
                f.unlink(missing_ok=True)
        for f in self.path.glob(".*.tmp*"):  # temp files of a commit that never finished
            f.unlink(missing_ok=True)
