"""Corpora read on Ray: as many workers as wanted give the same memory as one, a worker killed
mid-document is retried from its last commit, and bad Ray settings are one line and exit 2.
Ray starts locally here (seconds) and is always shut down."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from helpers import files_of

from landmark_memory import load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.jobs.build import encode_document
from landmark_memory.training.data import SAMPLE_DIR

pytestmark = pytest.mark.slow  # builds on Ray

CLI = [sys.executable, "-m", "landmark_memory.app.cli"]


@pytest.fixture
def own_ray():
    """A Ray instance of 2 CPUs started here, which the command joins (a program's own Ray is kept)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def build_argv(mem, inputs, *extra):
    return ["build", str(mem), "--input", str(inputs), "--chunk-size", "100", "--quiet", *extra]


def ask(capsys, mem):
    assert main(["ask", str(mem), "What did the captain say?", "--max-new-tokens", "6", "--passages", "4",
                 "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_two_workers_build_bit_for_bit_what_one_worker_and_this_process_build(documents, tmp_path, capsys):
    assert not ray.is_initialized()
    train = ("--train-size", "4")  # documents and corpus train their index lists, each as often
    # its own local Ray, started and shut down by the command
    two = subprocess.run(CLI + build_argv(tmp_path / "two", documents, *train, "--workers", "2", "--worker-threads",
                                          "1",
                                          "--json"),
                         capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr
    assert json.loads(two.stdout)["workers"] == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker: the same arithmetic
    try:
        assert main(build_argv(tmp_path / "here", documents, *train)) == 0
    finally:
        torch.set_num_threads(threads)
    assert main(build_argv(tmp_path / "one", documents, *train, "--workers", "1", "--worker-threads", "1")) == 0
    capsys.readouterr()
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one") == files_of(tmp_path / "here")
    answers = [ask(capsys, tmp_path / m) for m in ("two", "one")]
    assert answers[0]["text"] == answers[1]["text"] and answers[0]["retrieved"] == answers[1]["retrieved"]
    assert {p["source"] for p in answers[0]["retrieved"]} <= {str(f) for f in documents.glob("*.txt")}


def test_a_worker_killed_mid_document_is_retried_from_its_last_commit(own_ray, tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text((SAMPLE_DIR / "train" / "treasure_island_excerpt.txt").read_text())
    mem = tmp_path / "m"
    rc = []
    build = threading.Thread(target=lambda: rc.append(main(build_argv(mem, book, "--workers", "1", "--worker-threads",
                                                                      "1", "--commit-every", "0"))))
    build.start()
    deadline, killed = time.time() + 300, None
    while killed is None and build.is_alive() and time.time() < deadline:
        for doc in (mem / "docs").glob("*") if (mem / "docs").is_dir() else []:
            try:
                read = json.loads((doc / "manifest.json").read_text())["inputs"][0]["ingested"]
                pid = int((doc / "writer.lock").read_text().split()[1])
            except (OSError, ValueError, IndexError, KeyError):
                continue
            if read > 0:
                os.kill(pid, signal.SIGKILL)
                killed = read
        time.sleep(0.02)
    build.join(timeout=300)
    assert killed is not None, "the document should have been killed while it was read"
    assert rc == [0]
    total = len(encode_document(load_tokenizer(), book.read_text(), 50))
    assert killed < total
    assert main(["info", str(mem), "--verify"]) == 0
    capsys.readouterr()
    assert main(build_argv(tmp_path / "clean", book)) == 0
    assert files_of(mem) == files_of(tmp_path / "clean")  # every token once, each block as a clean build has it


@pytest.mark.parametrize("argv,words", [
    (["--workers", "2", "--ray-address", "127.0.0.1:9"], ["cannot reach a Ray cluster", "ray start --head"]),
    (["--workers", "2", "--ray-address", "nowhere"], ["HOST:PORT"]),
    (["--ray-address", "auto"], ["needs --workers"]),
    (["--workers", str(len(os.sched_getaffinity(0)) + 1)], ["cores"]),
])
def test_bad_ray_settings_are_one_line_and_write_nothing(documents, tmp_path, capsys, argv, words):
    assert main(build_argv(tmp_path / "m", documents, *argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "m").exists() and not ray.is_initialized()


def test_zero_workers_is_refused_by_the_command_line(documents, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(build_argv(tmp_path / "m", documents, "--workers", "0"))
    assert e.value.code == 2 and "is not a number of workers" in capsys.readouterr().err


class Bar:
    """A progress bar that keeps every count it showed."""

    def __init__(self):
        self.n, self.shown = 0, []

    def update(self, n):
        self.n += n
        self.shown.append(self.n)


def test_the_bar_follows_the_tokens_workers_read_before_any_commit(own_ray, tmp_path):
    from landmark_memory import LandmarkGPT, LandmarkMemory
    from landmark_memory.jobs.distributed import RayReader
    from landmark_memory.jobs.reading import DocumentJob

    tok, text = load_tokenizer(), (SAMPLE_DIR / "book" / "up_from_slavery.txt").read_text()[:100_000]
    with LandmarkMemory(LandmarkGPT.from_pretrained(), path=tmp_path / "m", store="lmdb", documents=True) as mem:
        job = DocumentJob((tmp_path / "m" / "docs" / ("0" * 16)).resolve(), str(tmp_path / "book.txt"), "0" * 64,
                          encode_document(tok, text, 50), mem.options, commit_every=1e9)  # one commit, at its end
        bar = Bar()
        with RayReader(1, None, None, threads=1) as reader:  # joins the Ray started here
            (result,) = list(reader.run([job], lambda: False, bar))
        mem.close(commit=False)
    assert result.done and bar.n == len(job.ids)
    assert 0 < bar.shown[0] < len(job.ids)  # it moved while the document was read, before its only commit


@pytest.mark.parametrize("at", ["ray", "workers", "folder check"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_ray_starts_is_held_until_ray_is_shut_down_again(documents, tmp_path, monkeypatch, at, signum):
    from landmark_memory.jobs import distributed

    step = {"ray": "_start_ray", "workers": "_start_workers", "folder check": "_check_reaches"}[at]
    original = getattr(distributed.RayReader, step)

    def signalled(self, ray_module):  # the signal comes as the step starts: it runs on, and the rest is skipped
        os.kill(os.getpid(), signum)
        return original(self, ray_module)

    monkeypatch.setattr(distributed.RayReader, step, signalled)
    got = []

    def handler(s, frame):  # what the command's handler does: the signal as an exception, once Ray is down
        got.append((s, ray.is_initialized()))
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, handler), signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with distributed.RayReader(1, None, None, memory=tmp_path / "m"):
                pytest.fail("the start went on after the signal")
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    assert got == [(signum, False)]  # raised once, after Ray was shut down
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".landmark-memory-probe*"))


def test_a_start_stopped_by_a_signal_the_build_only_notes_reads_nothing_and_starts_no_other_ray(tmp_path, monkeypatch):
    from landmark_memory.jobs import distributed

    original = distributed.RayReader._start_workers

    def signalled(self, ray_module):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(self, ray_module)

    monkeypatch.setattr(distributed.RayReader, "_start_workers", signalled)
    noted = []  # what the build's handler does: note the signal, commit what was read, then exit
    before = signal.signal(signal.SIGTERM, lambda s, frame: noted.append(s))
    try:
        with distributed.RayReader(1, None, None, memory=tmp_path / "m") as reader:
            got = list(reader.run([object()], lambda: bool(noted), None))  # (a job it must not touch)
            assert not ray.is_initialized()  # (a Ray call here would have started another: auto-init)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert noted == [signal.SIGTERM] and got == [] and not ray.is_initialized()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("after", [0.5, 2.0, 3.5, 5.0])
def test_a_signal_at_any_instant_of_a_builds_start_is_one_line_and_its_exit_status(documents, tmp_path, signum, after):
    mem = tmp_path / "m"
    proc = subprocess.Popen([sys.executable, "-m", "landmark_memory.app.entry", *build_argv(mem, documents, "--workers",
                                                                                          "2")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(after)  # importing, loading the model, starting Ray and its workers, reading
    # a terminal's Ctrl-C reaches the whole group (Ray's own processes block SIGINT); `kill` the build alone
    (os.killpg if signum == signal.SIGINT else os.kill)(proc.pid, signum)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # (the build and its Ray ended, not left to take the cores from what follows)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the build went on for 2 minutes after the signal: {err[-500:]}")
    assert proc.returncode in (0, 128 + signum), err  # (0: the build was done before the signal)
    assert "Traceback" not in err and "***" not in err and len(err.strip().splitlines()) <= 1, err
    if proc.returncode:
        assert "interrupted" in err + out
    assert not (mem / "manifest.json").exists() or main(["info", str(mem), "--verify"]) == 0
