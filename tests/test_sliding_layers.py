"""Layers that keep no memory: a Gemma 3 model's sliding-window layers read only their last
positions, so its memory holds blocks for its global layers alone; their windows live in a
commit's state file, so a memory saved, reopened, rewound or held as a session reads on as if it
had never stopped (the in-sequence equivalence of every family is in test_hf.py)."""

import json

import pytest
import torch
from helpers import turns_read_as_one_forward
from hf_tiny import ids_of, tiny
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from landmark_memory import hf
from landmark_memory.app.cli import _layers
from landmark_memory.format import MemoryFileError
from landmark_memory.format.directory import MemoryDir
from landmark_memory.memory import LandmarkMemory
from landmark_memory.memory.saved import saved_chunk
from landmark_memory.uses.inspect import describe, verify

OPTS = dict(chunk_size=14, top_k=2, store_dtype="float32")


@pytest.mark.parametrize("T_q,Tk,window,G", [(9, 9, 4, 1), (5, 13, 6, 2), (1, 7, 8, 2), (1, 7, 7, 1), (1, 9, 3, 4)])
def test_sliding_window_attention_equals_a_softmax_over_each_querys_window(T_q, Tk, window, G):
    from landmark_memory.kernels import sliding_window_attention

    g = torch.Generator().manual_seed(T_q * 100 + Tk)
    q = torch.randn(2, 2 * G, T_q, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, Tk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    for i in range(T_q):  # query i sits at position Tk - T_q + i and reads the window ending there
        at = Tk - T_q + i
        ks, vs = (t[:, :, max(at - window + 1, 0):at + 1].repeat_interleave(G, 1) for t in (k, v))
        out[:, :, i] = (q[:, :, i:i + 1] @ ks.transpose(-2, -1) * 0.3).softmax(-1).matmul(vs)[:, :, 0]
    torch.testing.assert_close(sliding_window_attention(q, k, v, window, 0.3), out, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def gemma(tokenizer_object):
    return tiny(tokenizer_object, "gemma3")  # layers: sliding (12 positions), full, sliding


@torch.no_grad()
def test_a_gemma3_memory_keeps_blocks_for_its_global_layers_only_and_info_says_so(gemma, text, tmp_path):
    model, tok = gemma
    idx = ids_of(tok, text, 100)
    with LandmarkMemory(model, store="mmap", path=tmp_path / "g", **OPTS) as mem:
        assert len(mem.forward(idx, logits="none").retrieved) == 1  # what each memory layer retrieved
        assert mem.shape.n_layer == 1 and mem.shape.memory_layers == [1] and mem.shape.windows == (12, 0, 12)
        assert sorted(mem._decoder.windows) == [0, 2] and all(k.shape[2] == 11 for k,
                                                              _ in mem._decoder.windows.values())
    info = describe(tmp_path / "g")
    per_layer = 2 * 2 * (7 + 1) * 16 * 4 / 7  # keys and values, 2 heads, a block and its landmark, float32
    assert (info["layers"], info["memory_layers"], info["windows"]) == (3, 1, {"0": 12, "2": 12})
    assert info["store_bytes_per_token"] == pytest.approx(per_layer, abs=0.1)
    assert _layers(info) == ("1 of 3 with a memory (the other 2 attend to a sliding window of 12 positions and keep "
                             "only it)")
    keys = sorted(p.name for p in (tmp_path / "g" / "keys").iterdir())
    assert keys == ["s0_l0_h0.f32", "s0_l0_h1.f32"]  # memory layer 0, the model's layer 1

    assert verify(tmp_path / "g").ok


@torch.no_grad()
def test_a_saved_gemma3_memory_reads_on_as_if_it_had_never_stopped(gemma, text, tmp_path):
    model, tok = gemma
    idx = ids_of(tok, text, 90)
    cut = 47  # mid-chunk and mid-block: the open chunk and the windows must survive
    whole = LandmarkMemory(model, **OPTS)
    expected = torch.cat([whole.forward(idx[:, :cut]).logits, whole.forward(idx[:, cut:]).logits], 1)
    with LandmarkMemory(model, store="lmdb", path=tmp_path / "m", **OPTS) as mem:
        first = mem.forward(idx[:, :cut]).logits
    mem = LandmarkMemory.open(tmp_path / "m", model)
    rest = mem.forward(idx[:, cut:]).logits
    mem.close(commit=False)
    torch.testing.assert_close(torch.cat([first, rest], 1), expected, rtol=0, atol=0)
    with LandmarkMemory.open(tmp_path / "m", model, readonly=True) as mem:  # a reader forgets what it was fed
        again = []
        for _ in range(2):
            again.append(mem.forward(idx[:, cut:]).logits)
            mem.rewind()
    torch.testing.assert_close(again[0], again[1], rtol=0, atol=0)
    torch.testing.assert_close(again[0], expected[:, cut:], rtol=0, atol=0)


@torch.no_grad()
def test_a_gemma3_session_with_every_block_retrieved_reads_as_one_forward(gemma, text, tmp_path):
    model, tok = gemma
    idx = ids_of(tok, text, 80)
    turns_read_as_one_forward(model, idx, hf.normal_logits(model, idx), tmp_path, chunk_size=14,
                              turns=((33, 56), (56, 80)), rtol=1e-4)


@torch.no_grad()
def test_a_window_the_model_cannot_have_is_refused_in_one_line(gemma, text, tmp_path):
    model, tok = gemma
    with LandmarkMemory(model, store="lmdb", path=tmp_path / "m", **OPTS) as mem:
        mem.forward(ids_of(tok, text, 30), logits="none")
    d = MemoryDir(tmp_path / "m", writable=False)
    manifest, state = d.read_commit()
    k, v = state["window.0.k"], state["window.0.v"]
    for wrong in ({"window.0.k": torch.cat([k, k], 2), "window.0.v": torch.cat([v, v], 2)},  # longer than the window
                  {"window.1.k": k, "window.1.v": v},  # a layer that keeps a memory
                  {"window.0.v": v[:, :, 1:]}):  # key and value disagree
        with pytest.raises(MemoryFileError, match="lacks or misshapes window"):
            saved_chunk(d, manifest, {**state, **wrong}, torch.device("cpu"), torch.float32)
    d.close()
    doc = json.loads((tmp_path / "m" / "manifest.json").read_text())
    doc["model"]["shape"]["windows"] = [12, 12, 12]
    (tmp_path / "m" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(MemoryFileError, match="model.shape.windows"):
        LandmarkMemory.open(tmp_path / "m", model)


def test_sliding_layers_are_refused_where_the_family_keeps_none_and_a_two_way_gemma_is_refused(tokenizer_object):
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token="</s>")
    sizes = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    qwen = Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(ValueError, match="a qwen2 model is converted when every layer attends to everything"):
        hf.convert(qwen, tok)
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(**sizes, use_bidirectional_attention=True,
                                               layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match="attends both ways"):
        hf.convert(gemma, tok)
    only_local = Gemma3ForCausalLM(Gemma3TextConfig(**sizes, layer_types=["sliding_attention"] * 2))
    with pytest.raises(ValueError, match="no layer that attends to everything"):
        hf.convert(only_local, tok)
