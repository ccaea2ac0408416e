"""A memory or a model folder received from someone else never makes the tool run code: the
model a manifest names is loaded only when it is one the package ships or the user names it
again, a folder that would need its own Python is refused, pickled weights are never
unpickled, and a damaged retrieval-heads file is one line, never a traceback."""

import io
import json
import shutil

import pytest
import torch

from landmark_memory.app.cli import main
from landmark_memory.models.heads import HEADS_FILE, find_heads
from landmark_memory.models.kinds import load_model
from landmark_memory.models.model import BUNDLED_MODEL
from landmark_memory.training.data import SAMPLE_DIR

MARK = "RAN"  # the file a folder's code writes when it runs


def code_folder(folder, marker, model_type="evilgpt"):
    """A model folder whose config names its own Python (``auto_map``), which writes ``marker`` when imported."""
    folder.mkdir(parents=True, exist_ok=True)
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import PretrainedConfig\n" \
           "class EvilConfig(PretrainedConfig):\n    model_type = 'evilgpt'\n"
    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (folder / name).write_text(code)
    auto = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel",
            "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    doc = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    (folder / "config.json").write_text(json.dumps({**doc, "model_type": model_type, "auto_map": auto}))
    return folder


def tiny_llama(folder):
    """A small Llama in ``folder`` (safetensors) with a fast tokenizer: what transformers loads with its own classes."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from landmark_memory import load_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=8192)).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(), eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """A memory of the bundled model over a short text, and the text."""
    d = tmp_path_factory.mktemp("memory")
    (d / "a.txt").write_text((SAMPLE_DIR / "train" / "treasure_island_excerpt.txt").read_text()[:2500])
    assert main(["build", str(d / "m"), "--input", str(d / "a.txt"), "--chunk-size", "100", "--quiet"]) == 0
    return d / "m", d / "a.txt"


def renamed(memory, tmp_path, name):
    """A copy of ``memory`` whose manifest names the model ``name``."""
    copy = tmp_path / "received"
    shutil.copytree(memory, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    doc["model"]["name"] = str(name)
    (copy / "manifest.json").write_text(json.dumps(doc))
    return copy


@pytest.mark.parametrize("command", ["ask", "chat", "serve", "build"])
def test_a_received_manifest_naming_a_folder_loads_nothing_until_the_user_names_it(memory, tmp_path, refused,
                                                                                 monkeypatch, command):
    marker = tmp_path / MARK
    received = renamed(memory[0], tmp_path, code_folder(tmp_path / "evil", marker))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\nhello\n"))  # what answers transformers' "run the code? [y/N]"
    argv = {"ask": ["ask", str(received), "hello"], "chat": ["chat", str(received), "--session", "s"],
            "serve": ["serve", str(received), "--port", "1"],
            "build": ["build", str(received), "--input", str(memory[1]), "--quiet"]}[command]
    refused(argv, str(tmp_path / "evil"), "--model")
    assert not marker.exists()


def test_a_folder_that_needs_its_own_code_is_refused_even_when_named(memory, tmp_path, refused, monkeypatch):
    marker = tmp_path / MARK
    folder = code_folder(tmp_path / "evil", marker)
    received = renamed(memory[0], tmp_path, folder.resolve())
    monkeypatch.setattr("sys.stdin", io.StringIO("y\nhello\n"))
    refused(["chat", str(received), "--session", "s", "--model", str(folder)],
             "config.json", "'evilgpt'", "never runs")
    assert not marker.exists()


def test_a_known_model_type_is_read_with_transformers_classes_never_the_folders_code(tmp_path, monkeypatch):
    marker = tmp_path / MARK
    folder = code_folder(tiny_llama(tmp_path / "llama"), marker, model_type="llama")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    try:
        model = load_model(folder, "cpu").model
        assert type(model).__name__ == "LlamaForCausalLM"
    except ValueError as e:  # (or refused in one line: either way nothing of the folder ran)
        assert "without running its code" in str(e) and "\n" not in str(e)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickled_weights_are_never_unpickled_and_named_in_one_line(tmp_path, refused, name):
    folder = tiny_llama(tmp_path / "llama")
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / name)
    (folder / "model.safetensors").unlink()
    refused(["eval", "--model", str(folder), "--input", str(SAMPLE_DIR / "val" / "alice_excerpt.txt"),
                           "--quiet"], str(folder / name), "pickle", "safetensors")


@pytest.fixture(scope="module")
def model_memory(tmp_path_factory, memory):
    """A copy of the bundled model in a folder, and a memory built with it (the folder named)."""
    d = tmp_path_factory.mktemp("own")
    shutil.copytree(BUNDLED_MODEL, d / "model")
    assert main(["build", str(d / "m"), "--input", str(memory[1]), "--chunk-size", "100", "--quiet",
                 "--model", str(d / "model")]) == 0
    return d / "model", d / "m"


@pytest.mark.parametrize("body", [
    b'{"heads": [[0, Infinity]]}', b'{"heads": [[0, 1]], "blocks": 1e400}', b'{"heads": [[0, NaN]]}',
    b"[" * 100_000 + b"]" * 100_000, b'{"heads": [[0, 1]], "notes": "' + b"x" * (2 << 20) + b'"}'])
def test_a_damaged_heads_file_is_one_line_from_every_command_that_loads_the_model(model_memory, refused, body):
    folder, mem = model_memory
    (folder / HEADS_FILE).write_bytes(body)
    try:
        refused(["ask", str(mem), "hello", "--model", str(folder), "--max-new-tokens", "1"],
                 str(folder / HEADS_FILE), "or remove it")
    finally:
        (folder / HEADS_FILE).unlink()


def test_a_file_beside_a_model_folder_is_never_taken_for_its_heads(model_memory):
    folder, mem = model_memory
    beside = folder.parent / f"{folder.name}.json"
    beside.write_text("not json")
    try:
        assert find_heads(str(folder.resolve())) is None
        assert main(["ask", str(mem), "hello", "--model", str(folder), "--max-new-tokens", "1"]) == 0
    finally:
        beside.unlink()
