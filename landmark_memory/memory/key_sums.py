"""Running sums of a memory's block keys, so that their mean over any run of blocks costs
what changed since it was last asked, not the memory's size.

``centre`` (``MemoryOptions``) scores blocks against the block keys less their mean over the
retrievable blocks ``[lo, n_blocks)``. That mean is ``(S(n_blocks) - S(lo)) / (n_blocks - lo)``
with ``S(n)`` the sum of the keys of blocks ``[0, n)``. Per layer two cursors hold ``S`` at the
two ends and move by adding (or taking out) the rows they pass. A commit saves ``S(n_blocks)``
in the state file, so that a memory opened from disk starts its cursors there instead of
reading every key file.
"""

from collections.abc import Callable

import numpy as np

Rows = Callable[[int, int, int], np.ndarray]  # (layer, first, last) -> float32 (B, H_kv, last - first, D)


class KeySums:
    """Sums of the block keys of blocks ``[0, n)`` per layer, float64 (B, H_kv, D).

    Parameters
    ----------
    n_layer : int.

    Each query takes ``rows``, which reads the block keys of blocks ``[first, last)`` of a
    layer (the sums hold no reference to the memory, so a closed memory is freed at once).
    """

    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self._saved: tuple[int, list[np.ndarray]] | None = None  # (n, S(n) per layer) a commit recorded
        self.reset()

    def reset(self) -> None:
        """Forget the cursors (blocks they passed are gone: a rewind): they start again at the
        saved sums, or at block 0."""
        self._cursors: list[dict[str, tuple[int, np.ndarray]]] = [{} for _ in range(self.n_layer)]
        if self._saved is not None:
            n, sums = self._saved
            for layer, s in enumerate(sums):
                self._cursors[layer]["end"] = (n, s)

    def seed(self, n: int, sums: list[np.ndarray]) -> None:
        """``sums`` per layer are ``S(n)`` (a commit's, from its state file)."""
        self._saved = n, [np.asarray(s, np.float64) for s in sums]
        self.reset()

    def _prefix(self, layer: int, n: int, cursor: str, rows: Rows) -> np.ndarray:
        """``S(n)`` of ``layer``, by moving ``cursor`` (or a copy of the nearest other) to ``n``."""
        here = self._cursors[layer]
        if cursor not in here:  # from block 0 or from the other cursor, whichever is nearer
            others = list(here.values())
            nearest = min(others, key=lambda c: abs(c[0] - n)) if others else None
            here[cursor] = nearest if nearest is not None and abs(nearest[0] - n) < n else (0, None)
        at, s = here[cursor]
        if at != n:
            lo, hi = min(at, n), max(at, n)
            part = rows(layer, lo, hi).sum(2, dtype=np.float64)  # (B, H_kv, D)
            s = part if s is None else s + part if n > at else s - part
        here[cursor] = (n, s)
        return s

    def mean(self, layer: int, lo: int, hi: int, rows: Rows) -> np.ndarray:
        """The mean block key of blocks ``[lo, hi)`` (``hi > lo``), float64 (B, H_kv, D)."""
        s = self._prefix(layer, hi, "end", rows)
        if lo:
            s = s - self._prefix(layer, lo, "start", rows)
        return s / (hi - lo)

    def state(self, n: int, rows: Rows) -> dict[str, np.ndarray]:
        """``S(n)`` of every layer as a commit's state file keeps it: ``landmark_sum.<layer>``."""
        return {} if not n else {f"{PREFIX}{layer}": self._prefix(layer, n, "end", rows)
                                 for layer in range(self.n_layer)}

    def load(self, n: int, state: dict, shape: tuple[int, int, int]) -> None:
        """Start from a commit's sums of its ``n`` blocks, where its state file has them (a
        memory saved before they were kept computes them from its key files when first asked);
        raises ``ValueError`` for sums not of ``shape`` (B, H_kv, D)."""
        names = [f"{PREFIX}{layer}" for layer in range(self.n_layer)]
        if not n or not all(name in state for name in names):
            self._saved = None
            self.reset()
            return
        sums = [np.asarray(state[name], np.float64) for name in names]
        wrong = [name for name, s in zip(names, sums) if s.shape != shape or not np.isfinite(s).all()]
        if wrong:
            raise ValueError(f"{wrong[0]} is not {shape} finite numbers")
        self.seed(n, sums)


PREFIX = "landmark_sum."
