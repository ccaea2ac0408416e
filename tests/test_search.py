"""The text index of a memory's blocks (SQLite FTS5) and search: its rows, its file written whole
and sealed, checked against the memory's tokens, rebuilt where it is not its writer's; the
fusion with the retrieval heads; ``search`` and the commands over it."""

import json
import os
import sqlite3

import numpy as np
import pytest
from helpers import ChatTokenizer

from landmark_memory import LandmarkGPT, LandmarkMemory, search
from landmark_memory.app.cli import main
from landmark_memory.core.tokenizer import EOS_TOKEN, load_tokenizer
from landmark_memory.format.text_index import EDGE, TEXT_INDEX, TEXT_SEAL, TextIndex, block_texts, match_words
from landmark_memory.models.heads import EvidenceHeads
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.uses.question import asked_words, word_rarity
from landmark_memory.uses.retrievers import TEXT_WEIGHT, fuse
from landmark_memory.uses.search import text_ranking

BS = 6


def decode_words(rows):
    """A stand-in decoder: token t is the word w<t>; 0 a border (a special token, left out)."""
    return [" ".join(f"w{t}" for t in r if t) for r in rows]


def rows_of(n, seed=0):
    return np.random.default_rng(seed).integers(1, 500, (n, BS), dtype=np.int32)


def test_a_blocks_row_is_its_text_after_the_edge_of_the_block_before_cut_at_a_border():
    rows = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 0, 14, 15, 16, 17], [18] * 6], np.int32)
    got = block_texts(rows, 0, 4, {0}, decode_words)
    assert got[0] == "w1 w2 w3 w4 w5 w6"
    assert got[1] == " ".join(f"w{t}" for t in [1, 2, 3, 4, 5, 6][-EDGE:] + [7, 8, 9, 10, 11, 12])
    assert got[3].split()[:4] == ["w14", "w15", "w16", "w17"]  # the block before, from its border on
    assert "w13" not in got[3]


def test_a_query_is_its_words_quoted_so_none_is_read_as_syntax():
    assert match_words(['near', 'or"not', "NOT"]) == '"near" OR "or""not" OR "NOT"'
    index = TextIndex.in_memory("d")
    index.sync(np.array([[5, 6, 7, 8, 9, 10]], np.int32), set(), decode_words)
    assert index.search(["w7", 'a"b', "NEAR(", "*"], 5, 1) == index.search(["w7"], 5, 1) != []


def test_search_ranks_the_blocks_that_hold_the_words_and_never_past_the_blocks_asked():
    rows = rows_of(40)
    rows[17, 2] = rows[31, 4] = 999  # a rare word in two blocks
    rows[31, 5] = 998
    index = TextIndex.in_memory("d")
    assert index.sync(rows, set(), decode_words) == 40
    got = index.search(["w999", "w998"], 5, 40)  # (a block's row holds the block before's last EDGE tokens)
    assert {b for b, _ in got[:2]} == {31, 32} and {b for b, _ in got[2:]} == {17, 18}
    assert got[1][1] > got[2][1] > 0
    assert {b for b, _ in index.search(["w999"], 5, 30)} == {17, 18}
    assert index.search(["nothing"], 5, 40) == []


def test_a_words_frequency_is_the_blocks_that_hold_it_of_those_asked():
    rows = rows_of(30, seed=1) % 100 + 1  # (words w1 to w100)
    rows[3, 0] = rows[20, 1] = 999
    index = TextIndex.in_memory("d")
    index.sync(rows, set(), decode_words)
    texts = block_texts(rows, 0, 30, set(), decode_words)
    for w in ("w999", "w7", "w50"):
        for n in (10, 30):
            assert index.frequencies([w], n)[w] == sum(w in t.split() for t in texts[:n])
    assert index.frequencies(["w999"], 30) == {"w999": 4}  # (blocks 3 and 20, and each next one through its edge)
    assert index.frequencies(["nothing"], 30) == {"nothing": 0}


def test_a_writers_index_is_written_whole_sealed_and_read_as_it_lies_by_a_reader(tmp_path):
    rows = rows_of(30)
    writer = TextIndex.open(tmp_path, "d", writable=True)
    writer.sync(rows[:20], set(), decode_words)
    assert not (tmp_path / TEXT_INDEX).exists()  # (a new index is a temporary file until it closes)
    writer.close()
    assert (tmp_path / TEXT_INDEX).exists() and (tmp_path / TEXT_SEAL).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    reader = TextIndex.open(tmp_path, "d", writable=False)
    assert reader.readonly and reader.blocks == 20
    before = (tmp_path / TEXT_INDEX).read_bytes()
    assert reader.sync(rows, set(), decode_words) == 10  # blocks committed since: a copy in memory grows
    assert reader.path is None and (tmp_path / TEXT_INDEX).read_bytes() == before
    reader.close()
    with TextIndex.open(tmp_path, "d", writable=True) as again:  # the writer appends to its sealed file
        assert again.blocks == 20 and again.sync(rows, set(), decode_words) == 10
    with TextIndex.open(tmp_path, "d", writable=False) as sealed:
        assert sealed.readonly and sealed.blocks == 30


@pytest.mark.parametrize("change", ["no seal", "touched", "another tokenizer", "a journal", "a link", "other tables"])
def test_an_index_its_seal_does_not_vouch_for_is_never_read_and_a_writer_builds_it_again(tmp_path, change):
    rows = rows_of(12)
    with TextIndex.open(tmp_path, "d", writable=True) as w:
        w.sync(rows, set(), decode_words)
    path, digest = tmp_path / TEXT_INDEX, "d"
    if change == "no seal":
        (tmp_path / TEXT_SEAL).unlink()
    elif change == "touched":
        os.utime(path)
    elif change == "another tokenizer":
        digest = "e"
    elif change == "a journal":
        (tmp_path / f"{TEXT_INDEX}-journal").write_bytes(b"")
    elif change == "a link":
        os.replace(path, tmp_path / "elsewhere.sqlite")
        path.symlink_to(tmp_path / "elsewhere.sqlite")
    else:
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE planted(x)")
        from landmark_memory.format.text_file import seal_index
        seal_index(path)  # (even sealed: not an index of ours)
    reader = TextIndex.open(tmp_path, digest, writable=False)
    assert reader.path is None and reader.blocks == 0  # built in memory, the file untouched
    reader.close()
    with TextIndex.open(tmp_path, digest, writable=True) as w:
        assert w.blocks == 0 and w.sync(rows, set(), decode_words) == 12
    assert not path.is_symlink() and (tmp_path / "elsewhere.sqlite").exists() == (change == "a link")
    with TextIndex.open(tmp_path, digest, writable=False) as r:
        assert r.readonly and r.blocks == 12


def test_an_index_whose_rows_are_not_the_memorys_starts_again():
    rows = rows_of(10)
    index = TextIndex.in_memory("d")
    index.sync(rows, set(), decode_words)
    rows[3, 0] = 777  # a block rewritten
    assert index.sync(rows, set(), decode_words) == 10
    assert [b for b, _ in index.search(["w777"], 3, 10)] == [3, 4]  # (4: its edge)
    assert index.sync(rows[:6], set(), decode_words) == 6  # fewer blocks than it holds


def test_fusion_sums_each_rankings_weight_over_k_plus_the_rank():
    heads, text = [(4, 9.0), (2, 5.0), (7, 1.0)], [(2, 3.0), (9, 2.0)]
    got = dict(fuse((heads, 1.0), (text, 2.0), k=10))
    assert got == pytest.approx({4: 1 / 11, 2: 1 / 12 + 2 / 11, 7: 1 / 13, 9: 2 / 12})
    assert [b for b, _ in fuse((heads, 1.0), (text, 2.0), k=10)] == [2, 9, 4, 7]
    three = dict(fuse((heads, 1.0), (text, 2.0), ([(7, 0.5)], 3.0), k=10))  # any number of rankings
    assert three == pytest.approx({**got, 7: 1 / 13 + 3 / 11})
    assert fuse((heads, 1.0), ([], 2.0), k=10) == heads  # one ranking alone is its own fusion


def test_search_fuses_the_heads_and_the_text_index_and_leaves_a_read_only_memory_as_it_was(corpus):
    tok, model = ChatTokenizer([]), LandmarkGPT.from_pretrained()
    loaded = LoadedModel(model, tok, EvidenceHeads(((0, 1), (3, 2)), blocks=2, candidates=8))
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        n, tokens = mem.n_blocks, mem.n_tokens
        assert n > 8  # past the candidates: the text index's blocks join the block keys'
        found = search(mem, loaded, "Who found the treasure map?", k=4)
        assert mem.n_tokens == tokens and mem.n_blocks == n
        r = found.ranking
        assert r.text and {b for b, _ in r.text} <= {b for b, _ in r.heads}
        assert r.fused == fuse((r.heads, 1.0), (r.text, TEXT_WEIGHT))
        assert [p.block for p in found.passages] == [b for b, _ in r.fused[:4]]
        assert r.text == text_ranking(mem, tok, "Who found the treasure map?", n)
        holds = [b for b, _ in r.text]
        text = tok.decode(mem.tokens(0, holds[0], holds[0] + 1).tolist()).lower()
        assert any(w in text for w in ("treasure", "map", "found"))
        assert found.quote is not None and found.quote.source is not None
        assert json.loads(json.dumps(found.to_json()))["ranking"]["fused"] == [p.block for p in found.passages]
        with pytest.raises(ValueError, match="question"):
            search(mem, loaded, "   ")


def test_a_words_rarity_is_bm25s_inverse_frequency_over_the_memorys_blocks(corpus):
    model, tok = LandmarkGPT.from_pretrained(), ChatTokenizer([])
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        n = mem.n_blocks
        texts = [tok.decode(mem.tokens(0, b, b + 1).tolist()).lower() for b in range(n)]
        common = max(("the", "and", "of"), key=lambda w: sum(w in t.split() for t in texts))
        rarity = word_rarity(mem, tok, asked_words(f"Which treasure map {common} zanzibar?"), n)
        assert set(rarity) == {"treasure", "map", "zanzibar"}  # (its own words: "the", "which" are not)
        assert rarity["zanzibar"] == pytest.approx(np.log(1 + (n + 0.5) / 0.5))  # in no block
        assert 0 < rarity["treasure"] < rarity["zanzibar"]
        assert word_rarity(mem, tok, asked_words("What of it?"), n) == {}


def test_a_model_without_heads_searches_by_the_text_index_alone(corpus):
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        found = search(mem, load_tokenizer(), "the treasure map", k=3)
    assert found.ranking.heads == [] and [p.block for p in found.passages] == [b for b, _ in found.ranking.text[:3]]


def test_build_writes_the_text_index_and_the_index_command_brings_an_older_memory_up(documents, tmp_path, capsys):
    path = tmp_path / "m"
    assert main(["build", str(path), "--input", str(documents), "--chunk-size", "100", "--quiet"]) == 0
    assert (path / TEXT_INDEX).exists() and (path / TEXT_SEAL).exists()
    capsys.readouterr()
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["text_index"]["sealed"] and info["text_index"]["blocks"] == info["blocks"]
    os.utime(path / TEXT_INDEX)
    assert main(["info", str(path)]) == 0
    assert "not sealed" in capsys.readouterr().out
    (path / TEXT_INDEX).unlink()
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 7}))  # as format 7 wrote it
    assert main(["index", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["added"] == doc["blocks"] > 0 and doc["format_was"] == 7
    assert json.loads((path / "manifest.json").read_text())["format_version"] == 8  # committed in this format
    tok = load_tokenizer()
    with LandmarkMemory.open(path, LandmarkGPT.from_pretrained()) as mem:
        with pytest.raises(ValueError, match="writer"):
            LandmarkMemory.open(path, mem.model, readonly=True).text_index.keep(tok)
        assert mem.text_index.keep(tok) == 0


def test_the_search_command_prints_the_passages_and_their_places_or_json(corpus, capsys):
    assert main(["search", str(corpus), "the treasure map", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Q: the treasure map") and "1. block" in out and " ms; " in out
    assert main(["search", str(corpus), "the treasure map", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert 1 <= len(doc["passages"]) <= 5 and doc["passages"][0]["source"].endswith(".txt")
    assert doc["ranking"]["fused"] == [p["block"] for p in doc["passages"]]


def test_a_documents_end_is_a_border_of_the_text_index(corpus):
    tok = load_tokenizer()
    eos = tok.token_to_id(EOS_TOKEN)
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        rows = mem.tokens(0).reshape(-1, mem.shape.block_size)
    ends = [b for b in range(1, len(rows)) if eos in rows[b - 1, -EDGE:].tolist()]
    assert ends  # (the fixture's documents end inside some block's last tokens)
    got = block_texts(rows, ends[0], ends[0] + 1, {eos}, lambda r: [tok.decode(x) for x in r])
    before = rows[ends[0] - 1, -EDGE:].tolist()
    assert got[0] == tok.decode(before[max(i for i, t in enumerate(before) if t == eos) + 1:] + rows[ends[0]].tolist())


def test_a_sessions_turns_are_found_by_their_words_after_the_memorys_blocks(documents, tmp_path):
    from landmark_memory.uses.answer import say
    from landmark_memory.uses.session import Session

    path, tok = tmp_path / "m", load_tokenizer()
    assert main(["build", str(path), "--input", str(documents), "--chunk-size", "100", "--quiet"]) == 0
    with LandmarkMemory.open(path, LandmarkGPT.from_pretrained(), readonly=True) as mem, \
            Session.open(mem, "notes") as s:
        base = mem.n_blocks
        turn = "My cat Zanzibar sleeps on the velvet cushion of the old piano every afternoon. " + \
            "Then the rain came down on the roof of the house, and we sat by the fire and talked. " * 6
        say(s, tok, turn, max_new_tokens=4)  # (a turn long enough to fill the open chunk's blocks)
        n = mem.n_blocks
        got = text_ranking(mem, tok, "Where does Zanzibar sleep?", n)
        assert n > base and got and all(b >= base for b, _ in got)
        said = search(mem, tok, "Zanzibar velvet cushion", k=1).passages[0]
        assert said.session == "notes" and said.turn == 0
