"""A writer's seals: what its key and index files were when it let them go, so that the next
writer reads again only the files that changed since (docs/design/hostile.md).

A writer checks every key file and every file an index keeps beside them against the
manifest's CRC-32 before it appends (``MemoryDir.key_file_rows``): damage within a file's bounds
must stop it before it writes. Reading them all costs as much as the memory is large, so a
writer whose files hold their commit's rows leaves ``keys/seals.json`` when it closes: per file,
the committed bytes and CRC-32 it vouches for and the file's status as it left it (size,
device, inode, modification and change times in nanoseconds). A file whose status is the
same at the next open was not written since; every write, truncation, rename or ``utime``
through the file system sets its change time, which no call sets back. A file whose status
differs, or whose seal is missing, malformed or for other rows, is read and checked as before.

A seal vouches only for bytes its writer checked or wrote. The writer notes each file's
status before it checks it (opening, ``statuses``); each of its files (``KeyRows``) notes the
status it found when taken and after each change the writer makes to it, and counts itself
changed by another where a change finds a status other than the last noted. At close the writer
seals only the files that no other changed, whose status when taken was the one it checked and
whose status now is the one after its own last change: damage made while it ran (same-size
damage to committed rows included) goes unsealed, and is read at the next open.

A change within the same tick of the file system's clock as the file's last write would keep
its change time, so a seal counts only where the file's change time is before the seals file's
own (the writer waits out the tick before it writes them). What a seal cannot see (a change to
the disk beneath the file system, or a seals file forged along with the damage) ``verify``
finds, as it reads everything: seals spare a writer reading, never ``verify``.
"""

import json
import os
import time
from pathlib import Path

from ..core.fileio import atomic_write, file_status, open_nofollow
from .manifest import KEYS

SEALS = f"{KEYS}/seals.json"
SEAL_BYTES = 4 << 20  # key and index files smaller than this together are read faster than sealed
MAX_SEALS_BYTES = 1 << 24  # a seals file longer than this is no writer's: not read
TICK_WAIT_S = 0.002  # how long a writer sleeps between looks at the file system's clock


def unchanged(folder: Path, sizes: dict[str, int], crcs: dict[str, int]) -> set[str]:
    """The files of ``sizes`` ({name in ``folder``: committed bytes}) sealed with those bytes
    and the CRC-32 ``crcs`` gives them, whose status is what their seal says: they need not be
    read again. Anything wrong with the seals file counts as no seal (empty set)."""
    seals, sealed_at = read_seal(folder / SEALS, MAX_SEALS_BYTES)
    files = seals.get("files") if isinstance(seals, dict) and seals.get("version") == 1 else None
    if not isinstance(files, dict):
        return set()
    out = set()
    for name, nbytes in sizes.items():
        seal, status = files.get(name), file_status(folder / name)
        if status is not None and name in crcs and seal == [nbytes, crcs[name], *status] and status[4] < sealed_at:
            out.add(name)
    return out


def statuses(folder: Path, names) -> dict[str, list[int]]:
    """``{name: status}`` of the files ``names`` in ``folder`` as they are now (those that are
    no regular file left out): what a writer notes before it checks them."""
    return {name: status for name in names if (status := file_status(folder / name)) is not None}


def vouched(checked: dict[str, list[int]], kept: dict[str, tuple[list[int] | None, list[int]]]) -> dict[str, list[int]]:
    """``{name: status}`` a writer closing may seal: of its files ``kept`` ({name: (status when
    taken, status after its last change)}, those no other changed while it held them), those it
    took as it ``checked`` them (or created: none then), with their last status."""
    return {name: last for name, (first, last) in kept.items() if first == checked.get(name)}


def seal(folder: Path, sizes: dict[str, int], crcs: dict[str, int], vouched: dict[str, list[int]]) -> None:
    """Write the seals of the files of ``sizes`` ({name in ``folder``: committed bytes}) with a
    CRC-32 in ``crcs`` whose status is still ``vouched[name]``, the one the caller (a writer
    closing) noted when it last checked or wrote them (``statuses``); none where they hold less
    than ``SEAL_BYTES`` together. Waits until the file system's clock has passed every file's
    change time, so that a later change shows."""
    if sum(sizes.values()) < SEAL_BYTES or os.path.islink(folder / KEYS) or not (folder / KEYS).is_dir():
        return
    files = {name: [nbytes, crcs[name], *status] for name, nbytes in sizes.items()
             if name in crcs and (status := file_status(folder / name)) is not None and status == vouched.get(name)}
    last = max((s[6] for s in files.values()), default=0)
    write_seal(folder / SEALS, {"version": 1, "files": files}, last)


def read_seal(path: Path, max_bytes: int) -> tuple[object, int]:
    """(the JSON of the seal file ``path``, its change time in ns); (None, 0) where there is none,
    it is a link or no regular file, longer than ``max_bytes`` or no JSON."""
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except OSError:  # (none, a link, no regular file)
        return None, 0
    with os.fdopen(fd, "rb") as f:
        sealed_at = os.fstat(f.fileno()).st_ctime_ns
        data = f.read(max_bytes + 1)
    try:
        return (json.loads(data), sealed_at) if len(data) <= max_bytes else (None, 0)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None, 0


def write_seal(path: Path, doc: dict, last: int) -> None:
    """Write ``doc`` as JSON to the seal file ``path`` (temporary file, rename), its change time
    after ``last`` (ns, the newest change time of the files it seals): the writer waits until the
    file system's clock has passed it, so that a later change to them shows."""
    data = json.dumps(doc).encode()

    def write(tmp: str) -> None:
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            for _ in range(25):  # a tick is 1 to 10 ms (a coarser clock: the seals count for nothing)
                if os.fstat(f.fileno()).st_ctime_ns > last:
                    return
                time.sleep(TICK_WAIT_S)
                os.utime(f.fileno())  # (sets its change time to the clock's now)

    atomic_write(path, write)
