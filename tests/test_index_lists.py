"""The ``ivf-rows`` index: exact until trained, then lists of block ids over the key rows where
they lie, and runs that copy the keys list by list; lists that depend on the keys alone; files a
commit appends to (a new level's written once per training, an older level's removed once a
commit holds the new one); a memory from before runs searched the same; damage named."""

import json

import numpy as np
import pytest
from helpers import feed

from landmark_memory.format import MemoryFileError
from landmark_memory.index import new_index, recall_at_k
from landmark_memory.index.lists import list_count, run_end
from landmark_memory.memory import LandmarkMemory
from landmark_memory.uses.inspect import describe, verify


def clustered(n, d, seed):
    """Keys around 40 centres, as landmark keys gather around a few directions."""
    rng = np.random.default_rng(seed)
    centres = 3 * rng.standard_normal((40, d))
    return (centres[rng.integers(0, 40, n)] + rng.standard_normal((n, d))).astype(np.float32)


def test_it_searches_as_flat_until_trained_then_its_lists_over_the_same_rows():
    xb, xq = clustered(3000, 16, 0), clustered(50, 16, 1)
    index, flat = new_index("ivf-rows", 16, train_size=256), new_index("flat", 16)
    for part in np.array_split(xb[:250], 9):
        index.add(part)
        flat.add(part)
    assert index.lists.level == 0
    for lo, hi in [(0, 250), (40, 200)]:
        for a, b in zip(index.search(xq, 4, lo, hi), flat.search(xq, 4, lo, hi)):
            np.testing.assert_array_equal(a, b)  # bit for bit: the same search
    index.add(xb[250:])
    flat.add(xb[250:])
    assert index.lists.level == 2 and index.lists.nlist == list_count(1024)  # trained at 256, again at 1024 keys
    for lo, hi in [(0, 3000), (500, 2900)]:
        D, I = index.search(xq, 8, lo, hi)
        assert ((I >= lo) & (I < hi)).all()
        np.testing.assert_allclose(D, np.einsum("qd,qkd->qk", xq, xb[I]), rtol=1e-5, atol=1e-4)
        assert (np.diff(D, axis=1) <= 0).all()
        assert recall_at_k(I, flat.search(xq, 8, lo, hi)[1]) >= 0.9
    index.nprobe = index.lists.nlist  # every list visited: the exact top-k
    D, I = index.search(xq, 8, 500, 2900)
    D_flat, I_flat = flat.search(xq, 8, 500, 2900)
    np.testing.assert_array_equal(I, I_flat)
    np.testing.assert_allclose(D, D_flat, rtol=1e-5, atol=1e-4)


def test_lists_depend_on_the_keys_alone_not_on_how_they_were_added():
    xb, xq = clustered(1500, 8, 2), clustered(30, 8, 3)
    made = []
    for step in (1, 7, 1500):  # one at a time, chunks, and two trainings in one add
        index = new_index("ivf-rows", 8, train_size=64)
        for a in range(0, len(xb), step):
            index.add(xb[a:a + step])
        made.append(index)
    for other in made[1:]:
        np.testing.assert_array_equal(other.lists.centroids.array(), made[0].lists.centroids.array())
        np.testing.assert_array_equal(other.lists.lists.array(), made[0].lists.lists.array())
        for a, b in zip(other.search(xq, 5, 10, 1400), made[0].search(xq, 5, 10, 1400)):
            np.testing.assert_array_equal(a, b)




def test_runs_copy_each_runs_keys_list_by_list_and_leave_under_half_a_training_after_them():
    xb = clustered(3000, 16, 4)
    index = new_index("ivf-rows", 16, train_size=256)
    for part in np.array_split(xb, 13):
        index.add(part)
    li = index.lists  # trained again at 1,024 keys: runs end at 1,024, 1,536, 2,048 and 2,560
    assert li.level == 2 and run_end(3000, 2, 256) == li.runs.n == 2560 and run_end(1023, 2, 256) == 0
    lists, runs = li.lists.array()[:, 0], li.runs.array()
    for a, b in [(0, 1024), (1024, 1536), (1536, 2048), (2048, 2560)]:
        np.testing.assert_array_equal(runs[a:b], xb[a + np.argsort(lists[a:b], kind="stable")])


def search_all(mem, xq):
    return [ix.search(xq, 3, lo, hi) for ix in mem.inspection.indexes() for lo, hi in [(0, 70), (5, 67)]]


def test_a_memory_from_before_runs_is_searched_the_same_and_its_writer_writes_them(model, tmp_path):
    path, xq = tmp_path / "m", clustered(6, 16, 5)
    with LandmarkMemory(model, store="lmdb", path=path, index="ivf-rows", index_options={"train_size": 16},
                        chunk_size=10, top_k=2) as mem:
        feed(mem, 70, 1)  # trained at 16, again at 64 blocks: one run of 64, 6 blocks after it
    with LandmarkMemory.open(path, model, readonly=True) as reader:
        assert {ix.lists.runs.n for ix in reader.inspection.indexes()} == {64}
        with_runs = search_all(reader, xq)
    doc = json.loads((path / "manifest.json").read_text())  # the same memory as format 7 wrote it: no runs
    doc["format_version"] = 7
    doc["files"]["rows_crc32"] = {k: v for k, v in doc["files"]["rows_crc32"].items() if not k.endswith(".runs")}
    (path / "manifest.json").write_text(json.dumps(doc))
    for f in (path / "keys").glob("*.runs"):
        f.unlink()
    with LandmarkMemory.open(path, model, readonly=True) as old:
        assert {ix.lists.runs for ix in old.inspection.indexes()} == {None}
        for (D, I), (D_old, I_old) in zip(with_runs, search_all(old, xq)):  # bit for bit
            np.testing.assert_array_equal(I_old, I)
            np.testing.assert_array_equal(D_old, D)
    assert verify(path).ok
    with LandmarkMemory.open(path, model) as writer:  # writes the runs as it opens; its commit is format 8
        feed(writer, 1, 2)
    assert json.loads((path / "manifest.json").read_text())["format_version"] == 8 and verify(path).ok
    with LandmarkMemory.open(path, model, readonly=True) as reader:
        assert {ix.lists.runs.n for ix in reader.inspection.indexes()} == {64}
        for (D, I), (D_new, I_new) in zip(with_runs, search_all(reader, xq)):
            np.testing.assert_array_equal(I_new, I)
            np.testing.assert_array_equal(D_new, D)


def key_files(path):
    return {f.name: f.read_bytes() for f in sorted((path / "keys").iterdir())}


def test_a_commit_appends_to_the_lists_and_a_new_level_replaces_the_old_one(model, tmp_path):
    path, centroids, lists = tmp_path / "m", "s0_l1_h0.ivf1.centroids", "s0_l1_h0.ivf1.lists"
    with LandmarkMemory(model, store="lmdb", path=path, index="ivf-rows", index_options={"train_size": 16},
                        chunk_size=10, top_k=2) as mem:
        feed(mem, 20, 1)  # trained at 16 blocks, in 2 lists
        mem.commit()
        first = key_files(path)  # (a writer's files hold room to grow into: what counts is their start)
        assert mem.inspection.indexes()[mem.shape.n_kv_head].lists.nlist == 2
        feed(mem, 20, 2)
        mem.commit()
        second = key_files(path)
        assert second[lists][:20 * 4] == first[lists][:20 * 4]  # committed lists stay, new blocks follow them
        assert second[centroids][:2 * 16 * 4] == first[centroids][:2 * 16 * 4]
        feed(mem, 30, 3)  # 70 blocks: trained again at 64
        assert (path / "keys" / "s0_l1_h0.ivf2.lists").exists() and (path / "keys" / lists).exists()
        (path / "keys" / "s0_l0_h1.ivf3.lists").write_bytes(b"left by a writer stopped after training")
        mem.commit()
        writer = [ix.search(np.ones((3, 16), np.float32), 2) for ix in mem.inspection.indexes()]
    names = set(key_files(path))  # the level before stays for readers of the commit before; the scratch goes
    assert {lists, "s0_l1_h0.ivf2.lists"} <= names and "s0_l0_h1.ivf3.lists" not in names
    crcs = json.loads((path / "manifest.json").read_text())["files"]["rows_crc32"]
    assert sorted(n for n in crcs if ".ivf" in n) == sorted(f"keys/{n}" for n in names if ".ivf2." in n)
    assert verify(path).ok
    assert describe(path)["index_search"] == "8 lists trained at 64 blocks (again at 256), 16 probed per query"
    with LandmarkMemory.open(path, model, readonly=True) as reader:  # the lists mapped as the writer left them
        for (D, I), ix in zip(writer, reader.inspection.indexes()):
            D_r, I_r = ix.search(np.ones((3, 16), np.float32), 2)
            np.testing.assert_array_equal(I_r, I)
            np.testing.assert_array_equal(D_r, D)


def test_damaged_lists_are_named_never_a_crash(model, tmp_path):
    path = tmp_path / "m"
    with LandmarkMemory(model, store="lmdb", path=path, index_options={"train_size": 8}, chunk_size=10) as mem:
        feed(mem, 12, 1)  # the default index, trained at 8 blocks
    lists = path / "keys" / "s0_l1_h1.ivf1.lists"
    good = lists.read_bytes()
    lists.write_bytes(good[:24] + np.int32(10 ** 6).tobytes() + good[28:])  # block 3 in a list that is not there
    with LandmarkMemory.open(path, model, readonly=True) as mem:  # read at the first search
        with pytest.raises(MemoryFileError, match="block 3 in a list that does not exist"):
            feed(mem, 1, 2)
    assert any("s0_l1_h1.ivf1.lists" in p and "CRC-32" in p for p in verify(path).problems)
    lists.write_bytes(good[:20])
    with pytest.raises(MemoryFileError, match=r"s0_l1_h1\.ivf1\.lists is truncated"):
        LandmarkMemory.open(path, model, readonly=True)
    lists.write_bytes(good)
    runs = path / "keys" / "s0_l1_h1.ivf1.runs"
    copies = runs.read_bytes()
    runs.write_bytes(copies[:-4])
    with pytest.raises(MemoryFileError, match=r"s0_l1_h1\.ivf1\.runs is truncated"):
        LandmarkMemory.open(path, model, readonly=True)
    runs.write_bytes(copies[:-4] + b"\xff" * 4)
    assert any("s0_l1_h1.ivf1.runs" in p and "CRC-32" in p for p in verify(path).problems)
    runs.write_bytes(copies)
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        assert mem.n_blocks == 12
