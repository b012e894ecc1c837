"""The measured tables' grids give, to the last bit, what a point-by-point reading gives: hole filling by a
cell-by-cell nearest-neighbour search, and multilinear log-log interpolation of every point on its own (scalars
broadcast to full arrays, as the grids were first read). Reading an axis once for many grids (`Points`), a scalar
axis once for all points, and summing in place are speed-ups that must not move a value.
(benchmarks/measured_identity.py checks whole timers against another tree.)"""
from __future__ import annotations

import numpy as np
import pytest

from tandem.perf.measured.grid import LogGrid, Points


def reference_fill(grid: np.ndarray, axes, exponents) -> np.ndarray:
    """Every hole, in index order along each axis in turn, from the nearest cell of its line holding a value."""
    g = grid.copy()
    for _ in range(sum(len(a) for a in axes)):
        if not np.isnan(g).any():
            return g
        for ax, (a, e) in enumerate(zip(axes, exponents)):
            la = np.log(a)
            v = np.moveaxis(g, ax, 0)
            for i in range(len(a)):
                row = v[i:i + 1]
                miss = np.isnan(row)
                for j in sorted(range(len(a)), key=lambda j: abs(j - i)):
                    if j == i or not miss.any():
                        continue
                    src = v[j:j + 1]
                    take = miss & ~np.isnan(src)
                    row[take] = src[take] + e * (la[i] - la[j])
                    miss &= ~take
    return g


def reference_read(grid: LogGrid, *points) -> np.ndarray:
    """Every point read with all axes as full arrays: log, clip, bracket, and the corners summed in order."""
    pts = [p.ravel() for p in np.broadcast_arrays(*[np.asarray(p, dtype=float) for p in points])]
    shape = np.broadcast_shapes(*(np.shape(p) for p in points))
    n = len(pts[0])
    scale, lo, wt = np.zeros(n), [], []
    for a, p, e in zip(grid.axes, pts, grid.exponents):
        lp, la = np.log(np.maximum(p, 1e-300)), np.log(a)
        clamped = np.clip(lp, la[0], la[-1])
        scale += e * np.maximum(lp - la[-1], 0.0)
        if len(a) == 1:
            lo.append(np.zeros(n, dtype=int))
            wt.append(np.zeros(n))
            continue
        i = np.clip(np.searchsorted(la, clamped, side="right") - 1, 0, len(a) - 2)
        lo.append(i)
        wt.append((clamped - la[i]) / (la[i + 1] - la[i]))
    acc = np.zeros(n)
    for corner in range(1 << len(grid.axes)):
        w, idx = np.ones(n), []
        for j, a in enumerate(grid.axes):
            up = (corner >> j) & 1
            if len(a) == 1:
                w = w * 0.0 if up else w
                idx.append(lo[j])
                continue
            idx.append(lo[j] + up)
            w = w * (wt[j] if up else 1.0 - wt[j])
        acc += w * grid.log_values[tuple(idx)]
    return np.exp(acc + scale).reshape(shape)


def same_bits(x, y) -> bool:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return x.shape == y.shape and np.array_equal(x.view(np.uint64), y.view(np.uint64))


def random_grid(rng, holes: float) -> LogGrid | None:
    """A 1- to 3-axis table measured at a random subset of its cells (None when no cell was)."""
    d = int(rng.integers(1, 4))
    axes = [np.unique(np.round(np.exp(rng.uniform(0, 9, int(rng.integers(1, 8)))), 1) + 0.5) for _ in range(d)]
    cells = np.stack([g.ravel() for g in np.meshgrid(*axes, indexing="ij")], axis=1)
    keep = rng.random(len(cells)) >= holes
    if not keep.any():
        return None
    lat = np.exp(rng.normal(0, 2, keep.sum()))
    return LogGrid.from_points([cells[keep, j] for j in range(d)], lat, tuple(rng.choice([1.0, 2.0, 1.5], d)))


def test_holes_are_filled_as_a_cell_by_cell_search_fills_them():
    """Protects the vectorised hole filling: on tables with few to almost all cells missing, every filled value
    (each a chain of neighbours' values plus exponent x log axis ratios) has the bits of the cell-by-cell search."""
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(400):
        grid = random_grid(rng, holes=(0.0, 0.2, 0.6, 0.95)[trial % 4])
        if grid is None:
            continue
        measured = np.where(grid.measured, grid.log_values, np.nan)
        assert same_bits(grid.log_values, reference_fill(measured, grid.axes, grid.exponents)), trial
        checked += 1
    assert checked > 300


def test_a_grid_reads_every_point_as_it_reads_that_point_alone():
    """Protects the per-axis grid reads: scalars, arrays, broadcast rows and columns, points past both ends of the
    axes, one-value axes, and an axis read through `Points` shared by several grids all give the reference bits."""
    rng = np.random.default_rng(11)
    shared = Points(np.maximum(np.arange(2000, dtype=float) * 3.7, 1.0))
    for trial in range(300):
        grid = random_grid(rng, holes=0.3)
        if grid is None:
            continue
        d = len(grid.axes)
        kinds = rng.integers(0, 4, d)
        pts = []
        for j, kind in enumerate(kinds):
            if kind == 0:
                pts.append(float(np.exp(rng.uniform(-2, 11))))
            elif kind == 1:
                pts.append(np.exp(rng.uniform(-2, 11, 40)))
            elif kind == 2:
                pts.append(np.exp(rng.uniform(-2, 11, (5, 1))))
            else:
                pts.append(shared if j == 0 else np.exp(rng.uniform(-2, 11, 40)))
        plain = [p.values if isinstance(p, Points) else p for p in pts]
        try:
            want = reference_read(grid, *plain)
        except ValueError:                      # shapes that do not broadcast: the grid refuses them too
            with pytest.raises(ValueError):
                grid(*pts)
            continue
        got = grid(*pts)
        assert isinstance(got, np.ndarray) and same_bits(got, want), (trial, [np.shape(p) for p in plain])
        assert same_bits(grid(*pts), want)      # a second read (axis plans cached) is the same


def test_a_one_point_read_is_a_zero_dimensional_array():
    """Protects the callers that read one value (`float(g(x))`, `g(x)[()]`): all-scalar points give a 0-d array."""
    m, n = np.meshgrid([1.0, 2.0, 4.0], [8.0, 16.0], indexing="ij")
    g = LogGrid.from_points([m.ravel(), n.ravel()], np.arange(1.0, 7.0), (1.0, 2.0))
    out = g(3.0, 10.0)
    assert out.shape == () and same_bits(out, reference_read(g, 3.0, 10.0))
