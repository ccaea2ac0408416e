"""The library's ask: the answer and the passages it read, as the command gives them."""

import json

import pytest

from landmark_memory import LandmarkGPT, LandmarkMemory, ask, load_tokenizer
from landmark_memory.cli import main

QUESTION = "What did the captain say?"


@pytest.fixture(scope="module")
def corpus(documents, tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "m"
    assert main(["build", str(path), "--input", str(documents), "--chunk-size", "100", "--quiet"]) == 0
    return path


def answer(path, **options):
    model = LandmarkGPT.from_pretrained()
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        return ask(mem, load_tokenizer(), QUESTION, **options)


def test_ask_gives_what_the_command_gives(corpus, documents, capsys):
    assert main(["ask", str(corpus), QUESTION, "--max-new-tokens", "6", "--passages", "4", "--json", "--quiet"]) == 0
    shown = json.loads(capsys.readouterr().out)
    got = answer(corpus, max_new_tokens=6, passages=4)
    assert got.text == shown["text"] and got.to_json()["passages"] == shown["retrieved"]
    assert len(got.tokens) == 6 and got.memory_tokens == shown["memory_tokens"] and not got.chat
    assert got.passages and {p.source for p in got.passages} <= {str(f) for f in documents.glob("*.txt")}
    assert sum(p.share for p in got.passages) <= 1 + 1e-9 and all(p.token_offset % 50 == 0 for p in got.passages)


def test_streamed_tokens_are_the_answers_tokens_in_order(corpus):
    seen = []
    got = answer(corpus, max_new_tokens=5, on_token=seen.append)
    assert seen == got.tokens


def test_a_fresh_memory_answers_the_same_question_the_same_way(corpus):
    assert answer(corpus, max_new_tokens=4) == answer(corpus, max_new_tokens=4)


@pytest.mark.parametrize("question,options,words", [(" ", {}, "empty"), (QUESTION, {"max_new_tokens": -1}, ">= 0")])
def test_bad_questions_are_refused(corpus, question, options, words):
    model = LandmarkGPT.from_pretrained()
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, pytest.raises(ValueError, match=words):
        ask(mem, load_tokenizer(), question, **options)
