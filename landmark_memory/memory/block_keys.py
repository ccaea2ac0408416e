"""The block keys of a memory's own blocks (a landmark's key, or the mean of the block's keys:
``MemoryOptions.block_keys``) and their indexes: per (stream, layer, key/value head) the float32 rows
(``index.rows.KeyRows``: in a saved memory, a key file of its own, mapped, appended in place by a writer) and the
``LandmarkIndex`` that searches them (a flat one searches those rows where they lie; an ``ivf-rows`` one keeps its
centroids and lists in files beside them). ``BlockMemory`` holds one, with the store and the blocks' token ids; a
commit syncs it (``sync``) and keeps an index that the rows do not rebuild in its state file (``state``).
"""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..format.directory import damaged, disk_errors
from ..format.manifest import KEYS, key_file
from ..format.options import MemoryOptions
from ..format.shape import ModelShape
from ..index import KINDS, IndexFile, LandmarkIndex, derived_from_rows, index_from_bytes, new_index
from ..index.rows import KeyRows


class BlockKeys:
    """Block key rows and indexes per [stream][layer][key/value head].

    Parameters
    ----------
    shape : ModelShape; options : MemoryOptions (the index kind and its options).
    key_path : Path, optional, the memory folder whose ``keys/`` holds the key files; None: in memory.
    writable : bool, the files are appended to (a writer); else mapped as far as they count.
    where : str, the memory as messages name it.
    """

    def __init__(self, shape: ModelShape, options: MemoryOptions, key_path: Path | None, writable: bool, where: str):
        self.shape, self.options, self.key_path, self.writable, self.where = shape, options, key_path, writable, where
        self.rows: list[list[list[KeyRows]]] = []  # [stream][layer][key/value head] float32 (n_blocks, D)
        self.indexes: list[list[list[LandmarkIndex]]] = []  # [stream][layer][key/value head]

    def start(self, streams: int) -> None:
        """Create the (empty) rows and indexes of ``streams`` streams."""
        D, o, s = self.shape.head_dim, self.options, self.shape
        self.rows = [[[KeyRows(D, None if self.key_path is None else self.key_path / key_file(b, layer, h),
                               writable=self.writable) for h in range(s.n_kv_head)]
                      for layer in range(s.n_layer)] for b in range(streams)]
        self.indexes = [[[new_index(o.index, D, **({"rows": self.rows[b][layer][h]} if KINDS[o.index].on_rows else {}),
                                    **o.index_options) for h in range(s.n_kv_head)]
                         for layer in range(s.n_layer)] for b in range(streams)]

    def errors(self):
        """A context in which a full disk or a damaged key file is a ``MemoryFileError``."""
        return disk_errors(f"the block keys of {self.where}")

    def each(self) -> Iterator[tuple[int, int, int, KeyRows]]:
        """``(stream, layer, head, KeyRows)`` of every key file or buffer."""
        yield from ((b, layer, h, rows) for b, stream in enumerate(self.rows) for layer, heads in enumerate(stream)
                    for h, rows in enumerate(heads))

    def all_indexes(self) -> list[LandmarkIndex]:
        return [ix for stream in self.indexes for layer in stream for ix in layer]

    def index_files(self) -> list[IndexFile]:
        """The files the indexes keep beside the key files (``LandmarkIndex.files``)."""
        return [f for ix in self.all_indexes() for f in ix.files()]

    def files(self) -> list[KeyRows]:
        """Every key file and index file (or buffer)."""
        return [rows for *_, rows in self.each()] + [f.rows for f in self.index_files()]

    # ---- adding and reading ---------------------------------------------------------------
    def add(self, xb: np.ndarray, layer: int, indexed: bool) -> None:
        """Append the block keys ``xb`` float32 (B, H_kv, n, D) of ``layer`` to its rows and,
        where ``indexed`` (or the index searches the rows), to its indexes."""
        for b in range(xb.shape[0]):
            for h in range(xb.shape[1]):
                ix = self.indexes[b][layer][h]
                if ix.rows is None:  # an index of its own kind: the keys lie beside it
                    self.rows[b][layer][h].append(xb[b, h])
                if indexed or ix.rows is not None:  # (a flat index appends to the keys it searches)
                    ix.add(xb[b, h])

    def read(self, layer: int, ids: np.ndarray, out: np.ndarray, at: np.ndarray) -> None:
        """Write the keys of blocks ``ids`` of ``layer`` into ``out`` (B, H_kv, n, D) at ``at``."""
        for b, stream in enumerate(self.rows):
            for h, rows in enumerate(stream[layer]):
                out[b, h, at] = rows.array()[ids]

    def nbytes(self) -> int:
        """Bytes of the rows and of what the indexes hold beside them (a flat index is its rows)."""
        rows = {id(r): r for *_, r in self.each()}
        return sum(r.nbytes for r in rows.values()) + sum(
            ix.nbytes - (ix.rows.nbytes if id(ix.rows) in rows else 0) for ix in self.all_indexes())

    # ---- files: what a commit writes, what opening or following one reads ------------------
    def sync(self, first: int, crcs: dict[str, int]) -> dict[str, int]:
        """Make the rows and index files durable; ``{file: CRC-32}`` of all the rows of each,
        carried on from ``crcs`` (those of its rows before block ``first``)."""
        out = {}
        with self.errors():
            for b, layer, h, rows in self.each():
                rows.sync()
                name = key_file(b, layer, h)
                out[name] = rows.crc32(first, crcs.get(name, 0))
            for f in self.index_files():  # a file new since the last commit is read whole
                f.rows.sync()
                name = f"{KEYS}/{f.rows.path.name}"
                out[name] = (f.rows.crc32(f.rows_at(first), crcs[name]) if name in crcs and f.rows_at else
                             crcs[name] if name in crcs else f.rows.crc32(0))
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """Every index in FAISS's serialisation, named ``index.<stream>.<layer>.<head>``; none
        for a kind that the landmark rows rebuild (``index.derived_from_rows``)."""
        if derived_from_rows(self.options.index):
            return {}
        return {f"index.{b}.{layer}.{h}": torch.from_numpy(ix.to_bytes())
                for b, s in enumerate(self.indexes) for layer, heads in enumerate(s) for h, ix in enumerate(heads)}

    def drop_stale_files(self, indexes: list[LandmarkIndex]) -> None:
        """Remove the index files none of ``indexes`` needs any more (the kind's ``stale_files``)."""
        if self.key_path is not None:
            for f in KINDS[self.options.index].make.stale_files(self.key_path / KEYS, indexes):
                f.unlink(missing_ok=True)

    def follow(self, n_blocks: int, runs: bool = True) -> None:
        """Count ``n_blocks`` rows in every key file, and in an index over them its lists (and
        ``runs``, where the commit's format keeps them)."""
        with self.errors():
            for b, layer, h, rows in self.each():
                rows.follow(n_blocks)
                self.indexes[b][layer][h].follow(n_blocks, runs)  # (an ivf-rows index maps its lists as far)

    def load(self, state: dict[str, torch.Tensor], streams: int, where: Path) -> None:
        """Read every index from a commit's ``state`` (a kind the rows do not rebuild)."""
        s, o = self.shape, self.options
        try:
            self.indexes = [[[index_from_bytes(o.index, s.head_dim, state[f"index.{b}.{layer}.{h}"].numpy(),
                                               **o.index_options)
                              for h in range(s.n_kv_head)] for layer in range(s.n_layer)] for b in range(streams)]
        except (KeyError, RuntimeError, ValueError) as e:  # a missing entry, or bytes FAISS cannot read
            raise damaged(f"the state file of {where}", f"lacks or garbles a landmark index ({e})") from None

    def close(self) -> dict[str, tuple]:
        """Release the files (a writer's cut to the rows that count); returns ``{file:
        FileWatch.kept}`` of a writer's files no other changed: what its seals vouch for."""
        every = self.files()
        for rows in every:
            rows.close()
        return {rows.path.relative_to(self.key_path).as_posix(): rows.watch.kept for rows in every
                if rows.watch is not None and rows.watch.kept is not None}
