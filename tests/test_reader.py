"""The question reader: its block ranking against a loop over layers, heads, tokens and blocks;
its file; ``ask`` reading its blocks and naming them first."""

from dataclasses import replace

import pytest
import torch
from helpers import BS

from landmark_memory import LandmarkGPT, LandmarkMemory, ask, load_tokenizer
from landmark_memory.core.layout import landmarked_length
from landmark_memory.models.config import AskPolicy
from landmark_memory.models.hf.lora import question_reader
from landmark_memory.models.loaded import LoadedModel
from landmark_memory.models.reader import QuestionReader, Reader, ReaderConfig, blended, load_reader, save_reader
from landmark_memory.uses.question import Question, search_states
from landmark_memory.uses.retrievers import ReaderRetriever


def random_reader(layers, heads, dim, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    reader = QuestionReader(ReaderConfig(n_layer=layers, n_head=heads, n_kv_head=heads, head_dim=dim, n_embd=width,
                                         rank=3))
    with torch.no_grad():  # trained-looking: queries corrected, heads mixed unevenly
        reader.B.copy_(torch.randn(reader.B.shape, generator=g) * 0.3)
        reader.mix.copy_(torch.randn(reader.mix.shape, generator=g))
    return reader


def recorded(mem, prompt):
    """What each prompt token searches with, taken apart from the engine: per layer its input
    h, raw query and search angles, at the rows of the steps that are no landmarks."""
    got, P = {}, mem.pending_count
    qkv, step = mem.backbone.qkv, []

    def rec_qkv(layer, h):
        step.append(h)
        return qkv(layer, h)

    def wrap(choose):
        def rec(layer, q, qr, at_search, *a):
            h = step.pop()
            p0 = landmarked_length(mem.pending_count, BS)
            rows = [r for r in range(q.shape[2]) if (p0 + r + 1) % (BS + 1)]  # every (BS + 1)-th row is a landmark
            got.setdefault(layer, []).append((h[0, rows], q[0][:, rows], at_search[0][rows], at_search[1][rows]))
            return choose(layer, q, qr, at_search, *a)
        return rec

    mem.backbone.qkv = rec_qkv
    try:
        with mem.inspection.choosing(wrap):
            mem.forward(torch.tensor([prompt]), logits="none")
    finally:
        del mem.backbone.qkv
    assert P + len(prompt) > mem.options.chunk_size  # the prompt crossed a chunk: two steps
    return {layer: [torch.cat(parts, -2) for parts in zip(*steps)] for layer, steps in got.items()}


def loop_scores(mem, reader, states, n, own, calibration):
    """Per block: the mixed attention of the question's tokens less the template's, a loop; for
    a blended reader, with the heads' attention by the model's own queries, each standardised."""
    c, w = reader.config, reader.mix.softmax(0).view(reader.config.n_layer, -1)
    fixed = reader.heads.view_as(w) if c.blend else torch.zeros_like(w)
    total, base = torch.zeros(n), torch.zeros(n)
    for layer, (h, q, cos, sin) in states.items():
        keys = mem.keys(layer, torch.arange(n))  # (H, n, D)
        A, B = reader.A[layer], reader.B[layer]
        T = q.shape[1]
        template = [t for t in range(T) if t not in own]
        for head in range(c.n_head):
            mine, mine_own, theirs = torch.zeros(n), torch.zeros(n), torch.zeros(n)
            for t in range(T):
                x = h[t] / h[t].pow(2).mean().add(1e-6).sqrt()
                for corrected in (True, False):
                    qt = q[head, t] + (B @ (A @ x)).view(c.n_head, c.head_dim)[head] if corrected else q[head, t]
                    qt = mem.backbone.rope.rotate((cos[t:t + 1], sin[t:t + 1]), qt[None])[0]
                    a = torch.softmax(torch.stack([qt @ keys[head, b] for b in range(n)]) * mem.backbone.scale, 0)
                    if t in own and corrected:
                        mine += a / len(own)
                    elif t in own:
                        mine_own += a / len(own)
                    elif not corrected:  # the template's tokens: the model's own queries
                        theirs += a / len(template)
            null = theirs if calibration == "template" else 0
            total += w[layer, head] * (mine - null)
            base += fixed[layer, head] * (mine_own - null)
    if not c.blend:
        return total, 1.0
    z = [(x - x.mean()) / ((x - x.mean()).pow(2).sum() / n).sqrt() for x in (total, base)]
    # a z-score's float32 error is its scores' times how much smaller their spread is than they are
    conditioning = max(float(x.abs().max() / (x - x.mean()).pow(2).mean().sqrt()) for x in (total, base))
    return (1 - c.blend) * z[0] + c.blend * z[1], conditioning


@pytest.mark.parametrize("calibration", ["template", "none"])
@pytest.mark.parametrize("blend", [0.0, 0.4])
def test_the_reader_ranks_blocks_as_a_loop_over_layers_heads_tokens_and_blocks(model, calibration, blend):
    text = torch.randint(4, 64, (1, 62), generator=torch.Generator().manual_seed(1))  # 12 blocks, 2 pending
    prompt = torch.randint(4, 64, (14,), generator=torch.Generator().manual_seed(2)).tolist()
    reader = random_reader(2, 2, 16, 32)
    if blend:  # the trained ranking mixed with fixed heads read by the model's own queries
        reader = blended(reader, torch.tensor([0.0, 3.0, 1.0, 0.0]), blend)
    own = list(range(3, 9))
    with torch.no_grad():
        ref_mem = LandmarkMemory(model, top_k=2, chunk_size=10)
        ref_mem.forward(text)
        want, conditioning = loop_scores(ref_mem, reader, recorded(ref_mem, prompt), 12, own, calibration)
        mem = LandmarkMemory(model, top_k=2, chunk_size=10)
        mem.forward(text)
        asked = Question("", mem.n_blocks, own=tuple(own), read_ids=len(prompt), states=search_states(mem, prompt))
        got = ReaderRetriever(mem, Reader(reader, calibration)).rank(asked, 5)
    top = want.topk(5)
    assert [b for b, _ in got] == top.indices.tolist()
    # blended scores are z-scores (order 1) of float32 scores whose spread may be far smaller than they are (without
    # calibration each head's attention sums to 1 over the blocks): absolute 1e-4, plus float32's 1e-7 of a score
    # grown by that ratio (``conditioning``: 2 with the template's calibration, 2e4 without)
    atol = 1e-4 + 1e-7 * conditioning if blend else 1e-6
    torch.testing.assert_close(torch.tensor([s for _, s in got]), top.values, rtol=1e-4, atol=atol)
    assert mem.n_tokens == ref_mem.n_tokens  # the prompt was read into memory


def test_a_reader_file_round_trips_and_a_damaged_one_is_refused_in_one_line(tmp_path):
    reader = random_reader(2, 2, 16, 32)
    save_reader(reader, tmp_path / "r.safetensors", "template")
    back, calibration = load_reader(tmp_path / "r.safetensors")
    assert calibration == "template" and back.config == reader.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), reader.state_dict().values()))
    mixed = blended(reader, torch.tensor([1.0, 0.0, 1.0, 0.0]), 0.25)  # a blended reader keeps its heads
    save_reader(mixed, tmp_path / "b.safetensors", "template")
    back = load_reader(tmp_path / "b.safetensors")[0]
    assert back.config.blend == 0.25 and back.heads.tolist() == [0.5, 0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="blend must lie between 0 and 1"):
        blended(reader, torch.ones(4), 1.0)
    for share in ("x", 1.5):  # a file that says so is refused in one line
        save_reader(QuestionReader(replace(mixed.config, blend=share)), tmp_path / "s.safetensors", "template")
        with pytest.raises(ValueError, match="is no share"):
            load_reader(tmp_path / "s.safetensors")
    one = torch.zeros(1, 4, 1)  # a memory of one block: its score is 0, never NaN
    assert mixed.scores(one, one, one).tolist() == [[0.0]]
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "r.safetensors").read_bytes()[:300])
    with pytest.raises(ValueError, match="not a question reader .* remove it to answer without one"):
        load_reader(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="calibration must be one of"):
        save_reader(reader, tmp_path / "x.safetensors", "null")


class Settings:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 2, 2, 32


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_reader_with_non_finite_weights_is_refused_at_load_in_one_line(tmp_path, value):
    reader = blended(random_reader(2, 2, 16, 32), torch.tensor([1.0, 0.0, 1.0, 0.0]), 0.25)
    name, t = next((k, v) for k, v in reader.state_dict().items() if v.is_floating_point() and v.numel() > 1)
    t.view(-1)[1] = value  # (the state dict shares the parameter's storage)
    save_reader(reader, tmp_path / "r.safetensors", "template")
    with pytest.raises(ValueError, match="NaN or infinite") as e:
        load_reader(tmp_path / "r.safetensors")
    assert name in str(e.value) and "\n" not in str(e.value)


def test_an_adapter_whose_reader_is_missing_or_reads_another_model_is_refused(tmp_path):
    class Model:
        config = Settings()

    with pytest.raises(ValueError, match="asks for 2 blocks of a question reader, but .* is missing"):
        question_reader(Model(), tmp_path, AskPolicy(reader_blocks=2))
    save_reader(random_reader(3, 2, 16, 32), tmp_path / "reader.safetensors", "none")
    with pytest.raises(ValueError, match=r"reads a model of .* \(3, 2, 2, 32\), this one has \(2, 2, 2, 32\)"):
        question_reader(Model(), tmp_path, AskPolicy(reader_blocks=2))
    assert question_reader(Model(), tmp_path, AskPolicy()) is None
    with pytest.raises(ValueError, match="reader_blocks to a count from 0 to 64"):
        AskPolicy.from_dict({"reader_blocks": True}, "landmark.json")
    assert AskPolicy.from_dict({"reader_blocks": 3}, "x").reader_blocks == 3


class ChatTokenizer:
    """The shipped tokenizer with a chat template of one line."""

    def __init__(self):
        self.tok, self.end_of_turn_ids = load_tokenizer(), ()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def chat_text(self, messages, *, first, answer):
        return "".join(f"{m['role']}:{m['content']}\n" for m in messages) + ("assistant:" if answer else "")


def test_ask_through_a_reader_reads_its_blocks_at_every_answer_token_and_names_them_first(corpus):
    model, tok, question = LandmarkGPT.from_pretrained(), ChatTokenizer(), "Who found the treasure map?"
    c = model.config
    reader = random_reader(c.n_layer, c.n_head, c.head_dim, c.n_embd, seed=3)
    loaded = LoadedModel(model, tok, reader=Reader(reader, "template"), policy=AskPolicy(reader_blocks=2))
    with LandmarkMemory.open(corpus, model, readonly=True) as mem:
        got = ask(mem, loaded, question, max_new_tokens=5, passages=4)
        mem.rewind()
        prompt = tok.chat_text([{"role": "user", "content": question}], first=True, answer=True)
        enc = tok.encode(prompt)
        start, end = prompt.index(question), prompt.index("\nassistant")
        own = [i for i, (a, b) in enumerate(enc.offsets) if start <= a < b <= end]
        asked = Question("", mem.n_blocks, own=tuple(own), read_ids=len(enc.ids) - 1,
                         states=search_states(mem, enc.ids[:-1]))
        chosen = [b for b, _ in ReaderRetriever(mem, Reader(reader, "template")).rank(asked, 2)]
        seen = []
        with mem.reading(chosen):
            mem.generate(torch.tensor([enc.ids[-1:]]), 5, on_read=seen.append)
    assert [p.block for p in got.passages[:2]] == chosen and len(got.passages) == 4
    for retrieved in seen:  # every layer of every answer position read the reader's blocks first
        for r in retrieved:
            assert (r[..., :2] == torch.tensor(chosen)).all()
