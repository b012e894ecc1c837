"""Interpolation of a measured latency table on its own axes: multilinear in log(axis) and log(latency), and
constant utilisation beyond the axes (latency grows as axis^exponent past the last measured value).

Tables are regular grids, possibly with holes (a shape the collector could not run, e.g. out of memory); a hole is
filled from its nearest measured neighbour along the axes at constant utilisation before lookups. Lookups are
vectorised over many points at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogGrid:
    """log-latency on a regular grid of positive axes; `exponents[i]` is how latency scales past axis i's ends."""

    axes: tuple[np.ndarray, ...]       # sorted, strictly increasing, positive
    log_values: np.ndarray             # shape (len(a) for a in axes), no NaN
    exponents: tuple[float, ...]
    measured: np.ndarray | None = None  # which cells were measured (the others filled); None: all

    @classmethod
    def from_points(cls, coords: list[np.ndarray], latency: np.ndarray, exponents: tuple[float, ...],
                    reduce: str = "min") -> "LogGrid":
        """Grid from scattered measurements on grid coordinates (duplicates reduced by `reduce`; a latency that is not a
        finite positive number counts as unmeasured; holes filled)."""
        axes = tuple(np.unique(np.asarray(c, dtype=float)) for c in coords)
        idx = tuple(np.searchsorted(a, np.asarray(c, dtype=float)) for a, c in zip(axes, coords))
        shape = tuple(len(a) for a in axes)
        vals = np.full(shape, np.inf if reduce == "min" else np.nan)
        lat = np.asarray(latency, dtype=float)
        lat = np.where(np.isfinite(lat) & (lat > 0), lat, np.inf if reduce == "min" else np.nan)   # not measured
        if reduce == "min":
            np.minimum.at(vals, idx, lat)
            vals[np.isinf(vals)] = np.nan
        else:
            vals[idx] = lat
        grid = np.log(np.where(vals > 0, vals, np.nan))
        return cls(axes, _fill_holes(grid, axes, exponents), tuple(float(e) for e in exponents), ~np.isnan(grid))

    def __call__(self, *points) -> np.ndarray:
        """Latency at the given points (one array per axis, broadcast together). Each axis's interpolation index and
        weight are computed on that axis's own points (a scalar once, not once per point) and broadcast only in the
        corner sum; every point gets the same arithmetic, in the same order, as evaluating it alone."""
        pts = [np.asarray(p, dtype=float) for p in points]
        pts = [p if p.flags.c_contiguous else p.copy() for p in pts]       # log reads contiguous memory
        out_shape = np.broadcast_shapes(*(p.shape for p in pts))
        scale = 0.0
        lo_idx, weights = [], []
        for a, p, e in zip(self.axes, pts, self.exponents):
            lp, la = np.log(np.maximum(p, 1e-300)), np.log(a)
            clamped = np.clip(lp, la[0], la[-1])
            scale = scale + e * np.maximum(lp - la[-1], 0.0)   # constant utilisation past the last measured value
            if len(a) == 1:
                lo_idx.append(None)
                weights.append(None)
                continue
            i = np.clip(np.searchsorted(la, clamped, side="right") - 1, 0, len(a) - 2)
            lo_idx.append(i)
            w = (clamped - la[i]) / (la[i + 1] - la[i])
            weights.append((1.0 - w, w))
        acc = 0.0
        d = len(self.axes)
        for corner in range(1 << d):
            if any((corner >> j) & 1 and lo_idx[j] is None for j in range(d)):
                continue                              # weight 0 on a one-value axis: adds an exact zero
            w = None
            idx = []
            for j in range(d):
                if lo_idx[j] is None:
                    idx.append(0)
                    continue
                up = (corner >> j) & 1
                idx.append(lo_idx[j] + up)
                f = weights[j][up]
                w = f if w is None else w * f
            v = _gather(self.log_values, idx)
            acc = acc + (v if w is None else w * v)
        x = acc + scale
        if np.shape(x) != out_shape:
            x = np.broadcast_to(x, out_shape)
        return np.exp(np.ravel(x)).reshape(out_shape)      # ravel: exp reads contiguous memory, as for one point

    def leave_one_out(self, axis: int) -> np.ndarray:
        """Relative errors of predicting every interior grid value along `axis` from its two neighbours on that
        axis (the value itself left out), over the cells whose value and both neighbours were measured."""
        measured = self.measured
        a = np.log(self.axes[axis])
        if len(a) < 3:
            return np.array([])
        v = np.moveaxis(self.log_values, axis, 0)
        w = (a[1:-1] - a[:-2]) / (a[2:] - a[:-2])
        shape = (-1,) + (1,) * (v.ndim - 1)
        pred = v[:-2] * (1 - w.reshape(shape)) + v[2:] * w.reshape(shape)
        err = np.abs(np.exp(pred - v[1:-1]) - 1.0)
        if measured is not None:
            m = np.moveaxis(measured, axis, 0)
            ok = m[1:-1] & m[:-2] & m[2:]
            return err[ok]
        return err.ravel()


def _gather(values: np.ndarray, idx: list) -> np.ndarray:
    """values at one index per axis, the index arrays broadcast together (an axis indexed by one value is sliced
    first, so the gather runs over the varying axes alone)."""
    basic = tuple(int(i) if np.ndim(i) == 0 else slice(None) for i in idx)
    arrays = tuple(i for i in idx if np.ndim(i) != 0)
    sub = values[basic]
    return sub[arrays] if arrays else sub


def _fill_holes(grid: np.ndarray, axes: tuple[np.ndarray, ...], exponents: tuple[float, ...]) -> np.ndarray:
    """Fill NaN cells from the nearest measured cell along one axis, scaled at constant utilisation
    (log latency + exponent x log axis ratio); repeated over the axes until no hole is left."""
    g = grid.copy()
    if np.isnan(g).all():
        raise ValueError("a measured table without a single positive latency")
    for _ in range(sum(len(a) for a in axes)):
        if not np.isnan(g).any():
            return g
        for ax, (a, e) in enumerate(zip(axes, exponents)):
            if len(a) > 1:
                v = np.moveaxis(g, ax, 0)
                lines = v.reshape(len(a), -1)             # a copy where the view cannot be flattened
                _fill_lines(lines, np.log(a), e)
                v[...] = lines.reshape(v.shape)
    return g


def _fill_lines(v: np.ndarray, la: np.ndarray, e: float) -> None:
    """One pass of hole filling along the rows of `v` (index along the axis x line), in place and in index order:
    a hole takes the nearest cell of its line that has a value (the lower index on a tie), holes filled earlier in
    the pass included. So a hole past index 0 takes its left neighbour (filled by then, unless its whole line is
    empty) and a hole at index 0 the first value of its line, each at log latency + e x log axis ratio: the very
    sums of a cell-by-cell search."""
    nan = np.isnan(v)
    if not nan.any():
        return
    head = np.flatnonzero(nan[0] & ~nan.all(axis=0))     # lines empty at index 0 with some value
    if len(head):
        first = np.argmax(~nan[:, head], axis=0)         # each one's first value
        v[0, head] = v[first, head] + e * (la[0] - la[first])
    for i in range(1, len(la)):
        miss = nan[i]
        if miss.any():                                   # an empty line stays empty: NaN + x is NaN
            v[i, miss] = v[i - 1, miss] + e * (la[i] - la[i - 1])
