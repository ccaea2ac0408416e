"""A transformers ``Cache`` backed by a landmark memory: ``model.generate(...,
past_key_values=cache)`` retrieves top-k blocks from our FAISS index and block store.

The cache holds a ``LandmarkMemory`` (any index kind, any store, or a saved memory directory).
A converted model's forward hands its input to the cache, which feeds it through the memory
chunk by chunk and returns the logits; key/value tensors never pass through transformers.

Sequence length, as ``generate`` sees it, counts the tokens fed through this cache object, not
what the memory held when it was opened: generation continues from the memory's end with the
prompt, so ``generate(prompt, past_key_values=LandmarkMemoryCache.open(path, model))`` reads
the prompt after everything saved in ``path``.
"""

from pathlib import Path

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..memory.engine import LandmarkMemory
from ..models.hf.convert import MemoryBackedCache
from ..models.kinds import is_converted


class LandmarkMemoryCache(MemoryBackedCache):
    """Landmark memory as a transformers cache.

    Parameters
    ----------
    model : a model converted by ``landmark_memory.models.hf.convert`` (or loaded by
        ``landmark_memory.hf.from_pretrained``).
    memory_options : ``LandmarkMemory`` options: index, store, path, top_k, chunk_size,
        retrieval, position_mapping, max_blocks, index_options, ...
    """

    is_compileable = False

    def __init__(self, model: torch.nn.Module, memory: LandmarkMemory | None = None, **memory_options):
        if not is_converted(model):  # a model as published never hands its input to this cache
            raise ValueError(f"a LandmarkMemoryCache serves a model converted with landmark_memory.hf.convert, got "
                             f"{type(model).__name__} as published; read it through LandmarkMemory (its blocks "
                             "searched by their own keys, block_keys='mean': no training) and its generate")
        super().__init__(layers=[])
        self.memory = memory if memory is not None else LandmarkMemory(model, **memory_options)
        self.fed = 0  # tokens fed through this cache object

    @classmethod
    def open(cls, path: str | Path, model: torch.nn.Module, **options) -> "LandmarkMemoryCache":
        """A cache over the saved memory at ``path`` (``LandmarkMemory.open`` options: readonly,
        top_k, retrieval, position_mapping, max_blocks, nprobe, ef_search)."""
        return cls(model, memory=LandmarkMemory.open(path, model, **options))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache_position: torch.Tensor | None = None, labels=None, inputs_embeds=None,
                logits_to_keep: int | torch.Tensor = 0, **_) -> CausalLMOutputWithPast:
        """Feed ``input_ids`` (B, T) after everything before; what a converted model's forward
        returns when it is given this cache. ``logits_to_keep`` as transformers means it (0:
        all; n: the last n; a tensor: those positions); ``generate`` passes 1, and then the
        output head runs for the prompt's last token only."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("a LandmarkMemoryCache reads token ids: pass input_ids, not inputs_embeds")
        if labels is not None:
            raise ValueError("a LandmarkMemoryCache does not compute losses; use LandmarkMemory.forward(idx, targets)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("a LandmarkMemoryCache reads unpadded streams: the attention mask must be all ones "
                             "(generate one prompt per stream, or prompts of equal length)")
        if cache_position is not None and len(cache_position) and int(cache_position[0]) != self.fed:
            raise ValueError(f"the input starts at position {int(cache_position[0])} but this cache has read "
                             f"{self.fed} tokens: a memory cannot go back; pass only new tokens")
        last_only = isinstance(logits_to_keep, int) and logits_to_keep == 1
        out = self.memory.forward(input_ids, logits="last" if last_only else "all")
        self.fed += input_ids.shape[1]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep  # 0: all
        return CausalLMOutputWithPast(logits=out.logits[:, keep], past_key_values=self)

    # ---- what transformers asks of a cache ------------------------------------------------
    def get_seq_length(self, layer_idx=0):
        return self.fed

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.fed + query_length, 0

    def get_max_length(self, layer_idx=None):
        return -1  # no limit

    @property
    def batch_size(self):
        return self.memory.streams or -1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise RuntimeError("a LandmarkMemoryCache is read by a model converted with landmark_memory.models.hf.convert; "
                           "this model's attention does not know it (convert the model, or load it with "
                           "landmark_memory.hf.from_pretrained)")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("a landmark memory cannot drop tokens it has read (no assisted or "
                                  "speculative decoding)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("a landmark memory serves greedy or sampled decoding, not beam search")

    # ---- the memory underneath ----------------------------------------------------------
    def commit(self) -> int:
        return self.memory.commit()

    def close(self, commit: bool = True) -> None:
        self.memory.close(commit)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(commit=exc_type is None)

    def __repr__(self):
        return f"LandmarkMemoryCache(tokens={self.memory.n_tokens}, blocks={self.memory.n_blocks}, fed={self.fed})"

