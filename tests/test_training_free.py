"""A memory without landmarks (``block_keys="mean"``): any checkpoint of the families we read, as
published, no training. Its kernel against a gather-everything reference, the invariant that
reading every block at its place is the stock model's forward (every family, tiny random
configurations), greedy decoding, saving and continuing, the block key's meaning, the command
line, and the refusals."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import ray
import torch
from helpers import BOOK, files_of
from hf_tiny import CASES, FAMILIES, TOL, cli, ids_of, tiny

from landmark_memory import RotaryEmbedding
from landmark_memory.core.quant import dequantize_kv, quantize
from landmark_memory.format import MemoryOptions
from landmark_memory.format.directory import MemoryDir
from landmark_memory.format.manifest import MemoryFileError
from landmark_memory.hf import LandmarkMemoryCache
from landmark_memory.kernels import block_attention_inference
from landmark_memory.kernels.plain import block_inference_dense
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.kinds import load_model
from landmark_memory.uses.answer import say
from landmark_memory.uses.session import Session

EVERY_BLOCK = dict(block_size=7, chunk_size=14, top_k=64, position_mapping="exact")


def pools(g, n_pool, H_kv, L, D, dtype):
    return (torch.randn(n_pool, H_kv, L, D, generator=g, dtype=dtype) for _ in range(2))


@pytest.mark.parametrize("T_q", [1, 5, 24])  # a decoding step, a few queries (slots gathered), a chunk (grouped)
def test_blocks_read_in_place_equal_every_querys_blocks_gathered(T_q):
    g = torch.Generator().manual_seed(T_q)
    B, H, H_kv, D, L, K, n_pool = 2, 4, 2, 16, 6, 3, 5
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T_q, T_q + 9, T_q + 9))
    pool_k, pool_v = pools(g, n_pool, H_kv, L, D, torch.float64)
    args = dict(pool_k=pool_k, pool_v=pool_v, block_table=torch.randint(-1, n_pool, (B, H, T_q, K), generator=g),
                block_pos=torch.randint(0, 500, (B, H, T_q, K), generator=g), rope=RotaryEmbedding(D, 10000.0),
                scale=0.3)
    ref = block_attention_inference(q, k, v, backend="reference", **args)
    compiled = block_attention_inference(q, k, v, **args)  # CPU float64: the slots scored by compiled loops
    pytorch = block_inference_dense(q, k, v, args["pool_k"], args["pool_v"], args["block_table"], args["block_pos"],
                                    args["rope"], args["scale"])
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(compiled, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pytorch, ref, rtol=1e-10, atol=1e-12)
    # a query whose slots are all empty reads its local keys alone: plain causal attention
    empty = block_attention_inference(q, k, v, **{**args, "block_table": torch.full_like(args["block_table"], -1)})
    s = (q @ k.transpose(-2, -1) * 0.3).masked_fill(torch.ones(T_q, T_q + 9, dtype=torch.bool).triu(10), float("-inf"))
    torch.testing.assert_close(empty, s.softmax(-1) @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("T_q", [1, 24])
def test_blocks_every_query_of_a_head_reads_join_the_local_keys_with_the_same_result(T_q, int8):
    g = torch.Generator().manual_seed(3 + T_q)
    B, H, H_kv, D, L, K, S, n_pool = 2, 4, 2, 16, 6, 3, 3, 9
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T_q, T_q + 5, T_q + 5))
    pool_k, pool_v = pools(g, n_pool, H_kv, L, D, torch.float64)
    table = torch.randint(-1, n_pool, (B, H, T_q, K + S), generator=g)
    pos = torch.randint(0, 500, (B, H, T_q, K + S), generator=g)
    # per stream and head one block and position for every query; empty columns where a head has fewer
    table[..., K:] = torch.randint(-1, n_pool, (B, H, 1, S), generator=g)
    pos[..., K:] = torch.randint(0, 500, (B, H, 1, S), generator=g)
    table[0, 1, :, K:] = torch.tensor([-1, 6, -1])
    args = dict(block_table=table, block_pos=pos, rope=RotaryEmbedding(D, 10000.0), scale=0.3)
    if int8:
        data, scales = quantize(torch.stack([pool_k, pool_v], 1).float())
        args |= dict(pool_k=data[:, 0], pool_v=data[:, 1], pool_scale=scales.float())
        pool_k, pool_v = dequantize_kv(data[:, 0], data[:, 1], scales.float(), torch.float64)
        q, k, v = q.float(), k.float(), v.float()
    else:
        args |= dict(pool_k=pool_k, pool_v=pool_v)
    ref = block_attention_inference(q.double(), k.double(), v.double(), backend="reference",
                                    **{**args, "pool_k": pool_k, "pool_v": pool_v, "pool_scale": None})
    out = block_attention_inference(q, k, v, shared=S, **args)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out.double(), ref, **(dict(rtol=1e-4, atol=1e-5) if int8 else
                                                   dict(rtol=1e-10, atol=1e-12)))
    per_head = {**args, "block_table": table[:, :, :1].expand_as(table), "block_pos": pos[:, :, :1].expand_as(pos)}
    torch.testing.assert_close(block_attention_inference(q, k, v, shared=K + S, **per_head).double(),
                               block_attention_inference(q.double(), k.double(), v.double(), backend="reference",
                                                         **{**per_head, "pool_k": pool_k, "pool_v": pool_v,
                                                            "pool_scale": None}),
                               **(dict(rtol=1e-4, atol=1e-5) if int8 else dict(rtol=1e-10, atol=1e-12)))
    if T_q > 1:
        with pytest.raises(ValueError, match="same for every query of a stream and head"):
            block_attention_inference(q, k, v, shared=K + 1, **args)  # a chosen column is not shared
    with pytest.raises(ValueError, match="count of the table"):
        block_attention_inference(q, k, v, shared=K + S + 1, **args)


@pytest.mark.parametrize("T_q", [1, 24])
def test_int8_blocks_are_read_as_the_reference_reads_them_dequantized(T_q):
    g = torch.Generator().manual_seed(7)
    B, H, H_kv, D, L, K, n_pool = 1, 4, 2, 32, 8, 4, 6
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T_q, T_q + 3, T_q + 3))
    data, scales = quantize(torch.randn(n_pool, 2, H_kv, L, D, generator=g) * torch.logspace(-2, 1, D))
    args = dict(block_table=torch.randint(-1, n_pool, (B, H, T_q, K), generator=g),
                block_pos=torch.randint(0, 900, (B, H, T_q, K), generator=g), rope=RotaryEmbedding(D, 10000.0))
    out = block_attention_inference(q, k, v, pool_k=data[:, 0], pool_v=data[:, 1], pool_scale=scales.float(), **args)
    fk, fv = dequantize_kv(data[:, 0], data[:, 1], scales.float(), torch.float64)
    ref = block_attention_inference(q.double(), k.double(), v.double(), pool_k=fk, pool_v=fv, backend="reference",
                                    **args)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_every_block_read_at_its_place_gives_the_stock_models_logits(tokenizer_object, text, case):
    model, tok = tiny(tokenizer_object, case, landmarks=False)
    idx = ids_of(tok, text, 61)
    mem = LandmarkMemory(model, **EVERY_BLOCK)
    pieces = [mem(idx[:, a:b]).logits for a, b in ((0, 23), (23, 24), (24, 61))]  # a chunk and more, a token, the rest
    assert (mem.options.block_keys, mem.shape.landmarks, mem.n_blocks) == ("mean", False, 8)
    torch.testing.assert_close(torch.cat(pieces, 1), model(input_ids=idx, use_cache=False).logits, **TOL)


@pytest.mark.parametrize("retrieval", ["per_token_head", "per_head"])
@torch.no_grad()
def test_a_memory_reads_its_chosen_sink_and_local_blocks_as_the_gathering_reference_does(tokenizer_object, text,
                                                                                        retrieval):
    model, tok = tiny(tokenizer_object, "llama", landmarks=False)
    idx = ids_of(tok, text, 120)
    logits = []
    for backend in ("reference", "auto"):  # each query's blocks gathered, against shared ones read as local keys
        mem = LandmarkMemory(model, block_size=7, chunk_size=14, top_k=2, sink_blocks=1, local_blocks=1,
                             retrieval=retrieval, backend=backend)
        logits.append(torch.cat([mem(idx[:, :100]).logits, mem(idx[:, 100:101]).logits, mem(idx[:, 101:]).logits], 1))
    assert mem.n_blocks == 16 and torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[1], logits[0], **TOL)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_greedy_decoding_through_the_memory_equals_the_stock_models(tokenizer_object, text, family):
    model, tok = tiny(tokenizer_object, family, landmarks=False)
    idx = ids_of(tok, text, 40)
    new = LandmarkMemory(model, **EVERY_BLOCK).generate(idx, 12)
    x = idx
    for _ in range(12):  # the stock model rereading its whole context: obviously right
        x = torch.cat([x, model(input_ids=x, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(new, x[:, idx.shape[1]:])


@torch.no_grad()
def test_a_query_scores_a_block_by_the_mean_of_its_scores_against_the_blocks_tokens(tokenizer_object, text):
    model, tok = tiny(tokenizer_object, landmarks=False)
    mem = LandmarkMemory(model, block_size=7, chunk_size=14)
    mem(ids_of(tok, text, 28))
    layer, block, rope = 1, 2, mem.backbone.rope
    assert mem.n_blocks == 4 and mem.pending_count == 0  # every token is in memory
    key = mem.keys(layer, torch.tensor([block]))[:, 0].double()  # (H_kv, D), not rotated
    (stored,) = mem.inspection.stored([(0, layer, block)])  # (2, H_kv, L, D): a float store keeps keys without RoPE
    q, at = torch.randn(2, 16, dtype=torch.float64), 40  # a query per key/value head, at position 40
    qr = rope(q[:, None], torch.tensor([at]))[:, 0]
    tokens = rope(stored[0].double(), block * 7 + torch.arange(7))  # (H_kv, 7, D) rotated where they sit
    scores = torch.einsum("hd,hd->h", qr, rope(key[:, None], torch.tensor([block * 7]))[:, 0])
    torch.testing.assert_close(scores, torch.einsum("hd,htd->ht", qr, tokens).mean(-1), rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("retrieval", ["per_token_head", None])
def test_a_saved_training_free_memory_continues_as_if_it_had_never_stopped(tokenizer_object, text, tmp_path,
                                                                            retrieval):
    """Each query choosing its own blocks, as one reading of the whole text; chosen per head (the
    default without landmarks: a step's queries choose together), as one reading in the same steps."""
    model, tok = tiny(tokenizer_object, "gemma3", landmarks=False)  # sliding-window layers keep their windows too
    idx = ids_of(tok, text, 90)
    opts = dict(block_size=7, chunk_size=14, top_k=2, sink_blocks=1, store="lmdb", retrieval=retrieval)
    with LandmarkMemory(model, path=tmp_path / "m", **opts) as mem:
        assert mem.options.retrieval == (retrieval or "per_head")
        mem(idx[:, :51])  # a chunk left open
    with LandmarkMemory(model, path=tmp_path / "whole", **opts) as whole:
        if retrieval:
            want = whole(idx).logits[:, 51:]
        else:  # the same steps: the first 51 tokens, then the rest
            whole(idx[:, :51])
            want = whole(idx[:, 51:]).logits
    with LandmarkMemory.open(tmp_path / "m", model, retrieval=retrieval) as mem:
        assert (mem.options.block_keys, mem.options.block_size, mem.n_tokens) == ("mean", 7, 51)
        torch.testing.assert_close(mem(idx[:, 51:]).logits, want, **TOL)
    doc = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert doc["options"]["block_keys"] == "mean" and doc["model"]["shape"]["landmarks"] is False


def test_a_mode_that_does_not_fit_the_model_or_memory_is_refused_in_one_line(tokenizer_object, tmp_path):
    plain, _ = tiny(tokenizer_object, landmarks=False)
    landmark, _ = tiny(tokenizer_object)
    with pytest.raises(ValueError, match="needs a model fine-tuned with landmark tokens; this one has none"):
        LandmarkMemory(plain, block_keys="landmark")
    with pytest.raises(ValueError, match="block_keys must be one of"):
        LandmarkMemory(plain, block_keys="representative")
    with pytest.raises(ValueError, match="a LandmarkMemoryCache serves a model converted with"):
        LandmarkMemoryCache(plain)
    with pytest.raises(ValueError, match="landmarks after every 7 tokens; a landmark memory's block_size cannot be 9"):
        LandmarkMemory(landmark, block_size=9)
    assert LandmarkMemory(landmark, block_keys="mean", block_size=9).shape.rows == 9  # its own keys: any block size
    with LandmarkMemory(plain, path=tmp_path / "m", store="lmdb", block_size=7) as mem:
        mem(torch.arange(30)[None] % 300)
    with pytest.raises(ValueError, match="block_keys cannot change once a memory is built"):
        LandmarkMemory.open(tmp_path / "m", plain, block_keys="landmark")
    with pytest.raises(MemoryFileError, match="was built with another model"):
        LandmarkMemory.open(tmp_path / "m", landmark)
    manifest = tmp_path / "m" / "manifest.json"
    doc = json.loads(manifest.read_text())
    for entry, value, words in ((("options", "block_keys"), "representative", "searches its blocks by "
                                 "'representative', which this landmark-memory does not know"),
                                (("model", "shape", "landmarks"), True, "where model.shape says landmarks = True"),
                                (("options", "block_size"), 9, "where model.shape says .* block_size = 7")):
        *path, name = entry
        changed = json.loads(json.dumps(doc))
        where = changed
        for p in path:
            where = where[p]
        where[name] = value
        manifest.write_text(json.dumps(changed))
        with pytest.raises(MemoryFileError, match=words):
            MemoryDir(tmp_path / "m", writable=False).read_manifest()


def test_options_without_landmarks_resolve_to_mean_keys_the_free_block_size_and_a_choice_per_head():
    o = MemoryOptions().resolved(None, "float32", False, 16)
    assert (o.block_keys, o.block_size, o.chunk_size, o.retrieval) == ("mean", 64, 256, "per_head")
    landmark = MemoryOptions().resolved(50, "float32", False, 16)
    assert (landmark.block_keys, landmark.retrieval) == ("landmark", "per_token_head")
    assert MemoryOptions(retrieval="per_token_head").resolved(None, "float32", False, 16).retrieval == "per_token_head"


@pytest.mark.slow
def test_build_ask_and_eval_take_a_model_as_published_with_no_training(plain_dir, tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(BOOK.read_text()[30_000:34_000])
    memory = tmp_path / "m"
    doc = json.loads(cli("build", memory, "--input", book, "--model", plain_dir, "--block-size", "16", "--json",
                         "--quiet"))
    assert doc["blocks"] > 10
    info = json.loads(cli("info", memory, "--json"))
    assert (info["block_keys"], info["block_size"], info["top_k"]) == ("mean", 16, 8)
    assert "searched by the mean of their own keys" in cli("info", memory)
    doc = json.loads(cli("ask", memory, "Who was born a slave?", "--model", plain_dir, "--raw",
                         "--max-new-tokens", "4", "--json", "--quiet"))
    assert doc["retrieved"] and all(0 <= p["block"] < info["blocks"] for p in doc["retrieved"])
    assert json.loads(cli("info", memory, "--verify", "--json"))["ok"]
    for extra, mode in (((), "memory"), (("--full-attention",), "full attention")):
        doc = json.loads(cli("eval", "--model", plain_dir, "--input", book, "--eval-length", "200", "--chunk-size",
                             "128", "--max-segments", "1", "--json", "--quiet", *extra))
        assert doc["mode"] == mode and 1 < doc["perplexity"] < 1e4


@pytest.fixture(scope="module")
def plain_dir(tokenizer_object, tmp_path_factory):
    """A tiny Llama as published (no landmarks), saved as a Hugging Face model directory."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model, tok = tiny(tokenizer_object, landmarks=False)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_training_free_corpus_builds_on_ray_keeps_sessions_and_serves(plain_dir, documents, tmp_path, serving):
    assert not ray.is_initialized()
    argv = ["--input", str(documents), "--model", str(plain_dir), "--block-size", "16", "--chunk-size", "64",
            "--train-size", "4", "--json", "--quiet"]  # documents and corpus train their index lists
    for name, extra in (("two", ["--workers", "2", "--worker-threads", "1"]), ("here", [])):
        r = subprocess.run([sys.executable, "-m", "landmark_memory.app.cli", "build", str(tmp_path / name), *argv,
                            *extra], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread, as each worker: the same sums
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count("no landmarks; each block of 16 tokens is searched by the mean of its own keys") == 1
    loaded = load_model(str(plain_dir), "cpu")
    model, tok = loaded.model, loaded.tokenizer
    assert files_of(tmp_path / "two", model) == files_of(tmp_path / "here", model)
    for turn in range(2):  # a session made, then resumed by name
        with LandmarkMemory.open(tmp_path / "two", model, readonly=True) as mem, Session.open(mem, "talk") as s:
            got = say(s, tok, "Who came to the inn?", max_new_tokens=3)
            assert s.n_turns == 2 * (turn + 1) and got.passages
    with serving(tmp_path / "two", "--model", str(plain_dir)) as url:
        req = urllib.request.Request(url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": str(plain_dir), "max_tokens": 3, "messages": [
                                         {"role": "user", "content": "Who came to the inn?"}]}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            doc = json.loads(r.read())
    assert r.status == 200 and doc["choices"][0]["message"]["role"] == "assistant"
