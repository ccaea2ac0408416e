"""Evidence read by retrieval heads, token by token: the attention against a loop over heads,
tokens and every stored token; the quote; choosing heads; their file; ``ask`` reading with them."""

import json

import pytest
import torch
from helpers import BS, ChatTokenizer

from landmark_memory import LandmarkGPT, LandmarkMemory, ask
from landmark_memory.core.layout import landmarked_length
from landmark_memory.core.tokenizer import encode_prompt, load_tokenizer
from landmark_memory.models.heads import PLAIN_FRAME, EvidenceHeads, load_heads, question_prompt, save_heads
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.uses.answer import NOT_FOUND
from landmark_memory.uses.answering.heads import EVIDENCE_PROMPT
from landmark_memory.uses.choose_heads import DevQuestion, choose, choose_heads, head_ranks
from landmark_memory.uses.evidence import (
    around,
    candidates,
    own_words,
    prompt_weights,
    quotes,
    sentences,
    shared_words,
    stem,
    support,
    token_attention,
)
from landmark_memory.uses.question import Question, search_states
from landmark_memory.uses.retrievers import HeadsRetriever, find_evidence
from landmark_memory.uses.search import text_ranking


def raw_keys(mem, text):
    """Per layer the raw (not rotated) keys of ``text``'s normal tokens, (H, T, D), taken from the
    model's own projections as the memory reads the text (not from the store)."""
    qkv, got = mem.backbone.qkv, {}

    def rec(layer, h):
        q, k, v = qkv(layer, h)
        p0 = landmarked_length(mem.pending_count, BS)
        rows = [r for r in range(k.shape[2]) if (p0 + r + 1) % (BS + 1)]
        got.setdefault(layer, []).append(k[0][:, rows])
        return q, k, v

    mem.backbone.qkv = rec
    try:
        mem.forward(text, logits="none")
    finally:
        del mem.backbone.qkv
    return {layer: torch.cat(parts, 1) for layer, parts in got.items()}


def loop_attention(mem, keys, got, w, heads, blocks):
    """(M, K, n, BS): a loop over heads, query heads, tokens and every stored token of ``blocks``;
    a query rotated to its search position and on by the key row, a key rotated by its offset."""
    n, rope, G = len(blocks), mem.backbone.rope, mem.backbone.n_head // mem.shape.n_kv_head
    out = torch.zeros(w.shape[0], len(heads), n, BS)
    for i, (layer, h) in enumerate(heads):
        q, _, cos, sin = got[layer]
        for g in range(h * G, (h + 1) * G):
            for t in range(q.shape[1]):
                qt = rope.rotate((cos[t:t + 1], sin[t:t + 1]), q[g, t][None])
                qt = rope(qt, torch.tensor([BS]))[0]  # the key row's place: a block at slot 0
                s = torch.tensor([[qt @ rope(keys[layer][h, b * BS + j][None], torch.tensor([j]))[0]
                                   for j in range(BS)] for b in blocks.tolist()]) * mem.backbone.scale
                a = torch.softmax(s.flatten(), 0).view(n, BS)
                out[:, i] += w[:, t, None, None] * a / G
    return out


def test_token_attention_is_a_loop_over_heads_tokens_and_every_stored_token(model):
    text = torch.randint(4, 64, (1, 62), generator=torch.Generator().manual_seed(1))  # 12 blocks, 2 pending
    prompt = torch.randint(4, 64, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        mem = LandmarkMemory(model, top_k=2, chunk_size=10)
        keys = raw_keys(mem, text)
        got = search_states(mem, prompt)
        w = prompt_weights([2, 3, 4, 5], len(prompt))
        heads, blocks = [(1, 0), (0, 1), (1, 1)], torch.tensor([0, 3, 4, 9, 11])
        fast = token_attention(mem, got, w, heads, blocks)
        want = loop_attention(mem, keys, got, w, heads, blocks)
    torch.testing.assert_close(fast, want, rtol=1e-4, atol=1e-6)
    assert torch.isfinite(fast).all()
    # each head's attention of one average of the prompt's tokens is a distribution over the stored tokens
    torch.testing.assert_close(fast.sum((2, 3)), torch.ones(2, 3))


def test_prompt_weights_average_the_question_and_the_template_apart():
    w = prompt_weights([1, 2], 5)
    torch.testing.assert_close(w, torch.tensor([[0, .5, .5, 0, 0], [1 / 3, 0, 0, 1 / 3, 1 / 3]]))


def test_the_quote_is_the_sentence_whose_tokens_hold_the_most_attention(corpus):
    model, tok = LandmarkGPT.from_pretrained(), ChatTokenizer([])
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        n, bs = mem.n_blocks, mem.shape.block_size
        blocks = torch.arange(n)
        ids = mem.tokens(0, 8, 11).tolist()  # blocks 8 to 10: a sentence of block 9 (and maybe its neighbours)
        text = tok.decode(ids)
        end = text.index(". ", len(tok.decode(ids[:bs])) + 5) + 1  # the first full stop well inside block 9
        start = text.rindex(". ", 0, end - 1) + 2
        mass = torch.zeros(2, 1, n, bs)
        at = 0
        for i, t in enumerate(ids):  # the attention of the tokens of that sentence, less a little of the rest
            piece = tok.decode([t])
            inside = start <= at + len(piece) // 2 < end
            mass[0, 0, 8 + i // bs, i % bs] = 1.0 if inside else 0.01
            at += len(piece)
        got, *_ = quotes(mem, tok, mass, blocks, [9], n)
    assert got.text == " ".join(text[start:end].split())
    assert got.block in (8, 9) and 8 * bs <= got.token < 10 * bs


def test_the_quote_weighs_the_heads_attention_by_the_share_of_the_questions_words_it_holds(corpus):
    model, tok = LandmarkGPT.from_pretrained(), ChatTokenizer([])
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        n, bs = mem.n_blocks, mem.shape.block_size
        blocks, mass = torch.arange(n), torch.zeros(2, 1, n, bs)
        mass[0, 0, 8:11] = 1.0  # every token alike: the longest sentence holds the most attention
        found = sentences(mem, tok, mass, blocks, [9], n)
        most = max(found, key=lambda q: q.score)

        def stems(text):
            return {w.removesuffix("s") for w in own_words(text)}

        other = next(q for q in found if stems(q.text) - stems(most.text))
        question = "What of " + " ".join(sorted(stems(other.text) - stems(most.text))[:3]) + "?"
        assert quotes(mem, tok, mass, blocks, [9], n) == [most]
        assert quotes(mem, tok, mass, blocks, [9], n, question) == [other] != [most]
        ranked = quotes(mem, tok, mass, blocks, [8, 9], n, question, count=len(found) + 10)
        assert ranked[0] == other and len({q.token for q in ranked}) == len(ranked)  # one crossing two blocks once
        assert support(question, other.text) == 1.0 and support(question, most.text) == 0.0


def test_support_finds_a_words_other_forms_and_weighs_each_word_by_its_rarity():
    question = "Which shoes did the girl marry in Toto?"
    assert own_words(question) == ["shoes", "girl", "marry", "toto"]
    assert support(question, "A shoe, a girl's married sister.") == 0.75  # (shoe, girl, marr-ied; not Toto)
    assert support(question, "Nothing of it.") == 0.0 and support("What of it?", "Anything.") == 1.0
    rarity = {"shoes": 1.0, "girl": 1.0, "marry": 1.0, "toto": 7.0}
    assert support(question, "Toto ran.", rarity) == pytest.approx(0.7)
    assert support(question, "Toto ran.") == 0.25
    assert [stem(w) for w in ("shoes", "married", "cats", "dog")] == ["shoe", "marri", "cat", "dog"]


def test_choose_pools_the_heads_that_rank_the_evidence_first_as_many_as_dev_recall_wants():
    g = torch.Generator().manual_seed(0)
    masses, golds = [], []
    for i in range(12):  # heads 3 and 1 put their attention on the evidence, the rest anywhere
        m = torch.rand(2, 6, 20, 4, generator=g) * 0.1
        gold = [i % 20]
        m[0, 3, gold] += 1.0
        m[0, 1, gold] += 0.5 if i % 3 else 0.0  # head 1 misses a third of the questions
        masses.append(m)
        golds.append(gold)
    heads = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    chosen, how = choose(masses, golds, heads, counts=(1, 2, 4))
    assert chosen == [(1, 1)] and how["count"] == 1 and how["recall@5"][1] == 1.0
    assert list(how["mrr"])[:2] == ["1,1", "0,1"]
    assert head_ranks(masses[0], golds[0])[3] == 1
    _, few = choose([m[:, :3] for m in masses], golds, heads[:3], counts=(2, 4, 8))
    assert set(few["recall@5"]) == {2, 3}  # a model of 3 heads may pool them all


def test_a_heads_file_round_trips_and_a_bad_one_is_refused_in_one_line(tmp_path):
    path = tmp_path / "heads" / "heads.json"  # (its folder made on first use)
    save_heads(EvidenceHeads(((3, 1), (0, 2)), blocks=2), path, chosen_by={"count": 2})
    got = load_heads(path)
    assert got.heads == ((3, 1), (0, 2)) and got.blocks == 2 and got.source == str(path) and got.frame is None
    save_heads(EvidenceHeads(((1, 0),), frame=PLAIN_FRAME), path)
    assert load_heads(path).frame == PLAIN_FRAME
    for body in ["not json", "[]", '{"heads": [[1.5, 0]]}', '{"heads": []}', '{"heads": [[0, 0]], "blocks": 99}',
                 '{"heads": [[0, 0]], "candidates": 0}', json.dumps({"heads": [[0, 0]] * 300}), '{"heads": [["a", 0]]}',
                 '{"heads": [[0, 0]], "frame": "no place for it"}', '{"heads": [[0, 0]], "frame": " {question} "}',
                 '{"heads": [[0, 0]], "frame": 3}', '{"heads": [[0, 0]], "frame": "{question} or {question}"}']:
        path.write_text(body)
        with pytest.raises(ValueError, match="retrieval heads") as e:
            load_heads(path)
        assert "\n" not in str(e.value)


def read_question(mem, tok, question, prompt, count):
    """``question`` posed in ``prompt`` and its first ``count`` ids read into the memory."""
    asked = Question.pose(mem, tok, question, prompt, [question])
    return asked.read(mem, count if count > 0 else len(asked.ids) + count)


@pytest.mark.parametrize("chat", [True, False], ids=["chat template", "plain frame"])
def test_ask_with_retrieval_heads_reads_their_blocks_at_every_answer_token_and_quotes_among_them(corpus, documents,
                                                                                               chat):
    model, question = LandmarkGPT.from_pretrained(), "Who found the treasure map?"
    tok = ChatTokenizer([]) if chat else load_tokenizer()  # (a model without a template reads the heads' frame)
    heads = EvidenceHeads(((0, 1), (3, 2)), blocks=2, frame=None if chat else "Q: {question}\nA:")
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        n = mem.n_blocks
        got = ask(mem, LoadedModel(model, tok, heads), question, max_new_tokens=5, passages=4, evidence="none",
                  refuse=False)
        mem.rewind()
        prompt, _ = question_prompt(tok, question, heads.frame)
        assert prompt.startswith("user:" if chat else "Q: Who found")
        enc = tok.encode(prompt)
        ranking, (found, *_) = find_evidence(mem, tok, heads, read_question(mem, tok, question, prompt, -1), 2)
        best = ranking.fused[:2]
        seen = []
        with mem.reading([b for b, _ in best]):
            mem.generate(torch.tensor([enc.ids[-1:]]), 5, on_read=seen.append)
    chosen = [b for b, _ in best]
    assert n and [p.block for p in got.passages[:2]] == chosen and len(got.passages) == 4
    for retrieved in seen:
        for r in retrieved:
            assert (r[..., :2] == torch.tensor(chosen)).all()
    q = got.quote
    assert q is not None and q.text == found.text and min(abs(q.block - b) for b in chosen) <= 1
    assert q.source in {str(f) for f in documents.glob("*.txt")}
    whole = " ".join(open(q.source).read().split())
    assert q.text in whole  # a sentence of the document, where the answer says
    assert got.to_json()["quote"]["text"] == q.text and got.prompt_tokens == len(enc.ids) and got.chat == chat


def test_ask_reads_the_quote_its_heads_found_in_a_turn_before_the_question_and_answers_after_it(corpus):
    model, question, tok = LandmarkGPT.from_pretrained(), "Who found the treasure map?", ChatTokenizer([])
    heads = EvidenceHeads(((0, 1), (3, 2)), blocks=2)
    loaded = LoadedModel(model, tok, heads)
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        n = mem.n_blocks
        got = ask(mem, loaded, question, max_new_tokens=5, refuse=False)
        mem.rewind()
        wide = ask(mem, loaded, question, max_new_tokens=5, evidence="around", refuse=False)
        mem.rewind()
        two = ask(mem, loaded, question, max_new_tokens=5, evidence="quotes", refuse=False)
        mem.rewind()
        closed = tok.chat_text([{"role": "user", "content": question}], first=True, answer=False)
        enc = tok.encode(closed)  # the question's turn, closed: what the heads score
        ranking, best_two = find_evidence(mem, tok, heads, read_question(mem, tok, question, closed, len(enc.ids)),
                                          2, 2)
        found = best_two[0]
        best = ranking.fused[:2]
        turn = EVIDENCE_PROMPT.format(evidence=found.text, question=question)
        rest = tok.encode(tok.chat_text([{"role": "user", "content": turn}], first=False, answer=True)).ids
        with mem.reading([b for b, _ in best]):
            new = mem.generate(torch.tensor([rest]), 5)[0].tolist()
        assert around(mem, tok, found, n, sentences=0) == found.text
    assert got.evidence == found.text == got.quote.text and got.tokens == new
    assert got.prompt_tokens == len(enc.ids) + len(rest) and [p.block for p in got.passages[:2]] == [b for b, _ in best]
    assert got.grounded == shared_words(got.text, found.text, question)
    assert found.text in wide.evidence and len(wide.evidence) > len(found.text)  # with its neighbours
    assert len(best_two) == 2 and best_two[1].token != found.token and two.quote.text == found.text
    assert two.evidence == " ".join(q.text for q in sorted(best_two, key=lambda q: q.token))  # in the memory's order


def test_ask_says_the_memory_holds_no_answer_where_its_quote_speaks_of_nothing_asked_and_names_the_closest_text(
        corpus):
    model, question, tok = LandmarkGPT.from_pretrained(), "Which xylophone did the quokka borrow?", ChatTokenizer([])
    loaded = LoadedModel(model, tok, EvidenceHeads(((0, 1), (3, 2)), blocks=2))
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        before = mem.n_tokens
        got = ask(mem, loaded, question, max_new_tokens=5)
        read = mem.n_tokens - before
        mem.rewind()
        anyway = ask(mem, loaded, question, max_new_tokens=5, refuse=False)
    assert got.refused and got.text == NOT_FOUND and got.tokens == tok.encode(NOT_FOUND).ids and got.evidence is None
    assert read == got.prompt_tokens + len(got.tokens)  # the memory read the refusal as the answer it gave
    assert got.quote == anyway.quote and [p.block for p in got.passages] == [p.block for p in anyway.passages[:2]]
    assert not anyway.refused and anyway.support == got.support == 0 and anyway.evidence == anyway.quote.text


def test_a_model_without_heads_or_reader_reads_first_the_block_its_text_index_ranks_first(corpus):
    model, tok, question = LandmarkGPT.from_pretrained(), load_tokenizer(), "Who found the treasure map?"
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        (best, _), *_ = text_ranking(mem, tok, question, mem.n_blocks, 1)
        got = ask(mem, tok, question, max_new_tokens=4, passages=3)
        mem.rewind()
        seen = []
        with mem.reading([best]):
            new = mem.generate(torch.tensor([encode_prompt(tok, question, [question]).ids]), 4,
                               on_read=seen.append)[0].tolist()
    assert got.passages[0].block == best and got.tokens == new and got.quote is None
    for retrieved in seen:  # every token, every layer and head: the text index's block first
        for r in retrieved:
            assert (r[..., 0] == best).all()


def test_ask_refuses_an_evidence_policy_it_does_not_know(corpus):
    with LandmarkMemory.open(corpus, LandmarkGPT.from_pretrained(), readonly=True) as mem:
        with pytest.raises(ValueError, match="evidence must be one of quote, quotes, around, none"):
            ask(mem, load_tokenizer(), "Who?", evidence="all")


def test_an_answers_grounded_words_are_those_its_evidence_holds_beyond_the_question():
    question = "What was the name of the inn that Jim's father kept?"
    evidence = "my father kept the Admiral Benbow inn"
    assert shared_words("The inn was the Admiral Benbow, kept by his father.", evidence, question) == \
        ["admiral", "benbow"]
    assert shared_words("It was the Red Lion.", evidence, question) == []  # nothing taken from its evidence


def test_a_framed_answer_ends_where_the_model_writes_the_frames_words_again(corpus):
    model, tok = LandmarkGPT.from_pretrained(), load_tokenizer()
    heads = EvidenceHeads(((0, 1),), frame="the {question}\n")  # the bundled model writes "the"
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        got = ask(mem, LoadedModel(model, tok, heads), "Who found the treasure map?", max_new_tokens=60, refuse=False)
    assert got.stop == "the" and "the" not in got.text and len(got.tokens) < 60
    assert "the" in tok.decode(got.tokens)  # cut from the text, as a stop string is


def test_heads_without_a_frame_leave_a_model_without_a_chat_template_asking_as_it_did(corpus):
    model, tok, question = LandmarkGPT.from_pretrained(), load_tokenizer(), "Who found the treasure map?"
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        want = ask(mem, tok, question, max_new_tokens=4)
    heads = EvidenceHeads(((0, 1),))  # chosen through a chat template: nothing to read with here
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        got = ask(mem, LoadedModel(model, tok, heads), question, max_new_tokens=4)
    assert got.quote is None and got.tokens == want.tokens and got.prompt_tokens == want.prompt_tokens


def test_heads_of_another_model_are_refused_at_ask_in_one_line(corpus):
    model, tok = LandmarkGPT.from_pretrained(), ChatTokenizer([])
    heads = EvidenceHeads(((0, 0), (30, 2)), source="heads.json")
    with LandmarkMemory.open(corpus, model, readonly=True) as mem, pytest.raises(ValueError, match="another") as e:
        ask(mem, LoadedModel(model, tok, heads), "Who found the treasure map?", max_new_tokens=2)
    assert "heads.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("chat", [True, False], ids=["chat template", "plain frame"])
def test_choose_heads_reads_each_text_and_asks_each_question_as_ask_does(chat):
    from landmark_memory.uses.choose_heads import shipped_questions

    questions, texts = shipped_questions()
    assert len(questions) >= 30 and set(texts) == {q.text for q in questions}
    model, tok = LandmarkGPT.from_pretrained(), ChatTokenizer([]) if chat else load_tokenizer()
    name = "train/treasure_island_excerpt.txt"
    mine = [q for q in questions if q.text == name] + [DevQuestion(name, "Who?", "no such words in the text", ())]
    heads, how = choose_heads(model, tok, mine, {name: texts[name]}, tokens=2600, progress=False, chunk_size=200)
    assert how["questions"] == 4  # the four whose evidence lies in the first 2,600 tokens (and not the made-up one)
    assert 1 <= len(heads.heads) <= 32 and len(set(heads.heads)) == len(heads.heads)
    c = model.config
    assert all(0 <= layer < c.n_layer and 0 <= h < c.n_head for layer, h in heads.heads)
    assert heads.frame == (None if chat else PLAIN_FRAME)  # what ask reads a question in for them


def test_the_heads_command_needs_a_model_that_answers_questions(capsys):
    from landmark_memory.app.cli import main

    assert main(["heads", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "bundled model" in err and "--model" in err and len(err.strip().splitlines()) == 1


def test_past_the_candidate_limit_the_heads_read_the_blocks_their_block_keys_rank_first(model):
    text = torch.randint(4, 64, (1, 62), generator=torch.Generator().manual_seed(1))
    prompt = torch.randint(4, 64, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    heads = [(1, 0), (0, 1)]
    with torch.no_grad():
        mem = LandmarkMemory(model, top_k=2, chunk_size=10)
        mem.forward(text, logits="none")
        got = search_states(mem, prompt)
        w = prompt_weights([2, 3, 4, 5], len(prompt))
        want = torch.zeros(12)  # a loop: each head's softmax over the block keys, question less template
        for layer, h in heads:
            q, _, cos, sin = got[layer]
            for t in range(q.shape[1]):
                qt = mem.backbone.rope.rotate((cos[t:t + 1], sin[t:t + 1]), q[h, t][None])[0]
                a = torch.softmax(mem.keys(layer, torch.arange(12))[h] @ qt * mem.backbone.scale, 0)
                want += (w[0, t] - w[1, t]) * a
        got_blocks = candidates(mem, got, w, heads, 4, 12)
        assert candidates(mem, got, w, heads, 12, 12).tolist() == list(range(12))
    assert got_blocks.tolist() == sorted(want.topk(4).indices.tolist())
    asked = Question("", 12, own=(2, 3, 4, 5), read_ids=len(prompt), states=got)
    best = HeadsRetriever(mem, ChatTokenizer([]), EvidenceHeads(tuple(heads), candidates=4)).rank(asked, 12)
    assert {b for b, _ in best} == set(got_blocks.tolist())


def test_a_terminal_shows_the_quote_with_what_the_answer_took_from_it_or_a_warning_or_the_closest_text():
    from landmark_memory.uses.answer import Answer
    from landmark_memory.uses.evidence import Quote

    q = Quote("My father kept the Admiral Benbow inn.", 3, 200, 0.5, source="book.txt", token_offset=200)
    said = Answer("Which inn?", "The Admiral Benbow.", [], True, quote=q, grounded=["admiral", "benbow"])
    assert said.evidence_lines() == [f"Quote: {q.cited()}", "From the quote: admiral, benbow"]
    wrong = Answer("Which inn?", "The Red Lion.", [], True, quote=q, grounded=[])
    assert wrong.evidence_lines()[1].startswith("Check this answer")
    refused = Answer("Which inn?", NOT_FOUND, [], True, quote=q, refused=True)
    assert refused.evidence_lines() == [f"Closest text: {q.cited()}"] and refused.evidence_fields()["refused"]
    assert Answer("Which inn?", "No idea.", [], True).evidence_lines() == []
