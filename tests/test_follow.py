"""A memory opened once and kept: a read-only memory forgets what it was fed (``rewind``),
follows its writer's commits (``refresh``) and then answers exactly as a fresh open would; the
saved format keeps no second copy of an exact index; the model's fingerprint is hashed once."""

import hashlib
import json
import shutil
import zlib

import faiss
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save

from landmark_memory import LandmarkGPT
from landmark_memory.format import MemoryFileError
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.fingerprint import model_fingerprint

OPTS = dict(top_k=2, chunk_size=10, index_options={"train_size": 16})


def ids(n, seed):
    return torch.randint(4, 64, (1, n), generator=torch.Generator().manual_seed(seed))


def fresh(path, model, probe):
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        return mem.forward(probe).logits


@pytest.mark.parametrize("store,index,dtype", [("lmdb", "flat", "float32"), ("mmap", "flat", "int8"),
                                               ("lmdb", "ivf", "float32"), ("mmap", "hnsw", "float32"),
                                               ("lmdb", "ivf-rows", "int8")])
def test_a_reader_refreshed_after_each_commit_answers_as_a_fresh_open(model, tmp_path, store, index, dtype):
    path, probe = tmp_path / "m", ids(47, 9)  # a probe long enough to put blocks of its own in memory
    writer = LandmarkMemory(model, store=store, path=path, index=index, store_dtype=dtype, **OPTS)
    writer.forward(ids(33, 1))  # mid-chunk: the reader takes the open chunk too
    writer.commit()
    reader = LandmarkMemory.open(path, model, readonly=True)
    try:
        for seed, n in [(2, 40), (3, 7), (4, 61)]:  # across the IVF's training at 16 blocks
            assert torch.equal(reader.forward(probe).logits, fresh(path, model, probe))
            reader.rewind()
            writer.forward(ids(n, seed))
            assert reader.refresh() is False  # nothing committed yet
            writer.commit()
            assert reader.refresh() is True
            assert reader.n_tokens == writer.n_tokens and reader.manifest.commit == writer.manifest.commit
        assert torch.equal(reader.forward(probe).logits, fresh(path, model, probe))
    finally:
        reader.close()
        writer.close()


def test_rewind_forgets_what_was_fed_and_reads_on_as_a_writer_would(model, tmp_path):
    path, a, b = tmp_path / "m", ids(58, 5), ids(44, 6)
    # exact search: a reader searches the blocks it was fed exactly (its overlay), a writer with an
    # approximate index would put them in its lists
    with LandmarkMemory(model, store="lmdb", path=path, index="flat", **OPTS) as m:
        m.forward(ids(60, 1))
    with LandmarkMemory.open(path, model) as writer:  # the same text in a memory that keeps it
        expected = writer.forward(b).logits
        writer.close(commit=False)
    with LandmarkMemory.open(path, model, readonly=True) as reader:
        reader.forward(a)  # blocks of its own, past the recent ones: its overlay is searched
        assert reader.n_blocks > 12 + OPTS["top_k"]
        reader.rewind()
        assert reader.n_tokens == 60 and reader._blocks.upper is None  # (a peek inside: no blocks fed)
        assert torch.equal(reader.forward(b).logits, expected)  # a text longer than top_k blocks reads its overlay


def test_refresh_refuses_a_memory_rebuilt_in_its_place(model, tmp_path):
    path = tmp_path / "m"
    with LandmarkMemory(model, store="mmap", path=path, **OPTS) as m:
        m.forward(ids(30, 1))
    reader = LandmarkMemory.open(path, model, readonly=True)
    try:
        (tmp_path / "m").rename(tmp_path / "old")
        with LandmarkMemory(model, store="mmap", path=path, **OPTS) as m:
            m.forward(ids(20, 2))
            m.commit()  # one commit more than the reader's, fewer blocks
        with pytest.raises(MemoryFileError, match="changed otherwise than by appending"):
            reader.refresh()
        with pytest.raises(ValueError, match="read-only"):
            LandmarkMemory(model, **OPTS).refresh()
    finally:
        reader.close()


def test_a_memory_keeps_its_keys_once_and_one_from_before_key_files_converts_on_its_first_commit(model, tmp_path):
    path, probe = tmp_path / "m", ids(23, 7)
    with LandmarkMemory(model, store="lmdb", path=path, **OPTS) as m:
        m.forward(ids(40, 1))  # 8 whole blocks: no open chunk to keep either
    doc = json.loads((path / "manifest.json").read_text())
    names = [f"keys/s0_l{layer}_h{h}.f32" for layer in range(2) for h in range(2)]
    (state,) = path.glob("state.*")  # the keys' sums alone: the flat index is the key files
    assert doc["format_version"] == 8 and doc["files"]["state"]["name"] == state.name
    assert sorted(load_file(state)) == ["landmark_sum.0", "landmark_sum.1"]
    assert sorted(doc["files"]["rows_crc32"]) == sorted(["tokens.bin",
                                                         *names]) and not (path / "landmarks.bin").exists()
    keys = {name: np.fromfile(path / name, np.float32).reshape(8, 16) for name in names}  # cut to the 8 rows
    expected = fresh(path, model, probe)
    # the same memory as format 4 wrote it: its keys as rows of landmarks.bin, every flat index in the state
    rows = np.stack([np.stack([keys[f"keys/s0_l{layer}_h{h}.f32"] for h in range(2)]) for layer in range(2)])
    (path / "landmarks.bin").write_bytes(rows.transpose(2, 0, 1, 3)[:, None].tobytes())  # (n, streams, layer, head, D)
    state = {}
    for name, x in keys.items():
        index = faiss.IndexFlatIP(16)
        index.add(x)
        layer, h = name[7], name[10]
        state[f"index.0.{layer}.{h}"] = torch.from_numpy(faiss.serialize_index(index))
    data = save(state)
    (path / "state.1.safetensors").write_bytes(data)
    doc.update(format_version=4)
    for entries, name in ((doc["options"], "block_keys"), (doc["options"], "block_size"),
                          (doc["model"]["shape"], "landmarks")):
        del entries[name]  # format 6's: before it every memory was a landmark memory of its model's block size
    doc["files"] = {"state": {"name": "state.1.safetensors", "bytes": len(data),
                              "sha256": hashlib.sha256(data).hexdigest()},
                    "rows_crc32": {"tokens.bin": doc["files"]["rows_crc32"]["tokens.bin"],
                                   "landmarks.bin": zlib.crc32((path / "landmarks.bin").read_bytes())}}
    (path / "manifest.json").write_text(json.dumps(doc))
    shutil.rmtree(path / "keys")
    assert torch.equal(fresh(path, model, probe), expected)  # read as it is
    with LandmarkMemory.open(path, model) as m:
        m.commit()  # converted: a commit like any other
    doc = json.loads((path / "manifest.json").read_text())
    (state,) = path.glob("state.*")  # the keys' sums alone: the flat index is the key files
    assert doc["format_version"] == 8 and doc["files"]["state"]["name"] == state.name
    assert sorted(load_file(state)) == ["landmark_sum.0", "landmark_sum.1"]
    assert not (path / "landmarks.bin").exists() and all((path / n).read_bytes() == keys[n].tobytes() for n in names)
    assert torch.equal(fresh(path, model, probe), expected)


def test_the_fingerprint_is_hashed_once_and_follows_the_weights(model, monkeypatch):
    m = LandmarkGPT(model.config)
    m.load_state_dict(model.state_dict())
    first = model_fingerprint(m)
    hashed, sha256 = [], hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: hashed.append(1) or sha256(*a))
    assert model_fingerprint(m) == first and not hashed  # the same weights: not hashed again
    with torch.no_grad():
        next(m.parameters()).add_(1.0)  # written in place: its version counter moves
    assert model_fingerprint(m) != first and hashed
