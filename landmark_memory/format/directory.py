"""The files of a saved memory, and the commit protocol that keeps them consistent.

A memory directory holds (docs/design/format.md, "On-disk format"):

- ``manifest.json``: format version, model fingerprint and config, options, counts, the
  commit counter, the inputs ingested, checksums of the other files; written last,
  atomically: it *is* the commit;
- ``state.<commit>.safetensors``, where there is something to keep: every approximate FAISS
  index (FAISS's own serialisation, as uint8 tensors) and the incomplete chunk (its token ids,
  keys and values);
- ``tokens.bin``: append-only raw rows, one per block (token ids as int32); only the first
  ``blocks`` rows count, a writer cuts any tail a crash left;
- ``keys/``: the block keys, a float32 file per (stream, layer, key/value head), mapped and
  appended in place (``index.rows.KeyRows``); rows past ``blocks`` are scratch;
- ``store/lmdb`` or ``store/mmap``: block keys and values (each with a CRC-32), written when
  a chunk completes, one transaction per chunk; blocks past the committed count are ignored
  and rewritten;
- ``writer.lock``: held (``flock``) by the one process that may write.

Commit order: store transactions (already done), raw rows and key files (fsync), the state
file (temp file, fsync, rename), the manifest (same), then older state files go. A process killed at any
instant leaves the previous manifest pointing at files that are all complete. Nothing here
follows a symbolic link, and every name read from a manifest stays inside the directory.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..core.fileio import TMP_MARK, LinkError, atomic_write, cut, open_nofollow
from ..index.rows import KeyFileError, KeyRows
from ..storage import StoreWriteError
from .errors import NoMemoryError, WriterBusyError
from .manifest import KEYS, LANDMARKS, TOKENS, Manifest, MemoryFileError, StateFile

MANIFEST, LOCK, STORE = "manifest.json", "writer.lock", "store"
STATE_NAME = re.compile(r"state\.\d+\.safetensors")
TEMPORARY = re.compile(r"\..+" + re.escape(TMP_MARK) + r"\d+|\.tmp\w{6,}")  # ours, and older safetensors' own
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

@contextlib.contextmanager
def disk_errors(what: str):
    """Turn a full disk or a link where a file should be into a ``MemoryFileError`` that says
    what to do; the memory stays at its last commit."""
    try:
        yield
    except KeyFileError as e:  # a key file that is a link, or shorter than its rows
        raise MemoryFileError(f"{e}; the memory is damaged: restore it from a backup or rebuild it") from None
    except LinkError as e:
        raise MemoryFileError(f"{e.strerror}: a memory reads and writes only its own plain files, never through a "
                              "link or a pipe; remove it (or choose another folder)") from None
    except StoreWriteError as e:
        raise MemoryFileError(f"{e.strerror}: the disk may be full or failing; free some space (or check the "
                              "device) and run again: the memory stays at its last commit") from None
    except OSError as e:
        if e.errno in DISK_FULL:
            raise MemoryFileError(f"no space left on the device while writing {what}; free some space and run "
                                  "again: the memory stays at its last commit") from None
        raise


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def damaged(what: str, why: str = "") -> MemoryFileError:
    """``MemoryFileError``: ``what`` (a file, the store) ``why``, and what to do about it."""
    return MemoryFileError(f"{' '.join(filter(None, (what, why)))}; the memory is damaged: restore it from a backup "
                           "or rebuild it")


def leftovers(path: Path) -> list[Path] | None:
    """What a first commit stopped midway left in the folder ``path`` (its lock file, temporary
    files), or None where it holds anything else."""
    found = [p for p in path.iterdir() if p.name == LOCK or TEMPORARY.fullmatch(p.name)] if path.is_dir() else []
    return found if not path.is_dir() or len(found) == sum(1 for _ in path.iterdir()) else None


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
        """A new memory at ``path`` (absent or empty), its manifest at commit 0. What an
        interrupted first commit left (``leftovers``) does not count; a folder this makes is
        removed again when its first commit fails (a full disk)."""
        path = Path(path)
        if (path / MANIFEST).exists():
            raise MemoryFileError(f"{path} already holds a memory; open it with LandmarkMemory.open(path, model) "
                                  "to continue it, or choose another path")
        if path.exists() and not path.is_dir():
            raise MemoryFileError(f"{path} is a file; a memory is a directory: choose another path")
        if path.is_dir() and leftovers(path) is None:
            raise MemoryFileError(f"{path} is not empty and holds no memory (no {MANIFEST}); "
                                  "choose a new or empty directory")
        for p in leftovers(path) or []:
            if p.is_symlink():
                raise MemoryFileError(f"{p} is a symbolic link: a memory writes only its own files; remove it")
        made, d = not path.exists(), None
        try:
            with disk_errors(f"the memory directory {path}"):
                path.mkdir(parents=True, exist_ok=True)
            d = cls(path, writable=True)
            d.drop_old_states(keep=None)
            d.write_manifest(manifest)
        except BaseException as e:
            if d is not None:
                d.close()
            if made:
                with contextlib.suppress(OSError):
                    for p in leftovers(path) or []:
                        p.unlink()
                    path.rmdir()
            if isinstance(e, OSError) and not isinstance(e, MemoryFileError):
                raise MemoryFileError(f"cannot create the memory directory {path}: {e.strerror}") from None
            raise
        return d

    def _take_lock(self):
        try:
            with disk_errors(str(self.path / LOCK)):
                fd = open_nofollow(self.path / LOCK, os.O_RDWR | os.O_CREAT)
        except PermissionError as e:
            raise MemoryFileError(f"cannot write to the memory {self.path} ({e.strerror}); open it read-only "
                                  "(readonly=True; the CLI's info and ask do) or fix its permissions") from None
        except FileNotFoundError:
            raise NoMemoryError(f"no memory at {self.path}: the directory does not exist "
                                  "(build one with `landmark-memory build`)") from None
        fh = os.fdopen(fd, "rb+", buffering=0)  # (unbuffered: a full disk fails the write, never the close)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with disk_errors(str(self.path / LOCK)):
                fh.truncate()
                fh.write(f"process {os.getpid()}\n".encode())
        except BlockingIOError:
            who = fh.read(200).decode(errors="replace").strip() or "another process"
            fh.close()
            raise WriterBusyError(f"the memory {self.path} is being written by {who}; only one writer at a time: "
                                  "wait for it to finish, or open the memory read-only") from None
        except BaseException:
            fh.close()
            raise
        self._lock = fh

    def close(self):
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def store_path(self) -> Path:
        """The block store's folder, refused when it (or what is in it) is a symbolic link."""
        store = self.path / STORE
        links = [str(store)] if os.path.islink(store) else []
        if not links and os.path.isdir(store):  # os.scandir: a corpus opens a document's store per first read
            for e in os.scandir(store):
                if e.is_symlink():
                    links.append(e.path)
                elif e.is_dir():
                    links += [f.path for f in os.scandir(e.path) if f.is_symlink()]
        if links:
            raise MemoryFileError(f"{links[0]} is a symbolic link: a memory writes only its own files; remove the "
                                  "link (or restore the memory from a backup)")
        return store

    def document(self, folder: str, writable: bool = False) -> "MemoryDir":
        """A corpus's document ``folder`` (``manifest.DOCUMENT_FOLDER``), itself a memory
        directory; refused when it or ``docs/`` is a symbolic link."""
        for p in (self.path / folder).parent, self.path / folder:
            if os.path.islink(p):
                raise MemoryFileError(f"{p} is a symbolic link: a memory reads and writes only its own files; remove "
                                      "the link (or restore the memory from a backup)")
        return MemoryDir(self.path / folder, writable=writable)

    # ---- manifest -----------------------------------------------------------------------
    def read_manifest(self) -> Manifest:
        f = self.path / MANIFEST
        if not self.path.is_dir():
            raise NoMemoryError(f"no memory at {self.path}: the directory does not exist "
                                  "(build one with `landmark-memory build`)")
        if not f.exists() and not f.is_symlink():
            entries = list(self.path.iterdir())
            if entries and all(p.name == LOCK or TEMPORARY.fullmatch(p.name) for p in entries):
                raise MemoryFileError(f"{self.path} holds no memory yet: a build was stopped before its first commit; "
                                      "build it again")
            raise MemoryFileError(f"{self.path} is not a memory: {MANIFEST} is missing "
                                  "(build one with `landmark-memory build`, or restore the directory from a backup)")
        try:
            doc = json.loads(self._read(MANIFEST))
        except PermissionError:
            raise MemoryFileError(f"cannot read {f}: permission denied; fix the memory's permissions") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MemoryFileError(f"{f} is damaged ({e}); restore the memory from a backup or rebuild it") from None
        m = Manifest.from_json(doc, str(f))
        m.inputs.attach(self, m.check_input)  # (a corpus's pages are read from here when first needed)
        return m

    def write_manifest(self, manifest: Manifest) -> None:
        """Write ``manifest`` (its ``updated`` time set now) atomically: this is the commit."""
        manifest.updated = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with disk_errors(str(self.path / MANIFEST)):
            atomic_write(self.path / MANIFEST, (json.dumps(manifest.to_json(), indent=1) + "\n").encode())
            _fsync_dir(self.path)

    def _read(self, name: str, nbytes: int = -1) -> bytes:
        try:
            fd = open_nofollow(self.path / name, os.O_RDONLY)
        except LinkError as e:
            raise MemoryFileError(f"{e.strerror}: a memory reads only its own plain files; restore the memory from "
                                  "a backup") from None
        with os.fdopen(fd, "rb") as f:
            return f.read(nbytes)

    # ---- raw append-only rows -----------------------------------------------------------
    def write_rows(self, name: str, offset: int, data: bytes) -> None:
        """Write ``data`` at byte ``offset`` of file ``name``, drop anything after it, fsync."""
        with disk_errors(str(self.path / name)):
            fd = open_nofollow(self.path / name, os.O_RDWR | os.O_CREAT)
            with os.fdopen(fd, "rb+") as f:
                f.truncate(offset)
                f.seek(offset)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    def read_rows(self, name: str, nbytes: int, offset: int = 0, mapped: bool = False) -> bytes | np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of file ``name``, committed rows (what follows is
        ``read_block_rows``' to cut, once the rows are checked); ``mapped``: a read-only map of
        them (uint8 (nbytes,)), read only where they are used, the file's size checked first."""
        f = self.path / name
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise MemoryFileError(f"{f} is {'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'no regular file'}: a "
                                  "memory reads and writes only its own plain files; remove it, or restore the memory "
                                  "from a backup")
        size, end = -1 if st is None else st.st_size, offset + nbytes
        if end == 0 and size < 0:  # nothing committed yet: the file need not exist
            return b""
        if size < end:
            raise damaged(str(f), "is missing" if size < 0 else f"is truncated ({size} of {end} bytes)")
        if nbytes == 0:  # (nothing to map)
            return b""
        with os.fdopen(open_nofollow(f, os.O_RDONLY), "rb") as fh:
            if mapped:
                mm = np.memmap(fh, np.uint8, "r", offset=offset, shape=(nbytes,))
                mm.filename = str(f)  # (numpy names only files it opened itself)
                return mm
            fh.seek(offset)
            return fh.read(nbytes)

    def read_block_rows(self, manifest: Manifest, first: int = 0, crcs: dict[str, int] | None = None,
                        mapped: bool = False) -> tuple[dict[str, bytes], dict[str, int]]:
        """``({name: bytes}, {name: CRC-32})``: the committed rows of the files read whole (``tokens.bin``; and
        ``landmarks.bin`` before format 5) from block ``first`` on, checked against the manifest's CRC-32s (memories
        written before those were kept: not), which carry on from ``crcs``, the CRC-32s of the rows before ``first``
        (0 from the start); and the CRC-32s of all rows. A writer then cuts what follows the committed rows (an
        uncommitted tail): only once they match the manifest, so that a damaged manifest (``blocks`` too small) never
        costs a row. ``mapped`` (a reader): ``tokens.bin``'s rows are a read-only map, their CRC-32 left to ``verify``
        (opening then costs the same however long the memory is)."""
        sizes = manifest.rows.sizes
        rows = {name: self.read_rows(name, (manifest.blocks - first) * n, first * n, mapped and name == TOKENS)
                for name, n in sizes.items()}
        crcs = {name: zlib.crc32(data, (crcs or {}).get(name, 0)) for name, data in rows.items()
                if not isinstance(data, np.memmap)}
        for name in crcs:
            if name in (manifest.rows_crc or {}) and crcs[name] != manifest.rows_crc[name]:
                raise damaged(str(self.path / name), "does not match the manifest (its CRC-32 differs: the rows or "
                               "the manifest are corrupted)")
        if self.writable:
            for name, n in sizes.items():
                self.cut_rows(name, manifest.blocks * n)
        return rows, crcs

    def cut_rows(self, name: str, nbytes: int) -> None:
        """Cut what follows the committed ``nbytes`` of the row file ``name`` (an uncommitted
        tail a stopped writer left), never through a link; a file not there yet is left so."""
        if os.path.lexists(self.path / name):
            with disk_errors(str(self.path / name)):
                cut(self.path / name, nbytes)

    def check_key_files(self, manifest: Manifest) -> None:
        """Every key file of the commit ``manifest`` (and every file its index keeps beside them)
        holds its committed rows (sizes only: the CRC-32s are ``verify``'s); a missing or short
        one is named."""
        with disk_errors(f"the block keys of {self.path}"):
            for name in manifest.key_files():  # mapped as a reader maps them, and let go
                KeyRows(manifest.model.shape.head_dim, self.path / name, writable=False, n=manifest.blocks)
            for name, nbytes in manifest.index_files().items():  # an ivf-rows index's centroids and lists
                KeyRows(1, self.path / name, writable=False, n=nbytes // 4, dtype=np.int32)

    def key_file_rows(self, manifest: Manifest, skip: set[str] = frozenset()) -> Iterator[tuple[str, bytes]]:
        """``(file, bytes)``, one file at a time: the committed rows of every key file of the
        commit ``manifest`` and of every file its index keeps beside them (an ``ivf-rows``
        index's centroids and lists) but those in ``skip``, each checked against its CRC-32 in
        the manifest (where kept). A writer reads them before it appends, skipping those its
        last writer sealed unchanged (``format/seals.py``); ``check_key_files`` checks sizes only."""
        for name, nbytes in manifest.key_file_bytes().items():
            if name in skip:
                continue
            data = self.read_rows(name, nbytes)
            if name in (manifest.rows_crc or {}) and zlib.crc32(data) != manifest.rows_crc[name]:
                raise damaged(str(self.path / name), "does not match the manifest (its CRC-32 differs: the file or "
                               "the manifest is corrupted)")
            yield name, data

    def key_path(self) -> Path:
        """The memory's folder, whose ``keys/`` holds its key files; refused when ``keys/`` is a
        symbolic link (each file is opened without following one)."""
        keys = self.path / KEYS
        if os.path.islink(keys):
            raise MemoryFileError(f"{keys} is a symbolic link: a memory writes only its own files; remove the link "
                                  "(or restore the memory from a backup)")
        return self.path

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
                    raise damaged(str(e), "is missing") from None

    def write_state(self, commit: int, tensors: dict[str, torch.Tensor]) -> StateFile:
        """Write ``state.<commit>.safetensors``; returns its manifest entry."""
        name = f"state.{commit}.safetensors"
        data = save_safetensors({k: t.contiguous() for k, t in tensors.items()})
        with disk_errors(str(self.path / name)):
            atomic_write(self.path / name, data)
        return StateFile(name, len(data), hashlib.sha256(data).hexdigest())

    def read_state(self, entry: StateFile) -> dict[str, torch.Tensor]:
        if not STATE_NAME.fullmatch(entry.name):
            raise damaged(f"{self.path / MANIFEST}", f"names a state file {entry.name!r} that is no memory file")
        f = self.path / entry.name
        if not f.exists() and not f.is_symlink():
            raise FileNotFoundError(f)
        data = self._read(entry.name)
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise MemoryFileError(f"{f} is truncated or corrupted (its size or checksum differs from the manifest); "
                                  "restore the memory from a backup or rebuild it")
        try:
            return load_safetensors(data)
        except SafetensorError as e:
            raise damaged(str(f), f"cannot be read ({e})") from None

    def drop_old_states(self, keep: str | None) -> None:
        """Remove state files other than ``keep``, temporary files a stopped commit left, and
        ``landmarks.bin`` of a memory converted to key files (format 5)."""
        for f in self.path.iterdir():
            if (STATE_NAME.fullmatch(f.name) and f.name != keep) or TEMPORARY.fullmatch(f.name) or f.name == LANDMARKS:
                f.unlink(missing_ok=True)
