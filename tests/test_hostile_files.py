"""Damaged memories and bad values, round two: a truncated store is named, never a SIGBUS; a
manifest that disagrees with the rows changes no file; values that were tracebacks are one line
with exit 2; options are checked before anything is written; inputs that are no text are
refused; and property-based damage to every manifest entry and file of a memory and a corpus."""

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from helpers import snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.cli import main, os_error_text
from landmark_memory.format import seals
from landmark_memory.format.documents import page_file
from landmark_memory.training.data import SAMPLE_DIR
from landmark_memory.uses.answer import say
from landmark_memory.uses.session import Session

BOOK = SAMPLE_DIR / "train" / "treasure_island_excerpt.txt"


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "book.txt"
    f.write_text(BOOK.read_text()[:3000])
    return f


@pytest.fixture(scope="module")
def corpus(text, tmp_path_factory):
    """A corpus of one document; tests damage copies of it."""
    mem = tmp_path_factory.mktemp("corpus") / "m"
    assert main(["build", str(mem), "--input", str(text), "--chunk-size", "50", "--quiet"]) == 0
    return mem


@pytest.fixture(scope="module")
def sharded_corpus(text, tmp_path_factory):
    """A corpus of one document that keeps its own store (as a large one does)."""
    mem = tmp_path_factory.mktemp("sharded") / "m"
    with pytest.MonkeyPatch.context() as m:
        m.setattr("landmark_memory.format.corpus_files.PACK_BYTES", -1)
        assert main(["build", str(mem), "--input", str(text), "--chunk-size", "50", "--quiet"]) == 0
    return mem


@pytest.fixture(scope="module")
def lists_corpus(text, tmp_path_factory):
    """A corpus whose ``ivf-rows`` indexes have trained their lists (at 8 blocks)."""
    mem = tmp_path_factory.mktemp("lists") / "m"
    assert main(["build", str(mem), "--input", str(text), "--chunk-size", "50", "--train-size", "8", "--quiet"]) == 0
    assert list(mem.glob("keys/*.ivf1.lists")) and list(mem.glob("keys/*.ivf1.centroids"))
    return mem


@pytest.fixture(scope="module")
def session_corpus(corpus, tmp_path_factory):
    """A copy of ``corpus`` with a session ``s`` of one turn."""
    mem = tmp_path_factory.mktemp("session") / "m"
    shutil.copytree(corpus, mem)
    with LandmarkMemory.open(mem, LandmarkGPT.from_pretrained(), readonly=True) as m, Session.open(m, "s") as s:
        say(s, load_tokenizer(), "The captain said", raw=True, max_new_tokens=2)
    return mem


@pytest.fixture(scope="module")
def context_memory(text, tmp_path_factory):
    """A memory read in one context (no documents), stopped mid-chunk: it has a state file."""
    from landmark_memory import load_tokenizer
    from landmark_memory.jobs.build import encode_document

    mem = tmp_path_factory.mktemp("context") / "m"
    ids = encode_document(load_tokenizer(), text.read_text(), 50)
    with LandmarkMemory(LandmarkGPT.from_pretrained(), store="lmdb", path=mem, chunk_size=50) as m:
        m.forward(torch.from_numpy(ids[None, :420]).long())
    return mem




def run(*argv):
    """The command in its own process (a SIGBUS must not take the tests with it)."""
    return subprocess.run([sys.executable, "-m", "landmark_memory.app.entry", *map(str, argv)], capture_output=True,
                          text=True, timeout=300)


def one_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err


@pytest.mark.slow
def test_a_truncated_lmdb_store_is_named_never_a_sigbus(corpus, text, tmp_path):
    mem = tmp_path / "m"
    shutil.copytree(corpus, mem)
    (data,) = mem.glob("store/lmdb/data.mdb")
    os.truncate(data, data.stat().st_size // 2)
    r = run("info", mem, "--verify")
    assert r.returncode == 2 and "data.mdb is truncated" in r.stdout, (r.returncode, r.stdout, r.stderr)
    for argv in (["ask", mem, "The captain", "--max-new-tokens", "2"], ["build", mem, "--input", text],
                 ["serve", mem, "--port", "1"]):
        one_line(run(*argv), "data.mdb is truncated")


@pytest.mark.parametrize("cut", ["store/lmdb/data.mdb", "tokens.bin", "keys/s0_l1_h0.f32"])
def test_a_reader_refuses_a_file_cut_under_it(corpus, tmp_path, cut):
    from landmark_memory import ask, load_tokenizer
    from landmark_memory.format import MemoryFileError

    mem = tmp_path / "m"
    shutil.copytree(corpus, mem)
    with LandmarkMemory.open(mem, LandmarkGPT.from_pretrained(), readonly=True) as m:
        ask(m, load_tokenizer(), "The captain", max_new_tokens=2, raw=True)  # the document's store is open now
        m.rewind()
        (f,) = mem.glob(cut)
        os.truncate(f, f.stat().st_size // 2)
        with pytest.raises(MemoryFileError, match=f"{f.name} is truncated"):
            m.refresh()  # as a server does before every answer: a read now would be a SIGBUS


@pytest.mark.parametrize("edit", ["blocks down by 2", "blocks 0", "streams 0"])
@pytest.mark.parametrize("which", ["corpus", "context"])
def test_a_manifest_with_too_few_rows_changes_no_file(corpus, context_memory, text, tmp_path, capsys, edit, which):
    mem = tmp_path / "m"
    shutil.copytree(corpus if which == "corpus" else context_memory, mem)
    doc = json.loads((mem / "manifest.json").read_text())
    if edit == "streams 0":
        doc["streams"] = 0
    else:
        doc["blocks"] = 0 if edit == "blocks 0" else doc["blocks"] - 2
        doc["tokens"] = doc["blocks"] * doc["model"]["shape"]["block_size"] + doc["pending_tokens"]
    (mem / "manifest.json").write_text(json.dumps(doc))
    before = snapshot(mem)
    argv = ["build", str(mem), "--input", str(text), "--chunk-size", "50", "--quiet"]
    assert main(argv) == 2 and "Traceback" not in capsys.readouterr().err
    assert snapshot(mem) == before


@pytest.mark.parametrize("argv,words", [
    (["ask", "{mem}", "caf\udce9"], ["not valid text"]),  # a question whose bytes are not UTF-8
    (["ask", "{mem}", "hi", "--device", "potato"], ["unknown device"]),
    (["ask", "{mem}", "hi", "--device", "cuda:7"], ["not on this machine"]),
    (["serve", "{mem}", "--port", "70000"], ["port number"]),
    (["ask", "{mem}", "hi", "--temperature", "inf"], ["finite"]),
    (["ask", "{mem}", "hi", "--seed", str(2**70)], ["seed"]),
    (["build", "{new}", "--input", "{text}", "--block-size", "100000"], ["block size"]),
])
def test_values_that_were_tracebacks_are_one_line(corpus, text, tmp_path, capsys, argv, words):
    argv = [a.format(mem=corpus, new=tmp_path / "n", text=text) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse refuses the value
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(err) and all(w in err[-1] for w in words), err
    assert not (tmp_path / "n").exists()


def test_a_tiny_temperature_samples_what_greedy_decoding_picks(corpus):
    from landmark_memory import ask, load_tokenizer

    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as m:
        greedy = ask(m, load_tokenizer(), "The captain", max_new_tokens=6, raw=True)
        m.rewind()
        tiny = ask(m, load_tokenizer(), "The captain", max_new_tokens=6, raw=True, temperature=1e-300, seed=2**64 - 1)
    assert tiny.tokens == greedy.tokens


@pytest.mark.parametrize("options", [{"store_dtype": "int3"}, {"top_k": 0}, {"index": "nope"},
                                     {"index_options": {"bogus": 1}}, {"chunk_size": 7}])
def test_invalid_options_are_refused_before_anything_is_written(tmp_path, options):
    with pytest.raises(ValueError):
        LandmarkMemory(LandmarkGPT.from_pretrained(), path=tmp_path / "D", store="lmdb", **options)
    assert not (tmp_path / "D").exists()


def test_a_batch_of_more_streams_than_a_memory_holds_is_refused_before_it_is_read():
    mem = LandmarkMemory(LandmarkGPT.from_pretrained())
    with pytest.raises(ValueError, match="at most 1,024 streams; idx has batch size 1,025"):
        mem.forward(torch.zeros(1025, 3, dtype=torch.long))
    assert mem.streams is None  # nothing was started


@pytest.mark.parametrize("content,words", [
    (b"text " * 20_000 + b"\x00 more", ["NUL byte at offset 100,000"]),
    (b"\xef\xbb\xbf", ["is empty"]),
    (b"\xef\xbb\xbf \r\n", ["is empty"]),
])
def test_inputs_that_are_no_text_are_refused(tmp_path, capsys, content, words):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    assert main(["build", str(tmp_path / "m"), "--input", str(f), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not (tmp_path / "m").exists()


def test_a_read_only_file_system_says_what_to_do():
    text = os_error_text(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/m"))
    assert "/mnt/ro/m" in text and "writable" in text


def test_a_truncated_mmap_store_is_named(text, tmp_path, capsys):
    mem = tmp_path / "m"
    assert main(["build", str(mem), "--input", str(text), "--chunk-size", "50", "--store", "mmap", "--quiet"]) == 0
    f = next(mem.glob("store/mmap/*.blocks"))
    os.truncate(f, f.stat().st_size - 7)
    assert main(["ask", str(mem), "The captain", "--max-new-tokens", "2", "--quiet"]) == 2
    assert f.name in capsys.readouterr().err


def _flip(f, at, value=None):
    """Write ``value`` (bytes) at byte ``at`` of ``f``, or flip that byte's bits."""
    data = bytearray(f.read_bytes())
    data[at:at + (len(value) if value else 1)] = value or bytes([data[at] ^ 0xFF])
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("chunk_size", [10**30, 50 * 1311])  # (the first multiple of 50 past 65,536)
def test_a_manifest_chunk_size_past_any_chunk_is_one_line(corpus, tmp_path, capsys, chunk_size):
    mem = tmp_path / "m"  # (hypothesis found 10**30: it overflowed making the chunk's positions)
    shutil.copytree(corpus, mem)
    doc = json.loads((mem / "manifest.json").read_text())
    doc["options"]["chunk_size"] = chunk_size
    (mem / "manifest.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["ask", str(mem), "The captain", "--max-new-tokens", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chunk_size" in err, err


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
@pytest.mark.parametrize("damage", ["another list", "a distance", "a centroid", "two layers swapped", "a key"])
def test_a_writer_refuses_index_and_key_files_damaged_within_their_bounds_and_writes_nothing(lists_corpus, tmp_path,
                                                                                            capsys, monkeypatch,
                                                                                            damage, sealed):
    mem = tmp_path / "m"
    shutil.copytree(lists_corpus, mem)
    if sealed:  # a writer closed it and sealed its files (format/seals.py): the damage comes after
        monkeypatch.setattr(seals, "SEAL_BYTES", 0)
        LandmarkMemory.open(mem, LandmarkGPT.from_pretrained()).close()
        assert (mem / seals.SEALS).is_file()
    lists, other = mem / "keys" / "s0_l1_h1.ivf1.lists", mem / "keys" / "s0_l2_h1.ivf1.lists"
    if damage == "another list":  # block 3's list id, still a list that exists
        _flip(lists, 24, np.int32(int(np.frombuffer(lists.read_bytes(), np.int32)[6]) ^ 1).tobytes())
    elif damage == "a distance":
        _flip(lists, 28)
    elif damage == "a centroid":
        _flip(mem / "keys" / "s0_l1_h1.ivf1.centroids", 9)
    elif damage == "two layers swapped":
        a, b = lists.read_bytes(), other.read_bytes()
        lists.write_bytes(b)
        other.write_bytes(a)
    else:
        _flip(mem / "keys" / "s0_l1_h1.f32", 17)
    book = tmp_path / "more.txt"
    book.write_text((SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:1500])
    before = snapshot(mem)
    capsys.readouterr()
    assert main(["build", str(mem), "--input", str(book), "--chunk-size", "50", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CRC-32" in err and "keys/s0_l" in err, err
    assert snapshot(mem) == before and not list(mem.glob("docs/*"))  # no new document folder, no tail
    assert main(["info", str(mem), "--verify"]) == 2


# ---- property-based damage -------------------------------------------------------------------
def _paths(doc, prefix=()):
    """Every (path to an entry) of a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, -1, 1, 10**30]),
                   st.floats(allow_nan=True), st.text(max_size=12), st.sampled_from(["../../etc", "/tmp", "docs/x"]),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _edit(doc, path, how, value):
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if how == "drop" and isinstance(parent, dict):
        del parent[path[-1]]
    elif how == "extra" and isinstance(parent, dict):
        parent["unexpected"] = value
    else:
        parent[path[-1]] = value


def _outcomes(mem, text):
    """``info``, ``info --verify``, ``ask``, ``build`` (its text and a new one), and where the
    memory has one a turn of its session ``s`` (``chat``) on ``mem``: each exit 0, or exit 2
    with one line; no traceback (a signal would end the tests). A failed command leaves every
    file as it was; a build never appends to a page of the document list it did not find sound."""
    chat = [["chat", mem, "--session", "s", "--raw", "--max-new-tokens", "1"]] if (mem / "sessions").is_dir() else []
    new = mem.parent / "new.txt"  # (a document the memory lacks: a build appends to its list)
    new.write_text((SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:400])
    for argv in (["info", mem], ["info", mem, "--verify"], ["ask", mem, "The", "--max-new-tokens", "1", "--quiet"],
                 ["build", mem, "--input", text, new, "--chunk-size", "50", "--quiet"], *chat):
        before, err, out = snapshot(mem), io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), _stdin("The captain said\n"):
            rc = main([str(a) for a in argv])
        err = err.getvalue()
        assert rc in (0, 2) and "Traceback" not in err, (argv, rc, err[-3000:])
        if rc == 0 and argv[0] == "build":  # a build never appends to a page it did not find sound
            after, pages = snapshot(mem), json.loads((mem / "manifest.json").read_text()).get("pages", [])
            for i, (_, nbytes, crc, _) in enumerate(pages):
                name = mem.joinpath(page_file(i)).relative_to(mem)
                if after.get(name) != before.get(name):
                    assert zlib.crc32(after[name][:nbytes]) == crc, name
        if rc == 2:  # one line; ``info --verify`` reports its problems on stdout instead
            verified = "--verify" in argv and not err and "damaged" in out.getvalue()
            assert verified or len(err.strip().splitlines()) == 1, (argv, err, out.getvalue())
            assert snapshot(mem) == before, argv


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), which=st.sampled_from(["corpus", "context", "document"]),
       how=st.sampled_from(["set", "drop", "extra"]), value=VALUES)
@pytest.mark.slow
def test_damaged_manifest_entries_are_exit_0_or_one_line(corpus, sharded_corpus, context_memory, text, tmp_path_factory,
                                                         data, which, how, value):
    mem = tmp_path_factory.mktemp("fuzz") / "m"
    shutil.copytree({"corpus": corpus, "context": context_memory, "document": sharded_corpus}[which], mem)
    manifest = mem / "manifest.json" if which != "document" else next(mem.glob("docs/*/manifest.json"))
    doc = json.loads(manifest.read_text())
    path = data.draw(st.sampled_from(list(_paths(doc))))
    _edit(doc, path, how, value)
    manifest.write_text(json.dumps(doc))
    _outcomes(mem, text)


@pytest.mark.parametrize("name", [[], "a folder\nwith a line break"])
def test_a_manifests_model_name_that_is_no_string_or_no_line_is_one_line_of_error(corpus, text, tmp_path, name):
    mem = tmp_path / "m"  # (both found by the fuzzing above: a crash on an unhashable name, an error of two lines)
    shutil.copytree(corpus, mem)
    doc = json.loads((mem / "manifest.json").read_text())
    doc["model"]["name"] = name
    (mem / "manifest.json").write_text(json.dumps(doc))
    _outcomes(mem, text)


@contextlib.contextmanager
def _stdin(text):
    stdin, sys.stdin = sys.stdin, io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = stdin


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), which=st.sampled_from(["corpus", "context", "lists", "session"]),
       how=st.sampled_from(["truncate", "extend", "flip"]))
@pytest.mark.slow
def test_damaged_files_are_exit_0_or_one_line(corpus, context_memory, lists_corpus, session_corpus, text,
                                              tmp_path_factory, data, which, how):
    mem = tmp_path_factory.mktemp("fuzz") / "m"
    shutil.copytree({"corpus": corpus, "context": context_memory, "lists": lists_corpus,
                     "session": session_corpus}[which], mem)
    files = sorted(p for p in mem.rglob("*") if p.is_file() and p.name not in ("writer.lock", "lock.mdb")
                   and p.stat().st_size and (which != "lists" or ".ivf" in p.name)
                   and (which != "session" or "sessions" in p.parts))
    f = data.draw(st.sampled_from(files))
    size = f.stat().st_size
    if how == "truncate":
        os.truncate(f, data.draw(st.integers(0, size - 1)))
    elif how == "extend":
        with open(f, "ab") as fh:
            fh.write(b"\x5a" * data.draw(st.integers(1, 5000)))
    else:
        at = data.draw(st.integers(0, size - 1))
        with open(f, "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0xFF]))
    _outcomes(mem, text)


def test_the_same_text_with_a_bom_or_other_line_ends_is_one_document(text, tmp_path, capsys):
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"\xef\xbb\xbf" + text.read_bytes().replace(b"\n", b"\r\n"))
    mem = tmp_path / "m"
    assert main(["build", str(mem), "--input", str(text), str(crlf), "--chunk-size", "50", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["skipped"]) == 1 and doc["documents"] == 1  # whichever of the two comes second


def test_a_document_an_earlier_version_named_by_its_bytes_is_not_read_again(text, tmp_path, monkeypatch, capsys):
    import hashlib

    import landmark_memory.jobs.build as build

    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(text.read_bytes().replace(b"\n", b"\r\n"))
    mem = tmp_path / "m"
    with monkeypatch.context() as m:  # as builds named documents before content hashes
        m.setattr(build, "content_sha256", lambda t: hashlib.sha256(t.encode()).hexdigest())
        assert main(["build", str(mem), "--input", str(crlf), "--chunk-size", "50", "--quiet"]) == 0
    capsys.readouterr()
    before = snapshot(mem)
    assert main(["build", str(mem), "--input", str(crlf), "--chunk-size", "50", "--json", "--quiet"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["added"] == 0 and done["skipped"] == [str(crlf)] and done["documents"] == 1
    assert snapshot(mem) == before


@pytest.mark.parametrize("flags", [[], ["--verify"]])
def test_info_on_a_folder_that_does_not_exist_says_there_is_no_memory(tmp_path, capsys, flags):
    assert main(["info", str(tmp_path / "nowhere"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "no memory at" in err and "damaged" not in err and len(err.splitlines()) == 1, err


def test_a_key_file_cut_mid_row_is_named_with_its_true_size(corpus, tmp_path, capsys):
    mem = tmp_path / "m"
    shutil.copytree(corpus, mem)
    f = mem / "keys" / "s0_l1_h0.f32"
    os.truncate(f, f.stat().st_size // 2 + 7)  # (not a whole row)
    size = f.stat().st_size
    assert main(["ask", str(mem), "The captain", "--max-new-tokens", "1", "--raw"]) == 2
    err = capsys.readouterr().err
    assert f"is truncated ({size:,} of" in err and len(err.strip().splitlines()) == 1, err
