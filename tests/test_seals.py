"""A writer's seals (format/seals.py): the next writer reads again only the key and index files
that changed since the last writer let them go, and a seal it cannot trust counts for nothing."""

import json
import os
import shutil

import pytest

from landmark_memory import LandmarkGPT, LandmarkMemory
from landmark_memory.app.cli import main
from landmark_memory.format import corpus_files, seals
from landmark_memory.format.directory import MemoryDir
from landmark_memory.format.errors import MemoryFileError
from landmark_memory.memory.saved import sealable_files
from landmark_memory.training.data import SAMPLE_DIR


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A corpus whose ``ivf-rows`` indexes trained (key files, centroids and lists), not sealed:
    it holds fewer key bytes than ``SEAL_BYTES``."""
    text = tmp_path_factory.mktemp("text") / "book.txt"
    text.write_text((SAMPLE_DIR / "train" / "treasure_island_excerpt.txt").read_text()[:3000])
    mem = tmp_path_factory.mktemp("built") / "m"
    assert main(["build", str(mem), "--input", str(text), "--chunk-size", "50", "--train-size", "8", "--quiet"]) == 0
    return mem


@pytest.fixture
def sealed(built, tmp_path, monkeypatch):
    """A copy of ``built`` that a writer opened and closed with seals on for any size."""
    mem = tmp_path / "m"
    shutil.copytree(built, mem)
    monkeypatch.setattr(seals, "SEAL_BYTES", 0)
    LandmarkMemory.open(mem, LandmarkGPT.from_pretrained()).close()
    assert (mem / seals.SEALS).is_file()
    return mem


def _key_files_read(mem, monkeypatch) -> list[str]:
    """The key and index files, and ``tokens.bin`` unless mapped, a writer opening ``mem`` reads
    (then closes it)."""
    read, original = [], MemoryDir.read_rows

    def spy(self, name, nbytes, offset=0, mapped=False):
        if name.startswith("keys/") or (name == "tokens.bin" and not mapped and nbytes):
            read.append(name)
        return original(self, name, nbytes, offset, mapped)

    monkeypatch.setattr(MemoryDir, "read_rows", spy)
    LandmarkMemory.open(mem, LandmarkGPT.from_pretrained()).close()
    monkeypatch.setattr(MemoryDir, "read_rows", original)
    return read


def test_a_small_memory_leaves_no_seals(built):
    assert not (built / seals.SEALS).exists()  # (its files are read faster than sealed)


def test_a_writer_reads_again_only_the_files_changed_since_the_last_writer_sealed_them(sealed, monkeypatch):
    every = sealable_files(MemoryDir(sealed, writable=False).read_manifest())
    assert len(every) > 3 and any(".ivf" in n for n in every)
    assert _key_files_read(sealed, monkeypatch) == []
    touched = sorted(every)[1]
    os.utime(sealed / touched)  # the same bytes, a new change time: read again (and found sound)
    assert _key_files_read(sealed, monkeypatch) == [touched]
    assert _key_files_read(sealed, monkeypatch) == []  # sealed again by that writer
    assert main(["info", str(sealed), "--verify"]) == 0  # (seals are no memory file verify asks about)


def test_seals_that_are_damaged_or_for_other_rows_count_for_nothing(sealed, monkeypatch):
    every = sealable_files(MemoryDir(sealed, writable=False).read_manifest())
    doc = json.loads((sealed / seals.SEALS).read_text())
    name = sorted(every)[0]
    for forged in ([*doc["files"][name][:1], doc["files"][name][1] ^ 1, *doc["files"][name][2:]],  # another CRC-32
                   [doc["files"][name][0] - 4, *doc["files"][name][1:]], doc["files"][name][:2]):  # other rows
        (sealed / seals.SEALS).write_text(json.dumps({**doc, "files": {**doc["files"], name: forged}}))
        assert _key_files_read(sealed, monkeypatch) == [name]
    for text in ["{", "[]", '{"version": 2, "files": {}}', "[" * 100_000, "\xff"]:
        (sealed / seals.SEALS).write_bytes(text.encode("utf-8", "surrogateescape"))
        assert sorted(_key_files_read(sealed, monkeypatch)) == sorted(every)


def test_a_seals_file_that_is_a_link_is_neither_read_nor_written_through(sealed, tmp_path, monkeypatch):
    every = sealable_files(MemoryDir(sealed, writable=False).read_manifest())
    outside = tmp_path / "outside.json"
    outside.write_bytes((sealed / seals.SEALS).read_bytes())
    (sealed / seals.SEALS).unlink()
    (sealed / seals.SEALS).symlink_to(outside)
    before = outside.read_bytes()
    assert sorted(_key_files_read(sealed, monkeypatch)) == sorted(every)
    assert outside.read_bytes() == before and not (sealed / seals.SEALS).is_symlink()  # the link replaced, not followed


def test_a_writer_seals_only_once_the_clock_has_passed_its_files_last_change(sealed):
    sealed_at = os.stat(sealed / seals.SEALS).st_ctime_ns
    files = json.loads((sealed / seals.SEALS).read_text())["files"]
    assert files and all(os.stat(sealed / name).st_ctime_ns == s[6] < sealed_at for name, s in files.items())


def test_a_merged_document_that_keeps_its_store_keeps_no_seals(built, tmp_path, monkeypatch):
    monkeypatch.setattr(seals, "SEAL_BYTES", 0)
    monkeypatch.setattr(corpus_files, "PACK_BYTES", 0)
    text = tmp_path / "more.txt"
    text.write_text((SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:1500])
    mem = tmp_path / "m"
    shutil.copytree(built, mem)
    assert main(["build", str(mem), "--input", str(text), "--chunk-size", "50", "--quiet"]) == 0
    kept = list(mem.glob("docs/*"))
    assert (mem / seals.SEALS).is_file() and kept and not [d for d in kept if (d / "keys").exists()]


def test_damage_made_while_a_writer_runs_is_never_sealed(sealed):
    every = sealable_files(MemoryDir(sealed, writable=False).read_manifest())
    name = sorted(every)[0]
    mem = LandmarkMemory.open(sealed, LandmarkGPT.from_pretrained())
    with open(sealed / name, "r+b") as f:  # a committed row changed behind the writer's back
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0x10]))
    mem.close()
    assert name not in json.loads((sealed / seals.SEALS).read_text())["files"]
    with pytest.raises(MemoryFileError, match=name.replace(".", r"\.") + ".*CRC-32"):
        LandmarkMemory.open(sealed, LandmarkGPT.from_pretrained())


def test_a_writer_that_appended_seals_the_files_it_grew(sealed, tmp_path, monkeypatch):
    text = tmp_path / "more.txt"
    text.write_text((SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:1500])
    before = MemoryDir(sealed, writable=False).read_manifest()
    assert main(["build", str(sealed), "--input", str(text), "--chunk-size", "50", "--quiet"]) == 0
    after = MemoryDir(sealed, writable=False).read_manifest()
    assert after.blocks > before.blocks
    assert _key_files_read(sealed, monkeypatch) == []


def test_tokens_bin_is_sealed_too_and_a_writer_maps_it_unread(sealed, monkeypatch):
    assert "tokens.bin" in json.loads((sealed / seals.SEALS).read_text())["files"]
    assert _key_files_read(sealed, monkeypatch) == []  # (mapped as a reader maps it)
    os.utime(sealed / "tokens.bin")
    assert _key_files_read(sealed, monkeypatch) == ["tokens.bin"]  # changed since: read and checked
    mem = LandmarkMemory.open(sealed, LandmarkGPT.from_pretrained())
    with open(sealed / "tokens.bin", "r+b") as f:  # a committed row changed behind the writer's back
        f.write(b"\x01")
    mem.close()
    assert "tokens.bin" not in json.loads((sealed / seals.SEALS).read_text())["files"]
    with pytest.raises(MemoryFileError, match="tokens.bin.*CRC-32"):
        LandmarkMemory.open(sealed, LandmarkGPT.from_pretrained())
