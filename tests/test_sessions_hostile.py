"""Sessions against hostile files and names (round three): a turn log that is a link, a pipe,
cut, flipped or gone is refused before a turn is read and nothing outside the session changes;
names are bounded in bytes as the file system bounds them, and every session made can be
deleted; a session is bound to its own name and to the options of the memory it was made over;
a turn and an answer are bounded on the command line as the server bounds them."""

import io
import os
import shutil
import sys

import pytest
from helpers import snapshot

from landmark_memory import LandmarkGPT, LandmarkMemory
from landmark_memory.app.cli import main
from landmark_memory.core.names import MAX_NEW_TOKENS, MAX_TURN_CHARS
from landmark_memory.format.session_files import SessionError, check_name, delete_session, list_sessions
from landmark_memory.uses.answer import QuestionError, say
from landmark_memory.uses.session import Session


@pytest.fixture
def memory(corpus, tmp_path):
    """A copy of the corpus, with a session ``s`` of one turn."""
    path = tmp_path / "m"
    shutil.copytree(corpus, path, ignore=shutil.ignore_patterns("sessions"))
    assert chat(path, "s") == (0, "")
    return path


def chat(memory, name, *lines, extra=()):
    """``landmark-memory chat MEMORY --session NAME`` given ``lines`` on stdin: (exit status, stderr)."""
    stdin, err = sys.stdin, io.StringIO()
    sys.stdin = io.StringIO("".join(f"{line}\n" for line in lines or ["The captain said"]))
    try:
        from contextlib import redirect_stderr, redirect_stdout

        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            try:
                rc = main(["chat", str(memory), "--session", name, "--raw", "--max-new-tokens", "3", *extra])
            except SystemExit as e:
                rc = e.code
    finally:
        sys.stdin = stdin
    return rc, err.getvalue()


def one_line(err, *words):
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_a_turn_log_that_is_a_link_is_refused_and_what_it_points_to_is_never_cut(memory, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("x" * 22_000)
    log = memory / "sessions" / "s" / "turns.jsonl"
    log.unlink()
    log.symlink_to(outside)
    rc, err = chat(memory, "s")
    assert rc == 2
    one_line(err, "turns.jsonl is a symbolic link")
    assert outside.read_text() == "x" * 22_000


@pytest.mark.parametrize("name", ["turns.jsonl", "turns.idx"])
def test_a_session_file_hard_linked_outside_is_refused_and_never_written_through(memory, tmp_path, name):
    outside, f = tmp_path / "outside", memory / "sessions" / "s" / name
    outside.write_bytes(f.read_bytes())
    f.unlink()
    os.link(outside, f)  # `ln -f outside turns.jsonl`: one file, two names
    before = outside.read_bytes()
    rc, err = chat(memory, "s")
    assert rc == 2
    one_line(err, name, "hard links")
    assert outside.read_bytes() == before


@pytest.mark.parametrize("damage", ["half", "flipped", "deleted", "pipe"])
def test_a_damaged_turn_log_is_refused_before_the_turn_and_nothing_is_written(memory, damage):
    folder = memory / "sessions" / "s"
    log = folder / "turns.jsonl"
    data = log.read_bytes()
    if damage == "half":
        log.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":
        log.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    else:
        log.unlink()
        if damage == "pipe":
            os.mkfifo(log)
    before = {p: p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name != "writer.lock"}
    rc, err = chat(memory, "s")
    assert rc == 2
    one_line(err, "turns.jsonl", {"half": "truncated", "flipped": "CRC-32", "deleted": "missing",
                                  "pipe": "no regular file"}[damage])
    assert {p: p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name != "writer.lock"} == before
    assert [s.problem for s in list_sessions(memory)] != [""]  # listed as damaged, not as sound


def test_a_name_up_to_the_file_systems_255_bytes_is_made_and_deleted_and_a_longer_one_refused(memory, capsys):
    longest, over = "名" * 85, "名" * 86  # 255 and 258 bytes in UTF-8, both within 100 characters
    assert check_name(longest) == longest
    with pytest.raises(SessionError, match="at most 255 bytes") as e:
        check_name(over)
    assert e.value.kind == "name"
    assert chat(memory, longest) == (0, "")
    assert main(["sessions", str(memory), "--delete", longest]) == 0
    assert not (memory / "sessions" / longest).exists()
    rc, err = chat(memory, over)
    assert rc == 2 and "no session name" in err and "Traceback" not in err


def test_a_session_copied_under_another_name_is_refused(memory, model):
    shutil.copytree(memory / "sessions" / "s", memory / "sessions" / "copy")
    rc, err = chat(memory, "copy")
    assert rc == 2
    one_line(err, "holds the session 's', not 'copy'")
    assert "copy" in {s.name for s in list_sessions(memory) if s.problem}
    delete_session(memory, "copy")  # and it can be deleted


def test_a_session_made_over_a_memory_with_other_options_is_refused(documents, corpus, tmp_path, model):
    other = tmp_path / "other"  # the same text, another chunk size and stored dtype
    assert main(["build", str(other), "--input", str(documents), "--chunk-size", "50", "--store-dtype", "float16",
                 "--quiet"]) == 0
    shutil.copytree(corpus, tmp_path / "m", ignore=shutil.ignore_patterns("sessions"))
    assert chat(tmp_path / "m", "s") == (0, "")
    (other / "sessions").mkdir()
    shutil.copytree(tmp_path / "m" / "sessions" / "s", other / "sessions" / "s")
    before = snapshot(other)
    rc, err = chat(other, "s")
    assert rc == 2
    one_line(err, "made over a memory built with other options", "chunk_size 100 against 50",
             "store_dtype 'int8' against 'float16'")
    assert snapshot(other) == before


def test_a_turn_and_an_answer_are_bounded_on_the_command_line(memory, model):
    rc, err = chat(memory, "s", extra=("--max-new-tokens", str(MAX_NEW_TOKENS + 1)))
    assert rc == 2 and f"0 to {MAX_NEW_TOKENS:,}" in err
    before = snapshot(memory)
    rc, err = chat(memory, "s", "a" * (MAX_TURN_CHARS + 1))
    assert rc == 2
    one_line(err, f"over the {MAX_TURN_CHARS:,} of one turn")
    assert snapshot(memory) == before
    with LandmarkMemory.open(memory, model, readonly=True) as mem, Session.open(mem, "s") as s:
        with pytest.raises(QuestionError, match="of one turn"):
            say(s, None, "a" * (MAX_TURN_CHARS + 1))


@pytest.fixture(scope="module")
def model():
    return LandmarkGPT.from_pretrained()
