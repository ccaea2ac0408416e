import json
import math

import pytest
import torch

from landmark_memory import LandmarkConfig, LandmarkGPT
from landmark_memory.training.optim import build_optimizer
from landmark_memory.training.train import TrainConfig


def tiny(**kw):
    base = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, block_size=5, landmark_id=1)
    return LandmarkConfig(**{**base, **kw})


@pytest.mark.parametrize("attention", ["landmark", "full"])
def test_forward_shapes_and_loss(attention):
    torch.manual_seed(0)
    model = LandmarkGPT(tiny(attention=attention))
    idx = torch.randint(4, 64, (3, 23))
    logits = model(idx)
    assert logits.shape == (3, 23, 64)
    logits2, loss = model(idx, idx)
    torch.testing.assert_close(logits, logits2)
    assert loss.shape == () and math.isfinite(loss.item())


def test_full_attention_module_equals_causal_softmax_attention():
    torch.manual_seed(0)
    cfg = tiny(attention="full")
    attn = LandmarkGPT(cfg).blocks[0].attn
    x = torch.randn(2, 9, cfg.n_embd)
    pos = torch.arange(9)
    q, k, v = attn.qkv(x).view(2, 9, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.rope(q, pos), attn.rope(k, pos)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(cfg.head_dim)
    s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    y = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 9, cfg.n_embd)
    torch.testing.assert_close(attn(x, pos), attn.proj(y), rtol=1e-5, atol=1e-6)


def test_landmark_model_without_complete_blocks_equals_full_model():
    torch.manual_seed(0)
    full = LandmarkGPT(tiny(attention="full"))
    lm = LandmarkGPT(tiny(attention="landmark", block_size=16))
    lm.load_state_dict(full.state_dict())
    idx = torch.randint(4, 64, (2, 16))  # one block, its landmark last: no normal token sees it
    torch.testing.assert_close(lm(idx), full(idx), rtol=1e-5, atol=1e-5)


def test_landmark_model_is_causal():
    torch.manual_seed(0)
    model = LandmarkGPT(tiny())
    idx = torch.randint(4, 64, (1, 30))
    changed = idx.clone()
    changed[0, 17] = (idx[0, 17] + 1) % 60 + 4
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :17], b[:, :17])
    assert not torch.allclose(a[:, 17:], b[:, 17:])


def test_landmarks_change_the_model_output():
    torch.manual_seed(0)
    full = LandmarkGPT(tiny(attention="full"))
    lm = LandmarkGPT(tiny(attention="landmark"))
    lm.load_state_dict(full.state_dict())
    idx = torch.randint(4, 64, (1, 20))
    torch.testing.assert_close(lm(idx)[:, :5], full(idx)[:, :5], rtol=1e-5, atol=1e-5)  # first block alike
    assert not torch.allclose(lm(idx)[:, 6:], full(idx)[:, 6:])  # later blocks see through landmarks


def test_ignored_targets_carry_no_loss():
    torch.manual_seed(0)
    model = LandmarkGPT(tiny())
    idx = torch.randint(4, 64, (2, 12))
    y = torch.randint(4, 64, (2, 12))
    y[:, 6:] = -100
    logits, loss = model(idx, y)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[:, :6].flatten(0, 1), y[:, :6].flatten()))


def test_weighted_loss_is_the_weighted_mean_of_per_token_losses():
    torch.manual_seed(0)
    model = LandmarkGPT(tiny())
    idx, y = torch.randint(4, 64, (2, 12)), torch.randint(4, 64, (2, 12))
    y[0, -2:] = -100
    w = torch.rand(2, 12) * 5 + 0.1
    logits, plain = model(idx, y)
    _, ones = model(idx, y, weights=torch.ones(2, 12))
    _, weighted = model(idx, y, weights=w)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none", ignore_index=-100)
    kept = (y != -100).flatten().float()
    torch.testing.assert_close(ones, plain)
    torch.testing.assert_close(weighted, (ce * w.flatten() * kept).sum() / (w.flatten() * kept).sum())
    with pytest.raises(ValueError, match="weights shape"):
        model(idx, y, weights=torch.ones(2, 11))


@pytest.mark.parametrize("attention", ["landmark", "full"])
def test_a_few_training_steps_lower_the_loss(attention):
    torch.manual_seed(0)
    model = LandmarkGPT(tiny(attention=attention))
    opt = build_optimizer(model, TrainConfig(lr=3e-3), "cpu")
    idx = torch.randint(4, 64, (4, 24))
    y = torch.roll(idx, -1, dims=1)
    losses = []
    for _ in range(25):
        _, loss = model(idx, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = LandmarkGPT(tiny())
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    loaded = LandmarkGPT.from_pretrained(tmp_path / "m")
    assert loaded.config == model.config
    assert loaded.lm_head.weight.data_ptr() == loaded.wte.weight.data_ptr(), "tied weights stay tied"
    idx = torch.randint(4, 64, (2, 17))
    assert torch.equal(loaded(idx), model(idx))


def test_from_pretrained_explains_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a saved LandmarkGPT"):
        LandmarkGPT.from_pretrained(tmp_path)
    LandmarkGPT(tiny()).save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**doc, "format_version": 99}))
    with pytest.raises(ValueError, match="upgrade"):
        LandmarkGPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**doc, "config": {**doc["config"], "n_layer": 3}}))
    with pytest.raises(ValueError, match="does not match its config"):
        LandmarkGPT.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{truncated")
    with pytest.raises(ValueError, match="not valid JSON"):
        LandmarkGPT.from_pretrained(tmp_path)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="attention"):
        tiny(attention="sparse")
    with pytest.raises(ValueError, match="multiple of n_head"):
        tiny(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="landmark_id"):
        tiny(landmark_id=64)
    with pytest.raises(ValueError, match="idx must be"):
        LandmarkGPT(tiny())(torch.randn(2, 3))
