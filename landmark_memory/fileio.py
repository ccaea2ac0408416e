"""Crash-safe file writes: nothing on disk is ever left half-written."""

import os
from pathlib import Path


def atomic_write(dest, write):
    """Call ``write(tmp_path)`` to produce the file, fsync it, then rename it over ``dest``.

    A crash leaves either the previous ``dest`` or the new one, never a partial file."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        write(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
