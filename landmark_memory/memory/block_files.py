"""The files half of ``BlockMemory`` (``blocks.py``): what a commit writes of the blocks (token
rows, key files and the files their indexes keep synced, index state, the landmark keys'
sums) and what opening or following a commit reads back (``extend``). Everything here needs
the attributes ``BlockMemory`` makes."""

from pathlib import Path

import numpy as np
import torch

from ..index import KINDS, derived_from_rows, index_from_bytes
from ..storage import StoreDamagedError
from .manifest import KEYS, LANDMARKS, TOKENS, MemoryFileError, RowLayout, key_file


class BlockFiles:
    def rows_since(self, layout: RowLayout, first: int) -> dict[str, bytes]:
        """``{file: bytes}``, the rows of blocks ``[first, n_blocks)`` for ``tokens.bin``."""
        return {TOKENS: layout.encode_tokens(self.ids.since(first)) if self.n_blocks > first else b""}

    def sync_keys(self, first: int, crcs: dict[str, int]) -> dict[str, int]:
        """Make the landmark keys durable; ``{key file: CRC-32}`` of all its rows, carried on
        from ``crcs`` (those of its rows before block ``first``)."""
        out = {}
        with self._key_errors():
            for b, layer, h, rows in self._each_key():
                rows.sync()
                name = key_file(b, layer, h)
                out[name] = rows.crc32(first, crcs.get(name, 0))
            for f in self._index_files():  # a file new since the last commit is read whole
                f.rows.sync()
                name = f"{KEYS}/{f.rows.path.name}"
                out[name] = (f.rows.crc32(first, crcs[name]) if name in crcs and f.per_block else
                             crcs[name] if name in crcs else f.rows.crc32(0))
        return out

    def drop_stale_files(self) -> None:
        """Remove the index files no reader needs any more (after a commit: the kind's
        ``stale_files``)."""
        if self.key_path is not None:
            for f in KINDS[self.options.index].make.stale_files(self.key_path / KEYS, self.all_indexes()):
                f.unlink(missing_ok=True)

    def index_state(self) -> dict[str, torch.Tensor]:
        """Every index in FAISS's serialisation, named ``index.<stream>.<layer>.<head>``; none
        for a kind that the landmark rows rebuild (``index.derived_from_rows``)."""
        if derived_from_rows(self.options.index):
            return {}
        return {f"index.{b}.{layer}.{h}": torch.from_numpy(ix.to_bytes())
                for b, s in enumerate(self.indexes) for layer, heads in enumerate(s) for h, ix in enumerate(heads)}

    def extend(self, layout: RowLayout, n_blocks: int, rows: dict[str, bytes], state: dict[str, torch.Tensor],
               where: Path) -> None:
        """Add the committed blocks ``[self.n_blocks, n_blocks)`` from their rows (``rows``,
        theirs only) and the commit's index ``state``, checked against the store (``where``
        names the memory in errors): all of them when a memory opens, those a writer committed
        since when a read-only one follows it. An index over the key rows searches the key files
        as far as they count now, other kinds are read from the state. A read-only memory must be
        rewound first."""
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
                with self._key_errors():
                    for b, layer, h, rows in self._each_key():
                        rows.follow(n_blocks)
                        self.indexes[b][layer][h].follow(n_blocks)  # (an ivf-rows index maps its lists as far)
                self.n_blocks += self.ids.add(ids)
        if not derived:
            try:
                self.indexes = [[[index_from_bytes(self.options.index, cfg.head_dim,
                                                   state[f"index.{b}.{layer}.{h}"].numpy(),
                                                   **self.options.index_options)
                                  for h in range(cfg.n_kv_head)] for layer in range(cfg.n_layer)] for b in range(B)]
            except (KeyError, RuntimeError, ValueError) as e:  # a missing entry, or bytes FAISS cannot read
                raise MemoryFileError(f"the state file of {where} lacks or garbles a landmark index ({e}); the "
                                      "memory is damaged: restore it from a backup or rebuild it") from None
        if any(ix.ntotal != n_blocks for stream in self.indexes for layer in stream for ix in layer):
            raise MemoryFileError(f"the indexes of {where} do not hold the {n_blocks} blocks the manifest names; "
                                  "the memory is damaged: restore it from a backup or rebuild it")
        try:
            if n_blocks:
                self.store.get([(b, layer, n_blocks - 1) for b in range(B) for layer in range(cfg.n_layer)])
        except KeyError:
            raise MemoryFileError(f"the block store of {where} lacks blocks the manifest names; the memory is "
                                  "damaged: restore it from a backup or rebuild it") from None
        except StoreDamagedError as e:
            raise MemoryFileError(f"the block store of {where} is damaged ({e}); restore the memory from a backup "
                                  "or rebuild it") from None
        try:
            self.sums.load(n_blocks, state, (B, cfg.n_kv_head, cfg.head_dim))
        except ValueError as e:
            raise MemoryFileError(f"the state file of {where} garbles the landmark keys' sums ({e}); the memory is "
                                  "damaged: restore it from a backup or rebuild it") from None
        if self.base is not None:
            self.base = self.n_blocks
