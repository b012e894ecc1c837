"""Argument checks shared by the policies and the core's configuration: one line each, one ValueError wording."""
from __future__ import annotations

import math
from typing import Any


def check_int(name: str, v: Any, lo: int, noun: str = "an integer", optional: bool = False) -> None:
    """ValueError "`name` must be [None or ]`noun` >= `lo`" unless `v` is an int (not a bool) >= lo (or None)."""
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}{noun} >= {lo}, got {v!r}")


def check_finite(name: str, v: Any, lo: float | None = None) -> None:
    """ValueError "`name` must be a finite number[ >= `lo`]" unless `v` is a finite real (not a bool) >= lo."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (lo is not None and v < lo):
        raise ValueError(f"{name} must be a finite number{'' if lo is None else f' >= {lo:g}'}, got {v!r}")
