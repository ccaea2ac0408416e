"""The blocks a memory holds: per layer the landmark keys (a growing buffer and one FAISS
index per stream and key/value head), every block's keys and values in the store behind the
hot cache, and the token ids of every block.

Block ``b`` of a stream holds normal tokens ``[b * block_size, (b + 1) * block_size)``; ids are
dense and FAISS's sequential ids are the block numbers. Keys are kept without RoPE.
"""

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..index import LandmarkIndex
from ..rope import RotaryEmbedding
from ..storage import HotCache, OverlayStore, StoreDamagedError, open_store
from ..storage.sharded import Shard, ShardedStore, open_budget
from .directory import disk_errors
from .manifest import LANDMARKS, TOKENS, MemoryFileError, ModelShape, RowLayout
from .options import MemoryOptions


class BlockMemory:
    """Landmark keys, indexes, block store and hot cache of one memory.

    Parameters
    ----------
    shape : ModelShape, the model's layer count, key/value heads, head dim and block size.
    options : MemoryOptions, resolved (index kind and options, store kind and dtype, chunk size).
    store_path : Path, optional, the folder of an on-disk store (a saved memory's ``store/``).
    shards : list of Shard, optional, a corpus: its documents' blocks, read-only from their own
        stores, whose folders ``shard_path(name)`` gives, instead of a store of its own.
    readonly : bool, new blocks stay in this process (an overlay over the saved store).
    device, dtype : where and in what the model computes; landmarks and cached blocks live there.
    rope : RotaryEmbedding of the model (cached blocks are kept rotated by their row offset).
    cache_bytes : int, hot-cache budget.
    """

    def __init__(self, shape: ModelShape, options: MemoryOptions, *, store_path: Path | None, readonly: bool,
                 device: torch.device, dtype: torch.dtype, rope: RotaryEmbedding, cache_bytes: int,
                 shards: list[Shard] | None = None, shard_path: Callable[[str], Path] | None = None):
        self.shape, self.options, self.device, self.dtype = shape, options, device, dtype
        self.where = "this memory" if store_path is None else str(Path(store_path).parent)  # for messages
        self.L = shape.block_size + 1
        self.streams: int | None = None  # batch size, fixed by the first chunk
        self.n_blocks = 0  # blocks per stream
        self.landmarks = [None] * shape.n_layer  # per layer (B, H_kv, >= n_blocks, D), grown by doubling
        self.indexes: list[list[list[LandmarkIndex]]] = []  # [stream][layer][key/value head]
        self.chunk_ids: list[np.ndarray] = []  # int32 (B, n * block_size) token ids of each addition (chunk, document)
        try:
            with disk_errors(f"the block store of {self.where}"):
                store = (self._documents(shards, shard_path) if shards is not None else
                         open_store(options.store, shape.block_entry, store_path, options.store_dtype,
                                    readonly=readonly, checksums=options.block_checksums))
        except StoreDamagedError as e:
            raise MemoryFileError(f"{e}; the memory is damaged: restore it from a backup or rebuild it") from None
        self.store = OverlayStore(store) if readonly else store
        offsets = torch.arange(self.L, device=device)

        def pool_ready(kv):  # (n, 2, H, L, D) keys rotated by their offset inside the block
            return torch.stack([rope(kv[:, 0], offsets.to(kv.device)), kv[:, 1]], 1)

        # blocks in the pool are pool-ready: an int8 store keeps them so (quantized after the
        # rotation, so the hot cache holds them as stored), a float store's are rotated when
        # fetched (the functions hold no reference to self: a closed memory is freed at once,
        # not at the next cycle collection, which matters when many large memories come and go)
        self.pool_ready = pool_ready if self.store.quantized else None
        self.cache = HotCache(self.store, device, dtype, cache_bytes, prepare=None if self.store.quantized else pool_ready)

    def _documents(self, shards: list[Shard], shard_path: Callable[[str], Path]) -> ShardedStore:
        o, shape = self.options, self.shape

        def open_shard(name):
            with disk_errors(f"the block store of {name}"):
                return open_store(o.store, shape.block_entry, shard_path(name), o.store_dtype, readonly=True,
                                  checksums=o.block_checksums, sealed=True)

        fds = 1 if o.store == "lmdb" else shape.n_layer  # a sealed environment; a map per layer
        return ShardedStore(shape.block_entry, shards, o.store_dtype, o.block_checksums, open_shard, open_budget(fds))

    def start(self, streams: int) -> None:
        """Fix the number of streams and create their empty indexes."""
        self.streams = streams
        self.indexes = [[[self._new_index() for _ in range(self.shape.n_kv_head)] for _ in range(self.shape.n_layer)]
                        for _ in range(streams)]

    def _new_index(self, data: np.ndarray | None = None) -> LandmarkIndex:
        o = self.options
        if data is None:
            return LandmarkIndex(o.index, self.shape.head_dim, **o.index_options)
        return LandmarkIndex.from_bytes(o.index, self.shape.head_dim, data, **o.index_options)

    # ---- adding ---------------------------------------------------------------------------
    def add_chunk(self, kv: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor) -> None:
        """Add a finished chunk: per layer its un-rotated keys and values (B, H_kv, n * L, D),
        landmark rows included, and its normal token ids (B, n * block_size)."""
        B, L, bs, nb = self.streams, self.L, self.shape.block_size, self.n_blocks
        n_new = ids.shape[1] // bs
        items, landmarks = {}, []
        for layer, (k, v) in enumerate(kv):
            H, D = k.shape[1], k.shape[-1]
            blocks = torch.stack([k, v], 1).view(B, 2, H, n_new, L, D).transpose(2, 3)  # (B, 2, n_new, H, L, D)
            if self.pool_ready is not None:
                blocks = self.pool_ready(blocks.transpose(1, 2).flatten(0, 1)).view(B, n_new, 2, H, L, D).transpose(1, 2)
            for b in range(B):
                for c in range(n_new):
                    items[(b, layer, nb + c)] = blocks[b, :, c]
            landmarks.append(k.view(B, H, n_new, L, D)[:, :, :, bs])  # (B, H, n_new, D)
        with disk_errors(f"the block store of {self.where}"):
            self.store.put(items)
        self.add_blocks(landmarks, ids)

    def add_blocks(self, landmarks: list[torch.Tensor], ids: torch.Tensor | np.ndarray) -> None:
        """Add blocks whose keys and values the store holds already: per layer their landmark
        keys (B, H_kv, n, D), and their normal token ids (B, n * block_size)."""
        B, nb = self.streams, self.n_blocks
        n_new = ids.shape[1] // self.shape.block_size
        for layer, lm in enumerate(landmarks):
            H, D = lm.shape[1], lm.shape[-1]
            buf = self.landmarks[layer]
            if buf is None or buf.shape[2] < nb + n_new:  # grow by doubling: appends stay O(1)
                grown = lm.new_empty((B, H, max(2 * nb, nb + n_new), D), device=self.device, dtype=self.dtype)
                if buf is not None:
                    grown[:, :, :nb] = buf[:, :, :nb]
                self.landmarks[layer] = buf = grown
            buf[:, :, nb:nb + n_new] = lm
            xb = lm.float().cpu().numpy()
            for b in range(B):
                for h in range(H):
                    self.indexes[b][layer][h].add(xb[b, h])
        self.chunk_ids.append(ids.to("cpu", torch.int32).numpy() if torch.is_tensor(ids) else ids.astype(np.int32))
        self.n_blocks += n_new

    # ---- reading --------------------------------------------------------------------------
    def landmark_keys(self, layer: int, blocks: torch.Tensor | slice) -> torch.Tensor:
        """Un-rotated landmark keys (B, H_kv, n, D) of ``blocks`` of ``layer``."""
        return self.landmarks[layer][:, :, :self.n_blocks][:, :, blocks]

    def search(self, layer: int, xq: np.ndarray, need: np.ndarray | None, k: int, lo: int, hi: int,
               group: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Top-``k`` landmark inner products among blocks ``[lo, hi)`` per query.

        Parameters
        ----------
        xq : float32 (B, H, T_q, D), RoPE-adjusted queries of the ``H`` query heads; head ``h``
            searches key/value head ``h // group``.
        need : bool (B, H, T_q), the queries that retrieve (a layer-head with none is skipped);
            None: every query.

        Returns
        -------
        D : float32 (B, H, T_q, k), scores, -inf where none; I : int64 ids, -1 there;
        skipped : int, layer-heads not searched.
        """
        B, H, Tq, dim = xq.shape
        if need is None:  # every query: each key/value head's query heads in one call, no masks
            out = [self.indexes[b][layer][g].search(xq[b, g * group:(g + 1) * group].reshape(-1, dim), k, lo, hi)
                   for b in range(B) for g in range(H // group)]
            return (np.stack([d for d, _ in out]).reshape(B, H, Tq, k), np.stack([i for _, i in out]).reshape(B, H, Tq, k),
                    0)
        D = np.full((B, H, Tq, k), -np.inf, np.float32)
        I = np.full((B, H, Tq, k), -1, np.int64)
        skipped = int((~need.any(-1)).sum())  # layer-heads whose queries are all below the CMT cutoff
        for b in range(B):
            for g in range(H // group):  # the query heads of a key/value head search its index in one call
                heads = slice(g * group, (g + 1) * group)
                sel = need[b, heads]  # (group, T_q)
                if sel.any():
                    D[b, heads][sel], I[b, heads][sel] = self.indexes[b][layer][g].search(xq[b, heads][sel], k, lo, hi)
        return D, I, skipped

    def pool(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Tensor | None]:
        """The chosen blocks ``ids`` (B, H, T_q, K) of ``layer`` made resident in the hot-cache
        arena: ``(block_table, pool_k, pool_v, pool_scale)``, the table (B, H, T_q, K) of arena
        slots (-1 empty), the arena's keys and values (n, H_kv, L, D), keys rotated by row
        offset, and for an int8 store their scales (n, H_kv, D + L) (else None)."""
        B, nb = ids.shape[0], self.n_blocks
        ids_np = ids.cpu().numpy()  # a few hundred ids at most: bookkeeping on the host, in numpy
        valid = ids_np >= 0
        key = np.arange(B)[:, None, None, None] * (nb + 1) + ids_np
        uniq, inverse = np.unique(key[valid], return_inverse=True)
        table = np.full(ids_np.shape, -1, np.int64)
        if len(uniq) == 0:
            empty = torch.zeros((0, self.shape.n_kv_head, self.L, self.shape.head_dim), device=self.device,
                                dtype=self.dtype)
            return torch.from_numpy(table).to(self.device), empty, empty, None
        try:
            pool, scales, slots = self.cache.pool([(u // (nb + 1), layer, u % (nb + 1)) for u in uniq.tolist()])
        except StoreDamagedError as e:
            raise MemoryFileError(f"{e} in the block store of {self.where}; the memory is damaged: restore it from a "
                                  "backup or rebuild it (`landmark-memory info --verify` lists every damaged block)")
        table[valid] = slots[inverse]
        return torch.from_numpy(table).to(self.device), pool[:, 0], pool[:, 1], scales

    def tokens(self, stream: int = 0) -> np.ndarray:
        """int32 (n_blocks * block_size,) the normal token ids of every block."""
        if not self.chunk_ids:
            return np.zeros(0, np.int32)
        return np.concatenate([c[stream] for c in self.chunk_ids])

    def all_indexes(self) -> list[LandmarkIndex]:
        return [ix for stream in self.indexes for layer in stream for ix in layer]

    def index(self, stream: int, layer: int, head: int) -> LandmarkIndex:
        """The landmark index of key/value head ``head`` of ``layer`` in ``stream``."""
        return self.indexes[stream][layer][head]

    def usage(self) -> tuple[int, int]:
        """``(fast, store)`` bytes: landmark keys, indexes and resident hot blocks; every
        block's keys and values in the store."""
        fast = sum(t[:, :, :self.n_blocks].numel() * t.element_size() for t in self.landmarks if t is not None)
        fast += sum(ix.nbytes for ix in self.all_indexes()) + self.cache.bytes
        return fast, self.n_blocks * (self.streams or 0) * self.shape.n_layer * self.store.nbytes

    # ---- saving and loading ---------------------------------------------------------------
    def rows_since(self, layout: RowLayout, first: int) -> dict[str, bytes]:
        """``{file: bytes}``, the rows of blocks ``[first, n_blocks)`` for ``tokens.bin`` and
        ``landmarks.bin``."""
        nb, bs = self.n_blocks, self.shape.block_size
        if nb <= first:
            return {TOKENS: b"", LANDMARKS: b""}
        tail, n = [], nb  # the id arrays added since block ``first`` (commits fall between additions)
        for ids in reversed(self.chunk_ids):
            if n <= first:
                break
            tail.append(ids)
            n -= ids.shape[1] // bs
        ids = np.concatenate(tail[::-1], 1)  # (B, (nb - first) * bs)
        return {TOKENS: layout.encode_tokens(ids),
                LANDMARKS: layout.encode_landmarks([t[:, :, first:nb] for t in self.landmarks])}

    def index_state(self) -> dict[str, torch.Tensor]:
        """Every index in FAISS's serialisation, named ``index.<stream>.<layer>.<head>``."""
        return {f"index.{b}.{layer}.{h}": torch.from_numpy(ix.to_bytes())
                for b, s in enumerate(self.indexes) for layer, heads in enumerate(s) for h, ix in enumerate(heads)}

    def load(self, layout: RowLayout, n_blocks: int, rows: dict[str, bytes], state: dict[str, torch.Tensor],
             where: Path) -> None:
        """Restore ``n_blocks`` committed blocks from their rows and index state, checked
        against the store (``where`` names the memory in errors)."""
        B, bs, cfg = layout.streams, self.shape.block_size, self.shape
        self.streams, self.n_blocks = B, n_blocks
        tok = layout.decode_tokens(rows[TOKENS])  # (nb, B, bs)
        per_chunk = self.options.chunk_size // bs
        self.chunk_ids = [tok[c:c + per_chunk].transpose(1, 0, 2).reshape(B, -1) for c in range(0, n_blocks, per_chunk)]
        if n_blocks:
            self.landmarks = layout.decode_landmarks(rows[LANDMARKS], self.device)
        try:
            self.indexes = [[[self._new_index(state[f"index.{b}.{layer}.{h}"].numpy()) for h in range(cfg.n_kv_head)]
                             for layer in range(cfg.n_layer)] for b in range(B)]
        except (KeyError, RuntimeError, ValueError) as e:  # a missing entry, or bytes FAISS cannot read
            raise MemoryFileError(f"the state file of {where} lacks or garbles a landmark index ({e}); the memory "
                                  "is damaged: restore it from a backup or rebuild it") from None
        if any(ix.ntotal != n_blocks for ix in self.all_indexes()):
            raise MemoryFileError(f"the indexes of {where} do not hold the {n_blocks} blocks the manifest names; "
                                  "the memory is damaged: restore it from a backup or rebuild it")
        try:
            if n_blocks:
                self.store.get([(b, layer, n_blocks - 1) for b in range(B) for layer in range(cfg.n_layer)])
        except (KeyError, StoreDamagedError):
            raise MemoryFileError(f"the block store of {where} lacks blocks the manifest names, or they are "
                                  "damaged; restore the memory from a backup or rebuild it") from None

    def close(self) -> None:
        self.store.close()
