"""An IVF over the key rows where they lie (index kind ``ivf-rows``): lists of block ids, no
copy of the keys.

The keys stay in their rows (``rows.KeyRows``: in a saved memory, its mapped key file). Below
``train_size`` keys the index searches them exactly (the caller's flat search). At
``train_size`` keys, and again each time they have grown ``RETRAIN_GROWTH`` times, it trains
``nlist`` centroids by k-means on the first ``threshold`` keys and puts every key in the list of
its nearest centroid (L2); a key added later goes to its nearest list. Training is a function of
the keys alone (a strided sample, strided first centroids, a fixed number of Lloyd iterations;
assignments by a compiled loop whose result does not depend on threads), so a memory resumed,
or read by any number of workers, gets the same lists.

What it keeps is the centroids, float32 (nlist, D), and per key its list and its distance to
that list's centroid, int32 (n, 2) (the distance as float32 bits):
beside a key file ``<stem>.f32``, the files ``<stem>.ivf<level>.centroids`` and
``<stem>.ivf<level>.lists``, both ``KeyRows`` (mapped, the lists appended in place as keys come),
so a commit writes what it appended, and the two files of a new level once per training.

A query scores the centroids, visits its ``nprobe`` best lists (of equal scores the lower
list), and scores their keys in place. Lists are chained oldest first (``head``, ``next``), so
a search restricted to ids ``[lo, hi)`` leaves a list at its first id from ``hi`` on, and it
leaves a list early once no key of it can beat its top k (a key's score is at most its
centroid's plus the query's norm times the list's radius). Its top-k is ordered by score, of
equal scores the lower id first, as a flat search orders it.
"""

import math
import os
import re
from pathlib import Path

import numpy as np
from numba import prange

from ..core.jit import njit
from .rows import KeyFileError, KeyRows

RETRAIN_GROWTH = 4
KMEANS_ITERATIONS = 8
SAMPLE_PER_LIST = 32  # k-means reads at most this many keys per centroid (a strided sample)
FILE_NAME = re.compile(r"s\d+_l\d+_h\d+\.ivf(\d+)\.(centroids|lists)")

# reductions may be reordered (and so vectorised); the compiled code is the same for every call
_FAST = {"reassoc", "contract"}


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


def list_count(n: int) -> int:
    """Lists of an index trained on ``n`` keys: about 4 sqrt(n), at least 8 keys per list."""
    return max(1, min(int(4 * math.sqrt(n)), n // 8))


def kmeans(x: np.ndarray, nlist: int, iterations: int = KMEANS_ITERATIONS) -> np.ndarray:
    """Centroids float32 (nlist, D) of keys ``x`` float32 (n, D), n >= nlist, by Lloyd's
    iterations from ``nlist`` keys spread evenly over ``x``; a centroid left without keys stays."""
    n = len(x)
    c = x[(np.arange(nlist) * n) // nlist].astype(np.float32)
    for _ in range(iterations):
        a = np.argmax(x @ c.T - 0.5 * (c * c).sum(1), axis=1)  # nearest in L2
        counts = np.bincount(a, minlength=nlist)
        sums = _sums(x, a, nlist)
        kept = counts > 0
        c[kept] = (sums[kept] / counts[kept, None]).astype(np.float32)
    return c


@njit
def _sums(x, a, nlist):
    """float64 (nlist, D): the sum of the rows of ``x`` (n, D) in each list of ``a`` (n,), added
    in row order (``np.add.at``'s sums, bit for bit, without its per-element dispatch)."""
    out = np.zeros((nlist, x.shape[1]), np.float64)
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            out[a[i], d] += x[i, d]
    return out


@njit(fastmath=_FAST, parallel=True)
def _assign(x, c, lists, dist):
    """Into ``lists`` int32 (n,): the nearest centroid of ``c`` (nlist, D) in L2 to each row of
    ``x`` (n, D), the lower of equals; into ``dist`` float32 (n,): the row's distance to it."""
    n, nlist, D = x.shape[0], c.shape[0], x.shape[1]
    half = np.empty(nlist, np.float32)
    for j in range(nlist):
        s = np.float32(0)
        for d in range(D):
            s += c[j, d] * c[j, d]
        half[j] = s / 2
    for i in prange(n):
        best, arg = -np.inf, 0
        for j in range(nlist):
            s = np.float32(0)
            for d in range(D):
                s += x[i, d] * c[j, d]
            s -= half[j]
            if s > best:
                best, arg = s, j
        s = np.float32(0)
        for d in range(D):
            s += (x[i, d] - c[arg, d]) ** 2
        lists[i], dist[i] = arg, np.sqrt(s)


@njit
def _chain(lists, dist, head, tail, nxt, radius, start, end):
    """Append ids ``[start, end)`` to their lists (``lists`` int32 (n,), ``dist`` float32 (n,)),
    growing each list's radius; returns the first id whose list does not exist (a damaged
    file), else -1."""
    for i in range(start, end):
        j = lists[i]
        if j < 0 or j >= len(head):
            return i
        if tail[j] < 0:
            head[j] = i
        else:
            nxt[tail[j]] = i
        tail[j], nxt[i] = i, -1
        radius[j] = max(radius[j], dist[i])
    return -1


@njit
def _insert(vals, ids, s, i):
    """Put score ``s`` of id ``i`` into the top list ``vals``/``ids`` (descending scores, of
    equal ones the lower id first; -1 ids are empty) if it belongs there."""
    k = len(vals)
    if not (s > vals[k - 1] or (s == vals[k - 1] and ids[k - 1] > i)):
        return
    j = k - 1
    while j > 0 and (vals[j - 1] < s or (vals[j - 1] == s and ids[j - 1] > i)):
        vals[j], ids[j] = vals[j - 1], ids[j - 1]
        j -= 1
    vals[j], ids[j] = s, i


@njit(fastmath=_FAST, parallel=True)
def _search(xq, keys, centroids, radius, head, nxt, nprobe, k, lo, hi, D_out, I_out):
    """Per query: the ``nprobe`` lists of best centroid scores, then the top ``k`` inner
    products of their ids in ``[lo, hi)`` into ``D_out`` float32 (nq, k), ``I_out`` int64.
    A list is left once no key of it can enter the top k: its keys lie within ``radius`` of
    its centroid ``c``, so score <= q.c + |q| radius, and the ids still to come are higher
    (equal keys, as layer 0's landmark keys all are, cost k products, not the list's length)."""
    nq, dim, nlist = xq.shape[0], xq.shape[1], centroids.shape[0]
    for q in prange(nq):
        pv, pi = np.full(nprobe, -np.inf, np.float32), np.full(nprobe, -1, np.int64)
        norm = np.float32(0)
        for d in range(dim):
            norm += xq[q, d] * xq[q, d]
        norm = np.sqrt(norm)
        for j in range(nlist):
            s = np.float32(0)
            for d in range(dim):
                s += xq[q, d] * centroids[j, d]
            _insert(pv, pi, s, j)
        vals, ids = D_out[q], I_out[q]
        for p in range(nprobe):
            if pi[p] < 0:
                break
            bound = pv[p] + norm * radius[pi[p]]
            i = head[pi[p]]
            while 0 <= i < hi:  # ids rise along a list
                if vals[k - 1] > bound or (vals[k - 1] == bound and ids[k - 1] < i):
                    break
                if i >= lo:
                    s = np.float32(0)
                    for d in range(dim):
                        s += xq[q, d] * keys[i, d]
                    _insert(vals, ids, s, i)
                i = nxt[i]


def summary(n: int, train_size: int, nprobe: int) -> str:
    """What an index of ``n`` keys searches, in words (``info``)."""
    level = level_of(n, train_size)
    if not level:
        return f"exact until {train_size:,} blocks"
    t = threshold(level, train_size)
    return (f"{list_count(t):,} lists trained at {t:,} blocks (again at {t * RETRAIN_GROWTH:,}), "
            f"{nprobe} probed per query")


def level_file(key_file: str | Path, level: int, what: str) -> str:
    """The file (``centroids`` or ``lists``) of ``level`` beside ``key_file`` (``<stem>.f32``)."""
    p = Path(key_file)
    return str(p.with_name(f"{p.stem}.ivf{level}.{what}"))


def level_files(key_file: str, n: int, train_size: int, dim: int) -> dict[str, int]:
    """``{file: bytes}`` that an index of ``n`` keys over ``key_file`` keeps (none untrained)."""
    level = level_of(n, train_size)
    if not level:
        return {}
    nlist = list_count(threshold(level, train_size))
    return {level_file(key_file, level, "centroids"): nlist * dim * 4, level_file(key_file, level, "lists"): n * 8}


def assign(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """int32 (n, 2) rows of a lists file for keys ``x`` float32 (n, D) and centroids ``c``: the
    nearest centroid's number and (float32 bits) the distance to it."""
    out = np.empty((len(x), 2), np.int32)
    dist = np.empty(len(x), np.float32)
    _assign(np.ascontiguousarray(x), c, out[:, 0], dist)
    out[:, 1] = dist.view(np.int32)
    return out


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
        self._head = self._tail = np.empty(0, np.int32)  # first and last id of each list, -1 none
        self._radius = np.empty(0, np.float32)  # the largest distance of a key of each list to its centroid
        self._next = np.empty(0, np.int32)  # the next id of each id's list, -1 none
        self._chained = 0  # ids in the chains

    @property
    def nlist(self) -> int:
        return len(self._head)

    def files(self) -> list[KeyRows]:
        """The rows this level keeps (none until trained): centroids, then lists."""
        return [self.centroids, self.lists] if self.level else []

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

    def follow(self, n: int) -> None:
        """Count the first ``n`` keys of a saved memory's rows (its key file mapped that far):
        map the lists of their level, which the writer trained (read where the first search
        needs them: opening costs the same however many keys there are)."""
        level = level_of(n, self.train_size)
        if level != self.level:
            self.close()
            self.level, self.centroids, self.lists = 0, None, None
            if level:
                nlist = list_count(threshold(level, self.train_size))
                w = self.rows.writable
                centroids = KeyRows(self.rows.dim, self._path(level, "centroids"), writable=w, n=nlist)
                try:
                    lists = KeyRows(2, self._path(level, "lists"), writable=w, n=n, dtype=np.int32)
                except KeyFileError:
                    centroids.close()
                    raise
                self.level, self.centroids, self.lists = level, centroids, lists
                self._reset_chains(nlist)
        elif level:
            self.lists.follow(n)

    def _train(self, level: int) -> None:
        t = threshold(level, self.train_size)
        nlist = list_count(t)
        x = self.rows.array()
        c = kmeans(np.ascontiguousarray(x[:t][::max(1, t // (SAMPLE_PER_LIST * nlist))]), nlist)
        self.close()
        self.level, self.centroids, self.lists = 0, None, None
        centroids = KeyRows(self.rows.dim, self._path(level, "centroids"), n=0)
        centroids.append(c)
        lists = KeyRows(2, self._path(level, "lists"), n=0, dtype=np.int32)
        lists.append(assign(x, c))
        self.level, self.centroids, self.lists = level, centroids, lists
        self._reset_chains(nlist)
        self._chain()

    def _reset_chains(self, nlist: int) -> None:
        self._head, self._tail = np.full(nlist, -1, np.int32), np.full(nlist, -1, np.int32)
        self._radius, self._chained = np.zeros(nlist, np.float32), 0

    def _chain(self) -> None:
        n = self.lists.n
        if n > len(self._next):
            grown = np.empty(max(n, 2 * len(self._next), 64), np.int32)
            grown[:self._chained] = self._next[:self._chained]
            self._next = grown
        rows = np.asarray(self.lists.array())
        bad = _chain(rows[:, 0], rows.view(np.float32)[:, 1], self._head, self._tail, self._next, self._radius,
                     self._chained, n)
        if bad >= 0:
            raise KeyFileError(f"{self.lists.path or 'the lists'} puts block {bad} in a list that does not exist "
                               f"(of {self.nlist})")
        self._chained = n

    def search(self, xq: np.ndarray, k: int, lo: int, hi: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` inner products among ids ``[lo, hi)`` of the ``nprobe`` lists nearest each
        query ``xq`` float32 (nq, D): ``D`` float32 (nq, k) (-inf where none), ``I`` int64 (-1)."""
        if self._chained < self.lists.n:
            self._chain()
        D = np.full((len(xq), k), -np.inf, np.float32)
        I = np.full((len(xq), k), -1, np.int64)
        _search(xq, np.asarray(self.rows.array()), np.asarray(self.centroids.array()), self._radius, self._head,
                self._next, min(nprobe, self.nlist), k, lo, hi, D, I)
        return D, I

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files())

    def close(self) -> None:
        """Release this level's files (a writer's cut to what counts; they stay until a commit
        of a later level makes them stale)."""
        for f in self.files():
            f.close()


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
