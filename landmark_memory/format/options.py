"""A memory's options: one frozen dataclass, validated in one place, stored in the manifest.

Structural options (index kind, store, chunk size, stored dtype) are fixed when a memory is
built; query options (``QUERY_OPTIONS``) and the index search breadths (``SEARCH_OPTIONS``)
may change when a saved memory is reopened (``with_query``).
"""

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from ..core.names import (
    BLOCK_KEYS,
    DEFAULT_INDEX,
    DEFAULT_TOP_K,
    FREE_BLOCK_SIZE,
    FREE_READS,
    FREE_RETRIEVAL,
    MAPPINGS,
    MAX_CHUNK_SIZE,
    MAX_TOP_K,
    RETRIEVALS,
    STORE_DTYPES,
    STORES,
)
from ..index import default_train_size, new_index
from ..models.kinds import backbone_for
from ..storage import DTYPE_NAMES

QUERY_OPTIONS = ("top_k", "retrieval", "position_mapping", "max_blocks", "cmt_cutoff", "sink_blocks", "local_blocks",
                 "centre")
SEARCH_OPTIONS = ("nprobe", "ef_search")  # kept in index_options
CHUNK_TOKENS = 250  # the paper's l_local: chunks default to the multiple of the block size nearest this
# a saved memory's blocks (lmdb, mmap): int8 costs both models 27-30% of float32's disk for at most
# 0.03% perplexity and the same passkey answers (experiments/results/storage.md); the in-process
# store keeps the model's dtype, so that evaluations are exact unless asked otherwise
SAVED_STORE_DTYPE = "int8"


def default_chunk_size(block_size: int) -> int:
    """The multiple of ``block_size`` nearest 250 (the paper's l_local): 250 for blocks of 50,
    252 for blocks of 63."""
    return block_size * max(1, round(CHUNK_TOKENS / block_size))


@dataclass(frozen=True)
class MemoryOptions:
    """How a memory searches, stores and reads: the one place of each option's default and
    meaning, from the command line (``app/cli.py``) to the engine and the manifest.

    index : str, landmark index kind per (stream, layer, key/value head), one of
        ``index.KINDS`` (default ivf-rows: exact until 1024 blocks, then lists over the keys).
    index_options : dict, passed to ``index.new_index``: train_size, nprobe, ef_search.
    store : str, block store: memory, lmdb or mmap (the latter two need a memory's ``path``).
    store_dtype : str, float32 / float16 / bfloat16 / int8 (``quant.py``: a quarter of float32's
        bytes); default int8 for a saved memory (lmdb, mmap), the model's dtype in memory.
    top_k : int, blocks retrieved per query (default 4 through landmarks, 8 without them:
        ``FREE_READS``).
    chunk_size : int, normal tokens per chunk, a multiple of the model's block size; default the
        multiple nearest 250 (the paper's l_local): 250 for blocks of 50, 252 for blocks of 63.
    retrieval : {"per_token_head", "per_head", "per_token"}, paper Table 2 (default per_token_head
        through landmarks, per_head without them: ``FREE_RETRIEVAL``).
    position_mapping : {"stingy", "exact"}; stingy (paper 3.2.1) puts the latest ``reads`` blocks
        at their own slots of a (reads + 1)-block prefix and all older ones at slot 0; exact uses
        true positions (for models trained with positional jumps) and scores every landmark
        exactly by brute force.
    max_blocks : int, optional, only the newest ``max_blocks`` blocks can be retrieved.
    cmt_cutoff : float, models with a Context Miss Token only (appendix D): a query whose CMT
        share is below this retrieves nothing, and a layer-head whose queries in a step are
        all below it searches no index and fetches no block. 0 = always retrieve.
    sink_blocks : int, the memory's first blocks (of those ``max_blocks`` leaves), read by every
        query besides its ``top_k`` (attention sinks, as StreamingLLM and InfLLM keep the
        first tokens), so that they take no retrieval slot (default 0 through landmarks, 1
        without them: a model as published leans on its first tokens).
    local_blocks : int, the memory's last blocks, read by every query besides its ``top_k``, as
        if the local window were that much longer (default 0 through landmarks, 2 without).
    centre : bool, choose blocks by scores against the block keys less their mean
        over the memory (per layer and head), so that what every landmark shares, which RoPE
        favours near the query, does not decide; the attention reads the blocks as they are.
    block_checksums : bool, every stored block carries a CRC-32 that reads verify.
    block_keys : {"landmark", "mean"}, what a block is searched by: the key of the landmark token
        that closes it (a model fine-tuned with landmarks: the paper's memory), or the mean of
        its own tokens' keys rotated to their offsets in the block (any model, no training: no
        landmark enters the text, and attention reads the retrieved blocks' tokens with the
        local ones in one ordinary softmax); default landmark for a landmark model, else mean.
    block_size : int, tokens per block: a landmark model's own (the default; it cannot change),
        or of a memory without landmarks any (default ``FREE_BLOCK_SIZE``).

    ``chunk_size``, ``store_dtype``, ``block_keys``, ``block_size``, ``top_k``, ``retrieval``,
    ``sink_blocks`` and ``local_blocks`` may be None until ``resolved`` fills them in for a model.
    """

    index: str = DEFAULT_INDEX
    index_options: dict = field(default_factory=dict)
    store: str = "memory"
    store_dtype: str | None = None
    top_k: int | None = None
    chunk_size: int | None = None
    retrieval: str | None = None
    position_mapping: str = "stingy"
    max_blocks: int | None = None
    cmt_cutoff: float = 0.0
    sink_blocks: int | None = None
    local_blocks: int | None = None
    centre: bool = False
    block_checksums: bool = True
    block_keys: str | None = None
    block_size: int | None = None

    @classmethod
    def of(cls, **settings: Any) -> "MemoryOptions":
        """Options from keyword settings (``LandmarkMemory(model, top_k=8)``), the rest default;
        ``TypeError`` naming the options for a name that is none."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"{', '.join(unknown)}: no memory option; the options are {', '.join(names)}")
        if settings.get("index_options", {}) is None:
            settings.pop("index_options")
        return cls(**settings)

    def resolved(self, model_block_size: int | None, dtype_name: str, has_cmt: bool, head_dim: int) -> "MemoryOptions":
        """These options checked for a model (its landmark block size, None for a model without
        landmarks; dtype, Context Miss Token, head dim), defaults filled in; raises
        ``ValueError`` saying what is wrong."""
        block_keys = self.block_keys or ("landmark" if model_block_size else "mean")
        if block_keys not in BLOCK_KEYS:
            raise ValueError(f"block_keys must be one of {BLOCK_KEYS}, got {block_keys!r}")
        if block_keys == "landmark" and not model_block_size:
            raise ValueError("block_keys='landmark' needs a model fine-tuned with landmark tokens; this one has none: "
                             "read it with block_keys='mean' (no training needed)")
        block_size = self.block_size or model_block_size or FREE_BLOCK_SIZE
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if block_keys == "landmark" and block_size != model_block_size:
            raise ValueError(f"the model was fine-tuned with landmarks after every {model_block_size} tokens; a "
                             f"landmark memory's block_size cannot be {block_size}")
        defaults = dict(zip(("top_k", "sink_blocks", "local_blocks", "retrieval"),
                            (DEFAULT_TOP_K, 0, 0, "per_token_head") if block_keys == "landmark" else
                            (*FREE_READS, FREE_RETRIEVAL)))
        self = replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})
        chunk_size = self.chunk_size or default_chunk_size(block_size)
        if type(chunk_size) is not int or not block_size <= chunk_size <= MAX_CHUNK_SIZE or chunk_size % block_size:
            raise ValueError(f"chunk_size must be a positive multiple of the model's block_size ({block_size}), "
                             f"at most {MAX_CHUNK_SIZE:,}, got {chunk_size}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an int from 1 to {MAX_TOP_K}, got {self.top_k!r}")
        if self.retrieval not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {RETRIEVALS}, got {self.retrieval!r}")
        if self.position_mapping not in MAPPINGS:
            raise ValueError(f"position_mapping must be one of {MAPPINGS}, got {self.position_mapping!r}")
        for name in ("sink_blocks", "local_blocks"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TOP_K:
                raise ValueError(f"{name} must be an int from 0 to {MAX_TOP_K}, got {n!r}")
        if not isinstance(self.centre, bool):
            raise ValueError(f"centre must be True or False, got {self.centre!r}")
        if self.max_blocks is not None and (type(self.max_blocks) is not int or self.max_blocks < 1):
            raise ValueError(f"max_blocks must be None or an int >= 1, got {self.max_blocks!r}")
        if self.store not in STORES:
            raise ValueError(f"unknown store {self.store!r}; choose one of {STORES}")
        cutoff = self.cmt_cutoff
        if not isinstance(cutoff, (int, float)) or not 0.0 <= cutoff <= 1.0:
            raise ValueError(f"cmt_cutoff must be a number in [0, 1], got {cutoff!r}")
        if cutoff > 0 and not (has_cmt and block_keys == "landmark"):
            raise ValueError("cmt_cutoff needs a model trained with a Context Miss Token (config cmt=True), read "
                             "through its landmarks")
        if self.store_dtype is not None and self.store_dtype not in STORE_DTYPES:
            raise ValueError(f"store_dtype must be one of {', '.join(STORE_DTYPES)}, got {self.store_dtype!r}")
        if not isinstance(self.index_options, dict):
            raise ValueError(f"index_options must be a dict, got {self.index_options!r}")
        try:  # fail now on a bad kind or option
            new_index(self.index, head_dim, **self.index_options)
        except TypeError as e:
            raise ValueError(f"index_options has an option the index {self.index!r} does not take ({e})") from None
        store_dtype = self.store_dtype or (dtype_name if self.store == "memory" else SAVED_STORE_DTYPE)
        return replace(self, chunk_size=chunk_size, store_dtype=store_dtype, cmt_cutoff=float(cutoff),
                       block_keys=block_keys, block_size=block_size)

    def for_model(self, model, bb=None, cmt_keys=None) -> "MemoryOptions":
        """These options ``resolved`` for ``model`` (its landmark block size, dtype, Context Miss
        Token and head dim), as a memory of it takes them; ``bb``, ``cmt_keys``: its backbone and
        CMT keys where the caller has them."""
        if bb is None:
            bb = backbone_for(model)
            with torch.no_grad():
                cmt_keys = bb.cmt_keys()
        dtype = DTYPE_NAMES[next(model.parameters()).dtype]
        return self.resolved(bb.block_size, dtype, cmt_keys is not None, bb.head_dim)

    @property
    def reads(self) -> int:
        """Blocks a query reads: its ``top_k`` chosen, the memory's first ``sink_blocks`` and its
        last ``local_blocks``; the stingy prefix has ``reads + 1`` block slots."""
        return self.top_k + self.sink_blocks + self.local_blocks

    @property
    def train_size(self) -> int:
        """Keys per (stream, layer, key/value head) before an IVF index trains."""
        return self.index_options.get("train_size") or default_train_size(self.index)

    def with_query(self, **changes: Any) -> "MemoryOptions":
        """These options with query-time settings changed (``QUERY_OPTIONS`` and
        ``SEARCH_OPTIONS``); the others were fixed when the memory was built."""
        bad = sorted(set(changes) - set(QUERY_OPTIONS) - set(SEARCH_OPTIONS))
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot change once a memory is built; only "
                             f"{', '.join(QUERY_OPTIONS + SEARCH_OPTIONS)} can")
        search = {k: changes.pop(k) for k in SEARCH_OPTIONS if k in changes}
        return replace(self, **changes, index_options={**self.index_options, **search})

    def built(self) -> dict:
        """The options fixed when the memory was built (all but the query and search options),
        as a dict: what a memory's blocks are stored as."""
        d = asdict(self)
        for name in QUERY_OPTIONS:
            d.pop(name)
        d["index_options"] = {k: v for k, v in self.index_options.items() if k not in SEARCH_OPTIONS}
        return d

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryOptions":
        """Options as a manifest stores them (older manifests lack ``cmt_cutoff``, the sink and
        local blocks, checksums of their blocks, and every one of them read through landmarks)."""
        known = {f.name for f in fields(cls)}
        before = {"block_checksums": False, "block_keys": "landmark", "sink_blocks": 0, "local_blocks": 0}
        return cls(**{**before, **{k: v for k, v in d.items() if k in known}})
