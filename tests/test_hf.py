"""Hugging Face integration on tiny randomly initialised models of every family we convert (no downloads):
the converted forward against our reference attention, retrieve-all and decoding equivalence
through the cache, save/load, fine-tuning, and the commands on a model directory."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BOOK, script
from hf_tiny import CASES, TOL, cli, ids_of, tiny
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from landmark_memory import hf
from landmark_memory.core.layout import insert_landmarks, normal_positions
from landmark_memory.core.rope import RotaryEmbedding
from landmark_memory.core.tokenizer import LANDMARK_TOKEN
from landmark_memory.kernels import landmark_attention_reference
from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.hf.backbone import HFBackbone
from landmark_memory.models.hf.families import FULL, SLIDING

pytestmark = pytest.mark.slow  # Hugging Face models converted, fine-tuned and run by the command line







def reference_logits(model, idx):
    """The converted model's forward rebuilt from its modules with the paper-equation reference
    attention and RoPE written out here: plain from the base, or a scaled one's frequencies and
    attention factor as transformers' own RoPE module holds them (per layer type where they
    differ); a sliding-window layer's plain softmax over its window; the logit cap."""
    bb, cfg = HFBackbone(model), model.config
    x = insert_landmarks(idx, cfg.landmark_block_size, cfg.landmark_token_id)
    own, pos = model.get_decoder().rotary_emb, torch.arange(x.shape[1])
    types = getattr(cfg, "layer_types", None) or [FULL] * bb.n_layer
    h = bb.embed(x)
    for layer in range(bb.n_layer):
        kind = types[layer] if isinstance(own.rope_type, dict) else None
        rope_type, params = (own.rope_type[kind], cfg.rope_parameters[kind]) if kind else (own.rope_type,
                                                                                           cfg.rope_parameters)
        inv_freq, factor = (getattr(own, f"{kind}_inv_freq"), getattr(own, f"{kind}_attention_scaling")) if kind else (
            own.inv_freq, own.attention_scaling)
        rope = RotaryEmbedding(bb.head_dim, params["rope_theta"], inv_freq=None if rope_type == "default" else inv_freq)
        scale = getattr(cfg, "query_pre_attn_scalar", bb.head_dim) ** -0.5 * factor ** 2
        q, k, v = bb.qkv(layer, h)
        G = bb.n_head // bb.n_kv_head
        q, k, v = rope(q, pos), rope(k.repeat_interleave(G, 1), pos), v.repeat_interleave(G, 1)
        if types[layer] == SLIDING:
            i, j = pos[:, None], pos[None, :]
            s = (q @ k.transpose(-2, -1) * scale).masked_fill((j > i) | (j <= i - cfg.sliding_window), float("-inf"))
            y = s.softmax(-1) @ v
        else:
            y = landmark_attention_reference(q, k, v, cfg.landmark_block_size, scale)
        h = bb.finish(layer, h, y)
    logits = model.lm_head(model.get_decoder().norm(h))
    cap = getattr(cfg, "final_logit_softcapping", None)
    logits = torch.tanh(logits / cap) * cap if cap else logits
    return logits[:, normal_positions(idx.shape[1], cfg.landmark_block_size)]


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_converted_forward_equals_reference_attention_forward(tokenizer_object, text, case):
    model, tok = tiny(tokenizer_object, case)
    idx = ids_of(tok, text, 45)
    out = hf.normal_logits(model, idx)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference_logits(model, idx), **TOL)


def test_convert_adds_a_landmark_token_initialised_to_the_mean_embedding(tokenizer_object):
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token="</s>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    n = len(tok)
    emb, out = model.get_input_embeddings().weight.clone(), model.get_output_embeddings().weight.clone()
    hf.convert(model, tok, block_size=5)
    lid = tok.convert_tokens_to_ids(LANDMARK_TOKEN)
    assert lid == n == model.config.landmark_token_id and len(tok) == n + 1
    torch.testing.assert_close(model.get_input_embeddings().weight[lid], emb.mean(0))
    torch.testing.assert_close(model.get_output_embeddings().weight[lid], out.mean(0))
    torch.testing.assert_close(model.get_input_embeddings().weight[:n], emb)
    with pytest.raises(ValueError, match="already a landmark model"):
        hf.convert(model, tok)


def test_unsupported_models_are_refused_clearly(tokenizer_object):
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token="</s>")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="'dynamic', whose frequencies change with the input's length"):
        hf.convert(LlamaForCausalLM(cfg), tok)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="rotates 50% of each head"):
        hf.convert(LlamaForCausalLM(cfg), tok)
    with pytest.raises(ValueError, match="transformers causal LM"):
        hf.convert(torch.nn.Linear(2, 2), tok)
    with pytest.raises(ValueError, match="block_size"):
        hf.convert(LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2)), tok, block_size=0)


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_retrieve_all_through_the_cache_equals_in_sequence_forward(tokenizer_object, text, case):
    model, tok = tiny(tokenizer_object, case)
    idx = ids_of(tok, text, 61)
    cache = hf.LandmarkMemoryCache(model, chunk_size=14, top_k=64, position_mapping="exact")
    pieces = [model(input_ids=idx[:, a:b], past_key_values=cache).logits for a, b in ((0, 23), (23, 24), (24, 61))]
    assert cache.get_seq_length() == 61 and cache.memory.n_blocks == 8
    torch.testing.assert_close(torch.cat(pieces, 1), hf.normal_logits(model, idx), **TOL)


@torch.no_grad()
def test_the_cache_keeps_the_logits_transformers_asks_for(tokenizer_object, text):
    model, tok = tiny(tokenizer_object)
    idx = ids_of(tok, text, 40)
    full = model(input_ids=idx, past_key_values=hf.LandmarkMemoryCache(model, chunk_size=14)).logits
    for keep, want in ((1, full[:, -1:]), (3, full[:, -3:]), (torch.tensor([0, 5]), full[:, [0, 5]])):
        got = model(input_ids=idx, past_key_values=hf.LandmarkMemoryCache(model, chunk_size=14),
                    logits_to_keep=keep).logits
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("index", ["flat", "hnsw", "ivf"])
@torch.no_grad()
def test_greedy_generate_with_the_cache_equals_landmark_memory_decoding(tokenizer_object, text, index):
    model, tok = tiny(tokenizer_object)
    idx = ids_of(tok, text, 90)
    opts = dict(chunk_size=14, top_k=2, index=index, index_options={"train_size": 4, "nprobe": 1} if index == "ivf"
                else {})
    cache = hf.LandmarkMemoryCache(model, **opts)
    out = model.generate(idx, past_key_values=cache, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    ref = LandmarkMemory(model, **opts).generate(idx, 12)
    assert out[0, 90:].tolist() == ref[0].tolist()
    assert cache.get_seq_length() == 90 + 11


@torch.no_grad()
def test_generate_reads_a_saved_memory_as_if_it_had_never_stopped(tokenizer_object, text, tmp_path):
    model, tok = tiny(tokenizer_object)
    book, prompt = ids_of(tok, text, 100), ids_of(tok, "What was the name of the school?", 20)
    with LandmarkMemory(model, path=tmp_path / "mem", store="lmdb", chunk_size=14, top_k=2) as mem:
        mem.forward(book)
    cache = hf.LandmarkMemoryCache.open(tmp_path / "mem", model, readonly=True)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    cache.close()
    once = LandmarkMemory(model, chunk_size=14, top_k=2)
    once.forward(book)
    assert out[0, prompt.shape[1]:].tolist() == once.generate(prompt, 8)[0].tolist()


@torch.no_grad()
def test_the_cache_refuses_what_a_memory_cannot_do(tokenizer_object, text):
    model, tok = tiny(tokenizer_object)
    idx = ids_of(tok, text, 20)
    cache = hf.LandmarkMemoryCache(model, chunk_size=14)
    model(input_ids=idx, past_key_values=cache)
    with pytest.raises(ValueError, match="cannot go back"):
        model(input_ids=idx, past_key_values=cache, cache_position=torch.arange(20))
    with pytest.raises(ValueError, match="attention mask must be all ones"):
        model(input_ids=idx, past_key_values=cache, attention_mask=torch.zeros_like(idx))
    plain = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "landmark_block_size": None}))
    with pytest.raises(RuntimeError, match="converted"):
        plain(input_ids=idx, past_key_values=cache)


@torch.no_grad()
def test_save_and_load_round_trip(tokenizer_object, text, tmp_path):
    model, tok = tiny(tokenizer_object)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    idx = ids_of(tok, text, 40)
    loaded = hf.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and loaded.config.landmark_block_size == 7
    torch.testing.assert_close(hf.normal_logits(loaded, idx), hf.normal_logits(model, idx), rtol=0, atol=0)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="landmark").eval()  # stock loader
    torch.testing.assert_close(hf.normal_logits(auto, idx), hf.normal_logits(model, idx), rtol=0, atol=0)
    plain = tmp_path / "plain"
    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(plain)
    with pytest.raises(ValueError, match="not a landmark model"):
        hf.from_pretrained(plain)


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_every_family_decodes_through_the_cache_as_its_memory_does_and_saves_and_loads(tokenizer_object, text, case,
                                                                                      tmp_path):
    model, tok = tiny(tokenizer_object, case)
    idx = ids_of(tok, text, 60)
    opts = dict(chunk_size=14, top_k=2)
    out = model.generate(idx, past_key_values=hf.LandmarkMemoryCache(model, **opts), max_new_tokens=8, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    assert out[0, 60:].tolist() == LandmarkMemory(model, **opts).generate(idx, 8)[0].tolist()
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    torch.testing.assert_close(hf.normal_logits(loaded, idx), hf.normal_logits(model, idx), rtol=0, atol=0)


def test_a_family_we_do_not_convert_is_refused_in_one_line(tokenizer_object):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, eos_token="</s>")
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="is not a family landmark attention converts; supported: llama, mistral"):
        hf.convert(model, tok)


@pytest.fixture(scope="module")
def model_dir(tokenizer_object, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-landmark-llama"
    model, tok = tiny(tokenizer_object)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_decode_benchmark_sets_memory_against_the_plain_models_dynamic_cache(model_dir, tokenizer_object, tmp_path,
                                                                            capsys):
    plain, (model, tok) = tmp_path / "plain", tiny(tokenizer_object)
    LlamaForCausalLM(LlamaConfig(**{k: getattr(model.config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads")})).save_pretrained(plain)
    tok.save_pretrained(plain)
    bench = script("bench_decode")
    bench.main(["--model", str(model_dir), "--baseline", str(plain), "--contexts", "100,200", "--indexes", "flat",
                "--steps", "2"])
    out = capsys.readouterr().out
    assert "4 heads over 2 key/value heads" in out and "| 200 | landmark, flat |" in out
    kv_mib = 2 * 2 * 200 * 2 * (64 // 4) * 4 / 2 ** 20  # layers x keys and values x positions x kv heads x dim
    assert "| 200 | full attention + KV cache | " in out and f"| {kv_mib:.1f} |" in out
    with pytest.raises(SystemExit, match="--baseline"):
        bench.main(["--model", str(model_dir), "--contexts", "100"])


@torch.no_grad()
def test_a_plain_models_kv_cache_decoding_equals_rereading_its_context(tokenizer_object, text, recwarn):
    from landmark_memory.core.decode import decode, decode_rereading
    from landmark_memory.models.kinds import kv_cache_decoder

    _, tok = tiny(tokenizer_object)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    idx = ids_of(tok, text, 40)
    got = decode(*kv_cache_decoder(plain, idx), 12)
    assert torch.equal(got, decode_rereading(lambda x: plain(input_ids=x).logits, idx, 12))
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]  # the cache by the name the model takes




def test_passkey_and_eval_commands_take_a_hugging_face_model_directory(model_dir, tmp_path):
    doc = json.loads(cli("passkey", "--model", model_dir, "--lengths", "300,400", "--trials", "2", "--chunk-size", "21",
                         "--json", "--quiet"))
    assert [r["length"] for r in doc["results"]] == [300, 400] and doc["mode"] == "landmark + memory"
    assert all(0 <= r["accuracy"] <= 1 for r in doc["results"])
    book = tmp_path / "book.txt"
    book.write_text(BOOK.read_text()[30_000:36_000])
    for extra, mode in (((), "memory"), (("--full-attention",), "in-sequence")):
        doc = json.loads(cli("eval", "--model", model_dir, "--input", book, "--eval-length", "100", "--chunk-size",
                             "21",
                             "--max-segments", "2", "--json", "--quiet", *extra))
        assert doc["mode"] == mode and doc["segments"] == 2 and 1 < doc["perplexity"] < 1e4


@pytest.mark.parametrize("lora", [False, True], ids=["all-weights", "lora"])
def test_fine_tuning_trains_and_resumes(model_dir, tmp_path, text, lora):
    data = tmp_path / "books"
    data.mkdir()
    for i in range(2):
        (data / f"b{i}.txt").write_text(text[i * 20_000:(i + 1) * 20_000])
    out = tmp_path / "ft"
    run = [sys.executable, str(Path(__file__).parents[1] / "experiments" / "finetune_hf.py"), "--hf-model", model_dir,
           "--data", data, "--out-dir", out, "--block-size", "7", "--seq-len", "56", "--batch-size", "2",
           "--grad-accum", "1", "--eval-interval", "2", "--eval-iters", "1", "--lr", "1e-3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if lora:
        run += ["--lora-rank", "4"]
    for steps, extra in (("2", []), ("4", ["--resume"])):
        r = subprocess.run([*map(str, run), "--max-iters", steps, *extra], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 2, 4]
    assert "resumed from" in r.stderr + r.stdout
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 4
    # a next stage starts from these weights: its first evaluation (the same windows) scores them
    stage2 = [*map(str, run), "--max-iters", "1", "--init-from", str(out), "--out-dir", str(tmp_path / "stage2")]
    r = subprocess.run(stage2, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((tmp_path / "stage2" / "train_log.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and abs(first["val_loss"] - log[-1]["val_loss"]) < 1e-3
    if not lora:
        assert hf.from_pretrained(out).config.landmark_block_size == 7
        return
    # the adapter and the landmark row alone were saved, and they apply on top of the base weights
    from peft import PeftModel

    assert json.loads((out / "landmark.json").read_text()) == {"block_size": 7}
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    base = hf.from_pretrained(model_dir)
    tuned = PeftModel.from_pretrained(hf.from_pretrained(model_dir), str(out)).merge_and_unload()
    lm = base.config.landmark_token_id
    emb, base_emb = tuned.get_input_embeddings().weight, base.get_input_embeddings().weight
    assert not torch.equal(emb[lm], base_emb[lm]) and torch.equal(emb[:lm], base_emb[:lm])
    tuned_q, base_q = tuned.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(tuned_q, base_q)
    r = subprocess.run([*stage2, "--lora-rank", "8"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "has LoRA rank 4; pass --lora-rank 4" in r.stderr


def test_readme_example_runs_as_written(model_dir, tmp_path, text):
    readme = (Path(__file__).parents[1] / "docs" / "guide.md").read_text()
    code = re.search(r"<!-- hf-example -->\s*```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) == 5
    (tmp_path / "my-landmark-llama").symlink_to(model_dir)
    model = hf.from_pretrained(model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    with LandmarkMemory(model, path=tmp_path / "my-memory", store="lmdb", chunk_size=21) as mem:
        mem.forward(ids_of(tok, text, 300))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(model_dir, tokenizer_object, text):
    from landmark_memory.training.finetune import HFLandmarkLM

    idx = torch.tensor([tokenizer_object.encode(text).ids[:60]])  # (1, 60)
    answer, source = torch.zeros(1, 59, dtype=torch.int64), torch.zeros(1, 59, dtype=torch.int64)
    answer[0, 50:55], source[0, 10:20] = 1, 1  # the recall loss too reads the layers' inputs
    runs = []
    for checkpoint in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation
        model = HFLandmarkLM.load(str(model_dir), 7, lora_rank=4, lora_alpha=8, grad_checkpoint=checkpoint).train()
        assert model.hf.is_gradient_checkpointing == checkpoint
        _, lm, recall = model(idx[:, :-1], idx[:, 1:], answer=answer, source=source)
        loss = lm + recall
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        runs.append((loss, grads))
    (loss, grads), (loss_c, grads_c) = runs
    assert torch.isfinite(loss) and torch.allclose(loss, loss_c, rtol=1e-6)
    assert grads.keys() == grads_c.keys() and any(g.abs().sum() > 0 for g in grads.values())
    for name, g in grads.items():
        assert torch.allclose(g, grads_c[name], rtol=1e-4, atol=1e-7), name


def test_fine_tuning_with_a_recall_weight_logs_the_recall_loss_of_its_drills(model_dir, tmp_path, text):
    from landmark_memory.training.train import Trainer, parse_args

    data = tmp_path / "books"
    data.mkdir()
    for i in range(2):
        (data / f"b{i}.txt").write_text(text[i * 20_000:(i + 1) * 20_000])
    args = ["--hf-model", str(model_dir), "--data", str(data), "--out-dir", str(tmp_path / "ft"), "--block-size", "7",
            "--seq-len", "1200", "--batch-size", "1", "--max-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
            "--lora-rank", "4", "--drill-rate", "1", "--recall-weight", "0.5"]
    Trainer(parse_args(args)[0]).run()
    log = [json.loads(line) for line in (tmp_path / "ft" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 2] and all(0 < r["val_recall"] < 10 for r in log)
    with pytest.raises(ValueError, match="needs --hf-model and --drill-rate"):
        Trainer(parse_args([*args[:-4], "--recall-weight", "0.5"])[0])
