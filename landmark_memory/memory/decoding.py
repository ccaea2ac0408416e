"""The decoding state of a memory and the step that advances it (``LandmarkMemory.decoder``).

Per chunk and layer (docs/design/inference.md, "Inference with memory"): compute q, k, v of the new
tokens; ask the lookup which blocks each query reads; fetch them through the hot cache into a
block pool; attend over local + retrieved blocks with the grouped softmax (a memory without
landmarks: one ordinary softmax). The open chunk's ids, keys and values are kept here until
the chunk is complete, when its blocks go to the block memory; a sliding-window layer keeps the
last positions its window reads instead.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..core.layout import insert_landmarks, landmark_mask
from ..core.rope import rotation_dtype
from ..format.shape import ModelShape
from ..kernels import block_attention_inference, cmt_share, landmark_attention_inference, sliding_window_attention
from .blocks import BlockMemory
from .lookup import BlockLookup
from .retrieval import chunk_base


@dataclass
class OpenChunk:
    """What a commit keeps of the text past the memory's last block, no RoPE applied: the open
    chunk's token ids (streams, P) and per memory layer its keys and values (streams, H_kv, P
    with landmarks, D); per sliding-window layer the keys and values of the positions its window
    still reads (streams, H_kv, at most window - 1, D)."""

    ids: torch.Tensor | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class Decoder:
    """The text a memory has read past its last block, and the step that reads more.

    Parameters
    ----------
    backbone : the model's ``Backbone`` (``models/kinds.backbone_for``).
    shape : ModelShape.
    blocks : BlockMemory, where a complete chunk's blocks go and retrieved ones come from.
    lookup : BlockLookup, which blocks each query reads; its ``options`` are the memory's.
    cmt_k : per memory layer the CMT's key (1, H, 1, D), or None (no landmarks).
    backend : str, the attention backend.

    Attributes
    ----------
    ids : (B, P) normal token ids since the last chunk boundary, or None.
    choose : ``lookup.choose``, or what ``LandmarkMemory.choosing`` put in its place.
    kv : per memory layer (k, k rotated, v) of those positions, (B, H_kv, P', D), or None.
    windows : per sliding-window layer (k, v) of the last positions its window reads, no RoPE.
    observer : called at each memory layer of a step with (memory layer, the layer's input
        (B, T_q, C), raw queries (B, H, T_q, D), at_search angles, the step's normal rows): what a
        question reader reads (``question.point``); None.
    """

    def __init__(self, backbone, shape: ModelShape, blocks: BlockMemory,
                 lookup: BlockLookup, cmt_k: torch.Tensor | None, backend: str):
        self.backbone, self.shape, self.blocks, self.lookup = backbone, shape, blocks, lookup
        self.choose = lookup.choose  # (``LandmarkMemory.choosing`` wraps it)
        self.cmt_k, self.backend, self.rope, self.device = cmt_k, backend, backbone.rope, blocks.device
        self.group = backbone.n_head // backbone.n_kv_head
        self.memory_layer = {layer: m for m, layer in enumerate(shape.memory_layers)}  # model layer: memory layer
        self.observer: Callable | None = None
        self.ids, self.kv = None, [None] * shape.n_layer
        self.windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kept = self.ids, self.kv, {}  # the open chunk as ``keep`` left it, for ``restore``
        self._chunk_angles = None  # (chunk base, rope.angles of its positions from a block before it)
        self._window_angles = None  # the sliding-window layers' rope.angles at positions 0, 1, ... of their windows

    @property
    def pending_count(self) -> int:
        """Tokens of the open chunk (fed since the last chunk boundary)."""
        return 0 if self.ids is None else self.ids.shape[1]

    options = property(lambda self: self.lookup.options, doc="The memory's options, held by its lookup alone.")

    def base(self) -> int:
        """Position of the open chunk's first row."""
        o = self.options
        return chunk_base(self.blocks.n_blocks, o.reads, self.blocks.L, o.position_mapping)

    def flush(self) -> None:
        """Put the open chunk's blocks into memory (its tokens fill whole blocks)."""
        if self.pending_count:
            self.blocks.add_chunk([(k, v) for k, _, v in self.kv], self.ids)
            self.ids, self.kv = None, [None] * self.shape.n_layer

    def open_chunk(self) -> OpenChunk:
        """What was read past the last block, as a commit keeps it."""
        kv = [(k, v) for k, _, v in self.kv] if self.ids is not None else []
        return OpenChunk(self.ids, kv, dict(self.windows))

    def take(self, chunk: OpenChunk) -> None:
        """Continue after ``chunk``: its keys rotated to where the open chunk sits now."""
        self.windows = dict(chunk.windows)
        if chunk.ids is None:
            self.ids, self.kv = None, [None] * self.shape.n_layer
            return
        pos = self.base() + torch.arange(chunk.kv[0][0].shape[2], device=self.device)
        self.ids, self.kv = chunk.ids, [(k, self.rope(k, pos), v) for k, v in chunk.kv]

    def keep(self) -> None:
        """Remember the open chunk as it is now (a saved memory's, as taken: rotated once)."""
        self._kept = self.ids, self.kv, dict(self.windows)

    def restore(self) -> None:
        """The open chunk ``keep`` remembered, again."""
        self.ids, self.kv, windows = self._kept
        self.windows = dict(windows)

    def usage(self) -> int:
        """Bytes of the open chunk's keys and values and the windows' (all near the compute)."""
        held = [kv for kv in self.kv if kv] + list(self.windows.values())
        return sum(t.numel() * t.element_size() for kv in held for t in kv)

    # ---- one step: new tokens after the pending ones, within one chunk -------------------
    def step(self, new: torch.Tensor, logits: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Read ``new`` (B, n) normal ids, at most what fills the open chunk; returns their
        logits (``logits`` as ``LandmarkMemory.forward`` takes it) and per memory layer the
        blocks each of them chose (B, H, n, top_k)."""
        bb, s, G, o = self.backbone, self.shape, self.group, self.options
        bs, P = s.block_size, self.pending_count
        ids = new if P == 0 else torch.cat([self.ids, new], 1)
        x = insert_landmarks(ids, bs, bb.landmark_id) if s.landmarks else ids  # (B, Tk) the chunk so far
        p0, Tk = s.rows_of(P), x.shape[1]
        at_q, at_search = self._angles(p0, Tk)
        h = bb.embed(x[:, p0:])  # (B, T_q, C)
        # the new positions that are normal tokens: all of them unless the step closes a block
        normal = slice(None) if Tk - p0 == new.shape[1] else ~landmark_mask(Tk, bs, self.device)[p0:]
        retrieved, new_kv, windows = [], [], {}
        for layer in range(bb.n_layer):
            q, k, v = bb.qkv(layer, h)  # (B, H, T_q, D) and (B, H_kv, T_q, D) x 2, no RoPE
            if bb.windows[layer]:  # a sliding-window layer: no memory, its last positions only
                y, windows[layer] = self._window(layer, q, k, v)
                h = bb.finish(layer, h, y)
                continue
            m = self.memory_layer[layer]
            qr, kr = self.rope.rotate(at_q, q, k)
            if self.observer is not None:
                self.observer(m, h, q, at_search, normal)
            if P:  # the chunk's earlier positions, kept raw (for memory) and rotated
                pk, pkr, pv = self.kv[m]
                k, kr, v = torch.cat([pk, k], 2), torch.cat([pkr, kr], 2), torch.cat([pv, v], 2)  # (B, H_kv, Tk, D)
            new_kv.append((k, kr, v))
            local_k, local_v = (kr, v) if G == 1 else (kr.repeat_interleave(G, 1), v.repeat_interleave(G, 1))
            cmt_k, skip = None, None
            if self.cmt_k is not None:
                cmt_k = self.cmt_k[m].expand(q.shape[0], -1, -1, -1).to(qr.dtype)  # (B, H, 1, D)
                if o.cmt_cutoff > 0:  # the CMT's share needs only local keys: decide before searching
                    skip = cmt_share(qr, local_k, bs, cmt_k) < o.cmt_cutoff  # (B, H, T_q)
            ids_used, block_pos = self.choose(m, q, qr, at_search, skip)
            read, block_pos, shared = _read_columns(ids_used, block_pos, self._shared())
            table, pool_k, pool_v, pool_scale = self.blocks.pool(m, read)
            blocks = dict(pool_k=pool_k, pool_v=pool_v, block_table=table, block_pos=block_pos, rope=self.rope,
                          scale=bb.scale, pool_scale=pool_scale, backend=self.backend, check=False)
            y = (landmark_attention_inference(qr, local_k, local_v, bs, cmt_k=cmt_k, **blocks) if s.landmarks else
                 block_attention_inference(qr, local_k, local_v, shared=shared, **blocks))
            h = bb.finish(layer, h, y)
            # the chosen blocks, not the forced ones after them (fewer than top_k where fewer are candidates)
            chosen = ids_used[:, :, normal, :ids_used.shape[-1] - (o.reads - o.top_k)]
            retrieved.append(F.pad(chosen, (0, o.top_k - chosen.shape[-1]), value=-1))
        h = h[:, normal]  # (B, n, C)
        if logits != "all":  # "last": the step's last token; "none": no head at all
            h = h[:, h.shape[1] - (logits == "last"):]
        logits = bb.head(h) if h.shape[1] else h.new_zeros((h.shape[0], 0, bb.vocab_size))  # (B, n, V)
        self.ids, self.kv, self.windows = ids, new_kv, windows
        if self.pending_count == o.chunk_size:  # the chunk is complete: its blocks go to memory
            self.flush()
        return logits, retrieved

    def _shared(self) -> int:
        """The table's last columns that every query of a step reads alike, per stream and head:
        the sink and local blocks, and all of them where the top-k is chosen per head."""
        o = self.options
        return o.reads if o.retrieval == "per_head" else o.reads - o.top_k

    def _window(self, layer, q, k, v):
        """A sliding-window layer's attention for the step's queries ``q`` (B, H, T_q, D) over the
        positions its window still reads and the step's ``k``, ``v`` (B, H_kv, T_q, D), no RoPE;
        and what its window reads after the step. Keys are rotated where they sit in the window
        (RoPE scores depend only on position differences), so where the memory puts the chunk
        does not matter to these layers."""
        bb, past = self.backbone, self.windows.get(layer)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)  # (B, H_kv, Tk, D)
        Tk, T_q, window = k.shape[2], q.shape[2], bb.windows[layer]
        if self._window_angles is None or self._window_angles[0].shape[0] < Tk:  # made once: every step slices them
            pos = torch.arange(max(Tk, window + self.shape.rows_of(self.options.chunk_size)), device=self.device)
            self._window_angles = bb.window_rope.angles(pos, dtype=rotation_dtype(self.blocks.dtype))
        cos, sin = self._window_angles
        qr = bb.window_rope.rotate((cos[Tk - T_q:Tk], sin[Tk - T_q:Tk]), q)
        kr = bb.window_rope.rotate((cos[:Tk], sin[:Tk]), k)
        y = sliding_window_attention(qr, kr, v, window, bb.window_scale)
        keep = max(Tk - (window - 1), 0)  # the next query reads the window - 1 positions before it
        return y, (k[:, :, keep:], v[:, :, keep:])

    def _angles(self, p0, Tk):
        """RoPE angles every layer shares for the open chunk's positions ``[p0, Tk)``: at the
        queries' positions, and ``key_row`` earlier, where they search older blocks from (a
        block at slot 0 is scored at its key row). The chunk's positions change only when it
        enters memory (stingy: never), so its angles are made once per chunk and sliced at
        each step."""
        base, r = self.base(), self.shape.key_row
        if self._chunk_angles is None or self._chunk_angles[0] != base:
            pos = base - r + torch.arange(r + self.shape.rows_of(self.options.chunk_size), device=self.device)
            self._chunk_angles = base, self.rope.angles(pos, dtype=rotation_dtype(self.blocks.dtype))
        cos, sin = self._chunk_angles[1]
        return (cos[p0 + r:Tk + r], sin[p0 + r:Tk + r]), (cos[p0:Tk], sin[p0:Tk])


def _read_columns(ids: torch.Tensor, pos: torch.Tensor, shared: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The columns of a step's block table (B, H, T_q, reads) that some query reads, with their
    positions, and how many of the last ``shared`` remain: a ``top_k`` larger than the blocks
    in memory (every block read, at exact positions, to prove the memory exact) leaves most
    columns empty, and the kernels' work grows with the columns, not the blocks."""
    live = (ids >= 0).flatten(0, -2).any(0)  # (reads,)
    if bool(live.all()):
        return ids, pos, shared
    return ids[..., live], pos[..., live], shared - int((~live[live.shape[0] - shared:]).sum())
