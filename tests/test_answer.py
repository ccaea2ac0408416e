"""The library's ask: the answer and the passages it read, as the command gives them."""

import json
from collections import Counter

import pytest
import torch
from helpers import ChatTokenizer

from landmark_memory import LandmarkGPT, LandmarkMemory, ask, load_tokenizer
from landmark_memory.app.cli import main
from landmark_memory.models.config import AskPolicy
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.uses.search import text_ranking

QUESTION = "What did the captain say?"


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




def test_a_chat_answer_ends_at_any_end_of_turn_token_and_leaves_it_out(corpus):
    model = LandmarkGPT.from_pretrained()
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        free = ask(mem, ChatTokenizer([]), QUESTION, max_new_tokens=6)
    assert free.chat and len(free.tokens) == 6
    stop = free.tokens[2]  # the third token of the free answer ends it, whichever end-of-turn token it is
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        seen = []
        got = ask(mem, ChatTokenizer([stop + 1, stop]), QUESTION, max_new_tokens=6, on_token=seen.append)
    cut = free.tokens[:free.tokens.index(stop)]
    assert got.tokens == cut and seen == cut and got.text == load_tokenizer().decode(cut)


def test_a_fresh_memory_answers_the_same_question_the_same_way(corpus):
    assert answer(corpus, max_new_tokens=4) == answer(corpus, max_new_tokens=4)


@pytest.mark.parametrize("question,options,words", [(" ", {}, "empty"), (QUESTION, {"max_new_tokens": -1}, ">= 0")])
def test_bad_questions_are_refused(corpus, question, options, words):
    model = LandmarkGPT.from_pretrained()
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, pytest.raises(ValueError, match=words):
        ask(mem, load_tokenizer(), question, **options)


def test_ask_centres_the_question_and_answer_and_leaves_the_memorys_options_as_they_were(corpus):
    model = LandmarkGPT.from_pretrained()
    with LandmarkMemory.open(corpus, model, readonly=True, centre=True) as mem:
        want = ask(mem, load_tokenizer(), QUESTION, max_new_tokens=6)  # the memory centres already
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        got = ask(mem, load_tokenizer(), QUESTION, max_new_tokens=6, centre=True)
        assert mem.options.centre is False
        mem.rewind()
        plain = ask(mem, load_tokenizer(), QUESTION, max_new_tokens=6)  # the bundled model's policy: no centring
        mem.rewind()
        told = ask(mem, LoadedModel(model, load_tokenizer(), policy=AskPolicy(centre=True)), QUESTION, max_new_tokens=6)
    assert got == want == told
    assert got.passages != plain.passages  # centring changed what was read


@pytest.mark.parametrize("deep", [False, True])
def test_passages_are_ranked_by_the_layers_the_models_policy_names(corpus, deep):
    model = LandmarkGPT.from_pretrained()
    tok = load_tokenizer()
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        got = ask(mem, LoadedModel(model, tok, policy=AskPolicy(deep_passages=deep)), QUESTION, max_new_tokens=6,
                  passages=50)
        mem.rewind()
        n, half, first, rest = mem.n_blocks, mem.shape.n_layer // 2 if deep else 0, Counter(), Counter()

        def read(retrieved):
            for layer, r in enumerate(retrieved):
                (rest if layer >= half else first).update(b for b in r[0].flatten().tolist() if 0 <= b < n)

        pinned = [b for b, _ in text_ranking(mem, tok, QUESTION, n, 1)]  # (no heads: the text index's block first)
        with mem.reading(pinned):
            mem.generate(torch.tensor([tok.encode(QUESTION).ids]), 6, on_read=read)
    total = sum(rest.values())
    ranked = pinned + [b for b, _ in rest.most_common() if b not in pinned]
    assert [(p.block, p.share) for p in got.passages] == [(b, rest[b] / total) for b in ranked[:50]]
    assert not deep or first.most_common(3) != rest.most_common(3)  # the first layers chose otherwise


def test_a_bad_ask_policy_in_an_adapter_is_explained():
    with pytest.raises(ValueError, match="landmark.json: 'ask' must map"):
        AskPolicy.from_dict({"centre": "yes"}, "landmark.json")
    assert AskPolicy.from_dict({"deep_passages": True}, "x") == AskPolicy(False, True)


def test_a_memory_asked_through_another_models_loaded_model_is_refused(corpus):
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem, \
            pytest.raises(ValueError, match="not the one this memory reads with"):
        ask(mem, LoadedModel(LandmarkGPT.from_pretrained(), load_tokenizer()), QUESTION)
