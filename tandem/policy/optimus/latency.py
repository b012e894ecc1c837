"""Optimus §5.2: a diffusion step's latency as a piecewise-affine function of its query tokens b·c.

The fully connected layers dominate a decode step and their work is the b·c query tokens of the step (b sequences,
c positions each); as b·c grows they go from memory-bound (flat: the weights are read once whatever the rows) through
a transition to compute-bound (linear). T(c, b) ≈ β1_k·b·c + β0_k in regime k of three, with the two regime
boundaries and the six coefficients fitted to (b·c, seconds) samples: the real engine's (`tandem profile`) or a
roofline's. The fit is least squares on relative error, every pair of boundaries between samples tried; an affine
piece of a later regime may have a negative intercept (a steeper line that starts later), so, unlike tandem.perf.fit,
the coefficients are not constrained; predictions are floored at the smallest sample.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

REGIMES = 3


@dataclass(frozen=True, slots=True)
class ChunkLatency:
    """T(c, b): seconds of a step of b sequences with c query tokens each (affine regimes in b·c)."""

    breakpoints: tuple[float, ...]              # b·c where the next regime starts
    coefs: tuple[tuple[float, float], ...]      # per regime (β0, β1)
    floor_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.coefs) != len(self.breakpoints) + 1 or list(self.breakpoints) != sorted(self.breakpoints):
            raise ValueError("a chunk latency model has one more regime than sorted breakpoints")

    def __call__(self, c: int, b: int) -> float:
        """Seconds of a step of b windows of c positions."""
        x = float(c * b)
        b0, b1 = self.coefs[bisect_right(self.breakpoints, x)]
        t = b0 + b1 * x
        return t if t > self.floor_s else self.floor_s

    def rows(self, rows: int, seqs: int = 1, ctx: int = 0) -> float:
        """The sizer's StepLatency: seconds of a step of `rows` query rows in all (sequences and cached tokens are
        not part of this model)."""
        return self(rows, 1)

    @classmethod
    def fit(cls, tokens: Iterable[float], seconds: Iterable[float], regimes: int = REGIMES) -> ChunkLatency:
        """Fit to (b·c, seconds) samples; ValueError on fewer than two distinct b·c or a non-finite sample."""
        x = np.asarray(list(tokens), dtype=float)
        y = np.asarray(list(seconds), dtype=float)
        if len(x) != len(y) or len(np.unique(x)) < 2:
            raise ValueError("a chunk latency fit needs samples at two or more distinct b*c")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0) and np.all(y > 0)):
            raise ValueError("chunk latency samples must be finite and positive")
        order = np.argsort(x, kind="stable")
        x, y = x[order], y[order]
        n = len(x)
        k = max(1, min(regimes, n // 2))
        cuts = [i for i in range(2, n - 1) if x[i] > x[i - 1]]   # a regime starts at sample i (>= 2 samples each)
        best = None
        for split in combinations(cuts, k - 1):
            bounds = [0, *split, n]
            if any(bounds[j + 1] - bounds[j] < 2 for j in range(k)):
                continue
            coefs, err = [], 0.0
            for j in range(k):
                c, e = _affine(x[bounds[j]:bounds[j + 1]], y[bounds[j]:bounds[j + 1]])
                coefs.append(c)
                err += e
            if best is None or err < best[0]:
                best = (err, tuple(float(x[i]) for i in split), tuple(coefs))
        if best is None:
            c, _ = _affine(x, y)
            return cls((), (c,), float(y.min()))
        return cls(best[1], best[2], float(y.min()))

    @classmethod
    def sample(cls, step_s: Callable[[int], float], max_tokens: int = 8192, regimes: int = REGIMES) -> ChunkLatency:
        """Fit to a step-time function of the query tokens (a roofline's), sampled at powers of two and between."""
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        xs = sorted({int(v) for k in range(int(math.log2(max_tokens)) + 1) for v in (2 ** k, 1.5 * 2 ** k)
                     if v <= max_tokens})
        return cls.fit(xs, [step_s(x) for x in xs], regimes)


def _affine(x: Sequence[float], y: Sequence[float]) -> tuple[tuple[float, float], float]:
    """(β0, β1) of y ≈ β0 + β1 x minimising the squared relative error, and that error."""
    w = 1.0 / np.asarray(y)
    A = np.column_stack([np.ones(len(x)), np.asarray(x)]) * w[:, None]
    sol, *_ = np.linalg.lstsq(A, np.asarray(y) * w, rcond=None)
    resid = A @ sol - np.asarray(y) * w
    return (float(sol[0]), float(sol[1])), float(resid @ resid)


__all__ = ["ChunkLatency", "REGIMES"]
