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
        """Latency at the given points (one array, or `Points`, per axis, broadcast together). Each axis's
        interpolation indices and weights are computed on that axis's own points (a scalar once, not once per point)
        and broadcast only in the corner sum; every point gets the same arithmetic, in the same order, as evaluating
        it alone."""
        plans = [p.plan(a, e) if isinstance(p, Points) else _axis_plan(a, _contiguous(p), e)
                 for a, p, e in zip(self.axes, points, self.exponents)]
        out_shape = np.broadcast_shapes(*(np.shape(plan[2]) for plan in plans))
        # the sums and products run in place in arrays of the output's shape (fresh temporaries would cost a page
        # fault per page each); values and order are those of the plain expression exp(0 + w v + w v ... + scale)
        acc, term, weight = np.zeros(out_shape), np.empty(out_shape), None
        d = len(plans)
        for corner in range(1 << d):
            ups = [(corner >> j) & 1 for j in range(d)]
            if any(up and plans[j][0] is None for j, up in enumerate(ups)):
                continue                              # weight 0 on a one-value axis: adds an exact zero
            w = None
            for (_, ws, _), up in zip(plans, ups):
                if ws is not None and w is None:
                    w = ws[up]
                elif ws is not None:
                    weight = np.empty(out_shape) if weight is None else weight
                    w = np.multiply(w, ws[up], out=weight)
            v = _gather(self.log_values, [0 if lo is None else lo[up] for (lo, _, _), up in zip(plans, ups)], term)
            if w is not None:
                np.multiply(w, v, out=term)
            elif v is not term:
                term[...] = v
            np.add(acc, term, out=acc)
        np.add(0.0, plans[0][2], out=term)            # scale = 0 + s_0 + s_1 ...
        for _, _, s in plans[1:]:
            np.add(term, s, out=term)
        np.add(acc, term, out=acc)
        return np.exp(acc, out=term)                  # contiguous, apart from its input: exp as for one point

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


MAX_PLANS = 32       # grid axes a `Points` keeps its interpolation on (a few MiB each for the token counts)


class Points:
    """Points on one axis that several grids are read at (a token count per table entry): their interpolation
    indices and weights on an axis are computed once, for the first grid with an axis of those values."""

    __slots__ = ("values", "_plans")

    def __init__(self, values) -> None:
        self.values = _contiguous(values)
        self._plans: dict[tuple[bytes, float], tuple] = {}

    def plan(self, axis: np.ndarray, exponent: float) -> tuple:
        """`_axis_plan` of these points on `axis` (cached by the axis's values)."""
        key = (np.asarray(axis, dtype=float).tobytes(), exponent)
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) >= MAX_PLANS:                # grids rebuilt (caches cleared): start afresh
                self._plans.clear()
            got = self._plans[key] = _axis_plan(axis, self.values, exponent)
        return got


def _contiguous(p) -> np.ndarray:
    """p as a float array in contiguous memory (where log and exp take the same path for every element)."""
    p = np.asarray(p, dtype=float)
    return p if p.flags.c_contiguous else p.copy()


def _axis_plan(a: np.ndarray, p: np.ndarray, e: float) -> tuple:
    """Points p on axis a: (lower and upper cell index, (1 - weight, weight) of the upper cell, log-latency added past
    the axis's end); None for the indices and weights of a one-value axis."""
    lp, la = np.log(np.maximum(p, 1e-300)), np.log(a)
    clamped = np.clip(lp, la[0], la[-1])
    scale = e * np.maximum(lp - la[-1], 0.0)                 # constant utilisation past the last measured value
    if len(a) == 1:
        return None, None, scale
    i = np.clip(np.searchsorted(la, clamped, side="right") - 1, 0, len(a) - 2)
    w = (clamped - la[i]) / (la[i + 1] - la[i])
    return (i, i + 1), (1.0 - w, w), scale


def _gather(values: np.ndarray, idx: list, out: np.ndarray):
    """values at one index per axis, the index arrays broadcast together (an axis indexed by one value is sliced
    first, so the gather runs over the varying axes alone); into `out` where one axis varies over out's shape."""
    basic = tuple(int(i) if np.ndim(i) == 0 else slice(None) for i in idx)
    arrays = tuple(i for i in idx if np.ndim(i) != 0)
    sub = values[basic]
    if len(arrays) == 1 and arrays[0].shape == out.shape:
        return np.take(sub, arrays[0], out=out)
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
