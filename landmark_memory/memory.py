"""LandmarkMemory: chunked inference over inputs of any length with top-k block retrieval.

Per chunk and layer (DESIGN.md "Inference with memory"): compute q, k, v of the new tokens;
score the memory landmarks (recent blocks exactly, older ones through the FAISS index with a
RoPE-adjusted query); pick top-k blocks per the retrieval mode; fetch them through the hot
cache into a block pool; attend over local + retrieved blocks with the grouped softmax. A
chunk's blocks enter memory when the chunk is complete.

Chunk boundaries are absolute (every ``chunk_size`` normal tokens from the start), and the
tokens since the last boundary stay local: feeding a text in one call, in pieces, or one token
at a time (decoding) gives the same result.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .backbone import backbone_for
from .index import LandmarkIndex
from .kernels import cmt_share, landmark_attention_inference
from .rope import RotaryEmbedding
from .memory_dir import LANDMARKS, TOKENS, MemoryDir, MemoryFileError, model_fingerprint, row_bytes
from .storage import DTYPE_NAMES, STORES, HotCache, OverlayStore, open_store
from .tokenizer import IGNORE_INDEX, insert_landmarks, landmark_mask, landmarked_length

RETRIEVALS = ("per_token_head", "per_head", "per_token")
MAPPINGS = ("stingy", "exact")
CHUNK_TOKENS = 250  # the paper's l_local: chunks default to the multiple of the block size nearest this


def default_chunk_size(block_size):
    return block_size * max(1, round(CHUNK_TOKENS / block_size))


@dataclass
class MemoryOutput:
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None  # mean next-token loss when targets were given
    retrieved: list  # per layer: int64 (B, H, T, top_k) memory block ids used by each token, -1 = none


class LandmarkMemory:
    """A landmark model with a memory of past blocks.

    Parameters
    ----------
    model : LandmarkGPT with ``attention="landmark"``, or a Hugging Face causal LM converted by
        ``landmark_memory.hf.convert`` (see ``backbone.py``).
    index : str, landmark index kind per (stream, layer, key/value head): flat, hnsw, ivf, ivfpq (+ -gpu).
    store : str, block store: memory, lmdb or mmap (the latter two need ``path``).
    path : str or Path, folder of the on-disk store.
    top_k : int, blocks retrieved per query.
    chunk_size : int, normal tokens per chunk, a multiple of the model's block size; default the
        multiple nearest 250 (the paper's l_local): 250 for blocks of 50, 252 for blocks of 63.
    retrieval : {"per_token_head", "per_head", "per_token"}, paper Table 2.
    position_mapping : {"stingy", "exact"}; stingy (paper 3.2.1) puts the latest top_k blocks at
        their own slots of a (top_k + 1)-block prefix and all older ones at slot 0; exact uses
        true positions (for models trained with positional jumps) and scores every landmark
        exactly by brute force.
    max_blocks : int, optional, only the newest ``max_blocks`` blocks can be retrieved.
    store_dtype : str, optional, float32 / float16 / bfloat16; default the model's dtype.
    cache_bytes : int, hot-block cache budget on the model's device.
    index_options : dict, optional, passed to ``LandmarkIndex`` (train_size, nprobe, ef_search).
    cmt_cutoff : float, models with a Context Miss Token only (appendix D): a query whose CMT
        share is below this retrieves nothing, and a layer-head whose queries in a step are
        all below it searches no index and fetches no block. 0 = always retrieve.
    backend : str, attention backend ("auto": Triton on CUDA, reference elsewhere).

    Attributes
    ----------
    retrieval_stats : dict, counts since creation: ``queries`` and ``skipped_queries`` (query
        retrievals, per token, layer and head, and those the CMT cutoff dropped),
        ``searches`` and ``skipped_searches`` (index searches, per step, stream, layer and
        head, and those skipped because every query was below the cutoff).
    """

    def __init__(self, model, *, index="flat", store="memory", path=None, top_k=4, chunk_size=None,
                 retrieval="per_token_head", position_mapping="stingy", max_blocks=None, store_dtype=None,
                 cache_bytes=256 << 20, index_options=None, cmt_cutoff=0.0, backend="auto"):
        self._configure(model, dict(index=index, store=store, top_k=top_k, chunk_size=chunk_size, retrieval=retrieval,
                                    position_mapping=position_mapping, max_blocks=max_blocks, store_dtype=store_dtype,
                                    index_options=dict(index_options or {}), cmt_cutoff=cmt_cutoff), cache_bytes,
                        backend)
        self.dir = None
        if path is not None:
            if store == "memory":
                raise ValueError("a memory saved at a path keeps its blocks on disk: pass store='lmdb' or 'mmap'")
            self.dir = MemoryDir.create(path, {**self._manifest(), "files": {}})
        self._open_store(path, readonly=False)

    def _configure(self, model, options, cache_bytes, backend):
        cfg = backbone_for(model)
        chunk_size, top_k = options["chunk_size"] or default_chunk_size(cfg.block_size), options["top_k"]
        options["chunk_size"] = chunk_size
        if not isinstance(chunk_size, int) or chunk_size < cfg.block_size or chunk_size % cfg.block_size:
            raise ValueError(f"chunk_size must be a positive multiple of the model's block_size ({cfg.block_size}), "
                             f"got {chunk_size}")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if options["retrieval"] not in RETRIEVALS:
            raise ValueError(f"retrieval must be one of {RETRIEVALS}, got {options['retrieval']!r}")
        if options["position_mapping"] not in MAPPINGS:
            raise ValueError(f"position_mapping must be one of {MAPPINGS}, got {options['position_mapping']!r}")
        max_blocks = options["max_blocks"]
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 1):
            raise ValueError(f"max_blocks must be None or an int >= 1, got {max_blocks!r}")
        if options["store"] not in STORES:
            raise ValueError(f"unknown store {options['store']!r}; choose one of {STORES}")
        with torch.no_grad():
            cmt_keys = cfg.cmt_keys()
        cutoff = options.setdefault("cmt_cutoff", 0.0)  # older manifests lack it
        if not isinstance(cutoff, (int, float)) or not 0.0 <= cutoff <= 1.0:
            raise ValueError(f"cmt_cutoff must be a number in [0, 1], got {cutoff!r}")
        if cutoff > 0 and cmt_keys is None:
            raise ValueError("cmt_cutoff needs a model trained with a Context Miss Token (config cmt=True)")
        self.model = model.eval()
        self.cfg, self.top_k, self.chunk_size = cfg, top_k, chunk_size
        self.group = cfg.n_head // cfg.n_kv_head  # query heads per key/value head
        self.retrieval, self.mapping, self.max_blocks = options["retrieval"], options["position_mapping"], max_blocks
        self.index_kind, self.index_options, self.backend = options["index"], options["index_options"], backend
        LandmarkIndex(self.index_kind, cfg.head_dim, **self.index_options)  # fail now on a bad kind or option
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.store_kind, self.store_dtype = options["store"], options["store_dtype"] or DTYPE_NAMES[self.dtype]
        self.cache_bytes = cache_bytes
        self.L = cfg.block_size + 1
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_base)
        self.cmt_cutoff = float(cutoff)
        self.cmt_k = cmt_keys  # per layer the CMT's key at position -1, (1, H, 1, D), or None
        self.retrieval_stats = dict(queries=0, skipped_queries=0, searches=0, skipped_searches=0)
        self.streams = None  # batch size, fixed by the first forward
        self.n_blocks = 0  # blocks in memory per stream
        self.pending_ids = None  # (B, P) normal ids since the last chunk boundary
        self.pending_kv = [None] * cfg.n_layer  # per layer (k, k rotated, v) of those positions, (B, H_kv, P', D)
        self.landmarks = [None] * cfg.n_layer  # per layer (B, H_kv, >= n_blocks, D) landmark keys, no RoPE
        self.indexes = None  # [stream][layer][key/value head] LandmarkIndex
        self.chunk_ids = []  # int32 (B, chunk_size) token ids of each chunk in memory
        self.inputs = []  # what was ingested, kept in the manifest (the CLI's build fills it)
        self.commit_count, self.readonly, self._committed_blocks = 0, False, 0
        self._fingerprint, self._closed = None, False

    def _open_store(self, path, readonly):
        cfg = self.cfg
        store_path = None if path is None else Path(path) / "store"
        self.store = open_store(self.store_kind, (2, cfg.n_kv_head, self.L, cfg.head_dim), store_path, self.store_dtype,
                                readonly=readonly)
        if readonly:
            self.store = OverlayStore(self.store)
        rope, offsets = self.rope, torch.arange(self.L, device=self.device)
        # cached blocks are pool-ready: keys rotated by their offset inside the block (the
        # function holds no reference to self: a closed memory is freed at once, not at the
        # next cycle collection, which matters when many large memories come and go)
        self.cache = HotCache(self.store, self.device, self.dtype, self.cache_bytes,
                              prepare=lambda kv: torch.stack([rope(kv[:, 0], offsets), kv[:, 1]], 1))

    # ---- public -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, idx, targets=None):
        """Feed normal token ids ``idx`` (B, T); returns ``MemoryOutput``."""
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"idx must be integer token ids of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        if self.streams is None:
            self.streams = idx.shape[0]
            self.indexes = [[[LandmarkIndex(self.index_kind, self.cfg.head_dim, **self.index_options)
                              for _ in range(self.cfg.n_kv_head)] for _ in range(self.cfg.n_layer)]
                            for _ in range(self.streams)]
        elif idx.shape[0] != self.streams:
            raise ValueError(f"this memory holds {self.streams} streams; idx has batch size {idx.shape[0]}")
        idx = idx.to(self.device)
        logits, retrieved, pos = [], [], 0
        while pos < idx.shape[1]:
            n = min(self.chunk_size - self.pending_count, idx.shape[1] - pos)
            lg, ret = self._step(idx[:, pos:pos + n])
            logits.append(lg)
            retrieved.append(ret)
            pos += n
        V, H = self.cfg.vocab_size, self.cfg.n_head
        logits = torch.cat(logits, 1) if logits else idx.new_zeros((idx.shape[0], 0, V), dtype=self.dtype)
        retrieved = [torch.cat([r[layer] for r in retrieved], 2) if retrieved else
                     idx.new_full((idx.shape[0], H, 0, self.top_k), -1) for layer in range(self.cfg.n_layer)]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.to(self.device).flatten(),
                                   ignore_index=IGNORE_INDEX)
        return MemoryOutput(logits, loss, retrieved)

    __call__ = forward

    def step(self, idx):
        """Append one token per stream, ``idx`` (B,) or (B, 1); returns its logits (B, vocab)."""
        return self.forward(idx.reshape(-1, 1)).logits[:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.0, generator=None):
        """Feed ``idx`` (B, T), then generate ``max_new_tokens`` (greedy when temperature is 0);
        returns the new tokens (B, max_new_tokens)."""
        logits = self.forward(idx).logits[:, -1]
        out = []
        for _ in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial((logits.float() / temperature).softmax(-1), 1, generator=generator)[:, 0]
            out.append(nxt)
            logits = self.step(nxt)
        return torch.stack(out, 1) if out else idx.new_zeros((idx.shape[0], 0))

    @property
    def n_tokens(self):
        """Normal tokens fed per stream."""
        return self.n_blocks * self.cfg.block_size + self.pending_count

    @property
    def pending_count(self):
        return 0 if self.pending_ids is None else self.pending_ids.shape[1]

    def memory_usage(self):
        """Bytes held: ``fast`` (landmark keys, indexes, resident hot blocks, the current
        chunk's keys and values: what must sit near the compute) and ``store`` (every block's
        keys and values, wherever the store keeps them)."""
        import faiss

        fast = sum(t[:, :, :self.n_blocks].numel() * t.element_size() for t in self.landmarks if t is not None)
        fast += sum(faiss.serialize_index(ix.index).nbytes for s in self.indexes or [] for layer in s for ix in layer)
        fast += self.cache.bytes + sum(t.numel() * t.element_size() for kv in self.pending_kv if kv for t in kv)
        store = self.n_blocks * (self.streams or 0) * self.cfg.n_layer * self.store.nbytes
        return {"fast": fast, "store": store}

    def tokens(self, stream=0):
        """int32 (n_blocks * block_size,) the normal token ids of every block in memory."""
        if not self.chunk_ids:
            return np.zeros(0, np.int32)
        return np.concatenate([c[stream] for c in self.chunk_ids])

    # ---- persistence --------------------------------------------------------------------
    def commit(self):
        """Make everything fed so far durable in the memory directory (DESIGN.md
        "Persistence"); returns the commit number. A process killed at any instant leaves the
        memory at its last commit."""
        if self.dir is None:
            raise ValueError("this memory has no directory: create it with a path (and store='lmdb' or 'mmap') "
                             "to save it")
        if self.readonly:
            raise ValueError(f"the memory {self.dir.path} is open read-only; open it with readonly=False to save")
        doc, files = self._manifest(), {}
        if self.streams is not None:
            B, bs, c0, nb = self.streams, self.cfg.block_size, self._committed_blocks, self.n_blocks
            per_row = row_bytes(doc)
            tok_rows = lm_rows = b""  # the blocks since the last commit, one row each
            if nb > c0:
                ids = np.concatenate(self.chunk_ids[c0 * bs // self.chunk_size:], 1)  # (B, (nb - c0) * bs)
                tok_rows = np.ascontiguousarray(ids.reshape(B, nb - c0, bs).transpose(1, 0, 2), np.int32).tobytes()
                lm = torch.stack([t[:, :, c0:nb] for t in self.landmarks], 2)  # (B, H, n_layer, n, D)
                lm_rows = lm.permute(3, 0, 2, 1, 4).contiguous().cpu().view(torch.uint8).numpy().tobytes()
            self.dir.write_rows(TOKENS, c0 * per_row[TOKENS], tok_rows)
            self.dir.write_rows(LANDMARKS, c0 * per_row[LANDMARKS], lm_rows)
            state = {f"index.{b}.{layer}.{h}": torch.from_numpy(ix.to_bytes())
                     for b, s in enumerate(self.indexes) for layer, heads in enumerate(s) for h, ix in enumerate(heads)}
            if self.pending_count:
                state["pending_ids"] = self.pending_ids.cpu()
                for layer, (k, _, v) in enumerate(self.pending_kv):
                    state[f"pending.{layer}.k"], state[f"pending.{layer}.v"] = k.cpu(), v.cpu()
            files["state"] = self.dir.write_state(self.commit_count + 1, state)
        self.commit_count += 1
        self.dir.write_manifest({**doc, "commit": self.commit_count, "files": files})
        self._committed_blocks = self.n_blocks
        self.dir.drop_old_states(files["state"]["name"] if files else None)
        return self.commit_count

    QUERY_OPTIONS = ("top_k", "retrieval", "position_mapping", "max_blocks", "cmt_cutoff", "nprobe", "ef_search")

    @classmethod
    def open(cls, path, model, *, readonly=False, cache_bytes=256 << 20, backend="auto", **options):
        """A saved memory, at its last commit, ready to continue as if it had never stopped.

        Parameters
        ----------
        path : str or Path, the memory directory.
        model : LandmarkGPT, the model the memory was built with (checked by fingerprint).
        readonly : bool, read without the writer lock (any number of readers); text fed
            afterwards stays in this process and is never saved.
        options : query-time settings to change: top_k, retrieval, position_mapping,
            max_blocks, cmt_cutoff, nprobe, ef_search. The rest was fixed when the memory was built.
        """
        bad = sorted(set(options) - set(cls.QUERY_OPTIONS))
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot change once a memory is built; only {', '.join(cls.QUERY_OPTIONS)} can")
        search = {k: options.pop(k) for k in ("nprobe", "ef_search") if k in options}
        fingerprint = model_fingerprint(model)
        d = MemoryDir(path, writable=not readonly)
        try:
            doc, state = d.read_commit()
            saved = doc["model"]
            if saved["fingerprint"] != fingerprint:
                raise MemoryFileError(
                    f"the memory {path} was built with another model (config {saved['config']}, fingerprint "
                    f"{saved['fingerprint'][:12]}); open it with that model")
            opts = {**doc["options"], **options, "index_options": {**doc["options"]["index_options"], **search}}
            mem = cls.__new__(cls)
            mem._configure(model, opts, cache_bytes, backend)
            mem.dir, mem.readonly, mem._fingerprint = d, readonly, fingerprint
            mem._open_store(path, readonly)
            mem._load(doc, state)
        except BaseException:
            d.close()
            raise
        return mem

    def _load(self, doc, state):
        self.commit_count, self.inputs = doc["commit"], doc["inputs"]
        if doc["streams"] is None:
            return
        cfg, B, nb = self.cfg, doc["streams"], doc["blocks"]
        bs, H, D = cfg.block_size, cfg.n_kv_head, cfg.head_dim
        self.streams, self.n_blocks, self._committed_blocks = B, nb, nb
        rows = self.dir.read_block_rows(doc)
        tok = np.frombuffer(rows[TOKENS], np.int32).reshape(nb, B, bs)
        per_chunk = self.chunk_size // bs
        self.chunk_ids = [tok[c:c + per_chunk].transpose(1, 0, 2).reshape(B, -1) for c in range(0, nb, per_chunk)]
        if nb:
            lm = torch.frombuffer(bytearray(rows[LANDMARKS]), dtype=self.dtype).view(nb, B, cfg.n_layer, H, D).to(self.device)
            self.landmarks = [lm[:, :, layer].permute(1, 2, 0, 3).contiguous() for layer in range(cfg.n_layer)]
        self.indexes = [[[LandmarkIndex.from_bytes(self.index_kind, D, state[f"index.{b}.{layer}.{h}"].numpy(),
                                                   **self.index_options)
                          for h in range(cfg.n_kv_head)] for layer in range(cfg.n_layer)] for b in range(B)]
        if any(ix.ntotal != nb for s in self.indexes for heads in s for ix in heads):
            raise MemoryFileError(f"the indexes of {self.dir.path} do not hold the {nb} blocks the manifest names; "
                                  "the memory is damaged: restore it from a backup or rebuild it")
        try:
            if nb:
                self.store.get([(b, layer, nb - 1) for b in range(B) for layer in range(cfg.n_layer)])
        except KeyError:
            raise MemoryFileError(f"the block store of {self.dir.path} lacks blocks the manifest names; "
                                  "the memory is damaged: restore it from a backup or rebuild it") from None
        if "pending_ids" in state:
            self.pending_ids = state["pending_ids"].to(self.device)
            pos = self._base() + torch.arange(state["pending.0.k"].shape[2], device=self.device)
            self.pending_kv = []
            for layer in range(cfg.n_layer):
                k, v = (state[f"pending.{layer}.{n}"].to(self.device) for n in "kv")
                self.pending_kv.append((k, self.rope(k, pos), v))

    def _manifest(self):
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        cfg = self.cfg
        shape = {"n_layer": cfg.n_layer, "n_kv_head": cfg.n_kv_head, "head_dim": cfg.head_dim, "block_size": cfg.block_size}
        return {"model": {"fingerprint": self._fingerprint, "config": cfg.model.config.to_dict(), "shape": shape,
                          "dtype": DTYPE_NAMES[self.dtype]},
                "options": {"index": self.index_kind, "index_options": self.index_options, "store": self.store_kind,
                            "store_dtype": self.store_dtype, "top_k": self.top_k, "chunk_size": self.chunk_size,
                            "retrieval": self.retrieval, "position_mapping": self.mapping, "max_blocks": self.max_blocks,
                            "cmt_cutoff": self.cmt_cutoff},
                "streams": self.streams, "blocks": self.n_blocks, "tokens": self.n_tokens,
                "pending_tokens": self.pending_count, "inputs": self.inputs}

    def close(self, commit=True):
        """Release the store and the writer lock; a writable saved memory commits first
        (``commit=False`` drops what was fed since the last commit)."""
        if self._closed:
            return
        if commit and self.dir is not None and not self.readonly:
            self.commit()
        self._closed = True
        self.store.close()
        if self.dir is not None:
            self.dir.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(commit=exc_type is None)

    # ---- one step: new tokens after the pending ones, within one chunk -------------------
    def _step(self, new):
        cfg, bs, G = self.cfg, self.cfg.block_size, self.group
        P = self.pending_count
        ids = new if P == 0 else torch.cat([self.pending_ids, new], 1)
        x = insert_landmarks(ids, bs, cfg.landmark_id)  # (B, Tk) the chunk so far
        p0, Tk = landmarked_length(P, bs), x.shape[1]
        qpos = self._base() + torch.arange(p0, Tk, device=self.device)
        h = cfg.embed(x[:, p0:])  # (B, Tq, C)
        normal = ~landmark_mask(Tk, bs, self.device)[p0:]
        retrieved, new_kv = [], []
        for layer in range(cfg.n_layer):
            q, k, v = cfg.qkv(layer, h)  # (B, H, Tq, D) and (B, H_kv, Tq, D) x 2, no RoPE
            qr, kr = self.rope(q, qpos), self.rope(k, qpos)
            if P:  # the chunk's earlier positions, kept raw (for memory) and rotated
                pk, pkr, pv = self.pending_kv[layer]
                k, kr, v = torch.cat([pk, k], 2), torch.cat([pkr, kr], 2), torch.cat([pv, v], 2)  # (B, H_kv, Tk, D)
            new_kv.append((k, kr, v))
            local_k, local_v = (kr, v) if G == 1 else (kr.repeat_interleave(G, 1), v.repeat_interleave(G, 1))
            cmt_k, skip = None, None
            if self.cmt_k is not None:
                cmt_k = self.cmt_k[layer].expand(q.shape[0], -1, -1, -1).to(qr.dtype)  # (B, H, 1, D)
                if self.cmt_cutoff > 0:  # the CMT's share needs only local keys: decide before searching
                    skip = cmt_share(qr, local_k, bs, cmt_k) < self.cmt_cutoff  # (B, H, Tq)
            ids_used, block_pos = self._retrieve(layer, q, qr, qpos, skip)
            table, pool_k, pool_v = self._pool(layer, ids_used)
            y = landmark_attention_inference(qr, local_k, local_v, bs, pool_k=pool_k, pool_v=pool_v, block_table=table,
                                             block_pos=block_pos, rope_base=cfg.rope_base, cmt_k=cmt_k,
                                             backend=self.backend)
            h = cfg.finish(layer, h, y)
            retrieved.append(ids_used[:, :, normal])
        logits = cfg.head(h[:, normal])  # (B, n, V)
        self.pending_ids, self.pending_kv = ids, new_kv
        if self.pending_count == self.chunk_size:
            self._flush()
        return logits, retrieved

    def _base(self):
        """Position of the chunk's first token: after the (top_k + 1) stingy slots, or after
        every block in memory (exact)."""
        return (self.top_k + 1) * self.L if self.mapping == "stingy" else self.n_blocks * self.L

    def _flush(self):
        """The finished chunk's blocks go to memory: rows to the store (one transaction),
        landmark keys to the indexes."""
        B, L, bs = self.streams, self.L, self.cfg.block_size
        n_new = self.chunk_size // bs
        items = {}
        for layer, (k, _, v) in enumerate(self.pending_kv):
            H, D = k.shape[1], k.shape[-1]
            kv = torch.stack([k, v], 1).view(B, 2, H, n_new, L, D)  # (B, 2, H, n_new, L, D)
            for b in range(B):
                for c in range(n_new):
                    items[(b, layer, self.n_blocks + c)] = kv[b, :, :, c]
            lm = k.view(B, H, n_new, L, D)[:, :, :, bs]  # (B, H, n_new, D)
            buf = self.landmarks[layer]
            if buf is None or buf.shape[2] < self.n_blocks + n_new:  # grow by doubling: appends stay O(1)
                grown = lm.new_empty((B, H, max(2 * self.n_blocks, self.n_blocks + n_new), D))
                if buf is not None:
                    grown[:, :, :self.n_blocks] = buf[:, :, :self.n_blocks]
                self.landmarks[layer] = buf = grown
            buf[:, :, self.n_blocks:self.n_blocks + n_new] = lm
            xb = lm.float().cpu().numpy()
            for b in range(B):
                for hd in range(H):
                    self.indexes[b][layer][hd].add(xb[b, hd])
        self.store.put(items)
        self.chunk_ids.append(self.pending_ids.to("cpu", torch.int32).numpy())
        self.n_blocks += n_new
        self.pending_ids, self.pending_kv = None, [None] * self.cfg.n_layer

    # ---- retrieval ----------------------------------------------------------------------
    def _retrieve(self, layer, q, qr, qpos, skip=None):
        """Block ids (B, H, Tq, top_k) chosen for each query (-1 = none) and the positions
        their first rows sit at. ``skip`` (B, H, Tq) bool: queries that retrieve nothing."""
        B, H, Tq, D = q.shape
        K, L, bs, nb = self.top_k, self.L, self.cfg.block_size, self.n_blocks
        lo = max(0, nb - self.max_blocks) if self.max_blocks else 0
        empty = q.new_full((B, H, Tq, K), -1, dtype=torch.long)
        if nb == lo:
            return empty, torch.zeros_like(empty)
        stats = self.retrieval_stats
        stats["queries"] += B * H * Tq
        if skip is not None:
            stats["skipped_queries"] += int(skip.sum())
            if skip.all():  # nothing to search, score or fetch
                stats["skipped_searches"] += B * H if self.mapping == "stingy" and nb - K > lo else 0
                return empty, torch.zeros_like(empty)
        scale, rope = D ** -0.5, self.rope
        lms = self.landmarks[layer][:, :, :nb]  # (B, H_kv, nb, D)
        if self.group > 1:
            lms = lms.repeat_interleave(self.group, 1)  # (B, H, nb, D)
        if self.mapping == "exact":
            ids = torch.arange(lo, nb, device=self.device)
            S = (qr @ rope(lms[:, :, lo:nb], ids * L + bs).transpose(-2, -1)) * scale  # (B, H, Tq, m)
            I = ids.expand(B, H, Tq, -1)
        else:
            recent = torch.arange(max(lo, nb - K), nb, device=self.device)
            slot = K + 1 - (nb - recent)  # latest block at slot K, next at K - 1, ...
            S = (qr @ rope(lms[:, :, recent], slot * L + bs).transpose(-2, -1)) * scale  # (B, H, Tq, r)
            I = recent.expand(B, H, Tq, -1)
            if recent[0] > lo:  # older blocks all sit at slot 0: one RoPE-adjusted query searches them
                xq = rope(q, qpos - bs).float().cpu().numpy()  # (B, H, Tq, D)
                need = np.ones((B, H, Tq), bool) if skip is None else ~skip.cpu().numpy()
                S_old = np.full((B, H, Tq, K), -np.inf, np.float32)
                I_old = np.full((B, H, Tq, K), -1, np.int64)
                for b in range(B):
                    for h in range(H):
                        if not need[b, h].any():  # every query of this layer-head is below the cutoff
                            stats["skipped_searches"] += 1
                            continue
                        stats["searches"] += 1
                        index = self.indexes[b][layer][h // self.group]
                        S_old[b, h, need[b, h]], I_old[b, h, need[b, h]] = index.search(xq[b, h, need[b, h]], K, lo,
                                                                                         int(recent[0]))
                S = torch.cat([torch.from_numpy(S_old).to(self.device, S.dtype) * scale, S], -1)
                I = torch.cat([torch.from_numpy(I_old).to(self.device), I], -1)
        if skip is not None:
            S, I = S.masked_fill(skip[..., None], float("-inf")), I.masked_fill(skip[..., None], -1)
        ids = self._select(S, I, lo, nb)
        if skip is not None:  # shared selections (per head, per token) must not reach skipped queries
            ids = ids.masked_fill(skip[..., None], -1)
        return ids, self._block_positions(ids, nb)

    def _select(self, S, I, lo, nb):
        """Top-k block ids per the retrieval mode from candidate scores S and ids I (B, H, Tq, M)."""
        B, H, Tq, M = S.shape
        K = self.top_k
        if self.retrieval == "per_token_head":
            top = S.topk(min(K, M), dim=-1)
            ids = torch.where(top.values == float("-inf"), -1, I.gather(-1, top.indices))
        else:
            # paper: max over tokens (per_head) or heads (per_token) of the softmaxed landmark scores
            logp = S - torch.logsumexp(S, -1, keepdim=True)
            logp = torch.where(I >= 0, logp, float("-inf"))
            if self.retrieval == "per_token":
                logp, I = logp.transpose(1, 2).flatten(2), I.transpose(1, 2).flatten(2)  # (B, Tq, H * M)
            else:
                logp, I = logp.flatten(2), I.flatten(2)  # (B, H, Tq * M)
            dense = logp.new_full((*logp.shape[:2], nb - lo), float("-inf"))
            dense = dense.scatter_reduce(-1, (I - lo).clamp(min=0), logp, "amax")
            top = dense.topk(min(K, nb - lo), dim=-1)
            ids = torch.where(top.values == float("-inf"), -1, top.indices + lo)  # (B, H or Tq, k)
            ids = ids[:, :, None] if self.retrieval == "per_head" else ids[:, None]
            ids = ids.expand(B, H, Tq, -1)
        if ids.shape[-1] < K:
            ids = F.pad(ids, (0, K - ids.shape[-1]), value=-1)
        return ids

    def _block_positions(self, ids, nb):
        """Where each chosen block's first row sits: its true position (exact), or stingy slots:
        recent blocks at their own slots, older ones from slot 0 in memory order, kept left of
        the first recent one."""
        L, K = self.L, self.top_k
        if self.mapping == "exact":
            return ids.clamp(min=0) * L
        order = torch.where(ids < 0, torch.iinfo(torch.long).max, ids).sort(-1)
        ids_sorted = ids.gather(-1, order.indices)
        recent = ids_sorted >= nb - K
        own_slot = K + 1 - (nb - ids_sorted)
        first_recent = torch.where(recent, own_slot, K + 1).min(-1, keepdim=True).values
        old_rank = torch.cumsum(~recent & (ids_sorted >= 0), -1) - 1
        slot = torch.where(recent, own_slot, torch.minimum(old_rank, first_recent - 1)).clamp(min=0)
        return torch.empty_like(slot).scatter_(-1, order.indices, slot) * L

    def _pool(self, layer, ids):
        """The chosen blocks made resident in the hot-cache arena (the pool), and the block
        table of arena slots."""
        B = ids.shape[0]
        valid = ids >= 0
        key = torch.arange(B, device=self.device)[:, None, None, None] * (self.n_blocks + 1) + ids
        uniq, inverse = torch.unique(key[valid], return_inverse=True)
        table = torch.full_like(ids, -1)
        H, D = self.cfg.n_kv_head, self.cfg.head_dim
        if len(uniq) == 0:
            empty = torch.zeros((0, H, self.L, D), device=self.device, dtype=self.dtype)
            return table, empty, empty
        keys = [(u // (self.n_blocks + 1), layer, u % (self.n_blocks + 1)) for u in uniq.tolist()]
        pool, slots = self.cache.pool(keys)  # (n, 2, H, L, D), keys rotated by offset in block
        table[valid] = slots[inverse]
        return table, pool[:, 0], pool[:, 1]
