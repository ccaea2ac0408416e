"""A long input of any shape: the resident memory of tokenizing a text of one line and of
reading a long document, this version against the same work done as before, in one run.

    python experiments/bench_long_input.py --books BOOKS                      # a 50 MB line, 300K tokens read
    python experiments/bench_long_input.py --books BOOKS --mb 5 --read 100000 --out experiments/results/long_input.md
    python experiments/bench_long_input.py --books BOOKS --mb 9 --shapes --out experiments/results/long_input_shapes.md

The text is the books joined into one line (their new lines made spaces), cut to ``--mb`` MB.
Each figure comes from a fresh process (its peak resident memory from the kernel): the
bundled tokenizer over the whole text at once (before) and a piece at a time (``build.encode``,
now), the two ids compared; then the bundled model reading the first ``--read`` of those
tokens into a saved memory, the C heap's free pages given back every 16K tokens (now) and never
(before), with the resident memory after each 50K tokens. With ``--shapes``, only the
tokenizing, for the same text with its words joined in each of ``SHAPES``' ways.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STEP = 50_000  # tokens between two looks at the resident memory


SHAPES = {  # how a text's words are joined
    "single spaces": " ".join, "two spaces": "  ".join, "no-break spaces": "\u00a0".join, "tabs": "\t".join,
    # no spaces at all, as Chinese is written: each letter a CJK character, punctuation kept
    "no spaces (CJK letters)": lambda words: "".join(words).translate(
        {c: 0x4E00 + 37 * c % 2000 for c in range(ord("A"), ord("z") + 1) if chr(c).isalpha()})}


def one_line(books: Path, mb: float, out: Path, shape: str = "single spaces") -> None:
    words, parts = [], 0
    for f in sorted(books.glob("*.txt")):
        t = f.read_text(encoding="utf-8", errors="replace").split()
        words += t
        parts += sum(map(len, t)) + len(t)
        if parts > mb * 1e6:
            break
    out.write_text(SHAPES[shape](words)[:int(mb * 1e6)])


def shapes(a) -> str:
    """The tokenizing table for each of ``SHAPES``: peak resident GB whole and in pieces."""
    import numpy as np

    lines = [f"# A long input of every shape: {a.mb:g} MB of one line, tokenized", "",
             f"Command: `python experiments/bench_long_input.py --books BOOKS --mb {a.mb:g} --shapes`; "
             f"{time.strftime('%Y-%m-%d')}, 2 CPU cores, the bundled tokenizer. Each figure is a fresh process's "
             "peak resident memory.", "",
             "| words joined by | tokens | whole: GB | s | pieces: GB | s | same ids |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for shape in SHAPES:
        text = a.work / "shape.txt"
        one_line(a.books, a.mb, text, shape)
        got = {how: fresh("tokenize", text, how, a.work / f"{how}.npy") for how in ("pieces", "whole")}
        same = np.array_equal(np.load(a.work / "pieces.npy"), np.load(a.work / "whole.npy"))
        (p, p_gb), (w, w_gb) = got["pieces"], got["whole"]
        lines.append(f"| {shape} | {w['tokens']:,} | {w_gb:.2f} | {w['seconds']:.1f} | {p_gb:.2f} | {p['seconds']:.1f} "
                     f"| {same} |")
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def fresh(*argv) -> tuple[dict, float]:
    """``argv`` run by this script in a fresh process: its result and that process's own peak
    resident GB (read by a process between, whose only child it is)."""
    probe = ("import json, resource, subprocess, sys; out = subprocess.run(sys.argv[1:], capture_output=True, "
             "text=True, check=True).stdout; print(json.dumps([json.loads(out.splitlines()[-1]), "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20]))")
    out = subprocess.run([sys.executable, "-c", probe, sys.executable, __file__, "--child", *map(str, argv)],
                         capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


def tokenize(text_file: str, how: str, ids_file: str) -> dict:
    import numpy as np

    from landmark_memory import load_tokenizer
    from landmark_memory.core.tokenizer import EOS_TOKEN
    from landmark_memory.jobs.build import encode, read_inputs
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
    from landmark_memory.core import heap
    from landmark_memory.jobs.reading import read_steps

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=Path)
    p.add_argument("--mb", type=float, default=50.0, help="size of the one-line text (MB)")
    p.add_argument("--read", type=int, default=300_000, help="tokens the model reads")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_long_input"))
    p.add_argument("--out", type=Path)
    p.add_argument("--shapes", action="store_true", help="only the tokenizing, for each way of joining words")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        result = tokenize(*rest) if kind == "tokenize" else read(rest[0], int(rest[1]), rest[2] == "trim", rest[3])
        print(json.dumps(result))
        return
    a.work.mkdir(parents=True, exist_ok=True)
    if a.shapes:
        report = shapes(a)
        if a.out:
            a.out.write_text(report)
        return
    text = a.work / "line.txt"
    one_line(a.books, a.mb, text)
    pieces, pieces_gb = fresh("tokenize", text, "pieces", a.work / "pieces.npy")
    whole, whole_gb = fresh("tokenize", text, "whole", a.work / "whole.npy")
    import numpy as np

    same = np.array_equal(np.load(a.work / "pieces.npy"), np.load(a.work / "whole.npy"))
    import shutil

    runs = {}
    for how in ("trim", "none"):
        shutil.rmtree(a.work / f"m-{how}", ignore_errors=True)
        runs[how], _ = fresh("read", a.work / "pieces.npy", a.read, how, a.work / f"m-{how}")
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
