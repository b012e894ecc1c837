"""Non-negative least squares that always answers: scipy's NNLS, with BVLS when NNLS gives up.

scipy's `nnls` raises "Maximum number of iterations reached" on some ill-conditioned systems (measured
step times are noisy and nearly collinear), and some releases report a residual that does not match the
point they return. Every fit in tandem goes through `nonneg_lstsq`, which retries with a larger iteration
limit, falls back to `lsq_linear`'s bounded-variable solver, and computes the residual from the answer.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

KERNEL_SCIPY = ((1, 17), (1, 18))
"""scipy releases [from, to) whose `scipy.optimize.nnls` is a thin check around the compiled `_slsqplib.nnls(A, b,
maxiter) -> (x, rnorm, info)` (info 3: iteration limit), which `nnls` then calls directly (tests/test_perf_fit.py
checks both give the same bits); other releases go through scipy.optimize."""
KERNEL_MODULE = "scipy.optimize._slsqplib"


@lru_cache(maxsize=1)
def nnls_kernel():
    """scipy's compiled NNLS routine, loaded from its file without importing the scipy.optimize package (~0.3 s:
    scipy.linalg, scipy.sparse, ... which a fit never uses); None outside KERNEL_SCIPY or when it cannot be loaded.
    The module is registered under its own name, so a later `import scipy.optimize` uses this very module."""
    try:
        import scipy
        version = tuple(int(v) for v in scipy.__version__.split(".")[:2])
        if not KERNEL_SCIPY[0] <= version < KERNEL_SCIPY[1]:
            return None
        mod = sys.modules.get(KERNEL_MODULE)
        if mod is None:
            folder = Path(scipy.__file__).parent / "optimize"
            path = next((folder / f"_slsqplib{s}" for s in importlib.machinery.EXTENSION_SUFFIXES
                         if (folder / f"_slsqplib{s}").exists()), None)
            if path is None:
                return None
            spec = importlib.util.spec_from_file_location(KERNEL_MODULE, path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sys.modules[KERNEL_MODULE] = mod
        return mod.nnls
    except (ImportError, OSError, AttributeError, ValueError):
        return None


def nnls(a: np.ndarray, b: np.ndarray, maxiter: int | None = None):
    """scipy.optimize.nnls(a, b, maxiter=maxiter): its compiled kernel called as scipy.optimize.nnls calls it (same
    inputs, same answer) when `nnls_kernel` has it, else scipy.optimize.nnls imported on first use."""
    kernel = nnls_kernel()
    if kernel is None:
        from scipy.optimize import nnls as solve
        return solve(a, b, maxiter=maxiter)
    a = np.asarray_chkfinite(a, dtype=np.float64, order="C")
    b = np.asarray_chkfinite(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls needs a of shape (m, n) and b of shape (m,), got {a.shape} and {b.shape}")
    x, rnorm, info = kernel(a, b, maxiter or 3 * a.shape[1])
    if info == 3:
        raise RuntimeError("Maximum number of iterations reached.")
    return x, rnorm


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
