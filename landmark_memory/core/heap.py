"""Memory the C heap holds free, given back to the system.

Reading a long document allocates and frees the same large tensors chunk after chunk. glibc's
malloc raises its threshold for serving a request from its own heap instead of a fresh map
each time a large mapped block is freed; from then on the freed blocks stay in the heap, and a
mix of sizes keeps them from being reused: a 50 MB document's reading grew by about 3 KB a
token, without bound. ``trim`` hands the heap's free pages back (``malloc_trim``), which keeps
a reading's resident memory flat at the cost of about 3% of its time when called every 16K
tokens. Where the C library has no ``malloc_trim`` it does nothing.
"""

import ctypes
import ctypes.util

TRIM_TOKENS = 1 << 14  # a reading trims the heap after about this many tokens

_libc_name = ctypes.util.find_library("c")
_malloc_trim = getattr(ctypes.CDLL(_libc_name), "malloc_trim", None) if _libc_name else None


def trim() -> None:
    """Give the C heap's free pages back to the system (glibc; elsewhere nothing)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
