"""The compiled loops of the ``ivf-rows`` lists (``lists.py``): k-means, each key's nearest
centroid, the chains of a list's ids, the runs' order and the search. Each result is a function
of its inputs alone (reductions in a fixed order, or per row whatever the threads), so a memory
resumed, or read by any number of workers, gets the same lists and the same top-k."""

import numpy as np
from numba import prange

from ..core.jit import njit

KMEANS_ITERATIONS = 8

# reductions may be reordered (and so vectorised); the compiled code is the same for every call
_FAST = {"reassoc", "contract"}


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
def _nearest(x, c, lists, dist):
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
def chain_ids(lists, dist, head, tail, nxt, radius, first, upto, start, end):
    """Append ids ``[start, end)`` to their lists (``lists`` int32 (n,), ``dist`` float32 (n,)),
    growing each list's radius; an id from ``upto`` on (past the runs) is its list's ``first``
    there where the list has none yet. Returns the first id whose list does not exist (a damaged
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
        if i >= upto and first[j] < 0:
            first[j] = i
    return -1


@njit
def pass_runs(nxt, first, upto):
    """Move each list's ``first`` int32 (nlist,) id past the runs on to its first id from
    ``upto`` on (-1: none yet), the runs having grown to ``upto``."""
    for j in range(len(first)):
        i = first[j]
        while 0 <= i < upto:
            i = nxt[i]
        first[j] = i


@njit
def sort_run(lists, a, b, seg, ids):
    """The run of ids ``[a, b)`` ordered by list, then id (a counting sort of ``lists`` int32):
    into ``seg`` int64 (nlist + 1,) the row (from ``a``) where each list's keys start, into
    ``ids`` int32 (b - a,) the id of each row."""
    seg[:] = 0
    for i in range(a, b):
        seg[lists[i] + 1] += 1
    seg[0] = a
    for j in range(1, len(seg)):
        seg[j] += seg[j - 1]
    at = seg[:-1].copy()
    for i in range(a, b):
        ids[at[lists[i]] - a] = i
        at[lists[i]] += 1


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


@njit(fastmath=_FAST)
def _dot(x, y):
    """float32: the inner product of two float32 rows (one compiled reduction for every key)."""
    s = np.float32(0)
    for d in range(x.shape[0]):
        s += x[d] * y[d]
    return s


@njit
def _beaten(vals, ids, bound, i):
    """No key of bound ``bound`` from id ``i`` on can enter the top list ``vals``/``ids``."""
    k = len(vals)
    return vals[k - 1] > bound or (vals[k - 1] == bound and ids[k - 1] < i)


@njit(fastmath=_FAST, parallel=True)
def search_lists(xq, keys, runs, run_ids, seg, centroids, radius, first, nxt, nprobe, k, lo, hi, D_out, I_out):
    """Per query: the ``nprobe`` lists of best centroid scores, then the top ``k`` inner
    products of their ids in ``[lo, hi)`` into ``D_out`` float32 (nq, k), ``I_out`` int64: a
    list's keys in each run (``seg`` int64 (runs, nlist + 1) its rows of ``runs``, ``run_ids``
    their ids), then those after the runs, chained from ``first``.
    A list is left once no key of it can enter the top k: its keys lie within ``radius`` of
    its centroid ``c``, so score <= q.c + |q| radius, and the ids still to come are higher
    (equal keys, as layer 0's landmark keys all are, cost k products, not the list's length)."""
    nq, nlist = xq.shape[0], centroids.shape[0]
    for q in prange(nq):
        pv, pi = np.full(nprobe, -np.inf, np.float32), np.full(nprobe, -1, np.int64)
        norm = np.sqrt(_dot(xq[q], xq[q]))
        for j in range(nlist):
            _insert(pv, pi, _dot(xq[q], centroids[j]), j)
        vals, ids = D_out[q], I_out[q]
        for p in range(nprobe):
            j = pi[p]
            if j < 0:
                break
            bound, left = pv[p] + norm * radius[j], False
            for r in range(seg.shape[0]):
                for row in range(seg[r, j], seg[r, j + 1]):
                    i = run_ids[row]
                    if i >= hi or _beaten(vals, ids, bound, i):
                        left = True
                        break
                    if i >= lo:
                        _insert(vals, ids, _dot(xq[q], runs[row]), i)
                if left:
                    break
            i = -1 if left else first[j]
            while 0 <= i < hi and not _beaten(vals, ids, bound, i):  # ids rise along a list
                if i >= lo:
                    _insert(vals, ids, _dot(xq[q], keys[i]), i)
                i = nxt[i]


def assign(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """int32 (n, 2) rows of a lists file for keys ``x`` float32 (n, D) and centroids ``c``: the
    nearest centroid's number and (float32 bits) the distance to it."""
    out = np.empty((len(x), 2), np.int32)
    dist = np.empty(len(x), np.float32)
    _nearest(np.ascontiguousarray(x), c, out[:, 0], dist)
    out[:, 1] = dist.view(np.int32)
    return out
