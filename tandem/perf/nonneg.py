"""Non-negative least squares that always answers: scipy's NNLS, with BVLS when NNLS gives up.

scipy's `nnls` raises "Maximum number of iterations reached" on some ill-conditioned systems (measured
step times are noisy and nearly collinear), and some releases report a residual that does not match the
point they return. Every fit in tandem goes through `nonneg_lstsq`, which retries with a larger iteration
limit, falls back to `lsq_linear`'s bounded-variable solver, and computes the residual from the answer.
"""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, maxiter: int | None = None):
    """scipy.optimize.nnls, imported on first use: importing scipy.optimize costs ~0.4 s of every CLI start-up."""
    from scipy.optimize import nnls as solve
    return solve(a, b, maxiter=maxiter)


def lsq_linear(a: np.ndarray, b: np.ndarray, **kwargs):
    """scipy.optimize.lsq_linear, imported on first use (see `nnls`)."""
    from scipy.optimize import lsq_linear as solve
    return solve(a, b, **kwargs)


# NNLS's own limit is 3 x columns; an active-set method that needs more than this is cycling.
NNLS_ITER_PER_COLUMN = 50


def nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """x >= 0 minimising |a x - b|, and the squared residual |a x - b|^2 of that x."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nonneg_lstsq needs a of shape (m, n) and b of shape (m,), got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("nonneg_lstsq needs finite values")
    if a.shape[0] == 0:
        return np.zeros(a.shape[1]), 0.0
    try:
        x, _ = nnls(a, b, maxiter=NNLS_ITER_PER_COLUMN * max(1, a.shape[1]))
    except RuntimeError:
        x = lsq_linear(a, b, bounds=(0.0, np.inf), method="bvls").x
    x = np.maximum(x, 0.0)
    r = a @ x - b
    return x, float(r @ r)
