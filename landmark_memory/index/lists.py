"""An IVF over the key rows where they lie (index kind ``ivf-rows``): lists of block ids, and
runs that copy the keys list by list.

The keys stay in their rows (``rows.KeyRows``: in a saved memory, its mapped key file). Below
``train_size`` keys the index searches them exactly (the caller's flat search). At
``train_size`` keys, and again each time they have grown ``RETRAIN_GROWTH`` times, it trains
``nlist`` centroids by k-means on the first ``threshold`` keys and puts every key in the list of
its nearest centroid (L2); a key added later goes to its nearest list. Training is a function of
the keys alone (a strided sample, strided first centroids, a fixed number of Lloyd iterations;
assignments by a compiled loop whose result does not depend on threads), so a memory resumed,
or read by any number of workers, gets the same lists.

What it keeps is the centroids, float32 (nlist, D), per key its list and its distance to that
list's centroid, int32 (n, 2) (the distance as float32 bits), and its runs: copies of the keys
in runs of ids, each run's keys ordered by list (then id), so that a list's keys of a run lie
together. The first run is the ``threshold`` keys trained on, then one more each time
``threshold / 2`` more keys have come (``run_end``); the keys after the last run (fewer than
``threshold / 2``) are read where they lie. A list's keys lie a page apart in the key file
(1,024 lists over 180,000 keys: 180 pages a list), together in a run (some 7 pages a list, and
a page a key after the last run: ``experiments/results/library.md``).

Beside a key file ``<stem>.f32``, the files ``<stem>.ivf<level>.centroids``, ``.lists`` and
``.runs``, all ``KeyRows`` (mapped; the lists appended in place as keys come, the runs as runs
fill), so a commit writes what it appended, and the files of a new level once per training. A
memory from before runs (``runs=False``: format 7) is searched through the lists alone, and a
writer of it writes its runs when it opens it.

A query scores the centroids, visits its ``nprobe`` best lists (of equal scores the lower
list), and scores their keys: each run's segment of the list, then the keys after the runs,
chained oldest first (``head``, ``next``). Ids rise along a list, so a search restricted to ids
``[lo, hi)`` leaves a list at its first id from ``hi`` on, and it leaves a list early once no
key of it can beat its top k (a key's score is at most its centroid's plus the query's norm
times the list's radius). Its top-k is ordered by score, of equal scores the lower id first, as
a flat search orders it; runs or none, the same keys are scored in the same order, bit for bit.
"""

import math
import os
import re
from pathlib import Path

import numpy as np

from .base import IndexFile
from .lists_kernels import assign, chain_ids, kmeans, pass_runs, search_lists, sort_run
from .rows import KeyFileError, KeyRows

RETRAIN_GROWTH = 4
SAMPLE_PER_LIST = 32  # k-means reads at most this many keys per centroid (a strided sample)
FILE_NAME = re.compile(r"s\d+_l\d+_h\d+\.ivf(\d+)\.(centroids|lists|runs)")


def level_of(n: int, train_size: int) -> int:
    """How many times an index of ``n`` keys has trained: 0 below ``train_size``, then one more
    at each ``RETRAIN_GROWTH``-fold growth."""
    level, t = 0, train_size
    while n >= t:
        level, t = level + 1, t * RETRAIN_GROWTH
    return level


def threshold(level: int, train_size: int) -> int:
    """The key count at which ``level`` trains (on that many keys)."""
    return train_size * RETRAIN_GROWTH ** (level - 1)


def run_end(n: int, level: int, train_size: int) -> int:
    """The keys the runs of ``level`` hold once the index holds ``n``: the ``threshold`` keys it
    trained on, then ``threshold / 2`` more at a time (0 before the training)."""
    t = threshold(level, train_size) if level else n + 1
    if n < t:
        return 0
    step = run_step(t)
    return t + (n - t) // step * step


def run_step(t: int) -> int:
    """The keys of each run after the first, of a level trained on ``t``."""
    return max(1, t // 2)


def list_count(n: int) -> int:
    """Lists of an index trained on ``n`` keys: about 4 sqrt(n), at least 8 keys per list."""
    return max(1, min(int(4 * math.sqrt(n)), n // 8))


def summary(n: int, train_size: int, nprobe: int) -> str:
    """What an index of ``n`` keys searches, in words (``info``)."""
    level = level_of(n, train_size)
    if not level:
        return f"exact until {train_size:,} blocks"
    t = threshold(level, train_size)
    return (f"{list_count(t):,} lists trained at {t:,} blocks (again at {t * RETRAIN_GROWTH:,}), "
            f"{nprobe} probed per query")


def level_file(key_file: str | Path, level: int, what: str) -> str:
    """The file (``centroids``, ``lists`` or ``runs``) of ``level`` beside ``key_file`` (``<stem>.f32``)."""
    p = Path(key_file)
    return str(p.with_name(f"{p.stem}.ivf{level}.{what}"))


def level_files(key_file: str, n: int, train_size: int, dim: int, runs: bool = True) -> dict[str, int]:
    """``{file: bytes}`` that an index of ``n`` keys over ``key_file`` keeps (none untrained;
    ``runs``: its runs too)."""
    level = level_of(n, train_size)
    if not level:
        return {}
    nlist = list_count(threshold(level, train_size))
    return {level_file(key_file, level, "centroids"): nlist * dim * 4, level_file(key_file, level, "lists"): n * 8,
            **({level_file(key_file, level, "runs"): run_end(n, level, train_size) * dim * 4} if runs else {})}


class ListIndex:
    """The lists of an ``ivf-rows`` index over ``rows``, trained as they grow.

    Parameters
    ----------
    rows : KeyRows, the keys (float32 (n, D)); their file, if any, names the index's files.
    train_size : int, keys before the first training (exact search until then).
    """

    def __init__(self, rows: KeyRows, train_size: int):
        self.rows, self.train_size = rows, train_size
        self.level = 0
        self.centroids: KeyRows | None = None  # float32 (nlist, D)
        # int32 (n, 2): the list of each key and (float32 bits) its distance to the list's centroid
        self.lists: KeyRows | None = None
        self.runs: KeyRows | None = None  # float32 (run_end, D): the keys of each run by list; None: none kept
        self._head = self._tail = np.empty(0, np.int32)  # first and last id of each list, -1 none
        self._radius = np.empty(0, np.float32)  # the largest distance of a key of each list to its centroid
        self._next = np.empty(0, np.int32)  # the next id of each id's list, -1 none
        self._chained = 0  # ids in the chains
        self._first = np.empty(0, np.int32)  # each list's first id past the runs, -1 none
        self._seg = np.zeros((0, 1), np.int64)  # (runs, nlist + 1): the row of runs where each list's keys start
        self._run_ids = np.empty(0, np.int32)  # the id of each row of runs read so far
        self._sorted = 0  # ids in the runs read so far

    @property
    def nlist(self) -> int:
        return len(self._head)

    def files(self) -> list[IndexFile]:
        """The files this level keeps (none until trained): its centroids, written whole once; its
        lists, a row per key; its runs (where kept), the rows of ``run_end``."""
        level, t = self.level, self.train_size
        return [IndexFile(f, at) for f, at in ((self.centroids, None), (self.lists, lambda n: n),
                                                (self.runs, lambda n: run_end(n, level, t))) if f is not None]

    def _path(self, level: int, what: str) -> Path | None:
        return None if self.rows.path is None else Path(level_file(self.rows.path, level, what))

    def add(self, n_before: int) -> None:
        """Take the keys ``[n_before, rows.n)`` just appended to the rows."""
        level = level_of(self.rows.n, self.train_size)
        if level > self.level:
            self._train(level)
        elif self.level:
            self.lists.append(assign(self.rows.array()[n_before:], self.centroids.array()))
            self._chain()

    def follow(self, n: int, runs: bool = True) -> None:
        """Count the first ``n`` keys of a saved memory's rows (its key file mapped that far):
        map the lists of their level, which the writer trained, and its runs (``runs``: the
        commit holds them; a writer of a commit without them writes them), read where the first
        search needs them: opening costs the same however many keys there are."""
        level = level_of(n, self.train_size)
        if level != self.level:
            self.close()
            self._reset(0)
            if level:
                nlist = list_count(threshold(level, self.train_size))
                w = self.rows.writable
                self.centroids = KeyRows(self.rows.dim, self._path(level, "centroids"), writable=w, n=nlist)
                try:
                    self.lists = KeyRows(2, self._path(level, "lists"), writable=w, n=n, dtype=np.int32)
                    if runs or w:  # (a writer of a commit without them writes them from the first)
                        self.runs = KeyRows(self.rows.dim, self._path(level, "runs"), writable=w,
                                            n=run_end(n, level, self.train_size) if runs else 0)
                except KeyFileError:
                    self.close()  # (what was opened is let go)
                    self._reset(0)
                    raise
                self._reset(level)
                if w and not runs:
                    self._chain()
        elif level:
            self.lists.follow(n)
            if self.runs is not None:
                self.runs.follow(run_end(n, level, self.train_size))

    def _train(self, level: int) -> None:
        t = threshold(level, self.train_size)
        nlist = list_count(t)
        x = self.rows.array()
        c = kmeans(np.ascontiguousarray(x[:t][::max(1, t // (SAMPLE_PER_LIST * nlist))]), nlist)
        self.close()
        self._reset(0)
        centroids = KeyRows(self.rows.dim, self._path(level, "centroids"), n=0)
        centroids.append(c)
        lists = KeyRows(2, self._path(level, "lists"), n=0, dtype=np.int32)
        lists.append(assign(x, c))
        self.centroids, self.lists, self.runs = centroids, lists, KeyRows(self.rows.dim, self._path(level, "runs"), n=0)
        self._reset(level)
        self._chain()

    def _reset(self, level: int) -> None:
        """Empty chains and runs read for ``level``'s files (0: none)."""
        self.level = level
        if not level:
            self.centroids = self.lists = self.runs = None
        nlist = len(self.centroids.array()) if level else 0
        self._head, self._tail = np.full(nlist, -1, np.int32), np.full(nlist, -1, np.int32)
        self._first = np.full(nlist, -1, np.int32)
        self._radius, self._chained = np.zeros(nlist, np.float32), 0
        self._seg, self._run_ids, self._sorted = np.zeros((0, nlist + 1), np.int64), np.empty(0, np.int32), 0

    def _chain(self) -> None:
        """Chain the ids the lists gained, and read (a writer: write) the runs that filled."""
        n = self.lists.n
        if n > len(self._next):
            grown = np.empty(max(n, 2 * len(self._next), 64), np.int32)
            grown[:self._chained] = self._next[:self._chained]
            self._next = grown
        rows = np.asarray(self.lists.array())
        bad = chain_ids(rows[:, 0], rows.view(np.float32)[:, 1], self._head, self._tail, self._next, self._radius,
                     self._first, self._sorted, self._chained, n)
        if bad >= 0:
            raise KeyFileError(f"{self.lists.path or 'the lists'} puts block {bad} in a list that does not exist "
                               f"(of {self.nlist})")
        self._chained = n
        if self.runs is not None:
            self._sort_runs(rows[:, 0], run_end(n, self.level, self.train_size) if self.rows.writable else self.runs.n)

    def _sort_runs(self, lists: np.ndarray, upto: int) -> None:
        """Read the runs of ids ``[_sorted, upto)``: where each list's keys lie in them and whose
        they are; a writer appends their keys to the runs file first."""
        if upto <= self._sorted:
            return
        t = threshold(self.level, self.train_size)
        ends = [e for e in range(t, upto + 1, run_step(t)) if e > self._sorted]
        seg = np.empty((len(ends), self.nlist + 1), np.int64)
        ids = np.empty(upto - self._sorted, np.int32)
        a = self._sorted
        for r, b in enumerate(ends):
            sort_run(lists, a, b, seg[r], ids[a - self._sorted:b - self._sorted])
            a = b
        if self.rows.writable and self.runs.n < upto:  # (the rows from runs.n on: those the file lacks)
            self.runs.append(self.rows.array()[ids[self.runs.n - self._sorted:]])
        self._seg, self._run_ids = np.concatenate([self._seg, seg]), np.concatenate([self._run_ids, ids])
        self._sorted = upto
        pass_runs(self._next, self._first, upto)

    def search(self, xq: np.ndarray, k: int, lo: int, hi: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` inner products among ids ``[lo, hi)`` of the ``nprobe`` lists nearest each
        query ``xq`` float32 (nq, D): ``D`` float32 (nq, k) (-inf where none), ``I`` int64 (-1)."""
        if self._chained < self.lists.n:
            self._chain()
        D = np.full((len(xq), k), -np.inf, np.float32)
        I = np.full((len(xq), k), -1, np.int64)
        runs = np.asarray(self.runs.array()) if self.runs is not None else np.empty((0, self.rows.dim), np.float32)
        search_lists(xq, np.asarray(self.rows.array()), runs, self._run_ids, self._seg,
                     np.asarray(self.centroids.array()), self._radius, self._first, self._next,
                     min(nprobe, self.nlist), k, lo, hi, D, I)
        return D, I

    @property
    def nbytes(self) -> int:
        return sum(f.rows.nbytes for f in self.files())

    def close(self) -> None:
        """Release this level's files (a writer's cut to what counts; they stay until a commit
        of a later level makes them stale)."""
        for f in self.files():
            f.rows.close()


def lists_files(folder: Path) -> dict[Path, int]:
    """Every ``ivf-rows`` file in ``folder`` (a memory's ``keys/``) and its level."""
    if not folder.is_dir():
        return {}
    return {folder / e.name: int(m.group(1)) for e in os.scandir(folder) if (m := FILE_NAME.fullmatch(e.name))}


def stale_files(folder: Path, level: int) -> list[Path]:
    """The ``ivf-rows`` files in ``folder`` (a memory's ``keys/``) that no reader needs once a
    commit of ``level`` is made: those of levels before ``level - 1`` and an uncommitted training
    a stopped writer left. (The level before stays: a reader that has read the previous commit's
    manifest but not yet mapped its files still finds them.)"""
    return [f for f, at in lists_files(folder).items() if at not in (level, level - 1)]
