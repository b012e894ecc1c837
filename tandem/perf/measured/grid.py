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
        """Latency at the given points (one array per axis, broadcast together)."""
        pts = np.broadcast_arrays(*[np.asarray(p, dtype=float) for p in points])
        out_shape = pts[0].shape
        pts = [p.ravel() for p in pts]
        scale = np.zeros(len(pts[0]))
        lo_idx, weights = [], []
        for a, p, e in zip(self.axes, pts, self.exponents):
            lp, la = np.log(np.maximum(p, 1e-300)), np.log(a)
            clamped = np.clip(lp, la[0], la[-1])
            scale += e * np.maximum(lp - la[-1], 0.0)   # constant utilisation past the last measured value
            if len(a) == 1:
                lo_idx.append(np.zeros(len(p), dtype=int))
                weights.append(np.zeros(len(p)))
                continue
            i = np.clip(np.searchsorted(la, clamped, side="right") - 1, 0, len(a) - 2)
            lo_idx.append(i)
            weights.append((clamped - la[i]) / (la[i + 1] - la[i]))
        acc = np.zeros(len(pts[0]))
        d = len(self.axes)
        for corner in range(1 << d):
            w = np.ones(len(pts[0]))
            idx = []
            for j in range(d):
                up = (corner >> j) & 1
                if len(self.axes[j]) == 1:
                    if up:
                        w = w * 0.0
                    idx.append(lo_idx[j])
                    continue
                idx.append(lo_idx[j] + up)
                w = w * (weights[j] if up else 1.0 - weights[j])
            acc += w * self.log_values[tuple(idx)]
        return np.exp(acc + scale).reshape(out_shape)

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


def _fill_holes(grid: np.ndarray, axes: tuple[np.ndarray, ...], exponents: tuple[float, ...]) -> np.ndarray:
    """Fill NaN cells from the nearest measured cell along one axis, scaled at constant utilisation
    (log latency + exponent x log axis ratio); repeated over the axes until no hole is left."""
    g = grid.copy()
    if np.isnan(g).all():
        raise ValueError("a measured table without a single positive latency")
    for _ in range(sum(len(a) for a in axes)):
        holes = np.isnan(g)
        if not holes.any():
            return g
        for ax, (a, e) in enumerate(zip(axes, exponents)):
            la = np.log(a)
            v = np.moveaxis(g, ax, 0)
            for i in range(len(a)):
                row = v[i:i + 1]                      # a view, also for one-axis grids
                miss = np.isnan(row)
                if not miss.any():
                    continue
                for j in sorted(range(len(a)), key=lambda j: abs(j - i)):
                    if j == i:
                        continue
                    src = v[j:j + 1]
                    take = miss & ~np.isnan(src)
                    row[take] = src[take] + e * (la[i] - la[j])
                    miss &= ~take
                    if not miss.any():
                        break
    return g
