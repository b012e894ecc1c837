"""Arrival processes: when sessions start (Poisson, as in AMPD's and most serving benchmarks)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tandem.workload.session import Session, WorkloadError


def check_rate(rate: float) -> float:
    """Return `rate` as a float, or raise WorkloadError unless it is a finite number > 0."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise WorkloadError(f"arrival rate must be a number of sessions per second, got {rate!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise WorkloadError(f"arrival rate must be > 0 sessions/s, got {rate!r}")
    return float(rate)


def check_seed(seed: int) -> int:
    """Return `seed` if it is an integer >= 0 (what numpy's default_rng accepts), else raise WorkloadError."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise WorkloadError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    """Arrival times of `n` events of a Poisson process at `rate`/s after `start` (exponential gaps)."""
    rate = check_rate(rate)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise WorkloadError(f"number of arrivals must be an integer >= 0, got {n!r}")
    if not (isinstance(start, (int, float)) and math.isfinite(start) and start >= 0):
        raise WorkloadError(f"arrival start must be a finite time >= 0, got {start!r}")
    return start + np.cumsum(rng.exponential(1.0 / rate, size=int(n)))


def with_arrivals(sessions: Sequence[Session], rate: float, seed: int) -> list[Session]:
    """Copies of `sessions`, in order, re-timed as a Poisson process at `rate` sessions/s."""
    times = poisson_arrivals(len(sessions), rate, np.random.default_rng(check_seed(seed)))
    return [dataclasses.replace(s, arrival_s=float(t), rounds=list(s.rounds)) for s, t in zip(sessions, times)]
