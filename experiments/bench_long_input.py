"""A long input of any shape: the resident memory of tokenizing a text of one line and of
reading a long document, this version against the same work done as before, in one run.

    python experiments/bench_long_input.py --books BOOKS                      # a 50 MB line, 300K tokens read
    python experiments/bench_long_input.py --books BOOKS --mb 5 --read 100000 --out experiments/results/long_input.md

The text is the books joined into one line (their new lines made spaces), cut to ``--mb`` MB.
Each figure comes from a fresh process (its peak resident memory from the kernel): the
bundled tokenizer over the whole text at once (before) and a piece at a time (``build.encode``,
now), the two ids compared; then the bundled model reading the first ``--read`` of those
tokens into a saved memory, the C heap's free pages given back every 16K tokens (now) and never
(before), with the resident memory after each 50K tokens.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

STEP = 50_000  # tokens between two looks at the resident memory


def one_line(books: Path, mb: float, out: Path) -> None:
    text, parts = [], 0
    for f in sorted(books.glob("*.txt")):
        t = " ".join(f.read_text(encoding="utf-8", errors="replace").split())
        text.append(t)
        parts += len(t)
        if parts > mb * 1e6:
            break
    out.write_text(" ".join(text)[:int(mb * 1e6)])


def tokenize(text_file: str, how: str, ids_file: str) -> dict:
    import numpy as np

    from landmark_memory import load_tokenizer
    from landmark_memory.jobs.build import encode, read_inputs
    from landmark_memory.core.tokenizer import EOS_TOKEN
    from landmark_memory.training.data import strip_gutenberg

    text, tok, t = read_inputs([text_file])[0].text, load_tokenizer(), time.perf_counter()
    ids = (encode(tok, text) if how == "pieces" else
           np.array(tok.encode(strip_gutenberg(text)).ids + [tok.token_to_id(EOS_TOKEN)], np.int32))
    seconds = time.perf_counter() - t
    np.save(ids_file, ids)
    return {"tokens": len(ids), "seconds": seconds}


def read(ids_file: str, n: int, trim: bool, folder: str) -> dict:
    import numpy as np

    from landmark_memory import LandmarkGPT, LandmarkMemory
    from landmark_memory.jobs.reading import read_steps
    from landmark_memory.core import heap

    def anon_mb() -> int:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("RssAnon")).split()[1]) // 1024

    if not trim:
        heap.TRIM_TOKENS = 1 << 62
    ids, rows, done, t = np.load(ids_file)[:n], [], 0, time.perf_counter()
    with LandmarkMemory(LandmarkGPT.from_pretrained(), path=folder, store="lmdb") as mem:
        for k in read_steps(mem, ids[None]):
            done += k
            if done // STEP != (done - k) // STEP:
                rows.append((done, anon_mb()))
    return {"seconds": time.perf_counter() - t, "anon_mb": rows}


def child(*argv) -> tuple[dict, float]:
    """``argv`` run by this script in a fresh process: its result and the highest peak resident
    GB of this script's children so far (its own where it is the highest: run the smaller first)."""
    out = subprocess.run([sys.executable, __file__, "--child", *map(str, argv)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1]), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path)
    p.add_argument("--mb", type=float, default=50.0, help="size of the one-line text (MB)")
    p.add_argument("--read", type=int, default=300_000, help="tokens the model reads")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_long_input"))
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        result = tokenize(*rest) if kind == "tokenize" else read(rest[0], int(rest[1]), rest[2] == "trim", rest[3])
        print(json.dumps(result))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    text = a.work / "line.txt"
    one_line(a.books, a.mb, text)
    # (the smaller first: each tokenizing peak is then its own)
    pieces, pieces_gb = child("tokenize", text, "pieces", a.work / "pieces.npy")
    whole, whole_gb = child("tokenize", text, "whole", a.work / "whole.npy")
    import numpy as np

    same = np.array_equal(np.load(a.work / "pieces.npy"), np.load(a.work / "whole.npy"))
    import shutil

    runs = {}
    for how in ("trim", "none"):
        shutil.rmtree(a.work / f"m-{how}", ignore_errors=True)
        runs[how], _ = child("read", a.work / "pieces.npy", a.read, how, a.work / f"m-{how}")
    lines = [f"# A long input: {a.mb:g} MB of one line, {a.read:,} tokens read", "",
             f"Command: `python experiments/bench_long_input.py --books BOOKS --mb {a.mb:g} --read {a.read}`; "
             f"{time.strftime('%Y-%m-%d')}, 2 CPU cores, the bundled model and tokenizer.", "",
             "## Tokenizing (peak resident memory of a fresh process)", "",
             "| how | tokens | seconds | peak GB |", "|---|---:|---:|---:|",
             f"| whole text at once (before) | {whole['tokens']:,} | {whole['seconds']:.1f} | {whole_gb:.2f} |",
             f"| a piece at a time (now) | {pieces['tokens']:,} | {pieces['seconds']:.1f} | {pieces_gb:.2f} |", "",
             f"The same ids both ways: {same}. Peak {whole_gb / pieces_gb:.1f}x lower, "
             f"{whole['seconds'] / pieces['seconds']:.2f}x the speed.", "",
             "## Reading (anonymous resident memory, MB, after each 50K tokens)", "",
             "| tokens read | heap trimmed (now) | never (before) |", "|---:|---:|---:|"]
    lines += [f"| {n:,} | {t} | {b} |" for (n, t), (_, b) in zip(runs["trim"]["anon_mb"], runs["none"]["anon_mb"])]
    lines += ["", f"Time: {runs['trim']['seconds']:.1f} s trimmed against {runs['none']['seconds']:.1f} s "
                  f"({runs['trim']['seconds'] / runs['none']['seconds']:.2f}x)."]
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        a.out.write_text(report)


if __name__ == "__main__":
    main()
