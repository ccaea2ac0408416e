"""Saved memories under hostile conditions: links, corruption, growth under readers, a full
disk, signals, damaged files, edited inputs, bad option values, and a kill at every rename
and sync of a build. Each failure is one line on stderr and exit status 2; the memory stays
at its last commit and nothing outside its folder is written."""

import contextlib
import hashlib
import io
import json
import os
import random
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.jobs.build import build as build_corpus
from landmark_memory.jobs.build import encode_document, read_inputs
from landmark_memory.jobs.reading import LocalReader, read_document
from landmark_memory.storage import LmdbStore, stored_nbytes
from landmark_memory.training.data import SAMPLE_DIR

BOOK = SAMPLE_DIR / "train" / "treasure_island_excerpt.txt"
CLI = [sys.executable, "-m", "landmark_memory.app.cli"]


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "book.txt"
    f.write_text(BOOK.read_text()[:5000])
    return f


def build(mem, book, *extra, capsys=None):
    rc = main(["build", str(mem), "--input", str(book), "--chunk-size", "50", "--quiet", *extra])
    if capsys is not None:
        return rc, capsys.readouterr().err
    return rc


def built(tmp_path, book, store="lmdb", index="flat"):
    """A corpus of ``book``; an approximate ``index`` gives it a state file (a flat one has none)."""
    mem = tmp_path / f"mem-{store}"
    assert build(mem, book, "--store", store, "--index", index) == 0
    return mem


def document(mem):
    """The folder of a corpus's one document."""
    (folder,) = (mem / "docs").iterdir()
    return folder


def blocks_folder(mem):
    """The folder whose store/ holds a corpus's blocks: its own (its document packed), or its
    one document's."""
    return mem if (mem / "store").is_dir() else document(mem)


# ---- 1. symbolic links -------------------------------------------------------------------
def test_a_linked_writer_lock_is_refused_and_its_target_untouched(tmp_path, book, capsys, refused):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "writer.lock").symlink_to(victim)
    refused(["build", str(tmp_path / "m"), "--input", str(book), "--quiet"], "symbolic link")
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("name", ["tokens.bin", "keys", "keys/s0_l0_h0.f32", "docs"])
def test_linked_files_of_a_memory_are_never_written_through(tmp_path, book, capsys, name, refused):
    mem = built(tmp_path, book)
    victim = tmp_path / "victim"
    target = mem / name
    if target.is_dir():
        target.rename(victim)
    else:
        victim.write_bytes(target.read_bytes())
        target.unlink()
    target.symlink_to(victim)
    before = {f: f.read_bytes() for f in ([victim] if victim.is_file() else victim.rglob("*")) if f.is_file()}
    more = tmp_path / "more.txt"
    more.write_text(BOOK.read_text()[5000:7000])
    refused(["build", str(mem), "--input", str(more), "--quiet"], "symbolic link")
    assert {f: f.read_bytes() for f in before} == before


def test_a_temporary_file_planted_as_a_hard_link_is_replaced_never_written_through(tmp_path, book, capsys):
    mem = built(tmp_path, book)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.link(victim, mem / f".manifest.json.tmp{os.getpid()}")  # the name this process's next commit writes
    more = tmp_path / "more.txt"
    more.write_text(BOOK.read_text()[5000:7000])
    assert main(["build", str(mem), "--input", str(more), "--quiet"]) == 0
    assert victim.read_text() == "precious" and main(["info", str(mem), "--verify"]) == 0


@pytest.mark.parametrize("name", ["../../state.1.safetensors", "/etc/passwd"])
def test_a_manifest_naming_a_file_outside_the_memory_is_refused(tmp_path, book, capsys, name, refused):
    mem = built(tmp_path, book, index="hnsw")
    doc = json.loads((mem / "manifest.json").read_text())
    doc["files"]["state"]["name"] = name
    (mem / "manifest.json").write_text(json.dumps(doc))
    refused(["info", str(mem)], "no memory file")


@pytest.mark.parametrize("where", ["shards", "page"])
@pytest.mark.parametrize("folder", ["../..", "docs/../../elsewhere", "/tmp"])
def test_a_manifest_naming_a_document_outside_the_memory_is_refused(tmp_path, book, capsys, monkeypatch, folder,
                                                                    where, refused):
    if where == "shards":  # the document keeps its own store: the manifest lists its folder
        monkeypatch.setattr("landmark_memory.format.corpus_files.PACK_BYTES", -1)
    mem = built(tmp_path, book)
    doc = json.loads((mem / "manifest.json").read_text())
    if where == "shards":
        doc["shards"][0][2] = folder
    else:  # a page's record, its CRC-32 made to match
        page = mem / "documents" / "000000.jsonl"
        record = json.loads(page.read_text())
        data = (json.dumps({**record, "document": folder}) + "\n").encode()
        page.write_bytes(data)
        doc["pages"][0][1:3] = [len(data), zlib.crc32(data)]
    (mem / "manifest.json").write_text(json.dumps(doc))
    refused(["ask", str(mem), "The", "--quiet"], "no document")


# ---- 2. corruption -----------------------------------------------------------------------
def corrupt_blocks(mem, store, blocks):
    """Overwrite 64 bytes inside layer 1's record of each of ``blocks`` (the default int8 store:
    LMDB keeps a block's layers in one value)."""
    rng = np.random.default_rng(0)
    mem = blocks_folder(mem)
    m = json.loads((mem / "manifest.json").read_text())
    shape = m["model"]["shape"]
    record = stored_nbytes((2, shape["n_kv_head"], shape["block_size"] + 1, shape["head_dim"]),
                           m["options"]["store_dtype"]) + 4  # + CRC-32
    if store == "mmap":
        f = mem / "store" / "mmap" / "s0_l1.blocks"
        data = bytearray(f.read_bytes())
        for b in blocks:
            data[b * record + 100:b * record + 164] = rng.bytes(64)
        f.write_bytes(bytes(data))
    else:
        assert m["options"]["store_dtype"] == "int8"
        env = lmdb.open(str(mem / "store" / "lmdb"))
        with env.begin(write=True) as txn:
            for b in blocks:
                key = struct.pack(">II", 0, b)
                value = bytearray(txn.get(key))
                value[record + 100:record + 164] = rng.bytes(64)
                txn.put(key, bytes(value))
        env.close()


@pytest.mark.parametrize("store", ["lmdb", "mmap"])
def test_corrupted_blocks_are_detected_on_read_and_named_by_verify(tmp_path, book, capsys, store):
    mem = built(tmp_path, book, store)
    capsys.readouterr()
    assert main(["info", str(mem), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    n_blocks = json.loads((mem / "manifest.json").read_text())["blocks"]
    bad = [0, n_blocks // 2, n_blocks - 2]  # the last block is read on open: these only when retrieved
    corrupt_blocks(mem, store, bad)
    rc = main(["info", str(mem), "--verify", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 2 and not doc["ok"]
    assert sorted(d["block"] for d in doc["damaged_blocks"]) == bad
    assert all(d["layer"] == 1 and d["stream"] == 0 for d in doc["damaged_blocks"])
    opened = LandmarkMemory.open(mem, LandmarkGPT.from_pretrained(), readonly=True, top_k=n_blocks)
    with pytest.raises(ValueError, match="corrupted"):  # a query that reads every block meets the damage
        opened.forward(torch.tensor([[5] * 60]))
    opened.close()


def test_a_flipped_row_file_is_refused_by_the_reads_that_touch_it(tmp_path, book, capsys, refused):
    mem = built(tmp_path, book)
    f = mem / "tokens.bin"
    data = bytearray(f.read_bytes())
    for row in range(0, len(data), 50 * 4):
        data[row + 3] ^= 0x40  # the first token id of every block becomes huge
    f.write_bytes(bytes(data))
    # a reader maps the rows: the passages it reads are checked (the CRC-32 is verify's and a writer's)
    refused(["ask", str(mem), "The", "--max-new-tokens", "2", "--quiet"], "vocabulary", "info --verify")
    refused(["info", str(mem)], "tokens.bin")
    refused(["build", str(mem), "--input", str(book), "--quiet"], "tokens.bin")
    assert main(["info", str(mem), "--verify"]) == 2 and "tokens.bin" in capsys.readouterr().out


# ---- 3. readers follow a growing LMDB map --------------------------------------------------
def test_a_reader_follows_the_map_a_writer_grew(tmp_path):
    shape = (2, 1, 4, 8)
    path = tmp_path / "lmdb"
    writer = textwrap.dedent(f"""
        import torch, sys
        from landmark_memory.storage import LmdbStore
        s = LmdbStore({shape}, {str(path)!r}, store_dtype="float32", map_size=1 << 16, checksums=True)
        n = int(sys.argv[1])
        s.put({{(0, 0, b): torch.full({shape}, float(b)) for b in range(n)}})
        s.close()
    """)
    subprocess.run([sys.executable, "-c", writer, "4"], check=True)
    reader = LmdbStore(shape, path, store_dtype="float32", map_size=1 << 16, readonly=True, checksums=True)
    assert reader.get([(0, 0, 3)])[0][0, 0, 0, 0] == 3
    subprocess.run([sys.executable, "-c", writer, "2000"], check=True)  # grows the map several times
    assert reader.get([(0, 0, 1999)])[0][0, 0, 0, 0] == 1999
    assert reader.get([(0, 0, 3)])[0][0, 0, 0, 0] == 3
    reader.close()


# ---- 4. a full disk ----------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(d)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small filesystem here")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("store", ["lmdb", "mmap"])
def test_a_full_disk_is_one_line_and_the_memory_stays_at_its_last_commit(small_disk, book, capsys, store, refused):
    mem = small_disk / "mem"
    err = refused(["build", str(mem), "--input", str(book), "--chunk-size", "50", "--store", store,
                           "--commit-every", "0", "--quiet"], "last commit")
    assert "no space left" in err or "disk may be full" in err, err
    if (mem / "manifest.json").exists() and any((mem / "docs").glob("*")):  # the document, at its last commit
        opened = LandmarkMemory.open(document(mem), LandmarkGPT.from_pretrained(), readonly=True)
        ids = encode_document(load_tokenizer(), book.read_text(), 50)
        np.testing.assert_array_equal(opened.tokens(), ids[:opened.n_blocks * 50])
        opened.close()


@pytest.mark.parametrize("room", [0, 4096])
def test_a_chat_that_meets_a_full_disk_leaves_no_session_and_the_memory_sound(small_disk, book, capsys,
                                                                               monkeypatch, room, refused):
    mem = small_disk / "mem"
    short = small_disk.parent / "short.txt"
    short.write_text(book.read_text()[:1500])
    assert main(["build", str(mem), "--input", str(short), "--chunk-size", "50", "--quiet"]) == 0
    with open(small_disk / "filler", "wb") as f:  # the disk full but for ``room`` bytes
        os.posix_fallocate(f.fileno(), 0, os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - room)
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("Who was the captain?\n"))
    refused(["chat", str(mem), "--session", "t", "--raw", "--max-new-tokens", "2"], "no space left")
    assert main(["info", str(mem), "--verify"]) == 0
    capsys.readouterr()
    assert main(["sessions", str(mem), "--json"]) == 0 and json.loads(capsys.readouterr().out) == []


def test_a_session_a_chat_stopped_before_its_first_commit_is_no_damage_and_chats_again(tmp_path, book, capsys,
                                                                                      monkeypatch):
    mem = built(tmp_path, book)
    (mem / "sessions" / "t").mkdir(parents=True)
    (mem / "sessions" / "t" / "writer.lock").write_text("process 1\n")  # (what a kill mid-creation leaves)
    assert main(["info", str(mem), "--verify"]) == 0
    capsys.readouterr()
    assert main(["sessions", str(mem), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["name"] == "t" and "never committed" in listed["problem"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Who was the captain?\n"))
    assert main(["chat", str(mem), "--session", "t", "--raw", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["sessions", str(mem), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["turns"] == 2


# ---- 5. a stop before the first commit ------------------------------------------------------
def test_a_folder_left_by_a_kill_before_the_first_commit_builds_again(tmp_path, book, capsys, refused):
    mem = tmp_path / "m"
    mem.mkdir()
    (mem / "writer.lock").write_text("process 1\n")
    (mem / f".manifest.json.tmp{os.getpid() + 1}").write_text("{")
    refused(["info", str(mem)], "no memory yet", "build it again")
    assert build(mem, book) == 0
    assert not [f for f in mem.iterdir() if ".tmp" in f.name]


def test_a_memory_with_no_commit_of_tokens_is_reported_not_damaged(tmp_path, capsys):
    LandmarkMemory(LandmarkGPT.from_pretrained(), store="lmdb", path=tmp_path / "m").close()
    assert main(["info", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 0


# ---- 6. signals -------------------------------------------------------------------------------
def start_build(mem, book, *extra):
    return subprocess.Popen(CLI + ["build", str(mem), "--input", str(book), "--chunk-size", "50", "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
def test_sigterm_commits_what_is_done_like_ctrl_c(tmp_path, capsys):
    long = tmp_path / "long.txt"
    long.write_text(BOOK.read_text()[:40000])
    mem = tmp_path / "m"
    proc = start_build(mem, long, "--commit-every", "3600")
    while not (mem / "manifest.json").exists() and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    main(["info", str(mem), "--json"])
    assert json.loads(capsys.readouterr().out)["inputs"][0]["ingested"] > 0  # hourly commits: the signal's


@pytest.mark.slow
def test_ctrl_c_while_starting_is_one_line_not_a_traceback(tmp_path, book):
    proc = subprocess.Popen([sys.executable, "-c", "from landmark_memory.app.entry import main; raise "
                                                   "SystemExit(main())",
                             "build", str(tmp_path / "m"), "--input", str(book)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.3)  # still importing
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err


# ---- 7. damaged contents get exit 2, never a traceback -------------------------------------------
def rewrite_state(mem, change):
    doc = json.loads((mem / "manifest.json").read_text())
    f = mem / doc["files"]["state"]["name"]
    tensors = load(f.read_bytes())
    change(tensors)
    data = save(tensors)
    f.write_bytes(data)
    doc["files"]["state"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (mem / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("damage,words", [
    ("index_missing", ["index.0.0.0"]),
    ("index_garbled", ["index"]),
    ("pending_misshaped", ["pending"]),
    ("manifest_without_model", ["lacks or garbles"]),
    ("manifest_without_files", ["lacks or garbles"]),
    ("store_missing", ["store"]),
    ("store_garbled", ["store"]),
])
def test_damaged_contents_are_exit_2_everywhere(tmp_path, capsys, damage, words, refused):
    text = tmp_path / "t.txt"
    text.write_text(BOOK.read_text()[:3030])
    mem = built(tmp_path, text, index="hnsw" if damage.startswith("index") else "flat")
    if damage == "pending_misshaped":  # a memory read in one context, stopped mid-chunk
        mem = tmp_path / "m"
        with LandmarkMemory(LandmarkGPT.from_pretrained(), store="lmdb", path=mem, chunk_size=50) as m:
            m.forward(torch.from_numpy(encode_document(load_tokenizer(), text.read_text(), 50)[None, :120]).long())
    if damage == "index_missing":
        rewrite_state(mem, lambda t: t.pop("index.0.0.0"))
    elif damage == "index_garbled":
        rewrite_state(mem, lambda t: t.update({"index.0.0.0": torch.zeros(40, dtype=torch.uint8)}))
    elif damage == "pending_misshaped":
        rewrite_state(mem, lambda t: t.update({"pending.0.k": t["pending.0.k"][:, :, :1].contiguous()}))
    elif damage.startswith("manifest"):
        doc = json.loads((mem / "manifest.json").read_text())
        del doc["model" if damage == "manifest_without_model" else "files"]
        (mem / "manifest.json").write_text(json.dumps(doc))
    else:
        data = blocks_folder(mem) / "store" / "lmdb" / "data.mdb"
        if damage == "store_missing":
            data.unlink()
        else:
            data.write_bytes(random.Random(0).randbytes(data.stat().st_size))
    refused(["ask", str(mem), "The", "--max-new-tokens", "2", "--quiet"], *words)
    rc = main(["info", str(mem), "--verify"])
    out = capsys.readouterr()
    assert rc == 2 and "Traceback" not in out.err


# ---- 8. an input edited after its build was stopped -------------------------------------------
def test_an_edited_unfinished_input_says_what_to_do_and_can_be_left(tmp_path, capsys, refused):
    text = tmp_path / "x.txt"
    text.write_text(BOOK.read_text()[:4000])
    model, tok = LandmarkGPT.from_pretrained(), load_tokenizer()

    class StopAfterOneChunk(LocalReader):
        def run(self, jobs, stop, bar):
            yield from (read_document(job, self.model, stop=lambda: True) for job in jobs)

    with LandmarkMemory(model, store="lmdb", path=tmp_path / "m", chunk_size=50, documents=True) as mem:
        build_corpus(mem, read_inputs([text]), tok, reader=StopAfterOneChunk(model), progress=False)
    with open(text, "a") as f:  # a build stopped after one chunk, then its file edited
        f.write("\nOne more line.\n")
    refused(["build", str(tmp_path / "m"), "--input", str(text), "--quiet"], "has changed", "--leave-unfinished")
    assert main(["build", str(tmp_path / "m"), "--input", str(text), "--leave-unfinished", "--quiet", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["left"] == [str(text.resolve())] and doc["added"] == len(encode_document(tok, text.read_text(), 50))
    main(["info", str(tmp_path / "m"), "--json"])
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert [(e["status"], e["ingested"]) for e in inputs] == [("left", 50), ("done", doc["added"])]


# ---- 9. permissions and option values -----------------------------------------------------------
def test_state_files_are_readable_by_whoever_may_read_the_memory(tmp_path, book):
    mem = built(tmp_path, book)
    umask = os.umask(0)
    os.umask(umask)
    for f in [*mem.glob("state.*.safetensors"), mem / "manifest.json", mem / "tokens.bin"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


@pytest.mark.parametrize("argv", [
    ["build", "M", "--input", "B", "--top-k", "0"],
    ["ask", "M", "p", "--top-k", "1025"],
    ["build", "M", "--input", "B", "--train-size", "0"],
    ["build", "M", "--input", "B", "--chunk-size", "0"],
    ["build", "M", "--input", "B", "--block-size", "0"],
    ["build", "M", "--input", "B", "--commit-every", "-1"],
    ["ask", "M", "p", "--max-new-tokens", "-1"],
    ["ask", "M", "p", "--temperature", "-0.5"],
    ["ask", "M", "p", "--passages", "0"],
    ["eval", "--input", "B", "--eval-length", "0"],
    ["passkey", "--trials", "0"],
])
def test_invalid_option_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "is not a" in capsys.readouterr().err


# ---- fault injection: a kill at each rename and sync of a build and its commits ---------------
KILLER = textwrap.dedent("""
    import os, signal, sys
    at, calls = int(sys.argv[1]), [0]

    def counted(orig):
        def call(*a, **k):
            calls[0] += 1
            if calls[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(*a, **k)
        return call

    os.replace, os.fsync = counted(os.replace), counted(os.fsync)
    from landmark_memory.app.cli import main
    rc = main(sys.argv[2:])
    print("CALLS", calls[0], file=sys.stderr)
    sys.exit(rc)
""")


@pytest.mark.slow
def test_a_kill_at_any_rename_or_sync_leaves_a_memory_that_finishes_exactly(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(BOOK.read_text()[:2500])
    ids = encode_document(load_tokenizer(), text.read_text(), 50)

    def run(at, mem):
        argv = ["build", str(mem), "--input", str(text), "--chunk-size", "50", "--commit-every", "0", "--quiet",
                "--train-size", "4"]  # the index trains after 4 blocks: its files are written by commits too
        return subprocess.run([sys.executable, "-c", KILLER, str(at), *argv], capture_output=True, text=True)

    clean = run(10 ** 9, tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    calls = int(clean.stderr.split("CALLS")[-1])
    points = sorted({*range(1, 9), *random.Random(0).sample(range(9, calls + 1), 4)})
    for at in points:
        mem = tmp_path / f"killed-{at}"
        assert run(at, mem).returncode == -signal.SIGKILL
        assert build(mem, text) == 0, f"kill at call {at}"
        capsys.readouterr()
        opened = LandmarkMemory.open(mem, LandmarkGPT.from_pretrained(), readonly=True)
        assert opened.n_tokens == len(ids), f"kill at call {at}"
        np.testing.assert_array_equal(opened.tokens(), ids)
        opened.close()
        assert main(["info", str(mem), "--verify"]) == 0, capsys.readouterr().out


# ---- LMDB failing at its commit (a full tmpfs gives EIO there, which the full-disk test may not reach) ----
def test_an_lmdb_commit_that_fails_is_one_line_and_the_build_finishes_after(tmp_path, book, capsys,
                                                                            monkeypatch, refused):
    original, writes = LmdbStore._put, [0]

    class FailingCommit:  # the environment, its third write transaction failing as it commits
        def __init__(self, env):
            self.env = env

        def __getattr__(self, name):
            return getattr(self.env, name)

        @contextlib.contextmanager
        def begin(self, write=False, **kw):
            with self.env.begin(write=write, **kw) as txn:
                yield txn
                writes[0] += write
                if write and writes[0] == 3:
                    txn.abort()
                    raise lmdb.Error("mdb_txn_commit: Input/output error")

    def put(self, items):
        env, self.env = self.env, FailingCommit(self.env)
        try:
            return original(self, items)
        finally:
            self.env = env

    monkeypatch.setattr(LmdbStore, "_put", put)
    mem = tmp_path / "m"
    refused(["build", str(mem), "--input", str(book), "--chunk-size", "50", "--commit-every", "0", "--quiet"],
            "Input/output error", "disk may be full", "last commit")
    monkeypatch.setattr(LmdbStore, "_put", original)
    assert build(mem, book) == 0
    final = LandmarkMemory.open(mem, LandmarkGPT.from_pretrained(), readonly=True)
    np.testing.assert_array_equal(final.tokens(), encode_document(load_tokenizer(), book.read_text(), 50))
    final.close()


@pytest.mark.parametrize("kind", ["landmark-gpt", "hugging-face"])
@pytest.mark.parametrize("damage", ["cut weights", "config field of the wrong type"])
def test_a_damaged_model_folder_is_one_line_naming_its_file(tmp_path, capsys, kind, damage, refused):
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from landmark_memory.models.model import BUNDLED_MODEL

    folder = tmp_path / kind
    if kind == "landmark-gpt":
        shutil.copytree(BUNDLED_MODEL, folder)
    else:
        LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=300)).save_pretrained(folder)
    if damage == "cut weights":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
        bad = "model.safetensors"
    else:
        doc = json.loads((folder / "config.json").read_text())
        (doc["config"] if kind == "landmark-gpt" else doc)["n_layer" if kind == "landmark-gpt" else
                                                            "num_hidden_layers"] = "two"
        (folder / "config.json").write_text(json.dumps(doc))
        bad = "config.json"
    capsys.readouterr()  # (what saving the model printed)
    refused(["heads", "--model", str(folder), "--quiet"], str(folder / bad), "restore the model's files")


def test_a_file_name_that_is_not_utf8_is_refused_before_reading_and_blocks_no_later_build(tmp_path, book,
                                                                                          capsys, refused):
    docs = tmp_path / "docs"
    docs.mkdir()
    name = docs / os.fsdecode(b"caf\xe9.txt")  # Latin-1 bytes: not UTF-8
    name.write_text(book.read_text()[:500])
    mem = tmp_path / "m"
    refused(["build", str(mem), "--input", str(docs), "--quiet"], "caf\\udce9.txt", "not UTF-8", "rename it")
    assert not mem.exists() or not any(mem.rglob("manifest*"))  # nothing read, nothing committed
    good = tmp_path / "good.txt"
    good.write_text(book.read_text()[:500])
    assert main(["build", str(mem), "--input", str(good), "--quiet"]) == 0
    assert main(["build", str(mem), "--input", str(good), "--quiet"]) == 0  # and again: nothing stands in the way


def test_a_document_an_earlier_build_left_that_cannot_be_merged_blocks_no_later_build(tmp_path, book, capsys):
    from landmark_memory.format.manifest import document_folder
    from landmark_memory.jobs.reading import DocumentJob

    mem = built(tmp_path, book)
    inp = read_inputs([book])[0]  # read apart under a name no UTF-8 file holds (as a build before the refusal did)
    text = inp.text[:800] + " More."
    sha = hashlib.sha256(text.encode()).hexdigest()
    with LandmarkMemory.open(mem, LandmarkGPT.from_pretrained(), readonly=True) as m:
        options = m.options
    read_document(DocumentJob(mem / document_folder(sha), str(tmp_path / "caf\udce9.txt"), sha,
                              encode_document(load_tokenizer(), text, 50), options, 60.0),
                  LandmarkGPT.from_pretrained())
    good = tmp_path / "good.txt"
    good.write_text(book.read_text()[1000:1600])
    for _ in range(2):  # the document set aside, the build goes on, and so does the next
        assert main(["build", str(mem), "--input", str(good), "--quiet"]) == 0
        out = capsys.readouterr().out
        assert "set aside, not merged" in out and "not UTF-8" in out and document_folder(sha) in out, out
    assert main(["info", str(mem), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["inputs"]
    assert [Path(d["path"]).name for d in listed if d["status"] == "done"] == [book.name, good.name]


@pytest.mark.parametrize("name, replaced", [
    ("tokens.bin", False), ("keys/s0_l0_h0.f32", False), ("documents/000000.jsonl", False),
    ("documents/digests.bin", False), ("store/lmdb/data.mdb", False), ("store/lmdb/lock.mdb", False),
    ("manifest.json", True), ("state.1.safetensors", True)])  # (the last two are replaced whole at a commit)
@pytest.mark.slow
def test_a_memory_file_hard_linked_outside_is_refused_or_replaced_never_written_through(tmp_path, book, capsys,
                                                                                         name, replaced, refused):
    mem = built(tmp_path, book)
    outside, target = tmp_path / "outside", mem / name
    if not target.exists():
        pytest.skip(f"this memory has no {name}")
    outside.write_bytes(target.read_bytes())
    target.unlink()
    os.link(outside, target)  # `ln -f outside memory/NAME`: one file, two names
    before = outside.read_bytes()
    more = tmp_path / "more.txt"
    more.write_text(BOOK.read_text()[5000:7000])
    if replaced:
        assert main(["build", str(mem), "--input", str(more), "--quiet"]) == 0
    else:
        refused(["build", str(mem), "--input", str(more), "--quiet"], str(target), "hard links")
    assert outside.read_bytes() == before


def test_a_manifest_that_loses_its_streams_but_keeps_its_tokens_is_one_line(tmp_path, book, capsys):
    mem = built(tmp_path, book)
    doc = json.loads((mem / "manifest.json").read_text())
    doc["streams"] = None  # (found by the manifest fuzz: `info --verify` counted blocks in range(None))
    (mem / "manifest.json").write_text(json.dumps(doc))
    for argv in (["info", str(mem)], ["info", str(mem), "--verify"], ["build", str(mem), "--input", str(book)]):
        assert main([*argv, "--quiet"] if argv[0] == "build" else argv) == 2
        out, err = capsys.readouterr()
        assert "streams = None" in out + err and "Traceback" not in err
