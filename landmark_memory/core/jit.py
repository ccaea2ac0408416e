"""Numba compilation for the CPU paths written as loops (kernels/numba_decode.py,
memory/retrieval.py), cached on disk where a cache can be written.

Numba keeps compiled code beside the module or in the user's cache folder; a read-only
install run by a user whose home cannot be written has neither, and then each process
compiles once (a second or two) instead of failing.
"""

import numba


def njit(fn=None, **options):
    """``numba.njit(cache=True, **options)``, or without the cache where none can be written;
    use as ``@njit`` or ``@njit(fastmath=...)``."""
    if fn is None:
        return lambda f: njit(f, **options)
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(**options)(fn)
