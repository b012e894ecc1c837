"""Windowed latency statistics a worker publishes (AMPD: mean TTFT/ITL over the last 10 s)."""
from __future__ import annotations

from array import array

COMPACT_ENTRIES = 4096
"""Expired entries at the front of a window after which (once they are half of it) they are dropped."""


class WindowedMean:
    """Mean of samples observed within the last `window_s` seconds; 0.0 when the window is empty.

    Entries are kept in three flat arrays (time, total, count: 24 bytes each) read from `_head`, and expire only
    when the window is read, in order: a window nobody reads (a worker's busy time under a policy that never asks
    for utilisation) costs 24 bytes a step, not a tuple of boxed floats, and the running sum sees the very same
    additions and subtractions in the same order."""

    __slots__ = ("window_s", "_t", "_v", "_n", "_head", "_sum", "_count")

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._t = array("d")                      # when each entry was recorded
        self._v = array("d")                      # its total
        self._n = array("q")                      # its sample count
        self._head = 0                            # the first entry not expired yet
        self._sum = 0.0
        self._count = 0

    def add(self, now: float, total: float, count: int = 1) -> None:
        """Record `count` samples summing to `total` at time `now` (one entry per step keeps it O(1))."""
        if count <= 0:
            return
        self._t.append(now)
        self._v.append(total)
        self._n.append(count)
        self._sum += total
        self._count += count

    def _expire(self, now: float) -> None:
        t, head, horizon = self._t, self._head, now - self.window_s
        end = len(t)
        if head < end and t[head] < horizon:
            v, n = self._v, self._n
            s, c = self._sum, self._count
            while head < end and t[head] < horizon:
                s -= v[head]
                c -= n[head]
                head += 1
            self._sum, self._count = s, c
        if head == end:
            self._sum, self._count = 0.0, 0
            if head:
                del t[:], self._v[:], self._n[:]
                head = 0
        elif head >= COMPACT_ENTRIES and head * 2 >= end:
            del t[:head], self._v[:head], self._n[:head]
            head = 0
        self._head = head

    def mean(self, now: float) -> float:
        """The windowed mean at `now`."""
        self._expire(now)
        return self._sum / self._count if self._count else 0.0

    def total(self, now: float) -> float:
        """The sum of the samples within the window at `now`."""
        self._expire(now)
        return self._sum

    def count(self, now: float) -> int:
        self._expire(now)
        return self._count
