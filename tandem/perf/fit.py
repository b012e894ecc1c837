"""Generic piecewise alpha-beta fitting.

A `PiecewiseLinear` splits the input space on one *key* feature at sorted breakpoints; inside
each segment the prediction is a linear form y = sum_j coef_j * x_j over a feature vector whose
first entry is usually the constant 1 (the alpha term) and whose others are the beta terms
(tokens, token pairs, ...). Coefficients are non-negative (tandem.perf.nonneg): every feature
used here is a count of work, so non-negative coefficients keep predictions non-negative and
monotone in the work, which is what schedulers comparing costs rely on.

Fitting minimises squared *relative* error (each row is divided by its target): latencies span
milliseconds to seconds, and an absolute-error fit would ignore the short tasks that routing and
reordering decisions are mostly about.

The same functions fit roofline samples (tandem.perf.ampd_cost) and, later, measurements of the
real engine (`tandem profile`).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tandem.perf.nonneg import nonneg_lstsq

# With at most this many distinct key values every boundary between them is a candidate
# breakpoint; above it, candidates are this many quantiles of the key.
MAX_CANDIDATES = 16


@dataclass
class PiecewiseLinear:
    """y = coefs[s] . x, with segment s = number of breakpoints <= x[key]."""

    key: int
    breakpoints: list[float]
    coefs: list[list[float]] = field(default_factory=list)

    @property
    def segments(self) -> int:
        return len(self.breakpoints) + 1

    def predict(self, x: Sequence[float]) -> float:
        """Prediction for one feature vector (pure Python: bisect + dot product)."""
        c = self.coefs[bisect_right(self.breakpoints, x[self.key])]
        t = 0.0
        for a, b in zip(c, x):
            t += a * b
        return t

    def predict_many(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=float)
        seg = np.searchsorted(np.asarray(self.breakpoints, dtype=float), X[:, self.key], side="right")
        C = np.asarray(self.coefs, dtype=float)
        return np.einsum("ij,ij->i", X, C[seg])

    def median_rel_error(self, X: np.ndarray, y: np.ndarray) -> float:
        """Median over samples of |prediction - y| / y."""
        y = np.asarray(y, dtype=float)
        return float(np.median(np.abs(self.predict_many(X) - y) / np.maximum(np.abs(y), 1e-300)))

    def to_dict(self) -> dict:
        return {"key": self.key, "breakpoints": [float(b) for b in self.breakpoints],
                "coefs": [[float(c) for c in row] for row in self.coefs]}

    @classmethod
    def from_dict(cls, d: dict) -> "PiecewiseLinear":
        bps = [float(b) for b in d["breakpoints"]]
        coefs = [[float(c) for c in row] for row in d["coefs"]]
        if len(coefs) != len(bps) + 1:
            raise ValueError(f"piecewise model has {len(bps)} breakpoints but {len(coefs)} coefficient rows; expected {len(bps) + 1}")
        return cls(int(d["key"]), bps, coefs)

    @classmethod
    def fit(cls, X, y, key: int, breakpoints: Sequence[float] | int = 1) -> "PiecewiseLinear":
        return fit(X, y, key, breakpoints)


def _weights(y: np.ndarray) -> np.ndarray:
    """1/y row weights (relative error); zero or tiny targets are floored at 1e-3 x median."""
    floor = max(float(np.median(np.abs(y))) * 1e-3, 1e-300)
    return 1.0 / np.maximum(np.abs(y), floor)


def fit(X, y, key: int, breakpoints: Sequence[float] | int = 1) -> PiecewiseLinear:
    """Fit a PiecewiseLinear by non-negative least squares on relative error.

    X: (n, k) features; y: (n,) targets; key: index of the feature that selects the segment.
    breakpoints: explicit sorted breakpoints, or the number of segments, in which case the
    breakpoints are chosen among boundaries between distinct key values (all of them when there
    are few, else MAX_CANDIDATES quantiles) by dynamic programming to minimise the total squared
    relative error. Segments with no samples take the coefficients of the nearest fitted one.
    """
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    if X.ndim != 2 or len(X) != len(y):
        raise ValueError(f"fit needs X of shape (n, k) and y of shape (n,), got {X.shape} and {y.shape}")
    if not 0 <= key < X.shape[1]:
        raise ValueError(f"key feature index {key} out of range for {X.shape[1]} features")
    w = _weights(y)
    order = np.argsort(X[:, key], kind="stable")
    Xs, ys, ws = X[order], y[order], w[order]
    Xw, yw = Xs * ws[:, None], ys * ws
    keys = Xs[:, key]

    if isinstance(breakpoints, (int, np.integer)):
        bps = _choose_breakpoints(Xw, yw, keys, int(breakpoints))
    else:
        bps = sorted(float(b) for b in breakpoints)

    # Fit each segment on its rows.
    cuts = np.searchsorted(keys, bps, side="left")  # rows with key >= bp go to the next segment
    bounds = [0, *cuts.tolist(), len(keys)]
    coefs: list[list[float] | None] = []
    for s in range(len(bps) + 1):
        lo, hi = bounds[s], bounds[s + 1]
        coefs.append(nonneg_lstsq(Xw[lo:hi], yw[lo:hi])[0].tolist() if hi > lo else None)
    filled = [i for i, c in enumerate(coefs) if c is not None]
    if not filled:
        raise ValueError("fit needs at least one sample")
    for i, c in enumerate(coefs):
        if c is None:
            coefs[i] = list(coefs[min(filled, key=lambda j: abs(j - i))])
    return PiecewiseLinear(key, bps, coefs)


def _choose_breakpoints(Xw: np.ndarray, yw: np.ndarray, keys: np.ndarray, segments: int) -> list[float]:
    """Breakpoints (as key values) for up to `segments` segments minimising total weighted SSE:
    dynamic programming over candidate boundaries, then each breakpoint is refined over every
    boundary between its neighbouring candidates."""
    if segments < 1:
        raise ValueError(f"need at least one segment, got {segments}")
    n = len(keys)
    # Row indices where the key changes value: the only places a breakpoint can separate rows.
    change = np.flatnonzero(keys[1:] > keys[:-1]) + 1
    if len(change) > MAX_CANDIDATES:
        pos = np.searchsorted(change, np.quantile(np.arange(1, n), np.linspace(0, 1, MAX_CANDIDATES + 2)[1:-1]))
        cand_rows = np.unique(change[np.clip(pos, 0, len(change) - 1)]).tolist()
    else:
        cand_rows = change.tolist()
    cand = [0, *cand_rows, n]  # segment boundaries as row indices
    segments = min(segments, len(cand) - 1)
    min_rows = 2  # a segment must hold at least this many rows
    INF = float("inf")
    cache: dict[tuple[int, int], float] = {}

    def cost(lo: int, hi: int) -> float:  # rows [lo, hi)
        got = cache.get((lo, hi))
        if got is None:
            got = nonneg_lstsq(Xw[lo:hi], yw[lo:hi])[1] if hi - lo >= min_rows else INF
            cache[(lo, hi)] = got
        return got

    m = len(cand)
    # best[s][j]: min cost of covering rows [0, cand[j]) with s segments; arg for backtracking.
    best = [[INF] * m for _ in range(segments + 1)]
    arg = [[-1] * m for _ in range(segments + 1)]
    best[0][0] = 0.0
    for s in range(1, segments + 1):
        for j in range(1, m):
            for i in range(s - 1, j):
                if best[s - 1][i] == INF:
                    continue
                c = best[s - 1][i] + cost(cand[i], cand[j])
                if c < best[s][j]:
                    best[s][j], arg[s][j] = c, i
    # Fewest segments whose error is within noise of the best (an exact fit needs no split).
    floor = min(best[s][m - 1] for s in range(1, segments + 1))
    if floor == INF:  # too few rows to split at all
        return []
    tol = floor * 1e-6 + 1e-12 * n
    s_best = min(s for s in range(1, segments + 1) if best[s][m - 1] <= floor + tol)
    idx, j = [], m - 1
    for s in range(s_best, 0, -1):
        j = arg[s][j]
        idx.append(j)
    idx = sorted(i for i in idx if i > 0)
    # Refine: move each boundary to the best change point between its neighbouring candidates.
    rows = [cand[i] for i in idx]
    for t, i in enumerate(idx):
        left = rows[t - 1] if t > 0 else 0
        right = rows[t + 1] if t + 1 < len(rows) else n
        lo_c, hi_c = cand[max(i - 1, 0)], cand[min(i + 1, m - 1)]
        options = change[(change > max(lo_c, left)) & (change < min(hi_c, right))]
        best_r, best_c = rows[t], cost(left, rows[t]) + cost(rows[t], right)
        for r in options.tolist():
            c = cost(left, r) + cost(r, right)
            if c < best_c:
                best_r, best_c = r, c
        rows[t] = best_r
    # Breakpoint halfway between the last key of one segment and the first of the next.
    return [float((keys[r - 1] + keys[r]) / 2) for r in rows]
