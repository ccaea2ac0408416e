"""Crash-safe file writes that never follow a symbolic link: nothing on disk is ever left
half-written, and nothing is written outside the folder named."""

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

TMP_MARK = ".tmp"  # temporary files are ".<name>.tmp<pid>": a cleanup can tell them from everything else


class LinkError(OSError):
    """A path that should be a plain file or folder is a symbolic link, or no regular file (a
    named pipe, a device, a socket)."""


def open_nofollow(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` of a regular file that refuses a symbolic link at ``path`` (its last
    component) or anything but a regular file there (opened without blocking, so a named pipe
    is refused, never waited on) with ``LinkError``, and so a file opened to write that has
    other hard links."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkError(errno.ELOOP, f"{path} is a symbolic link") from None
        if e.errno == errno.ENXIO:  # a named pipe opened to write with no reader
            raise LinkError(errno.ENXIO, f"{path} is no regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LinkError(errno.EINVAL, f"{path} is no regular file")
    if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
        os.close(fd)
        raise hard_linked(path, st.st_nlink)
    return fd


def file_status(path: str | Path) -> list[int] | None:
    """``[size, device, inode, mtime_ns, ctime_ns]`` of the regular file ``path`` (not followed
    where it is a link); None where there is none. Every write, truncation, rename or ``utime``
    through the file system sets the change time, which no call sets back."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns] if stat.S_ISREG(st.st_mode) else None


class FileWatch:
    """A writer's own file: ``kept``, its status when taken (``file_status``; None where it is
    not there yet) and after the writer's last change to it (``change``). A change that finds
    another status than the last noted was preceded by another's: ``kept`` is None from then on."""

    def __init__(self, path: str | Path):
        self.path = path
        self.kept: tuple[list[int] | None, list[int] | None] | None = (file_status(path),) * 2

    @contextlib.contextmanager
    def change(self):
        """A change the writer makes to the file, noted."""
        if self.kept is not None and file_status(self.path) != self.kept[1]:
            self.kept = None  # (another's change came first)
        yield
        if self.kept is not None:
            self.kept = (self.kept[0], file_status(self.path))


def hard_linked(path: str | Path, links: int) -> LinkError:
    """The error for a file to be written that has other names (``links`` in all): writing it
    would change a file outside the folder too."""
    return LinkError(errno.EMLINK, f"{path} has {links} hard links, so writing it would change another name's file "
                                   "too (copy it over itself to break the link)")


def cut(path: str | Path, nbytes: int) -> None:
    """Cut the regular file ``path`` to ``nbytes`` where it is longer (never through a link;
    ``LinkError`` for one)."""
    fd = open_nofollow(path, os.O_WRONLY)
    try:
        if os.fstat(fd).st_size > nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def atomic_write(dest: str | Path, content: bytes | Callable[[str], None]) -> None:
    """Write ``content`` (bytes, or a function that writes the file at the path it is given)
    to a temporary file beside ``dest``, fsync it, then rename it over ``dest``.

    A crash leaves either the previous ``dest`` or the new one, never a partial file. Bytes
    are written through a file created new (never through a link), with the usual
    permissions (0666 less the umask); the rename replaces a link at ``dest`` itself, never
    what it points to. Whatever lies at the temporary name (a leftover, a symbolic or hard link
    planted there) is removed first, and the file is created exclusively."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}{TMP_MARK}{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        if isinstance(content, (bytes, bytearray, memoryview)):
            fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        else:
            content(str(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def reserve(path: str | Path, nbytes: int) -> None:
    """Grow the file ``path`` (created if need be, never through a link) to at least ``nbytes``
    with the space reserved on the device: a full disk is ``ENOSPC`` here, never a SIGBUS when
    a page of a map over it is written later."""
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
