"""The ``landmark-memory`` command's entry point. Ctrl-C while torch and the rest are still
being imported ends the command with one line and exit status 130 once the imports are done:
a KeyboardInterrupt raised inside native import code could abort the process instead."""

import signal
import sys


def main() -> int:
    stopped = []
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
    try:
        from .cli import main as run
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        if stopped:
            raise KeyboardInterrupt
        return run()
    except KeyboardInterrupt:
        print("landmark-memory: interrupted", file=sys.stderr)
        return 130
