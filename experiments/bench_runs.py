"""What an ivf-rows level's runs save a warm ask: the same memory asked the same questions with
its runs (as format 8 reads it) and through its lists alone (as a reader of format 7 reads it),
in one process, the two ways taking turns.

    python experiments/bench_runs.py MEMORY [--rounds 3]

MEMORY: a saved memory of the bundled model past 1,024 blocks, committed in format 8 (e.g.
``bench_library.py``'s library of 100,000 small documents). Per way and round, a warm ask of
each of ``bench_scale.QUESTIONS`` (8 tokens, after one to warm up, the memory rewound after
each): the median ask, and the ivf-rows searches' time per ask (``LandmarkIndex.search_seconds``).
The answers of the two ways are compared (the runs change no result, bit for bit).
"""

import argparse
import statistics
import time

import torch
from bench_scale import QUESTIONS

from landmark_memory.format.manifest import Manifest
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import load_model
from landmark_memory.uses.answer import ask

KEEPS_RUNS = Manifest.keeps_runs


def asked(path: str, model, loaded, runs: bool) -> tuple[float, float, list[str]]:
    """(median seconds an ask, ivf search seconds an ask, the answers) of the memory read with
    its runs or through its lists alone."""
    Manifest.keeps_runs = KEEPS_RUNS if runs else property(lambda self: False)
    try:
        mem = LandmarkMemory.open(path, model, readonly=True)
    finally:
        Manifest.keeps_runs = KEEPS_RUNS
    with mem:
        indexes = mem.inspection.indexes()
        assert all((ix.lists.runs is not None) == runs for ix in indexes if ix.lists.level)
        times, searched, answers = [], 0.0, []
        for i, q in enumerate([QUESTIONS[0]] + QUESTIONS):  # the first warms up
            before = sum(ix.search_seconds for ix in indexes)
            t0 = time.perf_counter()
            a = ask(mem, loaded, q, max_new_tokens=8, raw=True)
            if i:
                times.append(time.perf_counter() - t0)
                searched += sum(ix.search_seconds for ix in indexes) - before
                answers.append(a.text)
            mem.rewind()
    return statistics.median(times), searched / len(QUESTIONS), answers


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("memory")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    loaded = load_model(None)
    model = loaded.model
    got = {True: [], False: []}
    for r in range(args.rounds):
        for runs in (False, True):
            got[runs].append(asked(args.memory, model, loaded, runs))
            ask_s, search_s, _ = got[runs][-1]
            print(f"round {r + 1}, {'runs' if runs else 'lists alone'}: ask {1e3 * ask_s:.1f} ms, "
                  f"ivf search {1e3 * search_s:.1f} ms an ask", flush=True)
    same = all(a[2] == got[True][0][2] for way in got.values() for a in way)
    print("| way | warm ask (median of rounds) | ivf-rows search an ask |\n|---|---:|---:|")
    for runs, name in ((False, "through the lists alone (format 7)"), (True, "with the runs (format 8)")):
        print(f"| {name} | {1e3 * statistics.median(a[0] for a in got[runs]):.1f} ms | "
              f"{1e3 * statistics.median(a[1] for a in got[runs]):.1f} ms |")
    ratio = statistics.median(a[0] for a in got[False]) / statistics.median(a[0] for a in got[True])
    print(f"\nthe lists alone / the runs: {ratio:.2f}x an ask; the same answers both ways: {same}")


if __name__ == "__main__":
    main()
