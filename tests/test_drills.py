"""Retrieval drills in book text (drills.py): every question asks a planted fact and its answer
copies that fact, or asks for a sentence of the book text and quotes it whole; the window keeps
its length and its book text; the training words stay apart from the evaluation's."""

import random
import re

import numpy as np
import pytest
from helpers import script

from landmark_memory import load_tokenizer
from landmark_memory.training.data import SAMPLE_DIR
from landmark_memory.training.drills import (
    ADJECTIVES,
    FIRST,
    LAST,
    PET_WORDS,
    ROLES,
    THINGS,
    TITLES,
    RetrievalDrills,
    village_fact,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def book(tok):
    text = (SAMPLE_DIR / "book" / "up_from_slavery.txt").read_text()[20_000:40_000]
    return np.asarray(tok.encode(text).ids, dtype=np.int64)


def numbers(text):
    return re.findall(r"\d+", text)


def test_every_answer_copies_the_values_of_the_fact_it_asks(tok, book):
    drills = RetrievalDrills(tok, rate=1.0)
    seen_kinds = set()
    for seed in range(40):
        window = book[:1500].copy()
        d = drills.drill(window, random.Random(seed))
        facts, asked = d.facts, d.asked
        text = tok.decode(window.tolist())
        assert len(window) == 1500 and 1 <= len(asked) <= min(3, len(facts))
        assert set(map(id, asked)) <= set(map(id, facts))
        at = [text.index(s.strip()) for f in facts for s in f.sentences]  # planted, in order within a fact
        tail = text[max(at):]
        for f in asked:
            said = f.completion if f.completion.strip() in tail else f.chat
            assert said.strip() in tail
            assert numbers(said) == list(dict.fromkeys(n for s in f.sentences for n in numbers(s)))
            assert f.key == "pass key" or "magic" in f.question or f.sentences == (" " + f.chat,)
            seen_kinds.add(f.key if f.key == "pass key" else "magic" if "magic" in f.question else "village")
        spans = [tok.decode(window[a:b].tolist()).strip() for a, b in d.answers]  # each answer, nothing else
        assert spans == [(f.completion if f.completion.strip() in tail else f.chat).strip() for f in asked]
        assert d.answers[-1][1] == len(window)
    assert seen_kinds == {"pass key", "magic", "village"}


def test_a_window_holds_distinct_keys_and_keeps_its_book_text_in_order(tok, book):
    drills = RetrievalDrills(tok, rate=1.0, max_facts=6)
    for seed in range(20):
        window = book[:1200].copy()
        facts = drills.drill(window, random.Random(seed)).facts
        keys = [f.key for f in facts]
        assert len(set(keys)) == len(keys) and keys.count("pass key") <= 1
        hay = book[:200].tolist()  # the window's first book tokens come through, in order
        kept = iter(window.tolist())
        assert all(any(t == u for u in kept) for t in hay)


def test_rate_picks_that_share_of_windows_and_only_those_have_answers(tok, book):
    drills, rng, changed = RetrievalDrills(tok, rate=0.3), random.Random(0), 0
    for _ in range(200):
        window = book[:600].copy()
        answers = drills(window, rng)
        assert bool(answers) != np.array_equal(window, book[:600])
        changed += bool(answers)
    assert 40 <= changed <= 80
    window = book[:600].copy()
    assert RetrievalDrills(tok, rate=0.0)(window, rng) == [] and np.array_equal(window, book[:600])


def test_a_quote_question_names_words_of_a_book_sentence_and_its_answer_repeats_that_sentence(tok, book):
    drills, quoted = RetrievalDrills(tok, rate=1.0, quote_share=1.0), 0
    for seed in range(20):
        window = book[:1500].copy()
        d = drills.drill(window, random.Random(seed))
        quotes = [(f, span) for f, span in zip(d.asked, d.answers) if f.key == "quote"]
        assert len(quotes) <= 1 and all(f.key != "quote" for f in d.facts)  # asked, never planted
        for f, (a, b) in quotes:
            quoted += 1
            given = re.search(r'"(.+)"', f.question).group(1)
            assert tok.decode(window[a:b].tolist()).strip() in (f.chat, f.completion.strip()) and given in f.chat
            first = min(a for _, (a, _) in zip(d.asked, d.answers))
            hay = " ".join(tok.decode(window[:first].tolist()).split())  # before every question, one line
            assert hay.count(f.chat) == 1  # the sentence stands whole in the book text, no fact planted inside
            assert " ".join(tok.decode(book[:1500].tolist()).split()).count(f.chat) == 1  # and it is the book's own
    assert quoted >= 15  # a short window may have no sentence to spare
    plain = RetrievalDrills(tok, rate=1.0)  # quote_share 0: the drills of earlier stages, unchanged
    assert all(f.key != "quote" for seed in range(20)
               for f in plain.drill(book[:1500].copy(), random.Random(seed)).asked)


def test_bad_settings_and_short_windows_say_what_to_change(tok, book):
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        RetrievalDrills(tok, rate=1.5)
    with pytest.raises(ValueError, match="quote share must be in \\[0, 1\\], got 1.0, 0.5 and -0.1"):
        RetrievalDrills(tok, rate=1.0, quote_share=-0.1)
    with pytest.raises(ValueError, match="max_questions <= max_facts"):
        RetrievalDrills(tok, rate=1.0, max_facts=2, max_questions=3)
    with pytest.raises(ValueError, match="too short for a retrieval drill"):
        RetrievalDrills(tok, rate=1.0).drill(book[:20].copy(), random.Random(0))


def test_chat_questions_are_user_turns_answered_before_the_end_of_turn(book):
    from transformers import AutoTokenizer

    from landmark_memory.models.hf.smollm2 import base_model_dir
    from landmark_memory.models.hf.tokenizer import TextTokenizer

    tok = TextTokenizer(AutoTokenizer.from_pretrained(base_model_dir()))
    ids = np.asarray(tok.encode((SAMPLE_DIR / "book" / "up_from_slavery.txt").read_text()[20_000:30_000]).ids)
    window = ids[:1500].astype(np.int64)
    d = RetrievalDrills(tok, rate=1.0, chat_share=1.0).drill(window, random.Random(1))
    text = tok.decode(window.tolist())
    for f, (a, b) in zip(d.asked, d.answers):
        assert f"<|im_start|>user\n{f.question}<|im_end|>\n<|im_start|>assistant\n{f.chat}<|im_end|>" in text
        assert tok.decode(window[a:b].tolist()) == f"{f.chat}<|im_end|>"  # the answer and its end of turn
    assert text.endswith("<|im_end|>")


def test_training_words_never_name_what_the_evaluations_ask():
    ruler, common = script("_ruler_tasks"), script("_common")
    assert not set(ADJECTIVES) & set(ruler.WORDS) and not set(THINGS) & set(ruler.NOUNS)
    evaluated = " ".join(s + " " + q for s, q, _ in common.PLANTED_FACTS).lower()
    assert not [w for w in ROLES + FIRST + LAST + TITLES + PET_WORDS if re.search(rf"\b{w.lower()}\b", evaluated)]
    rng, wanted = random.Random(0), [w.lower() for _, _, words in common.PLANTED_FACTS for w in words]
    said = " ".join(village_fact(rng).chat for _ in range(3000)).lower()
    assert not [w for w in wanted if re.search(rf"\b{w}\b", said)]  # no drill answers what an evaluation asks


def test_village_values_come_from_open_sets_so_an_answer_must_be_copied():
    rng = random.Random(0)
    facts = [village_fact(rng) for _ in range(2000)]
    named = [f.chat.split(" called ")[1] for f in facts if " called " in f.chat]
    assert len(set(named)) > 0.8 * len(named) > 100  # names hardly repeat
    counted = [f.chat for f in facts if f.question.startswith("How many")]
    assert len({re.search(r"(hid|sold) (\S+)", c).group(2) for c in counted}) > 50  # counts in words, 2 to 99
    assert all(f.sentences == (" " + f.chat,) for f in facts)
