"""The ``landmark-memory`` command's entry point. Ctrl-C or SIGTERM while torch and the rest are
still being imported ends the command with one line and exit status 130 or 143 once the imports
are done: a KeyboardInterrupt raised inside native import code could abort the process instead.

``build`` runs for hours, often beside other jobs: its OpenMP threads (torch, numba, FAISS)
wait passively at the end of each parallel region (``OMP_WAIT_POLICY=PASSIVE``, unless set)
instead of spinning on cores that another process needs. Two builds sharing a machine then
keep most of their speed (experiments/results/corpus.md). It must be set before the OpenMP
runtime loads, so here, before anything imports torch.
"""

import os
import signal
import sys

PASSIVE_COMMANDS = ("build",)


def main() -> int:
    if sys.argv[1:2] and sys.argv[1] in PASSIVE_COMMANDS:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if sys.argv[1:2] != ["train"]:  # --help and a wrong option answer here, before torch and FAISS load
        from .cli_args import parser

        parser().parse_args(sys.argv[1:])
    stopped = []
    previous = {s: signal.signal(s, lambda signum, _: stopped.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from .cli import main as run
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        print("landmark-memory: interrupted", file=sys.stderr)
        return 128 + stopped[0]
    try:
        return run()
    except KeyboardInterrupt:
        print("landmark-memory: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
