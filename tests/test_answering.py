"""How a question is answered: the answer policy chosen from the loaded model (or named), a new
policy added in one registry line, the one set of options the command line, the chat and the
server answer by, and the text index the engine keeps at every commit."""

import dataclasses
import json

import pytest
import torch
from helpers import ChatTokenizer

from landmark_memory import LandmarkGPT, LandmarkMemory, ask, load_tokenizer
from landmark_memory.app import serve_routes
from landmark_memory.app.cli import main
from landmark_memory.app.cli_args import parser
from landmark_memory.core.ask_options import AskOptions
from landmark_memory.format.text_file import TEXT_SEAL
from landmark_memory.format.text_index import TEXT_INDEX, TextIndex
from landmark_memory.models.config import AskPolicy
from landmark_memory.models.heads import EvidenceHeads
from landmark_memory.models.kinds import tokenizer_digest
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.models.reader import Reader
from landmark_memory.uses import answering
from landmark_memory.uses.answering.plan import Plan
from landmark_memory.uses.question import Question

QUESTION = "Who found the treasure map?"
HEADS = EvidenceHeads(((0, 1), (3, 2)), blocks=2)


def test_the_first_policy_that_fits_the_loaded_model_answers_it():
    model, chat, plain = LandmarkGPT.from_pretrained(), ChatTokenizer([]), load_tokenizer()
    reader = Reader(None, "template")
    cases = [(LoadedModel(model, chat, HEADS), AskOptions(), "heads"),
             (LoadedModel(model, chat, HEADS), AskOptions(raw=True), "text"),  # raw: no template, no heads
             (LoadedModel(model, plain, HEADS), AskOptions(), "text"),  # heads of a template, none here
             (LoadedModel(model, plain, dataclasses.replace(HEADS, frame="Q: {question}\nA:")), AskOptions(), "heads"),
             (LoadedModel(model, chat, reader=reader, policy=AskPolicy(reader_blocks=2)), AskOptions(), "reader"),
             (LoadedModel(model, chat, reader=reader), AskOptions(), "text"),  # a reader its policy asks nothing of
             (LoadedModel(model, chat), AskOptions(), "text")]
    for loaded, options, want in cases:
        assert answering.choose_policy(loaded, options) is answering.POLICIES[want]


def test_a_policy_named_in_the_options_answers_where_it_fits_and_is_refused_where_it_does_not(corpus):
    model, tok = LandmarkGPT.from_pretrained(), ChatTokenizer([])
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        bare = ask(mem, tok, QUESTION, max_new_tokens=4)
        mem.rewind()
        by_text = ask(mem, LoadedModel(model, tok, HEADS), QUESTION, max_new_tokens=4, policy="text")
        mem.rewind()
        by_heads = ask(mem, LoadedModel(model, tok, HEADS), QUESTION, max_new_tokens=4, refuse=False)
        with pytest.raises(ValueError, match="the heads policy does not fit"):
            ask(mem, tok, QUESTION, policy="heads")
        with pytest.raises(ValueError, match="policy must be one of heads, reader, text"):
            ask(mem, tok, QUESTION, policy="everything")
    assert by_text == bare and by_text.quote is None  # the heads the model has, left unread
    assert by_heads.quote is not None


class FirstBlock:
    """A policy of a test: every answer token reads the memory's first block first."""

    def fits(self, model, options):
        return True

    def plan(self, mem, model, messages, options, first):
        question = Question.pose(mem, model.tokenizer, messages[-1].content, messages[-1].content,
                                 [messages[-1].content])
        return Plan(False, 0, list(question.ids), [0] if question.n_blocks else [])


def test_a_new_policy_is_a_class_of_two_methods_and_one_registry_line(corpus, monkeypatch):
    monkeypatch.setitem(answering.POLICIES, "first-block", FirstBlock())
    model, tok = LandmarkGPT.from_pretrained(), load_tokenizer()
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        got = ask(mem, tok, QUESTION, max_new_tokens=4, policy="first-block")
        mem.rewind()
        seen = []
        with mem.reading([0]):
            want = mem.generate(torch.tensor([tok.encode(QUESTION).ids]), 4, on_read=seen.append)[0].tolist()
    assert got.passages[0].block == 0 and got.tokens == want
    assert all((r[..., 0] == 0).all() for retrieved in seen for r in retrieved)


def test_the_command_line_asks_by_the_policy_named_and_refuses_one_the_model_cannot_answer_by(corpus, capsys,
                                                                                             refused):
    argv = ["ask", str(corpus), QUESTION, "--max-new-tokens", "3", "--json", "--quiet"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--policy", "text"]) == 0  # (what the bundled model answers by anyway)
    assert json.loads(capsys.readouterr().out) == plain
    refused([*argv, "--policy", "heads"], "the heads policy does not fit")
    refused(["chat", str(corpus), "--session", "p", "--raw", "--policy", "reader"], "the reader policy does not fit")
    assert not (corpus / "sessions" / "p").exists()  # refused before a session was made


def test_the_command_line_the_chat_and_the_server_answer_by_the_same_default_options():
    o = AskOptions()
    for argv in (["ask", "m", "q"], ["chat", "m"]):
        args = parser().parse_args(argv)
        assert (args.max_new_tokens, args.temperature, args.seed, args.raw, args.passages, args.evidence,
                args.refuse) == (o.max_new_tokens, o.temperature, o.seed, o.raw, o.passages, o.evidence, o.refuse)
    fields = serve_routes.ChatRequest.model_fields
    assert (fields["temperature"].default, fields["passages"].default, fields["evidence"].default,
            fields["refuse"].default) == (o.temperature, o.passages, o.evidence, o.refuse)
    with pytest.raises(ValueError, match="evidence must be one of"):
        AskOptions(evidence="all")


def test_a_writer_that_keeps_its_text_index_has_it_sealed_and_whole_at_every_commit(tmp_path):
    model, tok = LandmarkGPT.from_pretrained(), load_tokenizer()
    ids = tok.encode("The quokka found a treasure map under the old piano. " * 40).ids
    path = tmp_path / "m"
    with LandmarkMemory(model, path=path, store="lmdb") as mem:
        mem.text_index.follow(tok)
        for part in (ids[:len(ids) // 2], ids[len(ids) // 2:]):
            mem.forward(torch.tensor([part]), logits="none")
            mem.commit()
            assert (path / TEXT_SEAL).exists()
            with TextIndex.open(path, tokenizer_digest(tok), writable=False) as index:
                assert index.blocks == mem.manifest.blocks > 0
    with LandmarkMemory.open(path, model, readonly=True) as mem:
        found = mem.text_index.search(tok, ["quokka"], 3, mem.n_blocks)
        assert found and all(0 <= b < mem.n_blocks for b, _ in found)
        with pytest.raises(ValueError, match="writer"):
            mem.text_index.follow(tok)
    assert (path / TEXT_INDEX).is_file()


def test_a_memory_hashes_the_tokenizer_its_text_is_read_with_once_however_often_it_is_asked(corpus, monkeypatch):
    from landmark_memory.memory import text

    hashed = []
    monkeypatch.setattr(text, "tokenizer_digest", lambda tok: hashed.append(tok) or tokenizer_digest(tok))
    tok = load_tokenizer()
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        for _ in range(3):
            assert mem.text_index.search(tok, ["treasure"], 3, mem.n_blocks)
            mem.text_index.frequencies(tok, ["treasure", "map"], mem.n_blocks)
    assert hashed == [tok]  # (its whole definition: tens of milliseconds for SmolLM2's, a question's cost)
