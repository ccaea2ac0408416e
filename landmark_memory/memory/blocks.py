"""The blocks a memory holds: their block keys and indexes (``block_keys.py``: per
(stream, layer, key/value head) float32 rows, a saved memory's in files of their own, mapped,
and the index that searches them), every block's keys and values in the store behind the hot
cache, and the token ids of every block.

Block ``b`` of a stream holds normal tokens ``[b * block_size, (b + 1) * block_size)``; ids are
dense and FAISS's sequential ids are the block numbers. Keys are kept without RoPE.

A read-only memory keeps the saved blocks apart from those fed in this process: the saved ones
(``base`` of them per stream) in ``indexes``, the later ones in a writable BlockMemory of their
own (``upper``: in memory with exact indexes, or an attached session's files, ``memory/
session.py``), their results merged per search. ``rewind`` lets the later ones go in a few
operations, so one open memory answers any number of questions, each as a fresh open would;
``extend`` adds the blocks a writer committed since (``LandmarkMemory.refresh``).
"""

from collections.abc import Callable
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..core.rope import RotaryEmbedding
from ..format.directory import damaged, disk_errors
from ..format.manifest import LANDMARKS, TOKENS, MemoryFileError, RowLayout
from ..format.options import MemoryOptions
from ..format.shape import ModelShape
from ..format.token_rows import TokenRows
from ..index import LandmarkIndex, derived_from_rows
from ..index.rows import KeyFileError
from ..storage import STORE_KINDS, BlockStore, HotCache, OverlayStore, StoreDamagedError, open_store
from ..storage.sharded import Shard, ShardedStore, open_budget
from .block_keys import BlockKeys
from .key_sums import KeySums


class BlockMemory:
    """Landmark keys, indexes, block store and hot cache of one memory.

    Parameters
    ----------
    shape : ModelShape, the model's layer count, key/value heads, head dim and block size.
    options : MemoryOptions, resolved (index kind and options, store kind and dtype, chunk size).
    store_path : Path, optional, the folder of an on-disk store (a saved memory's ``store/``).
    key_path : Path, optional, the memory folder whose key files hold the block keys (mapped;
        a writer appends to them); None: they live in memory.
    shards : list of Shard, optional, a corpus: its documents' blocks, read-only from their own
        stores, whose folders ``shard_path(name)`` gives, instead of a store of its own.
    readonly : bool, new blocks stay in this process (an overlay over the saved store).
    device, dtype : where and in what the model computes; landmarks and cached blocks live there.
    rope : RotaryEmbedding of the model (cached blocks are kept rotated by their row offset).
    cache_bytes : int, hot-cache budget.
    """

    def __init__(self, shape: ModelShape, options: MemoryOptions, *, store_path: Path | None, readonly: bool,
                 device: torch.device, dtype: torch.dtype, rope: RotaryEmbedding, cache_bytes: int,
                 shards: list[Shard] | None = None, shard_path: Callable[[str], Path] | None = None,
                 key_path: Path | None = None):
        self.shape, self.options, self.device, self.dtype, self.rope = shape, options, device, dtype, rope
        folder = key_path if key_path is not None else None if store_path is None else Path(store_path).parent
        self.where = "this memory" if folder is None else str(folder)  # for messages
        self.L = shape.rows
        self.streams: int | None = None  # batch size, fixed by the first chunk
        self.n_blocks = 0  # blocks per stream
        self.key_path = key_path
        self.keys = BlockKeys(shape, options, key_path, not readonly, self.where)  # keys and indexes
        self.ids = TokenRows(shape.block_size)  # the token ids of the blocks in ``indexes``
        # read-only: blocks [0, base) are saved (in ``indexes``), later ones in ``upper``; None: all in ``indexes``
        self.base: int | None = 0 if readonly else None
        self.upper: BlockMemory | None = None  # a read-only memory's blocks past ``base``, as its blocks 0 on
        self.sums = KeySums(shape.n_layer)  # (``mean_key``, ``key_sums``)
        try:
            with disk_errors(f"the block store of {self.where}"):
                store = (self._documents(shards, shard_path, store_path) if shards is not None else
                         open_store(options.store, shape.block_entry, store_path, options.store_dtype,
                                    readonly=readonly, checksums=options.block_checksums))
        except StoreDamagedError as e:
            raise damaged(str(e)) from None
        self.shards = store if shards is not None else None  # a corpus's documents' stores
        self.remote = None  # a served corpus's shares (``app.served``), searched instead of the saved indexes
        self.store = OverlayStore(store) if readonly else store
        self.offsets = offsets = torch.arange(self.L, device=device)

        def pool_ready(kv):  # (n, 2, H, L, D) keys rotated by their offset inside the block
            return torch.stack([rope(kv[:, 0], offsets.to(kv.device)), kv[:, 1]], 1)

        # blocks in the pool are pool-ready: an int8 store keeps them so (quantized after the
        # rotation, so the hot cache holds them as stored), a float store's are rotated when
        # fetched (the functions hold no reference to self: a closed memory is freed at once,
        # not at the next cycle collection, which matters when many large memories come and go)
        self.pool_ready = pool_ready if self.store.quantized else None
        prepare = None if self.store.quantized else pool_ready
        self.cache = HotCache(self.store, device, dtype, cache_bytes, prepare=prepare)

    def _documents(self, shards: list[Shard], shard_path: Callable[[str], Path], store_path: Path) -> ShardedStore:
        o, shape = self.options, self.shape

        def opener(path, readonly, sealed):  # a document's store (sealed), or the corpus's own
            with disk_errors(f"the block store of {path.parent}"):
                try:
                    return open_store(o.store, shape.block_entry, path, o.store_dtype, readonly=readonly,
                                      checksums=o.block_checksums, sealed=sealed)
                except StoreDamagedError as e:
                    raise damaged(str(e)) from None

        fds = STORE_KINDS[o.store].files(shape.n_layer)
        return ShardedStore(shape.block_entry, shards, o.store_dtype, o.block_checksums,
                            lambda name: opener(shard_path(name), True, True), open_budget(fds),
                            lambda readonly: opener(store_path, readonly, False))

    def add_document(self, shard: Shard, packed: bool, source: BlockStore | None = None) -> None:
        """The writer's next document of a corpus, its blocks after the others': in its own store
        (``shard``), or ``packed``: copied now from there (or from ``source``, read in RAM) into the corpus's."""
        if not packed:
            return self.shards.add(shard)
        where = f"the block store of {self.where}"
        with closing(source or self.shards.open_shard(shard.name)) as source, disk_errors(where):
            self.shards.pack(source, shard.blocks, self.streams, self.shape.n_layer)

    def start(self, streams: int) -> None:
        """Fix the number of streams and create their (empty) block keys and indexes."""
        self.streams = streams
        self.keys.start(streams)

    # ---- the blocks past a read-only memory's saved ones -----------------------------------
    def attach(self, upper: "BlockMemory") -> None:
        """Put the blocks of ``upper`` (writable, same shape and store dtype) after this read-only
        memory's saved ones, as blocks ``base`` on: what is fed from here on goes into ``upper``
        (an attached session's files). Rewind first; ``rewind`` lets it go."""
        if self.base is None or self.upper is not None:
            raise RuntimeError("only a rewound read-only memory takes the blocks of another")
        if self.streams is None:
            self.start(upper.streams or 1)
        if upper.streams is None:
            upper.start(self.streams)
        if upper.streams != self.streams:
            raise ValueError(f"this memory holds {self.streams} streams, the blocks attached {upper.streams}")
        self.upper, self.n_blocks = upper, self.base + upper.n_blocks
        self.store.attach(upper.store, self.base)

    def _fed(self) -> "BlockMemory":
        """Where a read-only memory's new blocks go: the attached blocks, else (from its first
        block fed) blocks in memory with exact indexes (its text is searched exactly)."""
        if self.upper is None:
            self.attach(BlockMemory(self.shape, replace(self.options, index="flat", index_options={}, store="memory"),
                                    store_path=None, readonly=False, device=self.device, dtype=self.dtype,
                                    rope=self.rope, cache_bytes=0))
        return self.upper

    # ---- adding ---------------------------------------------------------------------------
    def add_chunk(self, kv: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor) -> None:
        """Add a finished chunk: per layer its un-rotated keys and values (B, H_kv, n * L, D),
        landmark rows included, and its normal token ids (B, n * block_size)."""
        if self.base is not None:  # a read-only memory's own blocks
            self._fed().add_chunk(kv, ids)
            self.n_blocks = self.base + self.upper.n_blocks
            return
        B, L, bs, nb = self.streams, self.L, self.shape.block_size, self.n_blocks
        n_new = ids.shape[1] // bs
        items, keys = {}, []
        for layer, (k, v) in enumerate(kv):
            H, D = k.shape[1], k.shape[-1]
            blocks = torch.stack([k, v], 1).view(B, 2, H, n_new, L, D).transpose(2, 3)  # (B, 2, n_new, H, L, D)
            if self.pool_ready is not None:
                ready = self.pool_ready(blocks.transpose(1, 2).flatten(0, 1))  # (B * n_new, 2, H, L, D)
                blocks = ready.view(B, n_new, 2, H, L, D).transpose(1, 2)
            for b in range(B):
                for c in range(n_new):
                    items[(b, layer, nb + c)] = blocks[b, :, c]
            keys.append(self._new_block_keys(k.view(B, H, n_new, L, D)))  # (B, H, n_new, D)
        with disk_errors(f"the block store of {self.where}"):
            self.store.put(items)
        self.add_blocks(keys, ids)

    def _new_block_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys blocks are searched by, (B, H_kv, n, D), from their un-rotated keys (B, H_kv,
        n, L, D): each block's block key: its landmark's key, or (no landmarks) the mean of its tokens' keys
        rotated to their offsets in the block, so that a query's score against it, the block
        rotated to where it sits, is the mean of its scores against the block's tokens."""
        if self.shape.landmarks:
            return k[:, :, :, self.shape.block_size]
        return self.rope(k, self.offsets.to(k.device)).float().mean(-2)

    def add_blocks(self, keys: list[torch.Tensor], ids: torch.Tensor | np.ndarray, *,
                   indexed: bool = True) -> None:
        """Add blocks whose keys and values the store holds already: per layer their landmark
        keys (B, H_kv, n, D), and their normal token ids (B, n * block_size); ``indexed=False``
        leaves the indexes to the caller."""
        with self.keys.errors():
            for layer, lm in enumerate(keys):
                self.keys.add(lm.float().cpu().numpy(), layer, indexed)  # (B, H, n, D)
        self.n_blocks += self.ids.add(ids)

    # ---- reading --------------------------------------------------------------------------
    def block_keys(self, layer: int, blocks: torch.Tensor | slice) -> torch.Tensor:
        """Un-rotated block keys (B, H_kv, n, D) of ``blocks`` of ``layer``, in the model's dtype."""
        ids = np.arange(self.n_blocks)[blocks] if isinstance(blocks, slice) else blocks.cpu().numpy()
        return torch.from_numpy(self._key_rows(layer, ids)).to(self.device, self.dtype)

    def mean_key(self, layer: int, lo: int, hi: int) -> np.ndarray:
        """float64 (B, H_kv, D): the mean block key of blocks ``[lo, hi)`` of ``layer``."""
        return self.sums.mean(layer, lo, hi, self._key_run)

    def key_sums(self) -> dict[str, np.ndarray]:
        """Per layer the sum of every block's block key, as a commit's state file keeps it."""
        return self.sums.state(self.n_blocks, self._key_run)

    def _key_run(self, layer: int, first: int, last: int) -> np.ndarray:
        return self._key_rows(layer, np.arange(first, last))

    def _key_rows(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """float32 (B, H_kv, n, D): the block keys of blocks ``ids`` of ``layer``."""
        base = self.n_blocks if self.base is None else self.base
        saved, fed = ids < base, ids >= base
        out = np.empty((self.streams, self.shape.n_kv_head, len(ids), self.shape.head_dim), np.float32)
        self.keys.read(layer, ids[saved], out, saved)
        if fed.any():
            self.upper.keys.read(layer, ids[fed] - base, out, fed)
        return out

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
        B, H, T_q, dim = xq.shape
        base = self.n_blocks if self.base is None else self.base  # a served corpus's shares search the saved ones
        s = self.remote.search(layer, xq, need, k, lo, min(hi, base), group) if self.remote and lo < base else None
        if need is None:  # every query: each key/value head's query heads in one call, no masks
            out = [self._search(b, layer, g, xq[b, g * group:(g + 1) * group].reshape(-1, dim), k, lo, hi,
                                s and (s[0][b, g * group:(g + 1) * group].reshape(-1, k),
                                       s[1][b, g * group:(g + 1) * group].reshape(-1, k)))
                   for b in range(B) for g in range(H // group)]
            D, I = (np.stack([x[j] for x in out]).reshape(B, H, T_q, k) for j in (0, 1))
            return D, I, 0
        D = np.full((B, H, T_q, k), -np.inf, np.float32)
        I = np.full((B, H, T_q, k), -1, np.int64)
        skipped = int((~need.any(-1)).sum())  # layer-heads whose queries are all below the CMT cutoff
        for b in range(B):
            for g in range(H // group):  # the query heads of a key/value head search its index in one call
                heads = slice(g * group, (g + 1) * group)
                sel = need[b, heads]  # (group, T_q)
                if sel.any():
                    D[b, heads][sel], I[b, heads][sel] = self._search(b, layer, g, xq[b, heads][sel], k, lo, hi,
                                                                      s and (s[0][b, heads][sel], s[1][b, heads][sel]))
        return D, I, skipped

    def _search(self, b: int, layer: int, h: int, xq: np.ndarray, k: int, lo: int, hi: int, saved=None):
        """``(D, I)`` (nq, k): the top ``k`` of blocks ``[lo, hi)`` of one index, or of the saved
        blocks (``saved``: as a served corpus's shares found them) and the upper ones merged (the
        higher score first; of equal ones, the saved block)."""
        base = self.n_blocks if self.base is None else self.base
        try:
            D, I = saved or self.keys.indexes[b][layer][h].search(xq, k, lo, min(hi, base))
        except KeyFileError as e:  # (an index may read its own files at its first search)
            raise damaged(str(e)) from None
        if hi <= base:
            return D, I
        Do, Io = self.upper._search(b, layer, h, xq, k, max(lo, base) - base, hi - base)
        Io = np.where(Io >= 0, Io + base, -1)
        if lo >= base:
            return Do, Io
        D, I = np.concatenate([D, Do], 1), np.concatenate([I, Io], 1)
        order = np.argsort(-D, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(D, order, 1), np.take_along_axis(I, order, 1)

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
            raise MemoryFileError(f"{e} in the block store of {self.where}; the memory is damaged: restore it "
                                  "or rebuild it (`landmark-memory info --verify` lists each damaged block)") from e
        table[valid] = slots[inverse]
        return torch.from_numpy(table).to(self.device), pool[:, 0], pool[:, 1], scales

    def tokens(self, stream: int = 0, first: int = 0, last: int | None = None) -> np.ndarray:
        """int32 ((last - first) * block_size,) the normal token ids of blocks ``[first, last)``
        (default: every block); only the additions that hold them are read (a saved memory's
        rows may be a map of ``tokens.bin``)."""
        last = self.n_blocks if last is None else min(last, self.n_blocks)
        if self.base is not None and last > self.base:  # (the blocks past a reader's saved ones are its upper's)
            up = self.upper.tokens(stream, max(first - self.base, 0), last - self.base)
            return up if first >= self.base else np.concatenate([self.ids.read(stream, first, self.base), up])
        return self.ids.read(stream, first, last)

    def check_files(self) -> None:
        """Raise ``MemoryFileError`` where a file this memory maps (a block store's, a key file, tokens.bin)
        was cut since it was mapped: reading a page past a file's end would be a SIGBUS."""
        try:
            self.store.check()
            for rows in self.keys.files():
                rows.check()
        except (StoreDamagedError, KeyFileError) as e:
            raise damaged(str(e)) from None
        self.ids.check()
        if self.upper is not None:
            self.upper.check_files()

    def all_indexes(self) -> list[LandmarkIndex]:
        return self.keys.all_indexes() + (self.upper.all_indexes() if self.upper is not None else [])

    def index(self, stream: int, layer: int, head: int) -> LandmarkIndex:
        """The landmark index of key/value head ``head`` of ``layer`` in ``stream``."""
        return self.keys.indexes[stream][layer][head]

    def usage(self) -> tuple[int, int]:
        """``(fast, store)`` bytes: block keys, indexes and resident hot blocks; every
        block's keys and values in the store."""
        fast = self.keys.nbytes() + self.cache.bytes + (self.upper.usage()[0] if self.upper is not None else 0)
        return fast, self.n_blocks * (self.streams or 0) * self.shape.n_layer * self.store.nbytes

    def rewind(self) -> None:
        """Let go of the blocks a read-only memory took since it opened or last followed a
        commit (its ``upper`` ones: those fed in memory are forgotten, an attached session's stay
        in its files), and of their keys and values in the hot cache."""
        if self.base is None or self.upper is None:
            return
        self.n_blocks, self.upper = self.base, None
        self.store.forget()
        self.sums.reset()
        base = self.base
        self.cache.forget(lambda key: key[2] >= base)

    def close(self) -> dict[str, tuple]:
        """Release the key files (a writer's cut to the keys that count) and the store; returns
        ``{file: FileWatch.kept}`` of a writer's files no other changed: what its seals vouch for."""
        kept = self.keys.close()
        self.store.close()
        return kept

    # ---- files: what a commit writes of the blocks, what opening or following one reads -------
    def rows_since(self, layout: RowLayout, first: int) -> dict[str, bytes]:
        """``{file: bytes}``, the rows of blocks ``[first, n_blocks)`` for ``tokens.bin``."""
        return {TOKENS: layout.encode_tokens(self.ids.since(first)) if self.n_blocks > first else b""}

    def sync_keys(self, first: int, crcs: dict[str, int]) -> dict[str, int]:
        """Make the block keys durable; ``{key file: CRC-32}`` of all its rows, carried on
        from ``crcs`` (those of its rows before block ``first``)."""
        return self.keys.sync(first, crcs)

    def drop_stale_files(self) -> None:
        """Remove the index files no reader needs any more (after a commit: the kind's
        ``stale_files``)."""
        self.keys.drop_stale_files(self.all_indexes())

    def index_state(self) -> dict[str, torch.Tensor]:
        """Every index in FAISS's serialisation, named ``index.<stream>.<layer>.<head>``; none
        for a kind that the landmark rows rebuild (``index.derived_from_rows``)."""
        return self.keys.state()

    def extend(self, layout: RowLayout, n_blocks: int, rows: dict[str, bytes], state: dict[str, torch.Tensor],
               where: Path, runs: bool = True) -> None:
        """Add the committed blocks ``[self.n_blocks, n_blocks)`` from their rows (``rows``,
        theirs only) and the commit's index ``state``, checked against the store (``where``
        names the memory in errors): all of them when a memory opens, those a writer committed
        since when a read-only one follows it. An index over the key rows searches the key files
        as far as they count now (and ``runs``, where kept), other kinds are read from the state.
        A read-only memory must be rewound first."""
        if self.upper is not None:
            raise RuntimeError("rewind a read-only memory before it takes new saved blocks")
        B, cfg = layout.streams, self.shape
        if self.streams is None:
            self.start(B)
        derived = derived_from_rows(self.options.index)
        if n_blocks > self.n_blocks:
            if isinstance(rows[TOKENS], np.memmap):  # a reader's map of tokens.bin: checked before each refresh
                self.ids.watch(rows[TOKENS])
            ids = layout.decode_tokens(rows[TOKENS]).transpose(1, 0, 2).reshape(B, -1)  # (B, n * block_size)
            if LANDMARKS in rows:  # a memory from before key files: its keys are rows of landmarks.bin
                base, self.base = self.base, None  # saved blocks go to ``indexes``
                self.add_blocks(layout.decode_landmarks(rows[LANDMARKS], self.device), ids, indexed=derived)
                self.base = base
            else:  # the key files hold them: mapped as far as they count now
                self.keys.follow(n_blocks, runs)
                self.n_blocks += self.ids.add(ids)
        if not derived:
            self.keys.load(state, B, where)
        if any(ix.ntotal != n_blocks for ix in self.keys.all_indexes()):
            raise damaged(f"the indexes of {where}", f"do not hold the {n_blocks} blocks the manifest names")
        try:
            if n_blocks:
                self.store.get([(b, layer, n_blocks - 1) for b in range(B) for layer in range(cfg.n_layer)])
        except KeyError:
            raise damaged(f"the block store of {where}", "lacks blocks the manifest names") from None
        except StoreDamagedError as e:
            raise damaged(f"the block store of {where}", f"fails its checks ({e})") from None
        try:
            self.sums.load(n_blocks, state, (B, cfg.n_kv_head, cfg.head_dim))
        except ValueError as e:
            raise damaged(f"the state file of {where}", f"garbles the block keys' sums ({e})") from None
        if self.base is not None:
            self.base = self.n_blocks
