"""The optimizer of a training run: AdamW with decay on matrices, the learning-rate schedule,
and its state as safetensors for a checkpoint (no pickle)."""

import math

import torch


def lr_at(step, cfg):
    """Linear warmup over ``warmup_frac`` of training, then cosine from lr to min_lr."""
    warmup = max(1, int(cfg.warmup_frac * cfg.max_iters))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.max_iters - warmup))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def build_optimizer(model, cfg, device_type):
    """AdamW with weight decay on matrices and embeddings only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device_type == "cuda")


def optimizer_tensors(opt):
    """Optimizer state as flat tensors (safetensors) plus JSON-able hyperparameters."""
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": (v if torch.is_tensor(v) else torch.tensor(v)).contiguous()
               for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, sd["param_groups"]


def load_optimizer(opt, tensors, param_groups):
    """Restore ``opt`` from what ``optimizer_tensors`` gave."""
    state = {}
    for key, t in tensors.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": param_groups})
