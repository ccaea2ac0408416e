"""A library: a corpus's document list in pages (read when a record is asked for, a damaged page
named alone), found by its digests (a build reads the pages of its inputs alone) and named by its
full pages (a session reads one page), and a corpus of an earlier format opening and paging its
list at its next commit."""

import json
import shutil
import zlib
from functools import partial

import pytest

from landmark_memory import LandmarkGPT, LandmarkMemory, load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.format import MemoryFileError
from landmark_memory.format.documents import DIGESTS, DocumentList, InputRecord, folder_digest, page_file
from landmark_memory.jobs.build import build, read_inputs
from landmark_memory.training.data import SAMPLE_DIR
from landmark_memory.uses import session
from landmark_memory.uses.answer import ask
from landmark_memory.uses.inspect import verify
from landmark_memory.uses.session import Session

PAGE = 2  # records per page in these tests


@pytest.fixture(scope="module")
def model():
    return LandmarkGPT.from_pretrained()


@pytest.fixture
def small_pages(monkeypatch):
    monkeypatch.setattr("landmark_memory.format.documents.PAGE_DOCUMENTS", PAGE)
    monkeypatch.setattr("landmark_memory.format.manifest.PAGE_DOCUMENTS", PAGE)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Five short documents, each its own paragraph of the sample books."""
    d = tmp_path_factory.mktemp("texts")
    text = (SAMPLE_DIR / "train" / "treasure_island_excerpt.txt").read_text()
    for i in range(5):
        (d / f"d{i}.txt").write_text(f"Document {i}.\n" + text[600 * i:600 * i + 600])
    return d


def build_into(model, path, files):
    mem = (LandmarkMemory.open(path, model) if (path / "manifest.json").exists() else
           LandmarkMemory(model, path=path, store="lmdb", chunk_size=100, documents=True))
    with mem:
        return build(mem, read_inputs(files), load_tokenizer(), progress=False)


def record(i):  # (a name may hold any character: a line separator is no end of a record)
    return InputRecord(f"/d{i}.txt", f"d{i}\u2028\x85.txt", f"{i:064x}", 100, 100, 100 * i, document=f"docs/{i:016x}")


class Folder:
    """Just what a document list reads and writes: rows of files in a folder."""

    def __init__(self, path):
        self.path = path

    def write_rows(self, name, offset, data):
        with open(self.path / name, "r+b" if (self.path / name).exists() else "wb") as f:
            f.truncate(offset)
            f.seek(offset)
            f.write(data)

    def read_rows(self, name, nbytes):
        return (self.path / name).read_bytes()[:nbytes]


def test_a_paged_list_appends_across_commits_and_reads_back_each_page_alone(tmp_path, small_pages):
    d, listed = Folder(tmp_path), DocumentList(paged=True)
    for commit in ([0], [1, 2], [3, 4, 5, 6]):  # pages fill across commits: 1, then 2 + 1, then ...
        for i in commit:
            listed.append(record(i))
        listed.write(d)
    assert [p.count for p in listed.pages] == [2, 2, 2, 1] and not listed.tail
    again = DocumentList(paged=True, pages=listed.pages)
    again.attach(d, lambda e, where: None)
    assert again[5] == record(5) and list(again._read) == [2]  # one page read for one record
    assert again.containing(350) == record(3) and again.containing(10_000) is None
    assert list(again) == [record(i) for i in range(7)] and again[1:3] == [record(1), record(2)]
    assert again.extends(DocumentList(paged=True, pages=listed.pages[:2])) and not DocumentList(
        paged=True, pages=listed.pages[:2]).extends(again)


def test_a_corpus_opens_without_reading_its_list_and_a_passage_reads_one_page(model, texts, tmp_path, small_pages):
    path = tmp_path / "m"
    build_into(model, path, sorted(texts.glob("*.txt")))
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["format_version"] == 8 and doc["inputs"] == [] and [p[0] for p in doc["pages"]] == [2, 2, 1]
    assert doc["shards"] == []  # every document packed
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        assert mem.inputs._read == {}
        answer = ask(mem, load_tokenizer(), "The captain", max_new_tokens=4, passages=1, raw=True)
        assert answer.passages[0].source.endswith(".txt") and len(mem.inputs._read) == 1


def test_a_damaged_page_is_named_and_costs_no_other(model, texts, tmp_path, small_pages, capsys):
    path = tmp_path / "m"
    build_into(model, path, sorted(texts.glob("*.txt")))
    page = path / page_file(1)
    page.write_bytes(page.read_bytes().replace(b'"d', b'"x', 1))
    problems = verify(path).problems
    assert len(problems) == 1 and page_file(1) in problems[0] and "documents 2 to 3" in problems[0], problems
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        assert mem.inputs[4].name == "d4.txt" and mem.inputs[0].name == "d0.txt"  # the other pages
        with pytest.raises(MemoryFileError, match="documents 2 to 3"):
            mem.inputs[2]
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and page_file(1) in err


def test_a_page_record_with_a_line_break_in_a_key_is_refused_in_one_line(model, texts, tmp_path, small_pages,
                                                                          capsys):
    path = tmp_path / "m"
    build_into(model, path, sorted(texts.glob("*.txt")))
    page, doc = path / page_file(0), json.loads((path / "manifest.json").read_text())
    first, rest = page.read_bytes().split(b"\n", 1)
    data = json.dumps({**json.loads(first), "\x1e": 0}).encode() + b"\n" + rest
    page.write_bytes(data)
    doc["pages"][0][1:3] = [len(data), zlib.crc32(data)]
    (path / "manifest.json").write_text(json.dumps(doc))
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and page_file(0) in err and "garbles" in err, err


def test_a_corpus_of_format_6_opens_and_pages_its_list_at_its_next_commit(model, texts, tmp_path, small_pages,
                                                                         monkeypatch, capsys):
    files, path = sorted(texts.glob("*.txt")), tmp_path / "m"
    with monkeypatch.context() as m:  # format 6: every document kept its own store, its list in the manifest
        m.setattr("landmark_memory.format.corpus_files.PACK_BYTES", -1)
        build_into(model, path, files[:3])
    doc = json.loads((path / "manifest.json").read_text())
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        records = [{**r.__dict__} for r in mem.inputs]
    for r in records:
        del r["packed"]
    old = {**{k: v for k, v in doc.items() if k not in ("pages", "shards")}, "format_version": 6, "inputs": records}
    (path / "manifest.json").write_text(json.dumps(old))
    shutil.rmtree(path / "documents")
    assert main(["ask", str(path), "The captain", "--max-new-tokens", "2", "--json", "--quiet"]) == 0
    before = json.loads(capsys.readouterr().out)
    build_into(model, path, files)  # two more documents, packed; the three old ones keep their stores
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["format_version"] == 8 and doc["inputs"] == [] and len(doc["shards"]) == 3
    assert doc["digests_crc32"] == zlib.crc32((path / DIGESTS).read_bytes())  # (every record's, old ones too)
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        assert [e.name for e in mem.inputs] == [f.name for f in files] and [e.packed for e in mem.inputs] == [
            False] * 3 + [True] * 2
    assert verify(path).ok
    assert main(["ask", str(path), "The captain", "--max-new-tokens", "2", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["text"]  # (the corpus answers on)
    assert before["text"]


def digests_of(path, model):
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        return [folder_digest(e.document) for e in mem.inputs], [int(x) for x in mem.inputs.digests()]


def pages_read(monkeypatch) -> list[int]:
    """The pages of document lists read from now on, in order."""
    read, page = [], DocumentList.page

    def counted(self, p):
        if p not in self._read:
            read.append(p)
        return page(self, p)

    monkeypatch.setattr(DocumentList, "page", counted)
    return read


def test_a_build_finds_its_inputs_by_the_lists_digests_and_reads_only_their_pages(model, texts, tmp_path,
                                                                                   small_pages, monkeypatch):
    files, path = sorted(texts.glob("*.txt")), tmp_path / "m"
    build_into(model, path, files[:4])
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["digests_crc32"] == zlib.crc32((path / DIGESTS).read_bytes())
    read = pages_read(monkeypatch)
    summary = build_into(model, path, [files[3], files[4]])  # one the corpus holds (page 1 of 0 and 1), one new
    assert summary.skipped == [str(files[3])] and summary.merged == 1
    assert read == [1]
    listed, digests = digests_of(path, model)
    assert len(listed) == 5 and digests == listed and verify(path).ok


@pytest.mark.parametrize("how", ["damaged", "from before digests"])
def test_a_list_whose_digests_are_damaged_or_missing_is_read_page_by_page_and_its_next_commit_writes_them(
        model, texts, tmp_path, small_pages, how):
    files, path = sorted(texts.glob("*.txt")), tmp_path / "m"
    build_into(model, path, files[:4])
    if how == "damaged":
        data = bytearray((path / DIGESTS).read_bytes())
        data[3] ^= 0xFF
        (path / DIGESTS).write_bytes(bytes(data))
        problems = verify(path).problems
        assert len(problems) == 1 and DIGESTS in problems[0] and "writes it anew" in problems[0], problems
    else:  # a corpus of format 7 before digests were kept
        doc = json.loads((path / "manifest.json").read_text())
        del doc["digests_crc32"]
        (path / "manifest.json").write_text(json.dumps(doc))
        (path / DIGESTS).unlink()
        assert verify(path).ok
    summary = build_into(model, path, [files[3], files[4]])
    assert summary.skipped == [str(files[3])] and summary.merged == 1  # (found in the pages)
    listed, digests = digests_of(path, model)
    assert len(listed) == 5 and digests == listed and verify(path).ok


def test_a_page_record_whose_folder_is_not_named_by_its_sha256_is_refused_in_one_line(model, texts, tmp_path,
                                                                                        small_pages, capsys):
    path = tmp_path / "m"
    build_into(model, path, sorted(texts.glob("*.txt"))[:2])
    page, doc = path / page_file(0), json.loads((path / "manifest.json").read_text())
    first, rest = page.read_bytes().split(b"\n", 1)
    data = json.dumps({**json.loads(first), "document": "docs/0123456789abcdef"}).encode() + b"\n" + rest
    page.write_bytes(data)
    doc["pages"][0][1:3] = [len(data), zlib.crc32(data)]
    (path / "manifest.json").write_text(json.dumps(doc))
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not named by its sha256" in err, err


def test_a_session_over_a_library_names_its_documents_by_their_full_pages_and_reads_one_page(
        model, texts, tmp_path, small_pages, monkeypatch):
    files, path = sorted(texts.glob("*.txt")), tmp_path / "m"
    build_into(model, path, files[:3])  # pages of 2 and 1 documents
    read = pages_read(monkeypatch)
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        del read[:]
        with Session.open(mem, "s") as s:
            s.attach()
            assert read == [1]  # the full page by its manifest entry, the last one read
    build_into(model, path, files[3:])  # that page fills, and another begins
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        del read[:]
        with Session.open(mem, "s", create=False) as s:
            s.attach()  # (its three documents are still the library's first three)
            assert read == [1]


def test_a_session_that_named_a_librarys_documents_one_by_one_still_opens(model, texts, tmp_path, small_pages,
                                                                        monkeypatch):
    files, path = sorted(texts.glob("*.txt")), tmp_path / "m"
    build_into(model, path, files)
    with monkeypatch.context() as m:  # as sessions recorded their documents before full pages named them
        m.setattr(session, "_documents_digest", partial(session._documents_digest, by_pages=False))
        with LandmarkMemory.open(path, model, readonly=True) as mem, Session.open(mem, "s"):
            pass
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        assert session._documents_digest(mem.manifest, 5) != session._documents_digest(mem.manifest, 5, False)
        with Session.open(mem, "s", create=False) as s:
            s.attach()  # (found by its fields)


@pytest.mark.parametrize("damage", ["a digit", "cut to nothing", "pages swapped"])
def test_a_writer_refuses_a_damaged_page_it_would_append_to_and_writes_nothing(model, texts, tmp_path, small_pages,
                                                                               capsys, damage):
    files, path = sorted(texts.glob("*.txt")), tmp_path / "m"
    build_into(model, path, files[:3])  # pages of 2 and 1 records: the next document goes on page 1
    first, last = path / page_file(0), path / page_file(1)
    if damage == "a digit":  # the same length, another number
        data = last.read_bytes()
        at = data.index(b'"tokens": ') + len(b'"tokens": ')
        last.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    elif damage == "cut to nothing":
        last.write_bytes(b"")
    else:
        a, b = first.read_bytes(), last.read_bytes()
        first.write_bytes(b)
        last.write_bytes(a)
    before = {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
              and p.name not in ("writer.lock", "lock.mdb")}
    capsys.readouterr()
    assert main(["build", str(path), "--input", str(files[3]), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and page_file(1) in err, err
    after = {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
             and p.name not in ("writer.lock", "lock.mdb")}
    assert after == before
