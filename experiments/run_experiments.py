"""The CPU-sized set of paper-claim experiments, in one command: train the landmark model,
its full-attention baseline and an Infini-attention model where they are missing (same size,
data, windows and token budget), then run Table 1, Table 2, passkey vs length, exact vs
approximate search, and memory footprint.
Results land in experiments/results/ (see README.md there).

    python experiments/run_experiments.py --books BOOKS            # about 80 minutes on 2 CPU cores
    python experiments/run_experiments.py --books BOOKS --only table1,passkey
    python experiments/run_experiments.py --books BOOKS --only cmt,jumps   # the paper's extensions

The extensions (Context Miss Token, positional jumps: paper appendices D and E) train three
more models on 20 times the tokens, about 3 minutes each on one H100 GPU and many hours on a
CPU; they run only when named in --only.
"""

import argparse
import subprocess
import sys
from pathlib import Path

from _common import BASE_MODEL, CMT_MODEL, FULL_MODEL, INFINI_MODEL, JUMP_MODEL, LANDMARK_MODEL, ROOT

# every model: the tiny preset's size (4 layers, 4 heads of 32), windows of 512, 1000 steps of
# 8 windows (4.1M tokens), a 10% passkey mix, the paper's optimiser settings; Infini-attention
# reads each window in 4 segments of 128 (linear+delta memory)
TRAIN = ["--preset", "tiny", "--seq-len", "512", "--max-iters", "1000", "--eval-interval", "250", "--eval-iters", "8",
         "--passkey-rate", "0.1", "--sample-tokens", "0"]
CORE = [(LANDMARK_MODEL, [*TRAIN, "--attention", "landmark"]), (FULL_MODEL, [*TRAIN, "--attention", "full"]),
        (INFINI_MODEL, [*TRAIN, "--attention", "infini"])]
# the extensions: the same size, windows of 512, 5000 steps of 32 windows (82M tokens), no
# passkey mix (like the paper's PG19 runs); the baseline, the same with a Context Miss Token,
# the same with positional jumps of up to 100
TRAIN_EXT = ["--preset", "tiny", "--seq-len", "512", "--batch-size", "32", "--max-iters", "5000", "--eval-interval",
             "1000", "--eval-iters", "8", "--sample-tokens", "0"]
BASE, CMT = (BASE_MODEL, TRAIN_EXT), (CMT_MODEL, [*TRAIN_EXT, "--cmt"])
JUMP = (JUMP_MODEL, [*TRAIN_EXT, "--p-jump", "100"])
STEPS = {"table1": ("exp_table1.py", CORE), "table2": ("exp_table2.py", CORE), "passkey": ("exp_passkey.py", CORE),
         "exact_vs_approx": ("exp_exact_vs_approx.py", CORE), "footprint": ("exp_footprint.py", CORE),
         "cmt": ("exp_cmt.py", [BASE, CMT]), "jumps": ("exp_jump.py", [BASE, JUMP])}
DEFAULT = ("table1", "table2", "passkey", "exact_vs_approx", "footprint")


def run(cmd):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus (3 whole books are held out for validation)")
    ap.add_argument("--only", default=",".join(DEFAULT), help=f"experiments to run, among {', '.join(STEPS)} "
                                                              f"(default {','.join(DEFAULT)})")
    args = ap.parse_args()
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        sys.exit(f"unknown experiment(s) {', '.join(bad)}; choose among {', '.join(STEPS)}")
    here = Path(__file__).parent
    models = dict(m for step in steps for m in STEPS[step][1])
    for out, flags in models.items():
        if not (ROOT / out / "config.json").is_file():
            run([here / "train.py", *flags, "--data", args.books, "--out-dir", out])
    for step in steps:
        run([here / STEPS[step][0], "--books", args.books])


if __name__ == "__main__":
    main()
