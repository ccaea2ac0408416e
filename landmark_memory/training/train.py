"""Training loop for LandmarkGPT (paper section 4.1), single process or DistributedDataParallel.

    python experiments/train.py --preset tiny                                # bundled sample text
    python experiments/train.py --preset tiny --data BOOKS                   # 5% of books held out
    python experiments/train.py --preset tiny --attention full               # the baseline
    torchrun --nproc_per_node 2 experiments/train.py --preset tiny           # DDP (gloo on CPU)

Writes to ``--out-dir``: the latest model (``save_pretrained`` layout), ``best/`` (lowest
validation loss), ``optimizer.safetensors`` + ``trainer_state.json`` for ``--resume``, and
``train_log.jsonl``, one JSON line per evaluation.
"""

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..core.fileio import atomic_write
from ..core.tokenizer import EOS_TOKEN, load_tokenizer
from ..models.config import LandmarkConfig
from ..models.model import LandmarkGPT
from .data import SAMPLE_DIR, PasskeyMix, WindowSampler, list_text_files, split_books, tokenize_books
from .drills import RetrievalDrills
from .optim import build_optimizer, load_optimizer, lr_at, optimizer_tensors

STATE_NAME, OPTIM_NAME, LOG_NAME = "trainer_state.json", "optimizer.safetensors", "train_log.jsonl"


@dataclass
class TrainConfig:
    # data
    data: str = ""  # text files / folders; "" = the bundled sample (its own train/ and val/)
    val_data: str = ""  # validation books; "" = hold out --val-books whole books of --data
    val_books: int = 0  # 0 = 5% of the books, at least one
    passkey_rate: float = 0.0  # fraction of windows with a planted passkey to retrieve
    copy_rate: float = 0.25  # share of those windows that are copy drills instead (data.PasskeyMix)
    drill_rate: float = 0.0  # fraction of windows made retrieval drills in their own book text (drills.RetrievalDrills)
    drill_chat_share: float = 0.5  # share of the drills' questions asked as chat turns (models with a chat template)
    drill_quote_share: float = 0.0  # share of the drills that also ask to quote a sentence of their book text
    answer_weight: float = 1.0  # loss weight of the drills' answer tokens against 1 for the rest (validation: 1)
    recall_weight: float = 0.0  # with --drill-rate: weight of the recall loss on the drills' answers (recall.py)
    seq_len: int = 512  # normal tokens per window (landmarks come on top)
    # model
    attention: str = "landmark"  # landmark, full (the baseline) or infini (Infini-attention)
    block_size: int = 50  # normal tokens per block; a landmark closes each
    segment_size: int = 128  # attention="infini": tokens per segment
    infini_update: str = "linear+delta"  # attention="infini": memory update rule
    cmt: bool = False  # a Context Miss Token that learns when retrieval is needed (paper appendix D)
    p_cmt: float = 0.5  # with --cmt: chance that a landmark is CMT-controlled in a training window
    p_jump: int = 1  # positions jump by a random 1..p_jump after each landmark (appendix E); 1 = off
    n_layer: int = 12  # transformer layers
    n_head: int = 8  # attention heads per layer
    n_embd: int = 1024  # model width
    ffn_hidden: int = 4096  # hidden width of each MLP
    dropout: float = 0.0  # dropout probability in training
    init_from: str = ""  # start from this saved model (with --hf-model: an adapter); "" = random init
    hf_model: str = ""  # fine-tune this Hugging Face model folder (or "smollm2") with landmarks (paper 4.2)
    lora_rank: int = 0  # with --hf-model: train LoRA adapters of this rank and the landmark embedding; 0 = all weights
    lora_alpha: int = 0  # LoRA scale numerator; 0 = twice the rank
    grad_checkpoint: bool = False  # with --hf-model: recompute each layer in the backward pass (long windows fit)
    # optimisation (paper defaults)
    batch_size: int = 8  # per process, per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    max_iters: int = 240_000  # optimizer steps
    lr: float = 2e-3  # peak learning rate, after warmup
    min_lr: float = 4e-4  # learning rate at the end of the cosine decay
    warmup_frac: float = 0.02  # share of the steps warming up linearly
    weight_decay: float = 1e-3  # AdamW weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # 0 = off
    # bookkeeping
    eval_interval: int = 1000  # steps between validation runs (and saves)
    eval_iters: int = 20  # validation batches per run
    out_dir: str = ""  # "" = out/<preset>
    resume: bool = False  # continue the run saved in --out-dir, exactly where it stopped
    seed: int = 1337  # initialisation and data order
    device: str = "auto"  # cpu, cuda, cuda:1 ...; auto = cuda when available
    dtype: str = "auto"  # auto = bfloat16 autocast on GPUs that support it, else float32
    sample_tokens: int = 0  # print a sample of this many tokens at the end


PRESETS = {
    # minutes on 2 CPU cores
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, ffn_hidden=512, seq_len=256, batch_size=8, max_iters=200,
                 eval_interval=50, eval_iters=8, sample_tokens=40),
    # the paper's model: 12 layers, 8 heads of 128, FFN 4096, effective batch 128
    "paper": dict(n_layer=12, n_head=8, n_embd=1024, ffn_hidden=4096, seq_len=512, batch_size=16, grad_accum=8,
                  max_iters=240_000, eval_interval=1000, eval_iters=50),
    # fine-tuning a Hugging Face model (paper 4.2, its code's defaults): windows of 512 tokens
    # with landmarks (8 blocks of 63 + 8 landmarks), lr 2e-5 with 3% warmup and cosine decay to 0,
    # weight decay 0.1, AdamW betas (0.9, 0.999), gradient clipping 1, 128 windows per step
    "hf": dict(block_size=63, seq_len=504, batch_size=2, grad_accum=64, max_iters=15_000, lr=2e-5, min_lr=0.0,
               warmup_frac=0.03, weight_decay=0.1, beta2=0.999, eval_interval=500, eval_iters=10),
}


class Trainer:
    def __init__(self, cfg, preset=""):
        self.cfg = cfg
        self.ddp = "RANK" in os.environ
        if self.ddp:
            import torch.distributed as dist

            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            local = int(os.environ.get("LOCAL_RANK", 0))
            if torch.cuda.is_available():
                torch.cuda.set_device(local)
            else:  # share the cores instead of oversubscribing them
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        else:
            self.rank, self.world = 0, 1
        self.master = self.rank == 0
        dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if dev == "cuda" and self.ddp else dev)
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
        self.autocast = (torch.autocast(self.device.type, dtype=getattr(torch, dtype))
                         if dtype != "float32" else contextlib.nullcontext())
        self.out = Path(cfg.out_dir or f"out/{preset or 'run'}")
        if self.master:
            self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed + self.rank)

        if cfg.hf_model:
            from .finetune import HFLandmarkLM

            start = self.out if cfg.resume else (cfg.init_from or None)
            self.model = HFLandmarkLM.load(cfg.hf_model, cfg.block_size, lora_rank=cfg.lora_rank,
                                           lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank,
                                           start_from=start, grad_checkpoint=cfg.grad_checkpoint).to(self.device)
            self.tok = self.model.text_tokenizer()
        else:
            if cfg.grad_checkpoint:
                raise ValueError("--grad-checkpoint serves --hf-model fine-tuning only")
            self.tok = load_tokenizer()
        self.train_tokens, self.val_tokens = self._load_data()
        mix = self._mix()
        self.sampler = WindowSampler(self.train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed + self.rank, mix,
                                     answer_weight=cfg.answer_weight)
        # the same validation windows at every evaluation, so the curve compares like with like
        val = WindowSampler(self.val_tokens, cfg.seq_len, cfg.batch_size, seed=0, mix=mix)
        self.val_batches = [val.batch() for _ in range(cfg.eval_iters)]

        if cfg.hf_model:
            what = (f"LoRA adapters of rank {cfg.lora_rank} and the landmark embedding" if cfg.lora_rank
                    else "all weights")
            self.log(f"fine-tuning {cfg.hf_model} ({what}) with a landmark every {cfg.block_size} tokens"
                     + (f", starting from {cfg.init_from}" if cfg.init_from and not cfg.resume else ""))
        elif cfg.init_from:  # the saved model's architecture wins over the model flags
            self.model = LandmarkGPT.from_pretrained(cfg.init_from).to(self.device)
            self.log(f"initialised from {cfg.init_from}")
        else:
            mcfg = LandmarkConfig.for_tokenizer(self.tok, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                                                ffn_hidden=cfg.ffn_hidden, attention=cfg.attention,
                                                block_size=cfg.block_size, dropout=cfg.dropout,
                                                segment_size=cfg.segment_size, infini_update=cfg.infini_update,
                                                cmt=cfg.cmt, p_cmt=cfg.p_cmt, p_jump=cfg.p_jump)
            self.model = LandmarkGPT(mcfg).to(self.device)
        self.opt = build_optimizer(self.model, cfg, self.device.type)
        self.step, self.best_val, self.first_val = 0, float("inf"), None
        if cfg.resume:
            self._resume()
        self.ddp_model = self.model
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp_model = DistributedDataParallel(self.model, device_ids=ids)

    def log(self, msg):
        if self.master:
            tqdm.write(msg)

    def _mix(self):
        """What turns book windows into drills: the passkey mix or the retrieval drills (one of them)."""
        cfg = self.cfg
        if cfg.passkey_rate > 0 and cfg.drill_rate > 0:
            raise ValueError("--passkey-rate and --drill-rate each pick windows of their own kind; give one of them")
        if cfg.recall_weight and not (cfg.hf_model and cfg.drill_rate > 0):
            raise ValueError("--recall-weight scores the landmarks of retrieval drills' answers: "
                             "it needs --hf-model and --drill-rate above 0")
        if cfg.drill_rate > 0:
            return RetrievalDrills(self.tok, cfg.drill_rate, chat_share=cfg.drill_chat_share,
                                   quote_share=cfg.drill_quote_share)
        return PasskeyMix(self.tok, cfg.passkey_rate, copy_rate=cfg.copy_rate) if cfg.passkey_rate > 0 else None

    def _load_data(self):
        cfg = self.cfg
        eos = self.tok.token_to_id(EOS_TOKEN)
        if cfg.data:
            files = list_text_files(cfg.data.split(","))
            if cfg.val_data:
                train, val = files, list_text_files(cfg.val_data.split(","))
            else:
                train, val = split_books(files, cfg.val_books or None)
        else:
            train = list_text_files(SAMPLE_DIR / "train")
            val = list_text_files(cfg.val_data.split(",") if cfg.val_data else SAMPLE_DIR / "val")
        if set(train) & set(val):
            both = sorted(f.name for f in set(train) & set(val))
            raise ValueError(f"validation books also appear in training: {both}")
        t, v = tokenize_books(train, self.tok, eos), tokenize_books(val, self.tok, eos)
        self.log(f"data: training on {len(t):,} tokens of {len(train)} book file(s), validating on {len(v):,} tokens "
                 f"of {len(val)}: {', '.join(f.name for f in val)}")
        return t, v

    def losses(self, model, batch, weighted=True):
        """The language-model loss of ``batch`` (its answers weighted, or every token alike) and,
        with ``recall_weight``, the recall loss (else None)."""
        x, y = batch.x.to(self.device), batch.y.to(self.device)
        w = batch.w.to(self.device) if weighted else None
        with self.autocast:
            if not self.cfg.recall_weight:
                return model(x, y, weights=w)[1], None
            _, lm, recall = model(x, y, weights=w, answer=batch.answer.to(self.device),
                                  source=batch.source.to(self.device))
        return lm, recall

    @torch.no_grad()
    def evaluate(self):
        """The mean validation loss per token (unweighted) and the mean recall loss (or None)."""
        self.model.eval()
        runs = [self.losses(self.model, b, weighted=False) for b in self.val_batches]
        self.model.train()
        lm = sum(loss.item() for loss, _ in runs) / len(runs)
        return lm, (sum(r.item() for _, r in runs) / len(runs) if self.cfg.recall_weight else None)

    def train_step(self):
        """One optimiser step over ``grad_accum`` micro-batches; returns the mean loss."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        total = 0.0
        for micro in range(cfg.grad_accum):
            sync = micro == cfg.grad_accum - 1
            ctx = self.ddp_model.no_sync() if self.ddp and not sync else contextlib.nullcontext()
            with ctx:
                loss, recall = self.losses(self.ddp_model, self.sampler.batch())
                if recall is not None:
                    loss = loss + cfg.recall_weight * recall
                (loss / cfg.grad_accum).backward()
            total += loss.item() / cfg.grad_accum
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return total

    def save(self):
        """Latest model, optimizer and trainer state; the state file is written last, so
        ``--resume`` always finds a consistent checkpoint."""
        self.model.save_pretrained(self.out)
        tensors, groups = optimizer_tensors(self.opt)
        atomic_write(self.out / OPTIM_NAME, lambda f: save_file(tensors, f))
        state = {"step": self.step, "best_val": self.best_val, "first_val": self.first_val,
                 "sampler_rng": self.sampler.rng.getstate(), "param_groups": groups,
                 "train_config": dataclasses.asdict(self.cfg)}
        atomic_write(self.out / STATE_NAME, lambda f: Path(f).write_text(json.dumps(state)))

    def _resume(self):
        state_file = self.out / STATE_NAME
        if not state_file.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {self.out} ({STATE_NAME} missing); "
                                    "drop --resume to start afresh")
        state = json.loads(state_file.read_text())
        if not self.cfg.hf_model:  # a Hugging Face model was loaded from the checkpoint itself
            saved = LandmarkGPT.from_pretrained(self.out)
            if saved.config != self.model.config:
                raise ValueError(f"--resume: the checkpoint in {self.out} has model config {saved.config}, "
                                 f"this run asks for {self.model.config}; use the same flags or another --out-dir")
            self.model.load_state_dict(saved.state_dict())
        load_optimizer(self.opt, load_file(self.out / OPTIM_NAME, device=str(self.device)), state["param_groups"])
        self.step, self.best_val, self.first_val = state["step"], state["best_val"], state["first_val"]
        rng = state["sampler_rng"]
        self.sampler.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        self.log(f"resumed from {self.out} at step {self.step}")

    def _eval_and_save(self, t0):
        if not self.master:
            return None
        val, recall = self.evaluate()
        if self.first_val is None:
            self.first_val = val
        if val < self.best_val:
            self.best_val = val
            if self.step > 0:
                self.model.save_pretrained(self.out / "best")
        if self.step > 0:
            self.save()
        rec = {"step": self.step, "val_loss": round(val, 4), "lr": lr_at(self.step, self.cfg),
               "elapsed_s": round(time.time() - t0, 1), "world_size": self.world}
        if recall is not None:
            rec["val_recall"] = round(recall, 4)
        with open(self.out / LOG_NAME, "a") as f:
            f.write(json.dumps(rec) + "\n")
        recall_loss = "" if recall is None else f", recall loss {recall:.4f}"
        self.log(f"step {self.step}: val loss {val:.4f}{recall_loss}")
        return val

    def run(self):
        cfg = self.cfg
        kind = type(self.model.hf).__name__ if cfg.hf_model else f"attention={cfg.attention}"
        self.log(f"model: {self.model.num_params() / 1e6:.2f}M parameters, {kind}, "
                 f"block_size={cfg.block_size}, device={self.device}, world_size={self.world}")
        t0 = time.time()
        if self.step == 0:
            self._eval_and_save(t0)
        tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * self.world
        bar = tqdm(range(self.step, cfg.max_iters), initial=self.step, total=cfg.max_iters, desc="training",
                   disable=not self.master, dynamic_ncols=True)
        tick = time.time()
        for _ in bar:
            loss = self.train_step()
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss} at step {self.step}; lower --lr or check the "
                                         f"data")
            now = time.time()
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr_at(self.step, cfg):.2e}",
                            tok_s=f"{tokens_per_step / (now - tick):,.0f}")
            tick = now
            if self.step % cfg.eval_interval == 0 or self.step == cfg.max_iters:
                self._eval_and_save(t0)
                tick = time.time()
        bar.close()
        if self.master:
            self.log(f"validation loss {self.first_val:.4f} -> best {self.best_val:.4f} in {time.time() - t0:.0f} s; "
                     f"model saved to {self.out}")
            if cfg.sample_tokens:
                self.log("sample: " + self.sample(cfg.sample_tokens))
        if self.ddp:
            import torch.distributed as dist

            dist.destroy_process_group()
        return {"first_val": self.first_val, "best_val": self.best_val, "step": self.step}

    def sample(self, n, prompt="\n"):
        idx = torch.tensor([self.tok.encode(prompt).ids], device=self.device)
        g = torch.Generator(device=self.device).manual_seed(0)
        self.model.eval()
        out = self.model.generate(idx, n, temperature=0.8, sample_top_k=50, generator=g)
        return self.tok.decode(out[0].tolist())


def field_help() -> dict[str, str]:
    """Each TrainConfig field's comment where it is defined: the help text of its option."""
    lines = inspect.getsource(TrainConfig).splitlines()
    return {m[1]: m[2] for m in (re.match(r"\s+(\w+): [^=]+=.*?#\s*(.+)$", line) for line in lines) if m}


def parse_args(argv=None, prog="train.py"):
    """TrainConfig from the command line: ``--preset`` first, then any field as ``--field-name``."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="starting values (default: tiny)")
    helps = field_help()
    for f in dataclasses.fields(TrainConfig):
        flag, what = "--" + f.name.replace("_", "-"), helps.get(f.name, "").replace("%", "%%")  # argparse formats it
        default = PRESETS["tiny"].get(f.name, f.default)
        what += f" (default {default!r} with --preset tiny)" if what else ""
        if f.type is bool or isinstance(f.default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=what)
        else:
            ap.add_argument(flag, type=type(f.default), default=None, metavar=f.name.upper(), help=what)
    args = ap.parse_args(argv)
    values = {**PRESETS[args.preset], **{k: v for k, v in vars(args).items() if v is not None and k != "preset"}}
    return TrainConfig(**values), args.preset


def main(argv=None, prog="train.py"):
    cfg, preset = parse_args(argv, prog)
    return Trainer(cfg, preset).run()
