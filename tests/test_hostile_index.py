"""The text index as a hostile or damaged file: a received ``text.sqlite`` is read only once it
is found to be an index of ours (its header, its tables, its meta, every look bounded), never
written beside; damaged pages are searched around, found by ``verify`` and built again by
``landmark-memory index``; search checks its question as ``ask`` does; NFC and NFD spellings
find the same passages; a folder in the index's place stops a build before it reads."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import unicodedata
import warnings

import numpy as np
import pytest
from helpers import damage_segments, rewrite_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from landmark_memory import LandmarkGPT, LandmarkMemory, ask, load_tokenizer, search
from landmark_memory.app.cli import main
from landmark_memory.format import text_file
from landmark_memory.format.text_file import TEXT_INDEX, index_state, seal_index
from landmark_memory.format.text_index import TextIndex
from landmark_memory.jobs import build as build_job
from landmark_memory.training.data import SAMPLE_DIR
from landmark_memory.uses.evidence import own_words, support
from landmark_memory.uses.question import ASKED_WORDS, QuestionError, asked_words
from landmark_memory.uses.search import text_ranking


def copy_of(corpus, tmp_path, sealed=True):
    """A copy of the memory ``corpus``; its text index sealed again (a copy's seal never holds)."""
    path = tmp_path / "m"
    shutil.copytree(corpus, path)
    if sealed:
        seal_index(path / TEXT_INDEX)
    return path


def found(path, question, k=3):
    with LandmarkMemory.open(path, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        return [p.block for p in search(mem, load_tokenizer(), question, k=k).passages]


NULL_META = ["DROP TABLE meta", "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)",
             "INSERT INTO meta VALUES ('version', '1'), ('digest', 'd'), ('blocks', NULL), ('crc', '0')",
             "PRAGMA writable_schema = ON",  # the schema made ours again, word for word, around the NULL
             "UPDATE sqlite_master SET sql = 'CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)' "
             "WHERE name = 'meta'"]
RECURSIVE = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r)"
HOSTILE = {
    "a NULL in meta": NULL_META,
    "a count that is no number": ["UPDATE meta SET value = '1e9' WHERE key = 'blocks'"],
    "text that is no UTF-8": ["UPDATE meta SET value = CAST(x'ff8b' AS TEXT) WHERE key = 'digest'"],  # (fuzzing)
    "a recursive view named meta": ["DROP TABLE meta", f"CREATE VIEW meta(key, value) AS {RECURSIVE} "
                                                       "SELECT 'blocks', i FROM r WHERE i < 0"],
    "a view whose rows never end": ["DROP TABLE meta", f"CREATE VIEW meta(key, value) AS {RECURSIVE} "
                                                       "SELECT 'blocks', printf('%d', i) FROM r"],
    "a trigger": ["CREATE TRIGGER t AFTER INSERT ON meta BEGIN DELETE FROM meta; END"],
    "write-ahead-log mode": ["PRAGMA journal_mode = WAL"],
}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_info_reads_a_received_index_that_is_not_ours_as_unreadable_at_once_and_writes_nothing(corpus, tmp_path,
                                                                                               hostile):
    path = copy_of(corpus, tmp_path, sealed=False)
    rewrite_index(path, HOSTILE[hostile])
    before = sorted(p.name for p in path.iterdir())
    # in a process of its own: a hang inside SQLite would be deaf to the test's own signals
    r = subprocess.run([sys.executable, "-m", "landmark_memory.app.entry", "info", str(path), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    state = json.loads(r.stdout)["text_index"]
    assert state["blocks"] is None and str(path / TEXT_INDEX) in state["problem"]
    assert sorted(p.name for p in path.iterdir()) == before  # (no -wal, no -shm, no journal)
    seal_index(path / TEXT_INDEX)
    with LandmarkMemory.open(path, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        assert TextIndex.open(path, "d", writable=False).path is None  # sealed or not, never read as an index
        assert [p.block for p in search(mem, load_tokenizer(), "the treasure map").passages] == \
            found(corpus, "the treasure map", k=5)


def test_a_readers_checks_of_a_file_are_bounded_in_sqlites_steps(corpus, monkeypatch):
    assert index_state(corpus)["blocks"] > 0
    monkeypatch.setattr(text_file, "STEPS", 1)
    monkeypatch.setattr(text_file, "READ_STEPS", 0)  # (what any look past the bound meets)
    state = index_state(corpus)
    assert state["blocks"] is None and "interrupted" in state["problem"]


def test_a_file_that_is_no_sqlite_database_is_named_so(corpus, tmp_path):
    path = copy_of(corpus, tmp_path)
    (path / TEXT_INDEX).write_bytes(b"not a database" * 20)
    assert "no SQLite database" in index_state(path)["problem"]


@pytest.mark.parametrize("how", ["flipped", "zeroed"])
def test_damaged_segments_are_searched_around_found_by_verify_and_built_again_by_index(corpus, tmp_path, capsys,
                                                                                      how):
    question, want = "the treasure map", found(corpus, "the treasure map")
    path = copy_of(corpus, tmp_path)
    damage_segments(path, how)
    assert main(["info", str(path), "--verify"]) == 2
    out = capsys.readouterr().out
    assert "the text index" in out and "integrity-check" in out and f"landmark-memory index {path}" in out
    if how == "flipped":  # an error as it is read: a copy in memory answers, and says so
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert found(path, question) == want
        assert any("damaged" in str(w.message) and "in memory" in str(w.message) for w in seen)
        assert main(["search", str(path), question]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith(f"Q: {question}") and "Traceback" not in captured.err
        assert "warning: the text index" in captured.err and len(captured.err.strip().splitlines()) == 1
    else:  # nothing found, no error: what only verify could tell
        assert found(path, question) != want
    assert main(["index", str(path)]) == 0
    assert main(["info", str(path), "--verify"]) == 0
    capsys.readouterr()
    assert found(path, question) == want and index_state(path)["sealed"]


def test_verify_names_a_sealed_index_of_other_rows_and_reads_an_unsealed_one_never(corpus, tmp_path, capsys):
    path = copy_of(corpus, tmp_path)
    rewrite_index(path, ["UPDATE meta SET value = '12345' WHERE key = 'crc'"], reseal=True)
    assert main(["info", str(path), "--verify"]) == 2
    assert "holds other rows than the memory's" in capsys.readouterr().out
    os.utime(path / TEXT_INDEX)  # its seal no longer holds: readers and writers build it again, verify lets it be
    assert main(["info", str(path), "--verify"]) == 0


def test_search_refuses_a_question_that_is_no_text_as_ask_does(corpus, refused):
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        for q in ("zebra crossings \ud800", "   "):
            with pytest.raises(QuestionError):
                search(mem, load_tokenizer(), q)
    refused(["search", str(corpus), "zebra crossings \udced\udca0\udc80"], "not valid text", "character 16")
    refused(["ask", str(corpus), "zebra crossings \udced\udca0\udc80"], "not valid text", "character 16")


def test_a_long_question_asks_the_text_index_for_its_first_words_only(corpus, monkeypatch):
    asked = []
    monkeypatch.setattr(TextIndex, "search", lambda self, words, k, n: asked.append(list(words)) or [])
    question = "treasure " + " ".join(f"word{i:05d}x" for i in range(5000))
    assert asked_words(question) == own_words(question)[:ASKED_WORDS] and len(asked_words(question)) == ASKED_WORDS
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        text_ranking(mem, load_tokenizer(), question, mem.n_blocks)
    assert asked == [asked_words(question)] and asked[0][0] == "treasure"


def test_nfc_and_nfd_spellings_find_the_same_passages_pinned_block_and_support(tmp_path):
    text = (SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:2400]
    planted = (text[:800] + " They sailed down the Rhine to Köln and its cathedral. " + text[800:1600]
               + unicodedata.normalize("NFD", " The letter came from Zürich, by the lake. ") + text[1600:])
    (tmp_path / "a.txt").write_text(planted)
    assert main(["build", str(tmp_path / "m"), "--input", str(tmp_path / "a.txt"), "--chunk-size", "100",
                 "--quiet"]) == 0
    tok = load_tokenizer()
    with LandmarkMemory.open(tmp_path / "m", LandmarkGPT.from_pretrained(), readonly=True) as mem:
        for q, word in (("Who sailed to Köln?", "köln"), ("Where did the letter from Zürich come from?", "zürich")):
            nfc, nfd = unicodedata.normalize("NFC", q), unicodedata.normalize("NFD", q)
            assert nfc != nfd and own_words(nfc) == own_words(nfd)
            ranked = text_ranking(mem, tok, nfc, mem.n_blocks)
            assert ranked and ranked == text_ranking(mem, tok, nfd, mem.n_blocks)
            assert word in unicodedata.normalize("NFC", tok.decode(mem.tokens(0, ranked[0][0], ranked[0][0] + 1)
                                                                   .tolist())).lower()
            pinned = [ask(mem, tok, s, max_new_tokens=1, raw=True).passages[0].block for s in (nfc, nfd)]
            assert pinned[0] == pinned[1] == ranked[0][0]
            mem.rewind()
            evidence = unicodedata.normalize("NFD", f"We came to {word.title()} at night.")
            assert support(nfc, evidence) == support(nfd, evidence) > 0


def test_a_folder_in_the_text_indexs_place_stops_a_build_before_it_reads_or_says_what_is_committed(
        documents, tmp_path, refused, monkeypatch):
    path = tmp_path / "m"
    assert main(["build", str(path), "--input", str(documents / "a.txt"), "--chunk-size", "100", "--quiet"]) == 0
    (path / TEXT_INDEX).unlink()
    (path / TEXT_INDEX).mkdir()
    manifest = (path / "manifest.json").read_bytes()
    refused(["build", str(path), "--input", str(documents / "b.txt"), "--chunk-size", "100", "--quiet"],
            f"{path / TEXT_INDEX} is no file", "nothing was read")
    assert (path / "manifest.json").read_bytes() == manifest
    monkeypatch.setattr(build_job, "check_place", lambda folder: None)  # (as if it appeared once the build began)
    refused(["build", str(path), "--input", str(documents / "b.txt"), "--chunk-size", "100", "--quiet"],
            "is committed (commit 2: 2 documents)", "text index was not written")
    assert [p.name for p in path.iterdir() if p.name.startswith(".")] == []  # (no temporary file left)


def test_a_writer_whose_rename_fails_leaves_no_temporary_file(tmp_path):
    index = TextIndex.open(tmp_path, "d", writable=True)
    index.sync(np.arange(1, 13, dtype=np.int32).reshape(2, 6), set(), lambda rows: [" ".join(map(str, r))
                                                                                    for r in rows])
    (tmp_path / TEXT_INDEX).mkdir()
    with pytest.raises(OSError):
        index.close()
    assert [p.name for p in tmp_path.iterdir()] == [TEXT_INDEX]


PAGE = 4096  # SQLite's page


def _run(argv):
    """(exit status, stdout, stderr) of the command ``argv`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), how=st.sampled_from(["flip", "truncate", "zero a page"]))
@pytest.mark.slow
def test_a_sealed_index_damaged_anywhere_is_answered_around_and_built_again_by_index(corpus, tmp_path_factory, data,
                                                                                     how):
    path = copy_of(corpus, tmp_path_factory.mktemp("fuzz"), sealed=False)
    f = path / TEXT_INDEX
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        if how == "truncate":
            fh.truncate(data.draw(st.integers(0, size - 1)))
        elif how == "flip":
            fh.seek(at := data.draw(st.integers(0, size - 1)))
            old = fh.read(1)
            fh.seek(at)
            fh.write(bytes([old[0] ^ 0xFF]))
        else:
            fh.seek(PAGE * data.draw(st.integers(0, (size - 1) // PAGE)))
            fh.write(bytes(PAGE))
    seal_index(f)  # (damage beneath the seal: the index is read as it lies)
    for argv in (["info", path], ["info", path, "--verify"], ["search", path, "the treasure map"],
                 ["ask", path, "The captain said", "--max-new-tokens", "1", "--raw"]):
        rc, out, err = _run(argv)
        assert rc in (0, 2) and "Traceback" not in err, (argv, rc, err)
        if argv[0] in ("search", "ask"):  # answered (around damage it met: one line of warning)
            assert rc == 0 and len(err.strip().splitlines()) <= 1, (argv, err)
        elif rc == 2:
            assert "--verify" in argv and "text index" in out, (argv, out, err)
    assert _run(["index", path])[0] == 0
    assert _run(["info", path, "--verify"])[0] == 0
    assert found(path, "the treasure map") == found(corpus, "the treasure map")
