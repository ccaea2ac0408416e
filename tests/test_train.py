import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from landmark_memory import LandmarkGPT
from landmark_memory.training.data import SAMPLE_DIR
from landmark_memory.training.optim import lr_at
from landmark_memory.training.train import PRESETS, TrainConfig, Trainer, parse_args

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--ffn-hidden", "64", "--seq-len", "64",
         "--block-size", "7", "--batch-size", "4", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """Two small training books and one validation book cut from the bundled sample."""
    d = tmp_path_factory.mktemp("books")
    (d / "train").mkdir(), (d / "val").mkdir()
    for f in (SAMPLE_DIR / "train").glob("*.txt"):
        (d / "train" / f.name).write_text(f.read_text()[:12000])
    (d / "val" / "alice.txt").write_text((SAMPLE_DIR / "val" / "alice_excerpt.txt").read_text()[:6000])
    return d


def test_lr_warms_up_then_decays_by_cosine_to_min_lr():
    cfg = TrainConfig(max_iters=1000, warmup_frac=0.02, lr=2e-3, min_lr=4e-4)
    assert lr_at(0, cfg) == pytest.approx(2e-3 / 20)
    assert lr_at(19, cfg) == pytest.approx(2e-3)
    assert lr_at(20, cfg) == pytest.approx(2e-3)
    assert 4e-4 < lr_at(500, cfg) < 2e-3
    assert lr_at(1000, cfg) == pytest.approx(4e-4)


def test_presets_and_flags():
    cfg, preset = parse_args(["--preset", "paper"])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.ffn_hidden, cfg.seq_len, cfg.block_size) == (12, 8, 1024, 4096,
                                                                                                  512, 50)
    assert (cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.lr, cfg.min_lr, cfg.warmup_frac) == (0.9, 0.95, 1e-3, 2e-3,
                                                                                             4e-4, 0.02)
    assert cfg.batch_size * cfg.grad_accum == 128
    cfg, preset = parse_args(["--attention", "full", "--max-iters", "7", "--resume"])
    assert (preset, cfg.attention, cfg.max_iters, cfg.resume, cfg.n_layer) == ("tiny", "full", 7, True,
                                                                               PRESETS["tiny"]["n_layer"])


def _trainer(books, out, *extra):
    cfg, _ = parse_args([*SMALL, "--data", str(books / "train"), "--val-data", str(books / "val"),
                         "--out-dir", str(out), "--eval-interval", "3", "--max-iters", "6", *extra])
    return Trainer(cfg)


def test_training_lowers_validation_loss_and_saves(books, tmp_path):
    result = _trainer(books, tmp_path, "--max-iters", "30", "--eval-interval", "30", "--lr", "3e-3").run()
    assert result["best_val"] < result["first_val"] - 0.5
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 30]
    assert LandmarkGPT.from_pretrained(tmp_path / "best").config.block_size == 7


def test_resume_continues_exactly_as_if_never_stopped(books, tmp_path):
    straight = _trainer(books, tmp_path / "a")
    straight.run()
    interrupted = _trainer(books, tmp_path / "b")
    interrupted._eval_and_save(0)
    for _ in range(3):
        interrupted.train_step()
    interrupted._eval_and_save(0)  # checkpoint at step 3, as the loop does
    resumed = _trainer(books, tmp_path / "b", "--resume")
    assert resumed.step == 3
    resumed.run()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_resume_refuses_a_different_model(books, tmp_path):
    _trainer(books, tmp_path, "--max-iters", "3").run()
    with pytest.raises(ValueError, match="same flags"):
        _trainer(books, tmp_path, "--resume", "--n-embd", "64")
    with pytest.raises(FileNotFoundError, match="drop --resume"):
        _trainer(books, tmp_path / "empty", "--resume")


def test_drill_windows_train_and_leave_no_room_for_the_passkey_mix(books, tmp_path):
    t = _trainer(books, tmp_path, "--drill-rate", "1.0", "--seq-len", "512", "--max-iters", "1", "--answer-weight", "5")
    t.run()
    assert all("?" in t.tok.decode(row.tolist()) for row in t.val_batches[0].x)  # every validation window asks
    w = t.sampler.batch().w
    assert torch.all(w[:, -1] == 5.0) and torch.all((w == 1.0).sum(1) > 400)  # the answer ends the window
    with pytest.raises(ValueError, match="give one of them"):
        _trainer(books, tmp_path / "both", "--drill-rate", "0.5", "--passkey-rate", "0.5")
    with pytest.raises(ValueError, match="--hf-model fine-tuning only"):
        _trainer(books, tmp_path / "gc", "--grad-checkpoint")


def test_full_attention_baseline_trains_from_the_same_command(books, tmp_path):
    t = _trainer(books, tmp_path, "--attention", "full", "--max-iters", "2")
    t.run()
    assert t.model.config.attention == "full"


@pytest.mark.slow
def test_two_process_ddp_step(books, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "experiments" / "train.py"), *SMALL, "--data", str(books / "train"),
           "--val-data", str(books / "val"), "--out-dir", str(tmp_path), "--max-iters", "2", "--eval-interval", "2"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 2 and log[-1]["world_size"] == 2
    LandmarkGPT.from_pretrained(tmp_path)
