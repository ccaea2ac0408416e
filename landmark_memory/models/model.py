"""LandmarkGPT: a GPT-2-style decoder (pre-LayerNorm, RoPE) with landmark or full attention."""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import nn

from ..core.decode import decode_rereading
from ..core.fileio import atomic_write
from ..core.layout import IGNORE_INDEX, insert_landmarks, normal_positions
from ..core.names import ASSETS
from ..core.rope import RotaryEmbedding
from ..kernels import landmark_attention
from .config import LandmarkConfig
from .infini import InfiniState, infini_attention

BUNDLED_MODEL = ASSETS / "tiny"  # trained by experiments/train.py, see its README
FORMAT = "landmark-memory/LandmarkGPT"
FORMAT_VERSION = 1
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def jump_positions(B, T, block_size, p_jump, generator=None, device=None):
    """(B, T) int64 positions with positional jumps (appendix E): a landmarked sequence of T
    positions where, after each landmark, positions advance by a random integer in
    [1, p_jump] instead of 1. ``p_jump=1`` gives ``arange(T)`` in every row."""
    L = block_size + 1
    step = torch.ones(B, T, dtype=torch.long, device=device)
    after = torch.arange(L, T, L, device=device)  # the first position after each landmark
    step[:, after] = torch.randint(1, p_jump + 1, (B, len(after)), generator=generator, device=device)
    step[:, 0] = 0
    return step.cumsum(1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_base)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.attention == "infini":
            self.gate = nn.Parameter(torch.zeros(cfg.n_head))  # beta of Infini-attention's eq. 6, per head

    def heads(self, x):
        """Un-rotated q, k, v (B, H, T, D) of x (B, T, C); memory stores keys without RoPE."""
        B, T, _ = x.shape
        return self.qkv(x).view(B, T, 3, self.cfg.n_head, self.cfg.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def merge(self, y):
        """Output projection of per-head results y (B, H, T, D) -> (B, T, C)."""
        B, H, T, D = y.shape
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, H * D)))

    def forward(self, x, positions, state=None, cmt=None):
        """``cmt``: (rotated CMT key (1, H, 1, D), controlled landmarks (B, n_landmarks)) or None."""
        q, k, v = self.heads(x)  # (B, H, T, D) each
        if self.cfg.attention == "infini":  # state: this layer's LayerState
            return self.merge(infini_attention(q, k, v, state, self.cfg.segment_size, self.gate, self.rope,
                                               self.cfg.infini_update))
        q, k = self.rope(q, positions), self.rope(k, positions)
        if self.cfg.attention == "landmark":
            cmt_k, cmt_blocks = (None, None) if cmt is None else (cmt[0].expand(q.shape[0], -1, -1, -1).to(q.dtype),
                                                                  cmt[1])
            y = landmark_attention(q, k, v, self.cfg.block_size, cmt_k=cmt_k, cmt_blocks=cmt_blocks,
                                   backend=self.cfg.kernel_backend)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.merge(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, state=None, cmt=None):
        x = x + self.attn(self.ln_1(x), positions, state, cmt)
        return x + self.mlp(self.ln_2(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T), ignoring
    ``IGNORE_INDEX``: the mean over targets, or with ``weights`` (B, T) float their weighted
    mean (a drill's answer tokens may weigh more than its book text)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    w = (targets.flatten() != IGNORE_INDEX).float()  # (B*T,)
    if weights is not None:
        if weights.shape != targets.shape:
            raise ValueError(f"weights shape {tuple(weights.shape)} must equal targets shape {tuple(targets.shape)}")
        w = w * weights.flatten().float()
    return (ce * w).sum() / w.sum()


class LandmarkGPT(nn.Module):
    """Decoder-only language model over normal token ids.

    ``model(idx)`` takes normal token ids (B, T), inserts landmarks itself (landmark
    attention only) and returns logits (B, T, vocab) at the normal positions.
    ``model(idx, targets)`` returns ``(logits, loss)``, the mean next-token cross-entropy over
    targets that are not -100. A target that falls on a landmark moves to the next normal token
    by construction: logits exist only at normal positions. With ``attention="infini"`` the
    text is read segment by segment through a compressive memory (``infini.py``); pass an
    ``InfiniState`` as ``state`` to stream a text over several calls.
    """

    def __init__(self, cfg: LandmarkConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        if cfg.cmt:  # the Context Miss Token's input embedding (it is no vocabulary token)
            self.cmt = nn.Parameter(torch.empty(cfg.n_embd))
            nn.init.normal_(self.cmt, mean=0.0, std=0.02)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, state: InfiniState | None = None,
                weights: torch.Tensor | None = None):
        """``state`` (Infini-attention only): an ``InfiniState`` to continue from and update;
        None reads ``idx`` from a fresh, empty memory. ``weights``: see ``lm_loss``."""
        cfg = self.config
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"idx must be integer token ids of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        T = idx.shape[1]
        x = insert_landmarks(idx, cfg.block_size, cfg.landmark_id) if cfg.attention == "landmark" else idx  # (B, T')
        positions = torch.arange(x.shape[1], device=idx.device)
        if self.training and cfg.p_jump > 1:
            positions = jump_positions(x.shape[0], x.shape[1], cfg.block_size, cfg.p_jump, device=idx.device)[:, None]
        cmt = [None] * cfg.n_layer
        if cfg.cmt:  # training: each landmark is CMT-controlled with chance p_cmt; in sequence otherwise: none
            n_lm = x.shape[1] // (cfg.block_size + 1)
            controlled = (torch.rand(x.shape[0], n_lm, device=idx.device) < cfg.p_cmt if self.training
                          else torch.zeros(x.shape[0], n_lm, dtype=torch.bool, device=idx.device))
            cmt = [(k, controlled) for k in self.cmt_keys()]
        h = self.drop(self.wte(x))  # (B, T', C)
        if cfg.attention == "infini":
            state = InfiniState() if state is None else state
            for i, block in enumerate(self.blocks):
                h = block(h, positions, state.layer(i, h.new_empty(idx.shape[0], cfg.n_head, 0, cfg.head_dim)))
            state.tokens += T
        elif state is not None:
            raise ValueError("state applies to Infini-attention models only")
        else:
            for block, c in zip(self.blocks, cmt):
                h = block(h, positions, cmt=c)
        if cfg.attention == "landmark":
            h = h[:, normal_positions(T, cfg.block_size, idx.device)]  # (B, T, C)
        logits = self.lm_head(self.ln_f(h))  # (B, T, V)
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets, weights)

    def cmt_keys(self) -> list[torch.Tensor]:
        """Key (1, H, 1, D) of the Context Miss Token at each layer, rotated at its position -1.

        The CMT sits before the first token and attends to nothing: its attention output is
        zero, so its states, and its keys, depend on no input, and one pass serves every
        sequence and every memory."""
        h, keys = self.cmt.view(1, 1, -1), []  # (1, 1, C)
        at = torch.tensor([-1], device=h.device)
        for block in self.blocks:
            _, k, _ = block.attn.heads(block.ln_1(h))  # (1, H, 1, D)
            keys.append(block.attn.rope(k, at))
            h = h + block.attn.merge(torch.zeros_like(k))
            h = h + block.mlp(block.ln_2(h))
        return keys

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 sample_top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``idx`` (B, T) by ``max_new_tokens``, re-running the whole context each step
        (no cache: a reference decoder for short texts); returns (B, T + max_new_tokens).
        ``temperature=0`` is greedy."""
        new = decode_rereading(self, idx, max_new_tokens, temperature=temperature, sample_top_k=sample_top_k,
                               generator=generator)
        return torch.cat([idx, new], 1)

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into the folder ``path``.

        Each file is written under a temporary name, synced, then renamed, config last: a
        crash leaves the previous files or the new ones, never a half-written file."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        atomic_write(path / WEIGHTS_NAME, lambda f: save_model(self, f, metadata={"format": FORMAT}))
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": self.config.to_dict()}
        atomic_write(path / CONFIG_NAME, lambda f: Path(f).write_text(json.dumps(doc, indent=2) + "\n"))

    @classmethod
    def from_pretrained(cls, path: str | Path = BUNDLED_MODEL, device: str | torch.device = "cpu") -> "LandmarkGPT":
        """Load a model written by ``save_pretrained``; by default the bundled tiny model."""
        path = Path(path)
        cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
        for f in (cfg_file, weights):
            if not f.is_file():
                raise FileNotFoundError(f"{f} is missing: {path} is not a saved LandmarkGPT "
                                        "(save one with model.save_pretrained or experiments/train.py)")
        try:
            doc = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON ({e}); the save was damaged, save the model "
                             "again") from None
        if doc.get("format") != FORMAT:
            raise ValueError(f"{cfg_file} describes {doc.get('format')!r}, not a {FORMAT} model")
        if doc.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"{path} was written in format version {doc['format_version']}; this landmark-memory "
                             f"reads up to {FORMAT_VERSION}: upgrade the package")
        model = cls(LandmarkConfig.from_dict(doc["config"]))
        missing, unexpected = load_model(model, weights, strict=False, device=str(device))
        if missing or unexpected:
            raise ValueError(f"{weights} does not match its config: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        return model.to(device)

