"""Corpora: documents read apart, merged in the inputs' order, one index and one sharded store
over all of them (in this process; tests/test_ray_build.py runs the same on Ray)."""

import json

import lmdb
import numpy as np
import pytest
import torch
from helpers import files_of

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.format import MemoryFileError
from landmark_memory.jobs.build import build, encode_document, read_inputs
from landmark_memory.jobs.reading import LocalReader, read_document
from landmark_memory.storage import CorruptBlockError, open_store
from landmark_memory.storage.sharded import Shard, ShardedStore
from landmark_memory.uses.inspect import verify

SHAPE = (2, 3, 6, 8)  # (k/v, H, block_size + 1, D)


@pytest.fixture(scope="module")
def model():
    return LandmarkGPT.from_pretrained()


@pytest.fixture
def sharded(monkeypatch):
    """Every document keeps its own store (as a large one does), none is packed into the corpus's."""
    monkeypatch.setattr("landmark_memory.format.corpus_files.PACK_BYTES", -1)


@pytest.fixture(params=["packed", "sharded"])
def packing(request, monkeypatch):
    """Each way a corpus keeps a document's blocks: "packed" into its own store (a small
    document's), "sharded" in the document's (a large one's)."""
    if request.param == "sharded":
        monkeypatch.setattr("landmark_memory.format.corpus_files.PACK_BYTES", -1)
    return request.param


def corpus(model, path, files, reader=None, **build_options):
    """Build ``files`` into the corpus at ``path`` (created, or continued)."""
    mem = (LandmarkMemory.open(path, model) if (path / "manifest.json").exists() else
           LandmarkMemory(model, path=path, store="lmdb", chunk_size=100, documents=True))
    with mem:
        summary = build(mem, read_inputs(files), load_tokenizer(), reader=reader, progress=False, **build_options)
    return summary




class Reversed(LocalReader):
    """Every document read, then the results handed back last first."""

    def run(self, jobs, stop, bar):
        yield from reversed(list(super().run(jobs, stop, bar)))


def test_documents_merge_in_the_inputs_order_whatever_order_they_finish(model, documents, tmp_path):
    files = sorted(documents.glob("*.txt"))
    corpus(model, tmp_path / "in-order", files)
    corpus(model, tmp_path / "reversed", files, reader=Reversed(model))
    assert files_of(tmp_path / "in-order") == files_of(tmp_path / "reversed")


def test_a_document_sees_only_its_own_blocks(model, documents, tmp_path):
    files = sorted(documents.glob("*.txt"))
    corpus(model, tmp_path / "all", files)
    corpus(model, tmp_path / "last", files[-1:])
    everything, alone = files_of(tmp_path / "all"), files_of(tmp_path / "last")
    for name in alone:  # the last document's rows (token ids, landmark keys) end the corpus's, unchanged
        assert name in ("blocks", "index") or everything[name].endswith(alone[name])
    tok = load_tokenizer()
    ids = np.concatenate([encode_document(tok, f.read_text(), 50) for f in files])
    np.testing.assert_array_equal(np.frombuffer(everything["tokens.bin"], np.int32), ids)  # every token once


def test_one_index_per_layer_and_head_holds_every_documents_landmarks(model, documents, tmp_path):
    files = sorted(documents.glob("*.txt"))
    corpus(model, tmp_path / "m", files)
    for i, f in enumerate(files):  # each document read alone, as a corpus of its own
        corpus(model, tmp_path / f"alone{i}", [f])
    mem = LandmarkMemory.open(tmp_path / "m", model, readonly=True)
    docs = [tmp_path / f"alone{i}" for i in range(len(files))]
    for layer in range(mem.shape.n_layer):
        keys = mem.keys(layer, slice(None))  # (H_kv, n_blocks, D)
        for h in range(mem.shape.n_kv_head):
            ix = mem.inspection.indexes()[layer * mem.shape.n_kv_head + h]
            assert ix.ntotal == mem.n_blocks == len(mem.tokens()) // 50
            np.testing.assert_array_equal(ix.rows.array(), keys[h].float().numpy())  # the flat index is the keys
            own = [np.fromfile(d / "keys" / f"s0_l{layer}_h{h}.f32", np.float32).reshape(-1, 32) for d in docs]
            np.testing.assert_array_equal(ix.rows.array(), np.concatenate(own))  # every document's, in order
    assert [e.start for e in mem.inputs] == [0, mem.inputs[0].ingested, mem.inputs[0].ingested + mem.inputs[1].ingested]
    mem.close()


def test_a_reader_of_the_corpus_retrieves_blocks_of_every_document(model, documents, tmp_path):
    corpus(model, tmp_path / "m", sorted(documents.glob("*.txt")))
    mem = LandmarkMemory.open(tmp_path / "m", model, readonly=True, top_k=64)
    out = mem.forward(torch.tensor([load_tokenizer().encode("Alice and the captain and Holmes").ids]))
    used = torch.unique(torch.cat([r.flatten() for r in out.retrieved]))
    bounds = [e.start // 50 for e in mem.inputs]
    assert all(((used >= lo) & (used < lo + e.ingested // 50)).any() for lo, e in zip(bounds, mem.inputs))
    mem.close()


def test_a_corpus_takes_no_text_of_its_own(model, documents, tmp_path):
    corpus(model, tmp_path / "m", sorted(documents.glob("*.txt"))[:1])
    mem = LandmarkMemory.open(tmp_path / "m", model)
    with pytest.raises(PermissionError, match="read-only"):
        mem.forward(torch.zeros((1, 100), dtype=torch.long))
    mem.close(commit=False)


class StopAfterOneChunk(LocalReader):
    def run(self, jobs, stop, bar):
        yield from (read_document(job, self.model, stop=lambda: True) for job in jobs)


def test_info_lists_each_document_with_its_status_and_a_rerun_reads_only_what_is_left(model, documents, tmp_path,
                                                                                      capsys):
    files = sorted(documents.glob("*.txt"))
    corpus(model, tmp_path / "m", files[:1])
    corpus(model, tmp_path / "m", files, reader=StopAfterOneChunk(model), in_memory_chunks=0)
    assert main(["info", str(tmp_path / "m"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(e["status"], e["ingested"]) for e in info["inputs"]] == [("done", info["tokens"]), ("partial", 100),
                                                                       ("partial", 100)]
    assert info["tokens_read"] == info["tokens"] + 200  # what is on disk: the documents under way count too
    assert info["bytes_per_token"] == round(info["disk_bytes"] / info["tokens_read"], 1)
    partial_only = tmp_path / "partial-only"
    corpus(model, partial_only, files[1:2], reader=StopAfterOneChunk(model), in_memory_chunks=0)
    assert main(["info", str(partial_only)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("disk"))
    per_token = int(line.split("(")[1].split()[0].replace(",", ""))  # nothing merged yet: per token read
    assert per_token < 2 * info["bytes_per_token"], line
    again = corpus(model, tmp_path / "m", files)
    tok = load_tokenizer()
    assert again.skipped == [str(files[0])] and again.merged == 2
    assert again.added == sum(len(encode_document(tok, f.read_text(), 50)) - 100 for f in files[1:])
    corpus(model, tmp_path / "in-one-go", files)
    assert files_of(tmp_path / "m") == files_of(tmp_path / "in-one-go")
    assert main(["info", str(tmp_path / "m"), "--verify"]) == 0


def test_verify_names_the_damaged_document_or_packed_block(model, documents, tmp_path, capsys, packing):
    corpus(model, tmp_path / "m", sorted(documents.glob("*.txt")))
    docs = sorted((tmp_path / "m" / "docs").iterdir()) if packing == "sharded" else []
    store = docs[1] / "store" if docs else tmp_path / "m" / "store"  # (the corpus keeps the rows)
    env = lmdb.open(str(store / "lmdb"))  # a stored block flipped
    with env.begin(write=True) as txn:
        key, value = list(txn.cursor())[5]
        txn.put(key, bytes([value[0] ^ 0x40]) + value[1:])
    env.close()
    assert main(["info", str(tmp_path / "m"), "--verify", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    named = f"document docs/{docs[1].name}" if docs else "block"
    assert any(p.startswith(named) and "block" in p for p in report["problems"]), report


def test_a_memory_read_in_one_context_still_opens_but_takes_no_documents(model, documents, tmp_path, capsys):
    with LandmarkMemory(model, store="lmdb", path=tmp_path / "old", chunk_size=100) as mem:
        mem.forward(torch.from_numpy(encode_document(load_tokenizer(), (documents / "a.txt").read_text(),
                                                     50)[None]).long())
    assert main(["build", str(tmp_path / "old"), "--input", str(documents / "b.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "one context" in err and "new memory" in err
    assert main(["ask", str(tmp_path / "old"), "The", "--max-new-tokens", "2", "--quiet"]) == 0


# ---- the sharded store ------------------------------------------------------------------------
def test_a_sharded_store_reads_each_block_from_its_shard(tmp_path):
    rng = torch.Generator().manual_seed(0)
    sizes, shards, blocks = [3, 1, 4, 2, 5], [], {}
    start = 0
    for i, n in enumerate(sizes):
        store = open_store("lmdb", SHAPE, tmp_path / f"s{i}", "float32", checksums=True)
        own = {(0, layer, b): torch.randn(SHAPE, generator=rng) for layer in range(2) for b in range(n)}
        store.put(own)
        store.close()
        blocks.update({(0, layer, start + b): t for (_, layer, b), t in own.items()})
        shards.append(Shard(start, n, f"s{i}"))
        start += n
    opened = []

    def open_shard(name):
        opened.append(name)
        return open_store("lmdb", SHAPE, tmp_path / name, "float32", readonly=True, checksums=True)

    union = ShardedStore(SHAPE, shards[:2], "float32", True, open_shard, max_open=2)
    assert opened == []  # nothing opens before it is read
    for s in shards[2:]:
        union.add(s)
    keys = list(blocks)
    order = torch.randperm(len(keys), generator=rng).tolist()
    for k, t in zip([keys[i] for i in order], union.get([keys[i] for i in order])):
        assert torch.equal(t, blocks[k])
    assert len(union._open) == 2 and set(opened) == {s.name for s in shards}  # the least recent closed
    assert union.opens == len(opened) and union.open_seconds > 0
    with pytest.raises(KeyError):
        union.get([(0, 0, start)])
    union.close()


def test_a_corrupted_block_of_a_shard_is_named_as_the_union_numbers_it(tmp_path):
    for i in range(2):
        store = open_store("mmap", SHAPE, tmp_path / f"s{i}", "float32", checksums=True)
        store.put({(0, 0, b): torch.randn(SHAPE) for b in range(3)})
        store.close()
    f = tmp_path / "s1" / "mmap" / "s0_l0.blocks"
    data = bytearray(f.read_bytes())
    data[SHAPE[0] * 200 + 9] ^= 1  # block 0 of the second shard: block 3 of the union
    f.write_bytes(bytes(data))
    union = ShardedStore(SHAPE, [Shard(0, 3, "s0"), Shard(3, 3, "s1")], "float32", True,
                         lambda name: open_store("mmap", SHAPE, tmp_path / name, "float32", readonly=True,
                                                 checksums=True))
    with pytest.raises(CorruptBlockError, match=r"block 3 of layer 0 \(stream 0\) \(block 0 of s1\)") as e:
        union.get([(0, 0, 3)])
    assert e.value.key == (0, 0, 3)
    union.close()


# ---- one copy of every row ---------------------------------------------------------------------
def row_bytes(path, everywhere, states=True):
    """Bytes of token rows, landmark keys and (``states``) index state: the corpus's own, or
    ``everywhere`` (its documents' too)."""
    files = path.rglob("*") if everywhere else [*path.iterdir(), *(path / "keys").iterdir()]
    return sum(f.stat().st_size for f in files if f.is_file() and (
        f.name in ("tokens.bin", "landmarks.bin") or f.suffix in (".f32", ".lists", ".centroids")
        or (states and f.name.startswith("state."))))


@pytest.mark.parametrize("index", ["flat", "hnsw", "ivf-rows"])
def test_a_corpus_keeps_one_copy_of_its_documents_rows_and_blocks(model, documents, tmp_path, index, packing):
    path, train = tmp_path / "m", {"index_options": {"train_size": 4}} if index == "ivf-rows" else {}
    with LandmarkMemory(model, path=path, store="lmdb", chunk_size=100, documents=True, index=index, **train) as mem:
        build(mem, read_inputs(sorted(documents.glob("*.txt"))), load_tokenizer(), progress=False)
    assert row_bytes(path, everywhere=True) == row_bytes(path, everywhere=False) > 0
    assert any((path / "keys").glob("*.ivf2.lists")) == (index == "ivf-rows")  # trained at 4 and 16 blocks
    docs = sorted((path / "docs").iterdir())
    assert len(docs) == (3 if packing == "sharded" else 0) and (path / "store").is_dir() == (packing == "packed")
    for doc in docs:  # each keeps its manifest, marked, and its store
        assert json.loads((doc / "manifest.json").read_text())["rows_merged"] is True
        assert sorted(p.name for p in doc.iterdir()) == ["manifest.json", "store", "writer.lock"]
    assert verify(path).ok
    assert main(["ask", str(path), "The captain", "--max-new-tokens", "2", "--quiet"]) == 0


def test_a_packed_corpus_holds_and_answers_bit_for_bit_as_one_whose_documents_keep_their_stores(
        model, documents, tmp_path, monkeypatch, capsys):
    files = sorted(documents.glob("*.txt"))
    corpus(model, tmp_path / "packed", files)
    with monkeypatch.context() as m:
        m.setattr("landmark_memory.format.corpus_files.PACK_BYTES", -1)
        corpus(model, tmp_path / "sharded", files)
    assert not (tmp_path / "packed" / "docs").exists() or not any((tmp_path / "packed" / "docs").iterdir())
    assert files_of(tmp_path / "packed") == files_of(tmp_path / "sharded")
    answers = []
    for name in ("packed", "sharded"):
        assert main(["ask", str(tmp_path / name), "The captain", "--max-new-tokens", "6", "--json", "--quiet"]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0] == answers[1] and answers[0]["retrieved"]


class Recording(LocalReader):
    """Documents read in this process, each job kept (``stop_after``: a stop after that many chunks)."""

    def __init__(self, model, stop_after=None):
        super().__init__(model)
        self.jobs, self.stop_after = [], stop_after

    def run(self, jobs, stop, bar):
        for job in jobs:
            self.jobs.append(job)
            steps = iter(range(10 ** 9))
            yield read_document(job, self.model, stop=lambda: self.stop_after is not None and
                                next(steps) >= self.stop_after - 1)


def test_small_documents_are_read_in_ram_into_the_corpus_a_folder_each_would_give(model, documents, tmp_path):
    files = sorted(documents.glob("*.txt"))
    in_ram, in_folders = Recording(model), Recording(model)
    corpus(model, tmp_path / "ram", files, reader=in_ram, in_memory_chunks=100)
    corpus(model, tmp_path / "folders", files, reader=in_folders, in_memory_chunks=0)
    assert [j.in_memory for j in in_ram.jobs] == [True] * 3 and not any(j.in_memory for j in in_folders.jobs)
    assert files_of(tmp_path / "ram") == files_of(tmp_path / "folders")  # tokens, keys, indexes, every stored block
    ram, folders = ({k: v for k, v in json.loads((tmp_path / name / "manifest.json").read_text()).items()
                     if k != "updated"} for name in ("ram", "folders"))
    assert ram == folders  # the same records and CRC-32s (the commit's time aside)
    assert verify(tmp_path / "ram").ok
    mixed = Recording(model)
    corpus(model, tmp_path / "mixed", files, reader=mixed, in_memory_chunks=4)  # the shortest alone in RAM
    assert [j.in_memory for j in mixed.jobs] == [False, False, True]
    assert files_of(tmp_path / "mixed") == files_of(tmp_path / "ram")


def test_documents_read_in_ram_of_one_length_go_in_batches_in_their_order_within_a_window(monkeypatch):
    import landmark_memory.jobs.reading as building

    monkeypatch.setattr(building, "BATCH_DOCUMENTS", 2)
    monkeypatch.setattr(building, "BATCH_WINDOW", 6)
    lengths = [100, 50, 100, 100, 100, 50, 100, 100]  # the fourth short one in a folder: always alone
    jobs = [building.DocumentJob(tmp, str(i), "", np.zeros(n, np.int32), None, 1.0, in_memory=i != 3)
            for i, (n, tmp) in enumerate(zip(lengths, [None] * len(lengths)))]
    assert [[int(j.path) for j in b] for b in building.batches(jobs)] == [[0, 2], [1, 5], [3], [4], [6, 7]]


def test_documents_read_in_a_batch_give_the_corpus_each_read_alone_gives(model, tmp_path, monkeypatch):
    import landmark_memory.jobs.reading as building

    words = "the memory reads each of these documents as one stream of a batch".split()
    for i in range(5):  # one length in blocks (each fills most of its 4 blocks of 50 tokens)
        (tmp_path / f"d{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(170)) + "\n")
    files = sorted(tmp_path.glob("d*.txt"))
    sizes = []
    read = building._read_in_memory
    monkeypatch.setattr(building, "_read_in_memory", lambda jobs, *a: sizes.append(len(jobs)) or read(jobs, *a))
    corpus(model, tmp_path / "batched", files)
    monkeypatch.setattr(building, "BATCH_DOCUMENTS", 1)
    corpus(model, tmp_path / "alone", files)
    assert sizes == [5] + [1] * 5
    assert files_of(tmp_path / "batched") == files_of(tmp_path / "alone")  # tokens, keys, indexes, stored blocks
    batched, alone = ({k: v for k, v in json.loads((tmp_path / name / "manifest.json").read_text()).items()
                       if k != "updated"} for name in ("batched", "alone"))
    assert batched == alone


def test_a_document_read_in_ram_and_stopped_keeps_nothing_and_is_read_whole_again(model, documents, tmp_path):
    files, tok = sorted(documents.glob("*.txt")), load_tokenizer()
    stopped = corpus(model, tmp_path / "m", files, reader=Recording(model, stop_after=2), in_memory_chunks=100)
    assert stopped.merged == 0 and stopped.added == 0 and stopped.left == []
    assert not (tmp_path / "m" / "docs").exists() or not any((tmp_path / "m" / "docs").iterdir())
    again = corpus(model, tmp_path / "m", files)
    assert again.merged == 3 and again.added == sum(len(encode_document(tok, f.read_text(), 50)) for f in files)
    corpus(model, tmp_path / "in-one-go", files)
    assert files_of(tmp_path / "m") == files_of(tmp_path / "in-one-go")


def test_a_merged_document_opened_alone_says_to_open_its_corpus(model, documents, tmp_path, sharded):
    corpus(model, tmp_path / "m", [documents / "a.txt"])
    (doc,) = (tmp_path / "m" / "docs").iterdir()
    with pytest.raises(MemoryFileError, match="open the corpus"):
        LandmarkMemory.open(doc, model, readonly=True)


def test_copies_a_stopped_or_earlier_build_left_go_at_the_next_build(model, documents, tmp_path, monkeypatch,
                                                                     packing):
    import landmark_memory.jobs.build as building

    files, path = sorted(documents.glob("*.txt")), tmp_path / "m"
    with monkeypatch.context() as m:  # a build from before one copy, or one stopped before it dropped them
        m.setattr(building, "drop_merged_rows", lambda corpus, folder, packed: None)
        corpus(model, path, files, in_memory_chunks=0)  # (each document read in a folder of its own)
    assert row_bytes(path, True, states=False) == 2 * row_bytes(path, False, states=False)  # the documents' copies
    assert row_bytes(path, True) > row_bytes(path, True, states=False)  # (and their states: each its keys' sums)
    doc = sorted((path / "docs").iterdir())[0]
    if packing == "sharded":  # one stopped between marking its manifest and removing its rows
        manifest = json.loads((doc / "manifest.json").read_text())
        marked = {**manifest, "rows_merged": True, "files": {}}  # as drop_merged_rows marks it: no state, no rows
        (doc / "manifest.json").write_text(json.dumps(marked))
    else:  # one stopped midway through removing its folder
        (doc / "manifest.json").unlink()
    before = files_of(path)
    summary = corpus(model, path, files)
    assert summary.added == 0 and len(summary.skipped) == len(files)
    assert row_bytes(path, everywhere=True) == row_bytes(path, everywhere=False)
    assert files_of(path) == before and verify(path).ok
    assert len(list((path / "docs").iterdir())) == (3 if packing == "sharded" else 0)


def test_a_long_reading_gives_the_heaps_free_pages_back_as_it_goes(model, documents, tmp_path, monkeypatch):
    from landmark_memory.core import heap
    from landmark_memory.jobs import reading

    trims = []
    monkeypatch.setattr(heap, "TRIM_TOKENS", 200)
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    ids = encode_document(load_tokenizer(), (documents / "a.txt").read_text(), 50)
    with LandmarkMemory(model, path=tmp_path / "m", store="lmdb", chunk_size=100) as mem:
        read = sum(reading.read_steps(mem, ids[None]))
    assert read == len(ids) and len(trims) == len(ids) // 200 > 2
