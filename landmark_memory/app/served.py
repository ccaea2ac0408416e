"""A corpus served by Ray actors: each holds a share of its blocks (its part of every layer's
index, and their stores) and one front reads the text, fanning each chunk's queries of a layer
out to the shares and merging their top-k (docs/design/library.md, "A corpus served on Ray").

``Shares`` starts the actors (``_Share``: the corpus opened read-only at its last commit, a
range of its blocks answered) and ``Shares.serve(mem)`` makes an open memory of the same corpus
a front: its searches of the saved blocks go to the shares (``LandmarkMemory.serve_from``: one call
per share and layer, all heads at once, in parallel), and the blocks it reads come from them
(``ShareStore`` under the hot cache). Each share searches its range exactly as one process
searches the whole, and the merge keeps the higher score first (of equal ones, the lower
block), so the front retrieves the same blocks and answers the same, bit for bit. A share that
dies makes the request fail in one line (``MemoryFileError``: a server answers 503 and goes on);
nothing on disk changes. The shares answer at the commit they opened: restart to serve a newer.
"""

import numpy as np

from ..format import MemoryFileError
from ..jobs.distributed import set_threads
from ..memory import LandmarkMemory
from ..storage import BlockStore


class _Share:
    """A Ray actor (made remote in ``Shares``): the corpus at ``path`` read-only, answering for
    its blocks ``[first, end)``."""

    def __init__(self, path: str, model: str | None, first: int, end: int, threads: int):
        from ..models.kinds import load_model

        set_threads(threads)
        self.mem = LandmarkMemory.open(path, load_model(model, "cpu", None).model, readonly=True)
        self.first, self.end = first, end

    def blocks(self) -> int:
        return self.mem.n_blocks

    def check_files(self) -> None:
        """``BlockTransfer.check_files`` of this share (``MemoryFileError``: a file it maps was cut)."""
        self.mem.transfer.check_files()

    def search(self, layer: int, xq: np.ndarray, need: np.ndarray | None, k: int, lo: int, hi: int, group: int):
        """``BlockMemory.search`` of the blocks of ``[lo, hi)`` in this share: (D, I) (B, H, T_q, k)."""
        lo, hi = max(lo, self.first), min(hi, self.end)
        B, H, T_q, _ = xq.shape
        if lo >= hi:
            return np.full((B, H, T_q, k), -np.inf, np.float32), np.full((B, H, T_q, k), -1, np.int64)
        D, I, _ = self.mem.transfer.search(layer, xq, need, k, lo, hi, group)
        return D, I

    def read(self, keys: list[tuple[int, int, int]]):
        """The blocks ``keys`` of this share as stored (``LandmarkMemory.stored``)."""
        return self.mem.transfer.raw_blocks(keys)


class Shares:
    """``n`` Ray actors, each answering for a consecutive ``n``-th of the blocks of the corpus at
    ``path`` (built by ``model``), ``threads`` cores each. Ray is started locally (the machine's
    cores shared out) unless a program or ``address`` ("auto" or HOST:PORT) gives one."""

    def __init__(self, path, model: str | None, n: int, address: str | None = None, threads: int | None = None):
        import ray

        from ..format import MemoryDir
        from ..jobs.distributed import available_cores, start_ray

        if n < 1:
            raise ValueError(f"--shares must be at least 1, got {n}")
        d = MemoryDir(path, writable=False)
        try:
            m = d.read_manifest()  # (the commit the shares will open)
        finally:
            d.close()
        self.where, self.commit, self.actors, self._started = d.path.resolve(), m.commit, [], False
        self.ranges = [(i * m.blocks // n, (i + 1) * m.blocks // n) for i in range(n)]
        self.starts = [a for a, _ in self.ranges]
        self.searches, self.reads = 0, [0] * n  # round trips of searches (each to every share), blocks read per share
        self.moved = 0  # bytes of queries, top-k and blocks sent between the front and the shares
        if not ray.is_initialized() and address is None:
            threads = threads or max(1, available_cores() // n)
        self._started = start_ray(address, n * (threads or 1))
        try:
            actor = ray.remote(_Share).options(num_cpus=threads or 1, max_restarts=0)
            self.actors = [actor.remote(str(path), model, a, b, threads or 1) for a, b in self.ranges]
            self._call(lambda a: a.blocks.remote())  # every share up (its corpus opened) before serving
        except BaseException:
            self.close()
            raise

    def _call(self, send, actors=None) -> list:
        import ray

        refs, out, failed = [send(a) for a in (self.actors if actors is None else actors)], [], None
        for ref in refs:  # (every answer taken, failed ones too: Ray logs those never asked for)
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                failed = failed or e
        if isinstance(getattr(failed, "cause", None), MemoryFileError):  # (a share's own: a file cut under it)
            raise MemoryFileError(str(failed.cause))
        if failed is not None:
            raise MemoryFileError(f"a share of the corpus {self.where} served on Ray failed ({type(failed).__name__}: "
                                  f"{str(failed).splitlines()[0] if str(failed) else 'gone'}); restart the server")
        return out

    def check_files(self) -> None:
        """Every share's ``BlockTransfer.check_files``, asked at once: a file cut under a share
        is a ``MemoryFileError`` (a server's 503), not a share dead of a SIGBUS."""
        self._call(lambda a: a.check_files.remote())

    def search(self, layer: int, xq: np.ndarray, need: np.ndarray | None, k: int, lo: int, hi: int, group: int):
        """``BlockMemory.search`` of the saved blocks of ``[lo, hi)``, every share asked at once:
        (D, I) (B, H, T_q, k), the higher score first, of equal ones the lower block."""
        got = self._call(lambda a: a.search.remote(layer, xq, need, k, lo, hi, group))
        D, I = np.concatenate([d for d, _ in got], -1), np.concatenate([i for _, i in got], -1)
        self.searches += 1
        self.moved += len(got) * (xq.nbytes + (0 if need is None else need.nbytes)) + D.nbytes + I.nbytes
        order = np.argsort(-D, axis=-1, kind="stable")[..., :k]  # (shares in block order: ties keep the lower)
        return np.take_along_axis(D, order, -1), np.take_along_axis(I, order, -1)

    def read(self, keys: list[tuple[int, int, int]]) -> list:
        """The stored blocks ``keys``, each read from its share (the shares holding some, at once)."""
        which = np.searchsorted(self.starts, [b for _, _, b in keys], side="right") - 1
        asked = sorted(set(which.tolist()))
        for i in which.tolist():
            self.reads[i] += 1
        got = self._call(lambda i: self.actors[i].read.remote([k for k, w in zip(keys, which) if w == i]), asked)
        parts = {i: iter(g) for i, g in zip(asked, got)}
        self.moved += sum(t.nbytes for g in got for stored in g for t in stored if t is not None)
        return [next(parts[w]) for w in which.tolist()]

    def serve(self, mem: LandmarkMemory) -> LandmarkMemory:
        """Make ``mem`` (the corpus open read-only, at the shares' commit) their front."""
        if mem.dir is None or mem.dir.path.resolve() != self.where or mem.manifest.commit != self.commit:
            raise MemoryFileError(f"the memory {mem.dir.path if mem.dir else 'given'} is not the corpus {self.where} "
                                  f"at the commit its shares opened ({self.commit}): restart the server")
        mem.transfer.serve_from(self, lambda own: ShareStore(own, self))  # (its own store closed: the shares' to read)
        return mem

    def close(self) -> None:
        from ..jobs.distributed import stop_ray

        stop_ray(self.actors, self._started)
        self._started = False


class ShareStore(BlockStore):
    """The blocks of a served corpus, read from its shares (as the store ``like`` keeps them)."""

    def __init__(self, like: BlockStore, shares: Shares):
        super().__init__(like.shape, like.store_dtype, like.checksums)
        self.shares = shares

    def read_stored(self, keys):
        return self.shares.read(list(keys))

