"""The landmark-memory command, end to end on the bundled model and sample text."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.jobs.build import encode_document
from landmark_memory.training.data import SAMPLE_DIR

BOOK = SAMPLE_DIR / "train" / "treasure_island_excerpt.txt"
CLI = [sys.executable, "-m", "landmark_memory.app.cli"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    body = BOOK.read_text()
    (d / "a.txt").write_text(body[:6000])
    (d / "b.txt").write_text(body[6000:10000])
    return d


def run_json(capsys, *argv):
    rc = main([*argv, "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def dir_digest(path):
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(path).rglob("*")) if f.is_file() and f.name not in ("lock.mdb", "writer.lock")}


def n_tokens(*files):
    """Tokens of ``files`` as documents of the bundled model (blocks of 50) hold them."""
    tok = load_tokenizer()
    return sum(len(encode_document(tok, Path(f).read_text(), 50)) for f in files)


@pytest.fixture(scope="module")
def built(texts, tmp_path_factory):
    mem = tmp_path_factory.mktemp("built") / "mem"
    assert main(["build", str(mem), "--input", str(texts / "a.txt"), "--chunk-size", "100", "--quiet"]) == 0
    return mem


def test_build_then_info_reports_every_token(built, texts, capsys):
    info = run_json(capsys, "info", str(built))
    assert info["tokens"] == n_tokens(texts / "a.txt")
    assert info["blocks"] == info["tokens"] // 50 and info["index"] == "ivf-rows" and info["store"] == "lmdb"
    assert info["index_search"] == "exact until 1,024 blocks"
    assert info["commit"] >= 1 and info["inputs"][0]["status"] == "done" and info["inputs"][0]["path"].endswith("a.txt")


def test_building_again_skips_finished_inputs_and_appends_new_ones(built, texts, capsys, tmp_path):
    mem = tmp_path / "mem"
    shutil.copytree(built, mem)
    doc = run_json(capsys, "build", str(mem), "--input", str(texts))
    assert doc["skipped"] == [str(texts / "a.txt")] and doc["added"] == n_tokens(texts / "b.txt")
    info = run_json(capsys, "info", str(mem))
    assert info["tokens"] == n_tokens(texts / "a.txt", texts / "b.txt")
    assert [e["start"] for e in info["inputs"]] == [0, n_tokens(texts / "a.txt")]


def test_ask_continues_the_memory_and_names_its_passages(built, texts, capsys):
    before = dir_digest(built)
    doc = run_json(capsys, "ask", str(built), "The captain said", "--max-new-tokens", "4", "--show-retrieved")
    assert isinstance(doc["text"], str) and len(load_tokenizer().encode(doc["text"]).ids) >= 1
    assert doc["retrieved"], "a memory of dozens of blocks must be read"
    text = (texts / "a.txt").read_text()
    for p in doc["retrieved"]:
        assert p["source"] == str(texts / "a.txt") and p["token_offset"] % 50 == 0
        assert " ".join(p["text"].split())[:20] in " ".join(text.split())
    assert dir_digest(built) == before, "asking must not write the memory"


def test_eval_reports_a_finite_perplexity_in_both_modes(texts, capsys):
    mem = run_json(capsys, "eval", "--input", str(texts / "a.txt"), "--eval-length", "300", "--chunk-size", "100")
    seq = run_json(capsys, "eval", "--input", str(texts / "a.txt"), "--eval-length", "300", "--full-attention")
    assert mem["mode"] == "memory" and seq["mode"] == "in-sequence" and mem["segments"] == seq["segments"] >= 2
    assert 1 < mem["perplexity"] < 8192 and 1 < seq["perplexity"] < 8192


def test_eval_with_a_cmt_cutoff_needs_a_cmt_model(texts, capsys, tmp_path):
    rc = main(["eval", "--input", str(texts / "a.txt"), "--eval-length", "300", "--cmt-cutoff", "0.3", "--quiet"])
    assert rc == 2 and "Context Miss Token" in capsys.readouterr().err
    torch.manual_seed(0)
    cfg = LandmarkGPT.from_pretrained().config
    LandmarkGPT(type(cfg)(**{**cfg.to_dict(), "n_layer": 1, "cmt": True})).save_pretrained(tmp_path / "cmt")
    doc = run_json(capsys, "eval", "--input", str(texts / "a.txt"), "--eval-length", "300", "--chunk-size", "100",
                   "--model", str(tmp_path / "cmt"), "--cmt-cutoff", "0.3")
    assert doc["memory"]["cmt_cutoff"] == 0.3 and 1 < doc["perplexity"] < 8192


@pytest.mark.slow
def test_compare_measures_each_index_against_exact(capsys, tmp_path):
    book, plot = tmp_path / "book.txt", tmp_path / "compare.png"
    book.write_text(BOOK.read_text()[:20000])  # about 100 blocks: IVF trains 2 lists on 80
    doc = run_json(capsys, "compare", "--input", str(book), "--index", "hnsw,ivf,ivf-rows", "--chunk-size", "100",
                   "--train-size", "80", "--nprobe", "1", "--plot", str(plot))
    rows = {r["index"]: r for r in doc["rows"]}
    assert list(rows) == ["flat", "hnsw", "ivf", "ivf-rows"]
    assert rows["flat"]["recall"] == 1.0 and rows["flat"]["ppl_delta_pct"] == 0.0
    assert all(0 <= r["recall"] <= 1 and r["searches"] > 0 and np.isfinite(r["perplexity"]) for r in rows.values())
    assert rows["ivf"]["recall"] < 1.0 and rows["ivf-rows"]["recall"] < 1.0, "one list of several must miss blocks"
    assert plot.stat().st_size > 0


def test_passkey_reports_accuracy_per_length(capsys, tmp_path):
    doc = run_json(capsys, "passkey", "--lengths", "300,600", "--trials", "2", "--plot", str(tmp_path / "p.png"))
    assert [r["length"] for r in doc["results"]] == [300, 600]
    assert all(r["trials"] == 2 and 0 <= r["accuracy"] <= 1 for r in doc["results"])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_demo_runs_end_to_end_on_a_short_book(texts, capsys, tmp_path):
    doc = run_json(capsys, "demo", "--book", str(texts / "a.txt"), "--seed", "3", "--out", str(tmp_path / "d"))
    assert doc["tokens"] > 1000 and isinstance(doc["correct"], bool) and doc["retrieved"]
    rank = doc["key_passage_rank"]  # where the key's passage stands among every passage the answer read
    assert rank is None or 1 <= rank <= doc["passages_read"]
    if rank is not None and rank <= len(doc["retrieved"]):
        assert str(doc["key"]) in doc["retrieved"][rank - 1]["text"]
    assert [r["index"] for r in doc["compare"]] == ["flat", "ivf-rows", "hnsw", "ivf", "ivfpq"]
    assert (tmp_path / "d" / "memory" / "manifest.json").is_file()


@pytest.mark.parametrize("command", ["build", "info", "ask", "chat", "sessions", "serve", "eval", "compare", "passkey",
                                     "demo", "train"])
def test_every_command_and_option_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: landmark-memory {command}")
    options = out[out.index("options:"):].splitlines()[1:]
    bare = [line for line, after in zip(options, options[1:] + [""])  # an option line with nothing after it
            if line.startswith("  -") and len([x for x in line.strip().split("  ") if x]) < 2
            and not after.startswith(" " * 20)]
    assert not bare, bare


# ---- bad input: a clear message, a non-zero exit, the memory untouched -------------------
def bad_input(kind, tmp_path):
    f = tmp_path / "bad.txt"
    if kind == "empty file":
        f.write_text("")
    elif kind == "binary file":
        f.write_bytes(bytes(range(256)) * 4)
    elif kind == "non-UTF-8 file":
        f.write_bytes("caf\u00e9 au lait, d\u00e9j\u00e0 vu".encode("latin-1"))
    elif kind == "directory with no text":
        f = tmp_path / "empty_dir"
        f.mkdir()
        (f / "image.png").write_bytes(b"\x89PNG")
    return f


@pytest.mark.parametrize("kind,message", [("empty file", "is empty"), ("binary file", "looks binary"),
                                          ("non-UTF-8 file", "not UTF-8"), ("directory with no text", "no .txt files")])
def test_bad_inputs_are_refused_and_leave_the_memory_untouched(built, kind, message, tmp_path, capsys):
    before = dir_digest(built)
    rc = main(["build", str(built), "--input", str(bad_input(kind, tmp_path)), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "error" in err
    assert dir_digest(built) == before


def test_a_memory_refuses_another_model(built, tmp_path, capsys):
    other = LandmarkGPT.from_pretrained()
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1.0
    other.save_pretrained(tmp_path / "other")
    before = dir_digest(built)
    for argv in (["ask", str(built), "Hello"], ["build", str(built), "--input", str(BOOK)]):
        assert main([*argv, "--model", str(tmp_path / "other"), "--quiet"]) == 2
        assert "another model" in capsys.readouterr().err
    assert dir_digest(built) == before


def test_a_memory_built_with_a_folder_is_read_with_it_only_once_the_user_names_it_again(texts, tmp_path, capsys):
    LandmarkGPT.from_pretrained().save_pretrained(tmp_path / "own")
    mem, own = tmp_path / "mem", ["--model", str(tmp_path / "own")]
    assert main(["build", str(mem), "--input", str(texts / "a.txt"), *own, "--quiet"]) == 0
    capsys.readouterr()
    for argv in (["build", str(mem), "--input", str(texts / "b.txt")], ["ask", str(mem), "Hello"]):
        assert main([*argv, "--quiet"]) == 2  # a manifest never chooses the folder a model is loaded from
        err = capsys.readouterr().err
        assert str(tmp_path / "own") in err and "--model" in err and len(err.strip().splitlines()) == 1, err
    assert main(["build", str(mem), "--input", str(texts / "b.txt"), *own, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["ask", str(mem), "Hello", "--max-new-tokens", "2", "--json", *own]) == 0
    assert json.loads(capsys.readouterr().out)["memory_tokens"] > 0
    other = LandmarkGPT.from_pretrained()
    with torch.no_grad():
        other.lm_head.weight[0, 0] += 1.0
    other.save_pretrained(tmp_path / "own")  # the folder now holds other weights: refused as another model
    assert main(["ask", str(mem), "Hello", "--quiet", *own]) == 2
    assert "another model" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["build", "--help"], ["build", "m", "--input", "x", "--workers", "0"]])
def test_help_and_wrong_options_answer_before_torch_or_faiss_load(argv):
    probe = ("import sys; from landmark_memory.app import entry; sys.argv = ['landmark-memory', *sys.argv[1:]]\n"
             "try:\n    entry.main()\nexcept SystemExit as e:\n    code = e.code\n"
             "print('LOADED', 'torch' in sys.modules or 'faiss' in sys.modules, code, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert run.stderr.strip().splitlines()[-1] == f"LOADED False {2 if '--workers' in argv else 0}", run.stderr


def test_a_wrong_model_is_named_in_one_line_before_it_loads(built, capsys):
    for argv in (["ask", str(built), "Hello"], ["build", str(built), "--input", str(BOOK), "--block-size", "63"]):
        t0 = time.time()
        assert main([*argv, "--model", "smollm2-landmark", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and time.time() - t0 < 5, err  # SmolLM2 was never loaded
        assert "built with another model, bundled" in err and "--model smollm2-landmark" in err
        assert err.endswith("pass --model bundled")


@pytest.mark.parametrize("damage", ["manifest.json", "tokens.bin", "keys/s0_l3_h1.f32"])
def test_truncated_files_are_reported_not_loaded(built, damage, tmp_path, capsys):
    mem = tmp_path / "mem"
    shutil.copytree(built, mem)
    f = mem / damage
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    for argv in (["info", str(mem)], ["ask", str(mem), "Hello"]):
        assert main([*argv, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert ("damaged" if damage == "manifest.json" else "is truncated") in err and "rebuild" in err


@pytest.mark.slow
def test_a_read_only_memory_refuses_to_build_but_answers(built):
    # root writes anywhere: drop to an unprivileged user to make read-only mean something
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    if prefix and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be simulated")
    top = Path(tempfile.mkdtemp())  # pytest's own temporary folders are private to their owner
    top.chmod(0o755)
    mem = top / "mem"
    shutil.copytree(built, mem)
    for p in [mem, *mem.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    env = {**os.environ, "HOME": str(top), "PYTHONDONTWRITEBYTECODE": "1"}
    before = dir_digest(mem)
    build = subprocess.run(prefix + CLI + ["build", str(mem), "--input", str(BOOK), "--quiet"], env=env,
                           capture_output=True, text=True)
    assert build.returncode == 2 and "cannot write to the memory" in build.stderr, build.stderr
    ask = subprocess.run(prefix + CLI + ["ask", str(mem), "Hello", "--max-new-tokens", "2", "--json"], env=env,
                         capture_output=True, text=True)
    assert ask.returncode == 0, ask.stderr
    assert dir_digest(mem) == before
    for p in [mem, *mem.rglob("*")]:
        p.chmod(0o755)
    shutil.rmtree(top)


# ---- crash safety -----------------------------------------------------------------------
@pytest.mark.slow
def test_kill_during_build_never_loses_or_duplicates_committed_tokens(tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text(BOOK.read_text()[:30000])
    total = n_tokens(book)
    mem = tmp_path / "mem"
    argv = CLI + ["build", str(mem), "--input", str(book), "--chunk-size", "50", "--commit-every", "0", "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (mem / "manifest.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(7).uniform(0.5, 2.0))  # somewhere in the middle of ingestion
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    info = run_json(capsys, "info", str(mem))
    read = info["inputs"][0]["ingested"] if info["inputs"] else 0
    assert info["tokens"] == 0 and 0 <= read < total, "the build should have been killed before it finished"
    doc = run_json(capsys, "build", str(mem), "--input", str(book))
    assert doc["added"] == total - read
    final = run_json(capsys, "info", str(mem))
    assert final["tokens"] == total and final["inputs"][0]["status"] == "done"
    model = LandmarkGPT.from_pretrained()
    opened = LandmarkMemory.open(mem, model, readonly=True)
    ids = encode_document(load_tokenizer(), book.read_text(), 50)
    np.testing.assert_array_equal(opened.tokens(), ids)  # in order, none twice
    assert opened.pending_count == 0
    opened.close()


@pytest.mark.slow
def test_ctrl_c_commits_what_is_done_and_a_rerun_finishes(tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text(BOOK.read_text()[:30000])
    mem = tmp_path / "mem"
    argv = CLI + ["build", str(mem), "--input", str(book), "--chunk-size", "50", "--commit-every", "3600", "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (mem / "manifest.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    read = run_json(capsys, "info", str(mem))["inputs"][0]["ingested"]
    assert 0 < read < n_tokens(book), "an hourly commit interval means only Ctrl-C committed these"
    doc = run_json(capsys, "build", str(mem), "--input", str(book))
    assert doc["added"] + read == n_tokens(book)


def test_info_writes_a_document_names_control_characters_as_escapes(texts, tmp_path, capsys):
    name = tmp_path / "red\x1b[31mtext\x07.txt"  # a name that would colour a terminal and ring its bell
    name.write_text(BOOK.read_text()[:400])
    assert main(["build", str(tmp_path / "m"), "--input", str(name), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "red\\x1b[31mtext\\x07.txt" in out and "\x1b" not in out and "\x07" not in out
    assert main(["info", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"][0]["path"] == str(name)  # JSON keeps the name as it is


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(built, monkeypatch, capsys):
    class Closed:  # stdout of `landmark-memory info MEMORY | head -1` once head has gone
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):  # (not a real file: the command cannot point it at /dev/null)
            raise OSError("no file descriptor")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["info", str(built)]) == 141  # as a Unix tool killed by SIGPIPE
    assert capsys.readouterr().err == ""
