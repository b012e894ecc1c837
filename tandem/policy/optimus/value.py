"""What a window's positions cost to finish after the step: the block's cost to go, learnt online (LSTD).

A step's commits are not all it does. A streaming window covers its first masked positions; those it does not commit
stay masked and have been *tried*: they were below the threshold once, and they commit less later than positions no
window has covered (the trained tiny SDAR model, greedy, threshold 0.9, a closed loop of 32: a rest-of-block window
of 20 untried positions commits 18.7, of 20 tried ones 1.0). So a large window that commits most of a block leaves
its hard positions tried, and the steps that finish them cost more than the step saved: Optimus's c* =
argmax N_commit(c)·b / T(c, b) counts the commits of this step only, and on that model ran 0.78x chunk 8 at 32
sequences.

V(s) = a·untried + b·tried, the seconds of its share of steps a sequence takes to finish its active block from a
state with `untried` and `tried` masked positions, is fitted by least-squares temporal differences (LSTD, Bradtke &
Barto 1996) on the transitions the steps make: a window of m masked positions, `tried` of them tried before,
committing k of them, goes from (left - tried, tried) to (left - max(tried, m), max(tried, m) - k), at the cost of
its share of the step (its end: the block done, V = 0). What a step does for a sequence is then V(s) - V(s') =
b·k - (b - a)·u, u = max(0, m - tried) the untried positions its window covers: each commit saves a tried position's
cost, each untried position covered costs the difference. The sizer ranks windows by k - λ·u per second, λ = 1 - a/b
(`penalty`): 0 where tried positions cost what untried ones do (the simulator's draws do not depend on what was
tried), and Optimus's rule is the case λ = 0. Sans-I/O: transitions come in as numbers.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable

VALUE_HALFLIFE = 2048        # transitions after which one weighs half as much
MIN_TRANSITIONS = 64         # transitions seen before the fit is used (until then λ = 0: Optimus's rule)
MAX_PENALTY = 0.9            # |λ| at most this (a fit with tried positions free, or untried ones free, is noise)


class BlockValue:
    """LSTD fit of a block's cost to go, a·untried + b·tried seconds, and the penalty λ = 1 - a/b it implies."""

    __slots__ = ("_decay", "_a11", "_a12", "_a21", "_a22", "_b1", "_b2", "transitions", "_fit")

    def __init__(self, halflife: float = VALUE_HALFLIFE) -> None:
        if not (isinstance(halflife, (int, float)) and not isinstance(halflife, bool) and halflife > 0):
            raise ValueError(f"halflife must be > 0, got {halflife!r}")
        self._decay = math.exp(-math.log(2) / halflife)
        self._a11 = self._a12 = self._a21 = self._a22 = self._b1 = self._b2 = 0.0
        self.transitions = 0
        self._fit: tuple[float, float] | None = None

    def observe(self, m: int, left: int, tried: int, committed: Iterable[int], cost_s: float) -> None:
        """Windows of m masked positions, in blocks with `left` masked of which the first `tried` were tried,
        committed these counts (one per sequence), each at a cost of `cost_s` seconds (a sequence's share of the
        step)."""
        try:
            got = [operator.index(k) for k in committed]
        except TypeError:
            got = [-1]                               # not an integer: refused below
        if not (1 <= m <= left and 0 <= tried <= left and (not got or (min(got) >= 0 and max(got) <= m))) \
                or not (math.isfinite(cost_s) and cost_s >= 0):
            raise ValueError(f"no window of {m} of {left} masked ({tried} tried) commits {got} in {cost_s!r} s")
        n = len(got)
        if not n:
            return
        x1, x2 = float(left - tried), float(tried)
        reach = max(tried, m)
        # the windows' drops in untried and tried positions, summed: each goes to (left - reach, reach - k), which is
        # (0, 0) when it ends the block (k = left forces reach = left)
        d1 = float(n * (reach - tried))
        d2 = float(n * (tried - reach) + sum(got))
        d = self._decay ** n
        self._a11 = self._a11 * d + x1 * d1
        self._a12 = self._a12 * d + x1 * d2
        self._a21 = self._a21 * d + x2 * d1
        self._a22 = self._a22 * d + x2 * d2
        self._b1 = self._b1 * d + n * x1 * cost_s
        self._b2 = self._b2 * d + n * x2 * cost_s
        self.transitions += n
        self._fit = None

    @property
    def coefs(self) -> tuple[float, float] | None:
        """(a, b): seconds to finish an untried and a tried masked position; None until the fit is determined."""
        if self._fit is None and self.transitions >= MIN_TRANSITIONS:
            det = self._a11 * self._a22 - self._a12 * self._a21
            scale = abs(self._a11 * self._a22) + abs(self._a12 * self._a21)
            if scale > 0 and abs(det) > 1e-9 * scale:
                a = (self._b1 * self._a22 - self._a12 * self._b2) / det
                b = (self._a11 * self._b2 - self._a21 * self._b1) / det
                if a > 0 and b > 0:
                    self._fit = (a, b)
        return self._fit

    def penalty(self) -> float:
        """λ = 1 - a/b within ±MAX_PENALTY: what covering an untried position and not committing it costs, in
        commits (0 until the fit is determined)."""
        ab = self.coefs
        if ab is None:
            return 0.0
        return min(MAX_PENALTY, max(-MAX_PENALTY, 1.0 - ab[0] / ab[1]))


__all__ = ["BlockValue", "MAX_PENALTY", "MIN_TRANSITIONS", "VALUE_HALFLIFE"]
