"""LandmarkMemory: chunked inference over inputs of any length with top-k block retrieval.

Per chunk and layer (docs/DESIGN.md, "Inference with memory"): compute q, k, v of the new
tokens; score the memory landmarks (recent blocks exactly, older ones through the FAISS index
with a RoPE-adjusted query); pick top-k blocks per the retrieval mode; fetch them through the
hot cache into a block pool; attend over local + retrieved blocks with the grouped softmax (a
memory without landmarks: one ordinary softmax, each block searched by its tokens' mean key). A
chunk's blocks enter memory when the chunk is complete.

Chunk boundaries are absolute (every ``chunk_size`` normal tokens from the start), and the
tokens since the last boundary stay local: feeding a text in one call, in pieces, or one token
at a time (decoding) gives the same result. A document's end (``end_document``) closes its
chunk early; chunks after it count from there. ``SavedMemory`` (saved.py) is the saving half
(commit, open, close), ``BlockLookup`` (lookup.py) the half that chooses the blocks.
"""

from collections.abc import Callable, Collection, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..core.decode import decode
from ..core.layout import IGNORE_INDEX, insert_landmarks, landmark_mask
from ..core.names import DISK_STORES
from ..core.rope import rotation_dtype
from ..kernels import (BACKENDS, block_attention_inference, cmt_share, landmark_attention_inference,
                       sliding_window_attention)
from ..models.kinds import backbone_for
from .directory import MemoryDir
from .lookup import BlockLookup
from .manifest import TOKENS, InputRecord, Manifest
from .shape import ModelShape
from .options import QUERY_OPTIONS, MemoryOptions
from .outputs import MemoryOutput, RetrievalStats
from .retrieval import chunk_base
from .saved import Opened, SavedMemory


LOGITS = ("all", "last", "none")  # what ``forward`` computes of the output head


class LandmarkMemory(SavedMemory, BlockLookup):
    """A landmark model with a memory of past blocks.

    Parameters
    ----------
    model : LandmarkGPT with ``attention="landmark"``, or a Hugging Face causal LM of a family we
        read, converted by ``landmark_memory.models.hf.convert`` or as published, which a memory
        reads without landmarks (``MemoryOptions.block_keys``; ``kinds.py``).
    options : MemoryOptions, how the memory searches, stores and reads (``memory/options.py``
        says what each option means); or, instead, the options as keyword ``settings``
        (``LandmarkMemory(model, top_k=8, store="lmdb", path=...)``), the rest default.
    path : str or Path, folder of a saved memory (created; reopen it with ``LandmarkMemory.open``).
    cache_bytes : int, hot-block cache budget on the model's device.
    backend : str, attention backend ("auto": Triton on CUDA, dense PyTorch elsewhere).
    documents : bool, a saved corpus: its blocks are documents read apart and merged in
        (``memory/corpus.py``), read from their own stores; it takes no text of its own.
    opened : a saved memory's folder as ``LandmarkMemory.open`` found it (``saved.Opened``),
        which the memory takes instead of being made empty; ``open``'s to pass.

    Attributes
    ----------
    options : MemoryOptions, resolved for the model (defaults filled in).
    blocks : BlockMemory, landmark keys, indexes, block store and hot cache.
    retrieval_stats : RetrievalStats.
    inputs : list of InputRecord, the text files ``build`` ingested.
    """

    def __init__(self, model: torch.nn.Module, options: MemoryOptions | None = None, *,
                 path: str | Path | None = None, cache_bytes: int = 256 << 20, backend: str = "auto",
                 documents: bool = False, opened: Opened | None = None, **settings):
        if options is not None and settings:
            raise TypeError(f"give the memory's options as one MemoryOptions or as keyword settings, not both "
                            f"({', '.join(settings)})")
        self._setup(model, options if options is not None else MemoryOptions.of(**settings), cache_bytes, backend)
        if opened is not None:
            self._take(opened)
            return
        self.dir, self.documents = None, documents
        if documents and path is None:
            raise ValueError("a corpus of documents is a saved memory: pass a path")
        if path is not None:
            if self.options.store == "memory":
                raise ValueError(f"a memory saved at a path keeps its blocks on disk: pass store= one of {DISK_STORES}")
            self.dir = MemoryDir.create(path, Manifest(model=self.model_record(), options=self.options,
                                                       documents=documents))
        self.blocks = self._new_blocks(readonly=False)

    def _setup(self, model, options, cache_bytes, backend):
        if backend not in BACKENDS:  # the kernel is called unchecked at every layer
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        bb = backbone_for(model)
        with torch.no_grad():
            cmt_keys = bb.cmt_keys()
        param = next(model.parameters())
        self.options = o = options.for_model(model, bb, cmt_keys)
        self.model, self.backbone, self.backend = model.eval(), bb, backend
        windows = tuple(bb.windows) if any(bb.windows) else ()
        self.shape = ModelShape(bb.n_layer - sum(map(bool, windows)), bb.n_kv_head, bb.head_dim, o.block_size, windows,
                                landmarks=o.block_keys == "landmark")
        self.memory_layer = {layer: m for m, layer in enumerate(self.shape.memory_layers)}  # model layer: memory layer
        self.device, self.dtype, self.cache_bytes = param.device, param.dtype, cache_bytes
        self.group = bb.n_head // bb.n_kv_head  # query heads per key/value head
        self.rope = bb.rope
        self.cmt_k = cmt_keys if self.shape.landmarks else None  # per layer the CMT's key at position -1, (1, H, 1, D)
        self.retrieval_stats = RetrievalStats()
        self._chunk_angles = None  # (chunk base, rope.angles of its positions from a block before it)
        self._window_angles = None  # the sliding-window layers' rope.angles at positions 0, 1, ... of their windows
        self._forced = None  # ((lo, n_blocks), the sink and local blocks every query reads: numpy, tensor)
        self._pinned = np.zeros(0, np.int64)  # blocks every query reads first among its top-k (``reading``)
        # called at each memory layer of a step with (memory layer, the layer's input (B, Tq, C), raw queries
        # (B, H, Tq, D), at_search angles, the step's normal rows): what a question reader reads
        # (``answer.point``)
        self.observer: Callable | None = None
        self._mean_keys = {}  # per layer ((lo, n_blocks), the mean landmark key per query head (B, H, 1, D))
        self._recent_keys = {}  # per layer ((lo, n_blocks), the latest blocks' ids (r,), their landmark keys at their slots (B, H, D, r))
        self.pending_ids = None  # (B, P) normal ids since the last chunk boundary
        # per memory layer (k, k rotated, v) of those positions, (B, H_kv, P', D)
        self.pending_kv = [None] * self.shape.n_layer
        # per sliding-window layer (k, v) of the last positions its window reads, (B, H_kv, < window, D), no RoPE
        self.window_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the open chunk of the commit a reader holds, as ``take`` left it: (pending_ids, pending_kv, window_kv)
        self._saved_chunk = self.pending_ids, self.pending_kv, {}
        self.manifest: Manifest | None = None  # the last commit this memory wrote or read (None: never saved)
        self.inputs: list[InputRecord] = []
        self.commit_count, self.readonly, self._committed_blocks = 0, False, 0
        self._rows_crc = {TOKENS: 0}  # CRC-32 of the committed rows of each row file (and key file)
        self._keys_committed = 0  # blocks whose keys the key files' committed CRC-32s cover
        self._fingerprint, self._closed, self.documents = None, False, False
        self.attached = None  # the session whose blocks follow this read-only memory's (``memory/session.py``)

    # ---- public -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, logits: str = "all") -> MemoryOutput:
        """Feed normal token ids ``idx`` (B, T); returns ``MemoryOutput``. ``logits``: ``"all"``
        (B, T, vocab); ``"last"`` (B, 1, vocab), all that generating after a prompt needs;
        ``"none"`` (B, 0, vocab), for reading text into memory (``build``): no output head."""
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"idx must be integer token ids of shape (B, T), got {idx.dtype} {tuple(idx.shape)}")
        if logits not in LOGITS:
            raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
        if targets is not None and (targets.shape != idx.shape or logits != "all"):
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}, and a "
                             f"loss needs every token's logits (logits='all', got {logits!r})")
        if self.streams is None:
            self.blocks.start(idx.shape[0])
        elif idx.shape[0] != self.streams:
            raise ValueError(f"this memory holds {self.streams} streams; idx has batch size {idx.shape[0]}")
        idx = idx.to(self.device)
        out, retrieved, pos = [], [], 0
        while pos < idx.shape[1]:
            n = min(self.options.chunk_size - self.pending_count, idx.shape[1] - pos)
            lg, ret = self._step(idx[:, pos:pos + n], logits if logits != "last" or pos + n == idx.shape[1] else "none")
            out.append(lg)
            retrieved.append(ret)
            pos += n
        V, H, K = self.backbone.vocab_size, self.backbone.n_head, self.options.top_k
        if len(out) == 1:  # one step (a chunk, or a token): nothing to join, and logits are large
            out, retrieved = out[0], retrieved[0]
        else:
            out = torch.cat(out, 1) if out else idx.new_zeros((idx.shape[0], 0, V), dtype=self.dtype)
            retrieved = [torch.cat([r[layer] for r in retrieved], 2) if retrieved else
                         idx.new_full((idx.shape[0], H, 0, K), -1) for layer in range(self.shape.n_layer)]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(out.float().flatten(0, 1), targets.to(self.device).flatten(),
                                   ignore_index=IGNORE_INDEX)
        return MemoryOutput(out, loss, retrieved)

    __call__ = forward

    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """Append one token per stream, ``idx`` (B,) or (B, 1); returns its logits (B, vocab)."""
        return self.forward(idx.reshape(-1, 1)).logits[:, -1]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None, stop_ids: Collection[int] = (),
                 until: Callable[[list[int]], bool] | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None,
                 on_read: Callable[[list[torch.Tensor]], None] | None = None) -> torch.Tensor:
        """Feed ``idx`` (B, T), then generate up to ``max_new_tokens`` (greedy when temperature
        is 0; ``stop_ids`` and ``until`` end it, as in ``decode.decode``); returns the new tokens
        (B, n). The memory reads the new tokens too, so a later call continues after them.

        ``on_token(t)``: each new token (B,) as the memory is about to read it (streaming);
        ``on_read(retrieved)``: per layer the memory blocks (B, H, 1, top_k) read at each
        position that generating reads, the prompt's last and every new token's (``answer``
        counts them: the passages an answer read)."""
        if idx.shape[-1] == 0:
            raise ValueError("generate needs a prompt of at least one token")

        def read(nxt, told=True):  # (B, T) -> the logits after it, (B, vocab)
            out = self.forward(nxt, logits="last")
            if on_read is not None and told:
                on_read([r[:, :, -1:] for r in out.retrieved])
            return out.logits[:, -1]

        def step(nxt):  # (B, 1)
            if on_token is not None:
                on_token(nxt[:, -1])
            return read(nxt)

        C = self.options.chunk_size
        for a in range(0, idx.shape[1], C):  # a chunk at a time: the retrieved ids of a long prompt add up
            last = read(idx[:, a:a + C], told=a + C >= idx.shape[1])
        new = decode(last, step, max_new_tokens, temperature=temperature, generator=generator, stop_ids=stop_ids,
                     until=until)
        if new.shape[1]:
            step(new[:, -1:])
        return new

    @property
    def streams(self) -> int | None:
        """Batch size, fixed by the first forward."""
        return self.blocks.streams

    @property
    def n_blocks(self) -> int:
        """Blocks in memory per stream."""
        return self.blocks.n_blocks

    @property
    def n_tokens(self) -> int:
        """Normal tokens fed per stream."""
        return self.n_blocks * self.shape.block_size + self.pending_count

    @property
    def pending_count(self) -> int:
        """Tokens of the open chunk (fed since the last chunk boundary)."""
        return 0 if self.pending_ids is None else self.pending_ids.shape[1]

    def memory_usage(self) -> dict[str, int]:
        """Bytes held: ``fast`` (landmark keys, indexes, resident hot blocks, the current
        chunk's keys and values, the sliding-window layers' windows: what must sit near the
        compute) and ``store`` (every block's keys and values, wherever the store keeps them)."""
        fast, store = self.blocks.usage()
        held = [kv for kv in self.pending_kv if kv] + list(self.window_kv.values())
        fast += sum(t.numel() * t.element_size() for kv in held for t in kv)
        return {"fast": fast, "store": store}

    def tokens(self, stream: int = 0, first: int = 0, last: int | None = None) -> np.ndarray:
        """int32 ((last - first) * block_size,) the normal token ids of blocks ``[first, last)``
        in memory (default: every block)."""
        return self.blocks.tokens(stream, first, last)

    @contextmanager
    def querying(self, **changes):
        """Query options (``QUERY_OPTIONS``, e.g. ``centre=True``) changed for what is fed
        inside the ``with`` block, the memory's own again after it (the indexes' search
        breadths are set when a memory opens: ``LandmarkMemory.open(..., nprobe=...)``)."""
        fixed = sorted(set(changes) - set(QUERY_OPTIONS))
        if fixed:
            raise ValueError(f"only {', '.join(QUERY_OPTIONS)} change while a memory is open, not {', '.join(fixed)}")
        own = self.options
        new = own.with_query(**changes).for_model(self.model, self.backbone, self.cmt_k)
        self._use(new)
        try:
            yield self
        finally:
            self._use(own)

    @contextmanager
    def reading(self, blocks: Sequence[int]):
        """Every query fed inside the ``with`` block reads the memory blocks ``blocks`` (at most
        ``top_k``) as the first of its top-k and chooses the rest among the other blocks by its
        landmark scores: a question's evidence, chosen by a question reader (``answer.point``),
        read by every token of its answer at every layer. A sink or local block is read anyway."""
        ids = np.array([int(b) for b in blocks], np.int64)
        if len(ids) > self.options.top_k or len(set(ids.tolist())) < len(ids) or \
                ((ids < 0) | (ids >= self.n_blocks)).any():
            raise ValueError(f"reading takes at most top_k={self.options.top_k} distinct blocks of the memory's "
                             f"{self.n_blocks}, got {ids.tolist()}")
        own, self._pinned = self._pinned, ids
        try:
            yield self
        finally:
            self._pinned = own

    def _use(self, options: MemoryOptions) -> None:
        if options != self.options:  # what the caches hold depends on the options
            self.options, self._forced = options, None
            self._recent_keys.clear()
            self._mean_keys.clear()

    def end_document(self) -> None:
        """Put the open chunk's blocks into memory now, unfinished as the chunk is: a document
        ends here and nothing follows it. Its tokens must fill whole blocks."""
        if self.pending_count % self.shape.block_size:
            raise ValueError(f"a document ends on a block boundary: {self.pending_count} tokens of the open chunk "
                             f"are not a multiple of the block size {self.shape.block_size}")
        if self.pending_count:
            self.blocks.add_chunk([(k, v) for k, _, v in self.pending_kv], self.pending_ids)
            self.pending_ids, self.pending_kv = None, [None] * self.shape.n_layer

    def add_input(self, path: Path, sha256: str, tokens: int) -> InputRecord:
        """Record a text file whose ``tokens`` tokens are about to be fed from here on; the
        record's ``ingested`` count is the caller's to advance, and commits keep it."""
        entry = InputRecord(path=str(Path(path).resolve()), name=Path(path).name, sha256=sha256, tokens=tokens,
                            ingested=0, start=self.n_tokens)
        self.inputs.append(entry)
        return entry

    # ---- one step: new tokens after the pending ones, within one chunk -------------------
    def _step(self, new, logits):
        bb, s, G = self.backbone, self.shape, self.group
        bs, P = s.block_size, self.pending_count
        ids = new if P == 0 else torch.cat([self.pending_ids, new], 1)
        x = insert_landmarks(ids, bs, bb.landmark_id) if s.landmarks else ids  # (B, Tk) the chunk so far
        p0, Tk = s.rows_of(P), x.shape[1]
        at_q, at_search = self._angles(p0, Tk)
        h = bb.embed(x[:, p0:])  # (B, Tq, C)
        # the new positions that are normal tokens: all of them unless the step closes a block
        normal = slice(None) if Tk - p0 == new.shape[1] else ~landmark_mask(Tk, bs, self.device)[p0:]
        retrieved, new_kv, windows = [], [], {}
        for layer in range(bb.n_layer):
            q, k, v = bb.qkv(layer, h)  # (B, H, Tq, D) and (B, H_kv, Tq, D) x 2, no RoPE
            if bb.windows[layer]:  # a sliding-window layer: no memory, its last positions only
                y, windows[layer] = self._window(layer, q, k, v)
                h = bb.finish(layer, h, y)
                continue
            m = self.memory_layer[layer]
            qr, kr = self.rope.rotate(at_q, q, k)
            if self.observer is not None:
                self.observer(m, h, q, at_search, normal)
            if P:  # the chunk's earlier positions, kept raw (for memory) and rotated
                pk, pkr, pv = self.pending_kv[m]
                k, kr, v = torch.cat([pk, k], 2), torch.cat([pkr, kr], 2), torch.cat([pv, v], 2)  # (B, H_kv, Tk, D)
            new_kv.append((k, kr, v))
            local_k, local_v = (kr, v) if G == 1 else (kr.repeat_interleave(G, 1), v.repeat_interleave(G, 1))
            cmt_k, skip = None, None
            if self.cmt_k is not None:
                cmt_k = self.cmt_k[m].expand(q.shape[0], -1, -1, -1).to(qr.dtype)  # (B, H, 1, D)
                if self.options.cmt_cutoff > 0:  # the CMT's share needs only local keys: decide before searching
                    skip = cmt_share(qr, local_k, bs, cmt_k) < self.options.cmt_cutoff  # (B, H, Tq)
            ids_used, block_pos = self._retrieve(m, q, qr, at_search, skip)
            table, pool_k, pool_v, pool_scale = self.blocks.pool(m, ids_used)
            blocks = dict(pool_k=pool_k, pool_v=pool_v, block_table=table, block_pos=block_pos, rope=self.rope,
                          scale=bb.scale, pool_scale=pool_scale, backend=self.backend, check=False)
            y = (landmark_attention_inference(qr, local_k, local_v, bs, cmt_k=cmt_k, **blocks) if s.landmarks else
                 block_attention_inference(qr, local_k, local_v, shared=self.options.reads - self.options.top_k,
                                           **blocks))
            h = bb.finish(layer, h, y)
            retrieved.append(ids_used[:, :, normal, :self.options.top_k])  # the chosen blocks, not the forced ones
        h = h[:, normal]  # (B, n, C)
        if logits != "all":  # "last": the step's last token; "none": no head at all
            h = h[:, h.shape[1] - (logits == "last"):]
        logits = bb.head(h) if h.shape[1] else h.new_zeros((h.shape[0], 0, bb.vocab_size))  # (B, n, V)
        self.pending_ids, self.pending_kv, self.window_kv = ids, new_kv, windows
        if self.pending_count == self.options.chunk_size:  # the chunk is complete: its blocks go to memory
            self.blocks.add_chunk([(k, v) for k, _, v in self.pending_kv], self.pending_ids)
            self.pending_ids, self.pending_kv = None, [None] * self.shape.n_layer
        return logits, retrieved

    def _window(self, layer, q, k, v):
        """A sliding-window layer's attention for the step's queries ``q`` (B, H, Tq, D) over the
        positions its window still reads and the step's ``k``, ``v`` (B, H_kv, Tq, D), no RoPE;
        and what its window reads after the step. Keys are rotated where they sit in the window
        (RoPE scores depend only on position differences), so where the memory puts the chunk
        does not matter to these layers."""
        bb, past = self.backbone, self.window_kv.get(layer)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)  # (B, H_kv, Tk, D)
        Tk, Tq, W = k.shape[2], q.shape[2], bb.windows[layer]
        if self._window_angles is None or self._window_angles[0].shape[0] < Tk:  # made once: every step slices them
            pos = torch.arange(max(Tk, W + self.shape.rows_of(self.options.chunk_size)),
                               device=self.device)
            self._window_angles = bb.window_rope.angles(pos, dtype=rotation_dtype(self.dtype))
        cos, sin = self._window_angles
        qr = bb.window_rope.rotate((cos[Tk - Tq:Tk], sin[Tk - Tq:Tk]), q)
        kr = bb.window_rope.rotate((cos[:Tk], sin[:Tk]), k)
        y = sliding_window_attention(qr, kr, v, W, bb.window_scale)
        keep = max(Tk - (W - 1), 0)  # the next query reads W - 1 positions before it
        return y, (k[:, :, keep:], v[:, :, keep:])

    def _angles(self, p0, Tk):
        """RoPE angles every layer shares for the open chunk's positions ``[p0, Tk)``: at the
        queries' positions, and ``key_row`` earlier, where they search older blocks from (a
        block at slot 0 is scored at its key row). The chunk's positions change only when it
        enters memory (stingy: never), so its angles are made once per chunk and sliced at
        each step."""
        base, r = self._base(), self.shape.key_row
        if self._chunk_angles is None or self._chunk_angles[0] != base:
            pos = base - r + torch.arange(r + self.shape.rows_of(self.options.chunk_size), device=self.device)
            self._chunk_angles = base, self.rope.angles(pos, dtype=rotation_dtype(self.dtype))
        cos, sin = self._chunk_angles[1]
        return (cos[p0 + r:Tk + r], sin[p0 + r:Tk + r]), (cos[p0:Tk], sin[p0:Tk])

    def _base(self):
        o = self.options
        return chunk_base(self.n_blocks, o.reads, self.blocks.L, o.position_mapping)
