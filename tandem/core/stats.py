"""Windowed latency statistics a worker publishes (AMPD: mean TTFT/ITL over the last 10 s)."""
from __future__ import annotations

from collections import deque


class WindowedMean:
    """Mean of samples observed within the last `window_s` seconds; 0.0 when the window is empty."""

    __slots__ = ("window_s", "_q", "_sum", "_count")

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._q: deque[tuple[float, float, int]] = deque()
        self._sum = 0.0
        self._count = 0

    def add(self, now: float, total: float, count: int = 1) -> None:
        """Record `count` samples summing to `total` at time `now` (one entry per step keeps it O(1))."""
        if count <= 0:
            return
        self._q.append((now, total, count))
        self._sum += total
        self._count += count

    def _expire(self, now: float) -> None:
        q, horizon = self._q, now - self.window_s
        while q and q[0][0] < horizon:
            _, total, count = q.popleft()
            self._sum -= total
            self._count -= count
        if not q:
            self._sum, self._count = 0.0, 0

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
