import random
import re

import numpy as np
import pytest
import torch

from landmark_memory import (
    insert_landmarks,
    landmark_mask,
    lm_targets,
    load_tokenizer,
    normal_positions,
    strip_landmarks,
)
from landmark_memory.core.layout import IGNORE_INDEX
from landmark_memory.core.passkey import PasskeyPrompts, first_int, run_passkey
from landmark_memory.core.tokenizer import EOS_TOKEN, LANDMARK_TOKEN, SPECIAL_TOKENS
from landmark_memory.jobs.evaluate import parse_lengths
from landmark_memory.training.data import (
    SAMPLE_DIR,
    Answer,
    PasskeyMix,
    WindowSampler,
    list_text_files,
    read_text,
    split_books,
    strip_gutenberg,
)

LM = 1


def test_shipped_tokenizer_has_reserved_specials_and_round_trips_text():
    tok = load_tokenizer()
    assert 8192 <= tok.get_vocab_size() <= 16384
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.token_to_id(LANDMARK_TOKEN) == LM
    text = "‘Curiouser and curiouser!’ cried Alice.\n  The pass key is 31337. Ünïcødé ✓"
    ids = tok.encode(text).ids
    assert LM not in ids
    assert tok.decode(ids) == text


def test_landmark_text_in_input_is_not_the_landmark_token():
    tok = load_tokenizer()
    ids = tok.encode("a <|landmark|> b", add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False).count("<|landmark|>") == 1  # it round-trips as text...
    assert tok.get_vocab_size() > max(ids)


@pytest.mark.parametrize("T,bs", [(0, 3), (1, 1), (7, 3), (9, 3), (130, 50), (150, 50)])
def test_insert_then_strip_round_trips(T, bs):
    idx = torch.randint(4, 100, (2, T))
    x = insert_landmarks(idx, bs, LM)
    assert x.shape == (2, T + T // bs)
    lm = landmark_mask(x.shape[1], bs)
    assert (x[:, lm] == LM).all() and (x[:, ~lm] != LM).all()
    assert torch.equal(x[:, normal_positions(T, bs)], idx)
    assert torch.equal(strip_landmarks(x, bs), idx)


def test_landmark_positions_follow_the_rule():
    x = insert_landmarks(torch.arange(10, 17), 3, LM)  # 7 normal tokens, block 3
    assert x.tolist() == [10, 11, 12, LM, 13, 14, 15, LM, 16]


def test_strip_landmarks_along_another_dim():
    h = torch.randn(2, 9, 5)
    assert torch.equal(strip_landmarks(h, 2, dim=1), h[:, [0, 1, 3, 4, 6, 7]])


def test_lm_targets_skip_landmarks_and_carry_no_loss_on_them():
    x = insert_landmarks(torch.arange(10, 17), 3, LM)  # [10 11 12 L 13 14 15 L 16]
    y = lm_targets(x, 3)
    I = IGNORE_INDEX
    assert y.tolist() == [11, 12, 13, I, 14, 15, 16, I, I]


@pytest.mark.parametrize("T,bs", [(12, 3), (101, 50), (5, 7)])
def test_lm_targets_at_normal_positions_are_the_next_token(T, bs):
    idx = torch.randint(4, 100, (3, T))
    y = lm_targets(insert_landmarks(idx, bs, LM), bs)
    assert torch.equal(strip_landmarks(y, bs)[:, :-1], idx[:, 1:])
    assert (y[:, landmark_mask(y.shape[1], bs)] == IGNORE_INDEX).all()


def test_strip_gutenberg_keeps_only_the_body():
    text = ("\ufeffHeader\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\nBody line.\r\n"
            "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nLicence")
    assert strip_gutenberg(text) == "Body line.\n"
    assert strip_gutenberg("plain text") == "plain text\n"


def test_split_books_holds_out_whole_books_reproducibly(tmp_path):
    for i in range(20):
        (tmp_path / f"b{i:02d}.txt").write_text("x")
    files = list_text_files(tmp_path)
    train, val = split_books(files)
    assert len(val) == 1 and len(train) == 19 and not set(train) & set(val)
    assert split_books(files, 4) == split_books(files, 4)
    with pytest.raises(ValueError, match="hold out"):
        split_books(files[:1], 1)


def test_list_text_files_explains_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        list_text_files(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no .txt files"):
        list_text_files(tmp_path)


def test_passkey_mix_plants_fact_and_answer_without_changing_length():
    tok = load_tokenizer()
    mix = PasskeyMix(tok, rate=1.0, copy_rate=0.0)
    out = np.full(200, 5, dtype=np.int64)
    [ans] = mix(out, random.Random(3))
    a, b = ans.span
    text = tok.decode(out.tolist())
    key = text.split("The pass key is ")[1].split(".")[0]
    assert len(out) == 200 and b == 200 and tok.decode(out[a:b].tolist()).strip() == f"{key}."
    assert f"{key} is the pass key" in text and text.rstrip().endswith(f"What is the pass key? The pass key is {key}.")


def test_passkey_mix_packs_prompts_each_asking_for_its_own_key():
    tok = load_tokenizer()
    mix = PasskeyMix(tok, rate=1.0, max_prompts=4, copy_rate=0.0)
    counts = set()
    for seed in range(12):
        out = np.arange(1000, 1513, dtype=np.int64)
        spans = mix(out, random.Random(seed))
        text = tok.decode(out.tolist())
        asked = re.findall(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key", text)
        answers = re.findall(r"What is the pass key\? The pass key is (\d+)\.", text)
        assert len(out) == 513 and [a for a, b in asked] == [b for a, b in asked] == answers
        assert [tok.decode(out[a:b].tolist()).strip() for a, b in (s.span for s in spans)] == [f"{k}." for k in answers]
        counts.add(len(answers))
    assert counts == {1, 2, 3, 4}


def test_copy_drills_repeat_a_stretch_of_the_window():
    mix = PasskeyMix(load_tokenizer(), rate=1.0, copy_rate=1.0)
    out = np.arange(1000, 1513, dtype=np.int64)
    assert mix(out, random.Random(0)) == []  # every token is a copy: no answer stands out
    period = next(p for p in range(16, 257) if np.array_equal(out[p:], out[:-p]))
    assert len(out) == 513 and np.array_equal(out[:period], np.arange(out[0], out[0] + period))


def test_passkey_prompt_has_the_asked_length_and_depth():
    prompts = PasskeyPrompts(load_tokenizer())
    for n, depth in [(100, 0.0), (2000, 0.5), (5000, 1.0)]:
        ids = prompts.prompt(n, 31415, depth)
        text = prompts.tok.decode(ids)
        assert len(ids) == n and text.endswith("What is the pass key? The pass key is")
        at = text.index("The pass key is 31415")
        assert n == 100 or abs(at / len(text) - depth) < 0.05
    with pytest.raises(ValueError, match="needs more than"):
        prompts.prompt(20, 1, 0.5)


def test_run_passkey_records_each_trials_key_depth_and_answer():
    tok = load_tokenizer()

    def generate(ids):  # knows the key only when it sits in the first half of the prompt
        text = tok.decode(ids)
        key = int(re.search(r"The pass key is (\d+)", text).group(1))
        return f" {key}." if text.index("The pass key is") < len(text) / 2 else " none"

    rows = run_passkey(generate, tok, [300, 600], trials=6, seed=3)
    assert [(r["length"], r["trials"]) for r in rows] == [(300, 6), (600, 6)]
    for r in rows:
        assert len(r["answers"]) == 6 and r["correct"] == sum(a["answer"] == a["key"] for a in r["answers"])
        assert all((a["answer"] == a["key"]) == (a["depth"] < 0.5) for a in r["answers"] if abs(a["depth"] - 0.5) > 0.1)
        assert all(a["answer"] is None for a in r["answers"] if a["answer"] != a["key"])
        assert r["accuracy"] == r["correct"] / 6
    assert 0 < sum(r["correct"] for r in rows) < 12  # both outcomes occur with this seed
    assert run_passkey(generate, tok, [300, 600], trials=6, seed=3) == rows


def test_first_int_and_length_parsing():
    assert first_int(" 4821. Remember") == 4821 and first_int(" no digits") is None
    assert parse_lengths("1k, 4k,300,1m") == [1024, 4096, 300, 1 << 20]
    with pytest.raises(ValueError, match="cannot read length"):
        parse_lengths("4x")


def test_read_text_explains_what_is_wrong(tmp_path):
    for data, message in [(b"", "is empty"), (b"\x00\x01\x02", "looks binary"),
                          ("d\u00e9j\u00e0".encode("latin-1"), "not UTF-8")]:
        (tmp_path / "f.txt").write_bytes(data)
        with pytest.raises(ValueError, match=message):
            read_text(tmp_path / "f.txt")


def test_window_sampler_targets_are_inputs_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    batch = WindowSampler(tokens, seq_len=32, batch_size=4, seed=0).batch()
    x, y, w = batch.x, batch.y, batch.w
    assert x.shape == y.shape == w.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    assert torch.equal(w, torch.ones(4, 32))


def test_window_sampler_weighs_the_targets_of_answer_tokens_and_marks_where_they_are_read_from():
    tokens = np.arange(1000, dtype=np.uint16)

    def mix(window, rng):  # the window's tokens 5..8 answer from 1..3, 30..33 from 10..12 and 20..21
        window[5:8] = window[30:33] = 0
        return [Answer((5, 8), ((1, 3),)), Answer((30, 33), ((10, 12), (20, 21)))]

    batch = WindowSampler(tokens, seq_len=32, batch_size=2, seed=0, mix=mix, answer_weight=4.0).batch()
    w, y = batch.w, batch.y
    assert torch.equal(w == 4.0, y == 0) and int((w == 4.0).sum()) == 2 * 6 and torch.all((w == 1.0) | (w == 4.0))
    answer, source = torch.zeros(32, dtype=torch.int64), torch.zeros(32, dtype=torch.int64)
    answer[4:7], answer[29:32] = 1, 2  # aligned with the targets: y[:, t] is window token t + 1
    source[1:3], source[10:12], source[20:21] = 1, 2, 2  # aligned with the inputs
    assert all(torch.equal(batch.answer[r], answer) and torch.equal(batch.source[r], source) for r in range(2))
    with pytest.raises(ValueError, match="answer weight must be positive"):
        WindowSampler(tokens, seq_len=32, batch_size=2, seed=0, answer_weight=0.0)


ODD_TEXT = ("It was 1,234 years ago,  said   the captain.\n\n\tNaïve café — “quoted” words; a_b c-d e'f "
            "don't 42nd\u2028next\r\nline ") * 40


def test_a_text_tokenized_in_pieces_has_the_ids_of_the_whole(monkeypatch):
    from landmark_memory.jobs import build

    tok, book = load_tokenizer(), read_text(SAMPLE_DIR / "train" / "treasure_island_excerpt.txt")[:20000]
    monkeypatch.setattr(build, "PIECE_CHARS", 300)
    for text in (book, ODD_TEXT, "one" * 2000, book.replace(" ", "\n")):
        whole = tok.encode(strip_gutenberg(text)).ids + [tok.token_to_id(EOS_TOKEN)]
        parts = list(build.pieces(strip_gutenberg(text), lambda a, b: True, size=300))
        assert "".join(parts) == strip_gutenberg(text)
        assert build.encode(tok, text).tolist() == whole
    assert len(list(build.pieces(book, lambda a, b: True, size=300))) > 20  # (cut into many pieces)
    tried = []
    assert list(build.pieces(book, lambda a, b: tried.append(a) or False, size=300)) == [book]  # never cuts: whole
    assert len(tried) == build.CUT_TRIES  # (after a few places tried, not every word of the text)
    refused = set()
    kept = list(build.pieces(book, lambda a, b: len(refused) > 3 or refused.add(a) or False, size=300))
    assert len(refused) == 4 and "".join(kept) == book and len(kept) > 20  # (refused places passed over)


CJK = ("\u5929\u4e0b\u5927\u52bf\uff0c\u5206\u4e45\u5fc5\u5408\uff0c\u5408\u4e45\u5fc5\u5206\u3002"
       "\u5468\u672b\u4e03\u56fd\u5206\u4e89")


@pytest.mark.parametrize("shape", ["two spaces", "no-break spaces", "tabs", "no spaces", "one long word"])
def test_a_text_of_any_shape_is_cut_into_bounded_pieces_with_the_ids_of_the_whole(monkeypatch, shape):
    from landmark_memory.jobs import build

    tok = load_tokenizer()
    book = read_text(SAMPLE_DIR / "train" / "treasure_island_excerpt.txt")[:12000]
    text = {"two spaces": book.replace(" ", "  "), "no-break spaces": book.replace(" ", "\u00a0"),
            "tabs": book.replace(" ", "\t"), "no spaces": CJK * 300, "one long word": "abcdefghij" * 600}[shape]
    monkeypatch.setattr(build, "PIECE_CHARS", 300)
    monkeypatch.setattr(build, "CUT_REACH", 200)
    ids = build.encode(tok, text).tolist()

    def bounds(window):
        return [end for _, end in tok.encode(window).offsets]

    parts = list(build.pieces(strip_gutenberg(text), lambda a, b: True, bounds))
    assert "".join(parts) == strip_gutenberg(text) and len(parts) > 10
    assert max(map(len, parts)) <= 300 + 200 + 2 * build.CUT_WINDOW  # never the rest whole
    assert ids == tok.encode(strip_gutenberg(text)).ids + [tok.token_to_id(EOS_TOKEN)]
