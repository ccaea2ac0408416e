"""How a command stops on a signal. Ctrl-C raises KeyboardInterrupt; SIGTERM (what ``kill``,
systemd and container runtimes send) raises the same, as ``Terminated``, so that what a command
began is ended by one path (a build's workers, Ray, open memories) and it exits 128 + the signal
with one line. ``build`` notes both itself while it reads, to commit first (``jobs/build.py``),
and Ray's start holds them back (``jobs/distributed.py``)."""

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """A KeyboardInterrupt that SIGTERM raised."""


def _terminate(signum, frame):
    raise Terminated


@contextlib.contextmanager
def sigterm_interrupts(wanted: bool = True):
    """SIGTERM raises ``Terminated`` for the duration (where ``wanted``, on the main thread: the
    one signals reach); the handler before is restored after."""
    own = wanted and threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if own else None
    try:
        yield
    finally:
        if own:  # (None: a handler not set from Python; the default stands in)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def exit_status(stop: KeyboardInterrupt) -> int:
    """128 + the signal that raised ``stop``: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
