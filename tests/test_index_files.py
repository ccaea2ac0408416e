"""A new index kind that keeps files on disk is its class and a line in the registry: the memory
commits, checks, verifies, follows and cleans up its files by asking the kind (``LandmarkIndex``'s
``files``, ``saved_files``, ``stale_files``, ``search_words``), never by knowing its module."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import feed

from landmark_memory.format import MemoryFileError
from landmark_memory.index import KINDS, IndexFile, IndexKind
from landmark_memory.index.on_rows import RowsIndex
from landmark_memory.index.rows import KeyRows
from landmark_memory.memory import LandmarkMemory
from landmark_memory.uses.inspect import describe, verify


class NormsIndex(RowsIndex):
    """A toy kind: ``flat``'s exact search, and beside each key file a file of every key's norm
    (``<stem>.norms``, a row per block) and one written once (``<stem>.seen``, a stale one of
    an older name removed after each commit)."""

    def __init__(self, kind, dim, **options):
        super().__init__(kind, dim, **options)
        path = self.rows.path
        self.norms = KeyRows(1, None if path is None else path.with_suffix(".norms"), writable=self.rows.writable)
        self.seen = KeyRows(1, None if path is None else path.with_suffix(".seen"), writable=self.rows.writable)

    def add(self, xb):
        super().add(xb)
        self.norms.append(np.linalg.norm(xb, axis=1, keepdims=True).astype(np.float32))
        if not self.seen.n:
            self.seen.append(np.ones((1, 1), np.float32))

    def follow(self, n, runs=True):
        self.norms.follow(n)
        self.seen.follow(min(n, 1))

    def files(self):
        return [IndexFile(self.norms, rows_at=lambda n: n)] + ([IndexFile(self.seen, rows_at=None)] if self.seen.n
                                                                else [])

    @classmethod
    def saved_files(cls, key_file, n, train_size, dim, runs=True):
        stem = Path(key_file)
        return {str(stem.with_suffix(".norms")): n * 4, **({str(stem.with_suffix(".seen")): 4} if n else {})}

    @classmethod
    def stale_files(cls, folder, indexes):
        return list(folder.glob("*.old"))

    @classmethod
    def search_words(cls, n, train_size, nprobe):
        return f"exact, with the norms of {n} keys"


@pytest.fixture
def norms_kind(monkeypatch):
    monkeypatch.setitem(KINDS, "norms", IndexKind(NormsIndex, in_state=False))  # the registry line


def test_a_kind_that_keeps_files_is_committed_verified_and_followed_by_asking_the_kind(model, norms_kind, tmp_path):
    path = tmp_path / "m"
    with LandmarkMemory(model, store="lmdb", path=path, index="norms", chunk_size=10, top_k=2) as mem:
        feed(mem, 6, 1)
        mem.commit()
        with LandmarkMemory.open(path, model, readonly=True) as reader:
            feed(mem, 4, 2)
            (path / "keys" / "s0_l0_h0.old").write_bytes(b"a file the kind no longer needs")
            mem.commit()
            assert reader.refresh() and reader.n_blocks == 10
            ix = reader.inspection.indexes()[reader.shape.n_kv_head + 1]
            np.testing.assert_allclose(ix.norms.array()[:, 0], np.linalg.norm(ix.rows.array(), axis=1), rtol=1e-6)
    assert not (path / "keys" / "s0_l0_h0.old").exists()
    crcs = json.loads((path / "manifest.json").read_text())["files"]["rows_crc32"]
    assert sum(n.endswith(".norms") for n in crcs) == sum(n.endswith(".seen") for n in crcs) == 4  # 2 layers, 2 heads
    report = verify(path)
    assert report.ok, report.problems
    assert describe(path)["index_search"] == "exact, with the norms of 10 keys"
    norms = path / "keys" / "s0_l1_h1.norms"
    good = norms.read_bytes()
    norms.write_bytes(good[:8] + np.float32(7).tobytes() + good[12:])
    assert any("s0_l1_h1.norms" in p and "CRC-32" in p for p in verify(path).problems)
    norms.write_bytes(good[:20])
    with pytest.raises(MemoryFileError, match=r"s0_l1_h1\.norms is truncated"):
        LandmarkMemory.open(path, model, readonly=True)
