"""Which queued prefill task a worker takes next: FCFS, AMPD reordering (Alg. 2), Continuum priority."""
from __future__ import annotations

from functools import lru_cache
from itertools import permutations
from typing import Protocol

from tandem.policy.task import PrefillTask


@lru_cache(maxsize=None)
def _orders(window: int) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Every order of n = 1..window tasks, identity first; one shared copy per window (a cluster builds a picker per
    worker)."""
    return {n: tuple(permutations(range(n))) for n in range(1, window + 1)}


class Picker(Protocol):
    def pick(self, queue: list[PrefillTask], now: float) -> int:
        """Index of the task in `queue` to dequeue next (may reorder `queue` in place)."""
        ...


class FCFS:
    """First come, first served."""

    def pick(self, queue: list[PrefillTask], now: float) -> int:
        return 0


class TTFTAwareReorder:
    """AMPD Alg. 2: order the head window to maximise tasks meeting TTFT, postponing each at most `cap` times."""

    def __init__(self, window: int = 3, cap: int | None = None) -> None:
        if window < 1:
            raise ValueError("reorder window must be at least 1")
        self.window = window
        self.cap = window if cap is None else cap
        self._perms = _orders(window)

    def satisfied(self, tasks: list[PrefillTask], order: tuple[int, ...], now: float) -> int:
        """Eq. 3-4: how many tasks of `tasks` meet their TTFT SLO when run in `order` from `now`."""
        done, s = 0.0, 0
        for j in order:
            t = tasks[j]
            done += t.est_s
            if (now - t.enqueue_s) + done <= t.ttft_slo_s:
                s += 1
        return s

    def pick(self, queue: list[PrefillTask], now: float) -> int:
        n = min(self.window, len(queue))
        if n <= 1:
            return 0
        win = queue[:n]
        best, best_s = None, -1
        for order in self._perms[n]:                        # identity first: ties keep FCFS
            if any(order.index(j) > j and win[j].postponed >= self.cap for j in range(n)):
                continue                                    # lines 3-4: postponement capacity
            s = self.satisfied(win, order, now)
            if best is None or s > best_s:
                best, best_s = order, s
        for pos, j in enumerate(best):                      # line 7
            if pos > j:
                win[j].postponed += 1
        queue[:n] = [win[j] for j in best]                  # line 8
        return 0


class SessionFirst:
    """Continuum-like: tasks of sessions whose KV is retained (continuations) go before new sessions."""

    def pick(self, queue: list[PrefillTask], now: float) -> int:
        for i, t in enumerate(queue):
            if t.l_hist > 0:
                return i
        return 0
