"""The CPU-sized set of paper-claim experiments, in one command: train the landmark model,
its full-attention baseline and an Infini-attention model where they are missing (same size,
data, windows and token budget), then run Table 1, Table 2, passkey vs length, exact vs
approximate search, and memory footprint.
Results land in experiments/results/ (see README.md there).

    python experiments/run_experiments.py --books BOOKS            # about 80 minutes on 2 CPU cores
    python experiments/run_experiments.py --books BOOKS --only table1,passkey
"""

import argparse
import subprocess
import sys
from pathlib import Path

from _common import FULL_MODEL, INFINI_MODEL, LANDMARK_MODEL, ROOT

# every model: the tiny preset's size (4 layers, 4 heads of 32), windows of 512, 1000 steps of
# 8 windows (4.1M tokens), a 10% passkey mix, the paper's optimiser settings; Infini-attention
# reads each window in 4 segments of 128 (linear+delta memory)
TRAIN = ["--preset", "tiny", "--seq-len", "512", "--max-iters", "1000", "--eval-interval", "250", "--eval-iters", "8",
         "--passkey-rate", "0.1", "--sample-tokens", "0"]
STEPS = {"table1": "exp_table1.py", "table2": "exp_table2.py", "passkey": "exp_passkey.py",
         "exact_vs_approx": "exp_exact_vs_approx.py", "footprint": "exp_footprint.py"}


def run(cmd):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--books", required=True, help="the book corpus (3 whole books are held out for validation)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"experiments to run, among {', '.join(STEPS)}")
    args = ap.parse_args()
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        sys.exit(f"unknown experiment(s) {', '.join(bad)}; choose among {', '.join(STEPS)}")
    here = Path(__file__).parent
    for out, attention in ((LANDMARK_MODEL, "landmark"), (FULL_MODEL, "full"), (INFINI_MODEL, "infini")):
        if not (ROOT / out / "config.json").is_file():
            run([here / "train.py", *TRAIN, "--data", args.books, "--attention", attention, "--out-dir", out])
    for step in steps:
        run([here / STEPS[step], "--books", args.books])


if __name__ == "__main__":
    main()
