"""Optimus §5.2: a diffusion step's latency as a piecewise-affine function of its query tokens b·c.

The fully connected layers dominate a decode step and their work is the b·c query tokens of the step (b sequences,
c positions each); as b·c grows they go from memory-bound (flat: the weights are read once whatever the rows) through
a transition to compute-bound (linear). T(c, b) ≈ β1_k·b·c + β0_k in regime k of three, with the two regime
boundaries and the six coefficients fitted to (b·c, seconds) samples: the real engine's (`tandem profile`) or a
roofline's. Where the LM head and sampling were timed apart (`head_s`), the regimes price the forward of every query
row and the head is charged per sampled row only: a streaming step's K/V writes and a prompt's leftover tokens run
the forward but are not sampled, and on a small model with a large vocabulary the head is most of a sampled row.
The fit is least squares on relative error, every pair of boundaries between samples tried; an affine piece of a
later regime may have a negative intercept (a steeper line that starts later), so, unlike tandem.perf.fit, the
coefficients are not constrained; predictions are floored at the smallest sample. `StepOverhead` learns online what
a shell's steps take beyond that price.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from tandem.perf.window_profile import WindowLatencyProfile

REGIMES = 3
OVERHEAD_HALFLIFE = 64      # steps after which a measured step's overhead weighs half as much


@dataclass(frozen=True, slots=True)
class ChunkLatency:
    """T(c, b): seconds of a step of b sequences with c query tokens each (affine regimes in b·c, plus a cost per
    sequence when it was fitted on steps that tell the two apart)."""

    breakpoints: tuple[float, ...]              # b·c where the next regime starts
    coefs: tuple[tuple[float, float], ...]      # per regime (β0, β1)
    floor_s: float = 0.0
    per_seq_s: float = 0.0                      # seconds per sequence in the step, whatever its window
    head_s: float = 0.0                         # seconds per sampled row (LM head, sampling) outside the regimes;
                                                # 0: the regimes include it for every row

    def __post_init__(self) -> None:
        if len(self.coefs) != len(self.breakpoints) + 1 or list(self.breakpoints) != sorted(self.breakpoints):
            raise ValueError("a chunk latency model has one more regime than sorted breakpoints")
        for name in ("per_seq_s", "head_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"a chunk latency's {name} must be finite and >= 0, got {v!r}")

    def __call__(self, c: int, b: int) -> float:
        """Seconds of a step of b windows of c positions, every one sampled."""
        return self.rows(c * b, b)

    def rows(self, rows: int, seqs: int = 1, ctx: int = 0, sampled: int | None = None, prefill: int = 0) -> float:
        """The sizer's StepLatency: seconds of a step of `rows` window rows in all over `seqs` sequences, `sampled` of
        them through the LM head (all when not given), beside `prefill` prompt rows (the forward only); the cached
        tokens are not part of this model."""
        x = float(rows + prefill)
        b0, b1 = self.coefs[bisect_right(self.breakpoints, x)]
        t = b0 + b1 * x + self.per_seq_s * seqs
        if t < self.floor_s:
            t = self.floor_s
        return t + self.head_s * (rows if sampled is None else sampled)

    @classmethod
    def from_profile(cls, w: WindowLatencyProfile) -> ChunkLatency:
        """The fit a profile's `dllm_latency` section stores (`tandem profile` on a block-diffusion checkpoint)."""
        return cls(tuple(w.breakpoints), tuple(w.coefs), w.floor_s, w.per_seq_s, w.head_s)

    @classmethod
    def fit(cls, tokens: Iterable[float], seconds: Iterable[float], regimes: int = REGIMES,
            seqs: Iterable[float] | None = None) -> ChunkLatency:
        """Fit to (b·c, seconds) samples; with `seqs` (each sample's b), also a cost per sequence shared by the
        regimes (none when the best fit would make it negative). ValueError on fewer than two distinct b·c or a
        non-finite sample."""
        x = np.asarray(list(tokens), dtype=float)
        y = np.asarray(list(seconds), dtype=float)
        b = np.asarray(list(seqs), dtype=float) if seqs is not None else None
        if len(x) != len(y) or len(np.unique(x)) < 2 or (b is not None and len(b) != len(x)):
            raise ValueError("a chunk latency fit needs samples at two or more distinct b*c")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0) and np.all(y > 0)):
            raise ValueError("chunk latency samples must be finite and positive")
        if b is not None and not (np.all(np.isfinite(b)) and np.all(b >= 1)):
            raise ValueError("chunk latency samples' sequence counts must be finite and >= 1")
        order = np.argsort(x, kind="stable")
        x, y = x[order], y[order]
        if b is not None:
            b = b[order]
        n = len(x)
        k = max(1, min(regimes, n // 2))
        cuts = [i for i in range(2, n - 1) if x[i] > x[i - 1]]   # a regime starts at sample i (>= 2 samples each)
        best = None
        for split in combinations(cuts, k - 1):
            bounds = [0, *split, n]
            if any(bounds[j + 1] - bounds[j] < 2 for j in range(k)):
                continue
            coefs, alpha, err = _pieces(x, y, b, bounds)
            if best is None or err < best[0]:
                best = (err, tuple(float(x[i]) for i in split), coefs, alpha)
        if best is None:
            coefs, alpha, _ = _pieces(x, y, b, [0, n])
            return cls((), coefs, float(y.min()), alpha)
        return cls(best[1], best[2], float(y.min()), best[3])

    @classmethod
    def sample(cls, step_s: Callable[[int], float], max_tokens: int = 8192, regimes: int = REGIMES) -> ChunkLatency:
        """Fit to a step-time function of the query tokens (a roofline's), sampled at powers of two and between."""
        xs = sample_sizes(max_tokens)
        return cls.fit(xs, [step_s(x) for x in xs], regimes)


class StepOverhead:
    """What a shell's steps take beyond T: the measured step time less T's price of it, fitted online as a + b·seqs
    (a per step, b >= 0 per sequence: building the windows, sampling each sequence's rows and committing them, which
    a timing of the forward and the LM head alone does not see), by least squares with each step weighing half as
    much after `halflife` more (b = 0 until steps of different sizes were seen). Sans-I/O: the sizer is told each
    step's seconds."""

    __slots__ = ("_decay", "_w", "_sx", "_sxx", "_sy", "_sxy", "_fit")

    def __init__(self, halflife: float = OVERHEAD_HALFLIFE) -> None:
        if not (isinstance(halflife, (int, float)) and not isinstance(halflife, bool) and halflife > 0):
            raise ValueError(f"halflife must be > 0, got {halflife!r}")
        self._decay = math.exp(-math.log(2) / halflife)
        self._w = self._sx = self._sxx = self._sy = self._sxy = 0.0
        self._fit: tuple[float, float] | None = (0.0, 0.0)   # (a, b), until the next step

    def add(self, seqs: int, residual_s: float) -> None:
        """One step of `seqs` sequences took `residual_s` seconds more than T priced it (less when negative)."""
        if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1 or not math.isfinite(residual_s):
            raise ValueError(f"a step overhead needs seqs >= 1 and a finite residual, got {seqs!r}, {residual_s!r}")
        d, x, y = self._decay, float(seqs), float(residual_s)
        self._w = self._w * d + 1.0
        self._sx = self._sx * d + x
        self._sxx = self._sxx * d + x * x
        self._sy = self._sy * d + y
        self._sxy = self._sxy * d + x * y
        self._fit = None

    @property
    def coefs(self) -> tuple[float, float]:
        """(a, b): seconds per step and per sequence."""
        if self._fit is None:
            w = self._w
            mx, my = self._sx / w, self._sy / w
            var = self._sxx / w - mx * mx
            b = max(0.0, (self._sxy / w - mx * my) / var) if var > 1e-9 * (1.0 + mx * mx) else 0.0
            self._fit = (my - b * mx, b)
        return self._fit

    def __call__(self, seqs: int) -> float:
        """Seconds a step of `seqs` sequences takes beyond T."""
        a, b = self.coefs
        return a + b * seqs


def sample_sizes(max_tokens: int) -> list[int]:
    """The b·c a step-time function is sampled at: powers of two and halfway between, up to max_tokens."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    return sorted({int(v) for k in range(int(math.log2(max_tokens)) + 1) for v in (2 ** k, 1.5 * 2 ** k)
                   if v <= max_tokens})


def _pieces(x: np.ndarray, y: np.ndarray, b: np.ndarray | None, bounds: Sequence[int]
            ) -> tuple[tuple[tuple[float, float], ...], float, float]:
    """Per regime (β0, β1) of y ≈ β0 + β1 x (+ α b, α shared) minimising the squared relative error, α, the error."""
    k = len(bounds) - 1
    cols = np.zeros((len(x), 2 * k + (b is not None)))
    for j in range(k):
        cols[bounds[j]:bounds[j + 1], 2 * j] = 1.0
        cols[bounds[j]:bounds[j + 1], 2 * j + 1] = x[bounds[j]:bounds[j + 1]]
    if b is not None:
        cols[:, -1] = b
    w = 1.0 / y
    A = cols * w[:, None]
    sol, *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if b is not None and not sol[-1] >= 0:           # a sequence never makes a step faster: refit without it
        return _pieces(x, y, None, bounds)
    resid = A @ sol - y * w
    coefs = tuple((float(sol[2 * j]), float(sol[2 * j + 1])) for j in range(k))
    return coefs, float(sol[-1]) if b is not None else 0.0, float(resid @ resid)


__all__ = ["ChunkLatency", "OVERHEAD_HALFLIFE", "REGIMES", "StepOverhead", "sample_sizes"]
