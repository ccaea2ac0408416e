"""What a memory returns and counts."""

from dataclasses import dataclass, fields

import torch


@dataclass
class MemoryOutput:
    logits: torch.Tensor  # (B, T, vocab); (B, 1, vocab) for logits="last", (B, 0, vocab) for "none"
    loss: torch.Tensor | None  # mean next-token loss when targets were given
    # per layer: int64 (B, H, T, n_chosen) memory block ids each token chose (top_k, or fewer candidates), -1 = none
    retrieved: list[torch.Tensor]


@dataclass
class RetrievalStats:
    """Counts since a memory was created: query retrievals (per token, layer and head) and
    those the CMT cutoff dropped; index searches (per step, stream, layer and head) and those
    skipped because every query was below the cutoff."""

    queries: int = 0
    skipped_queries: int = 0
    searches: int = 0
    skipped_searches: int = 0

    def __add__(self, other: "RetrievalStats") -> "RetrievalStats":
        return RetrievalStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))
