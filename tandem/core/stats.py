"""Windowed latency statistics a worker publishes (AMPD: mean TTFT/ITL over the last 10 s)."""
from __future__ import annotations

from array import array
from collections import deque

CHUNK_ENTRIES = 1024
"""Entries per preallocated chunk of a window's storage."""


class WindowedMean:
    """Mean of samples observed within the last `window_s` seconds; 0.0 when the window is empty.

    Entries (time, total, count: 24 bytes each) are written into preallocated flat chunks and expire only when the
    window is read, in order: a window nobody reads (a worker's busy time under a policy that never asks for
    utilisation) costs 24 bytes a step, not a tuple of boxed floats, and the running sum sees the very same additions
    and subtractions in the same order."""

    __slots__ = ("window_s", "_chunks", "_w", "_r", "_sum", "_count")

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._chunks: deque[array] = deque([_chunk()])   # oldest first; entries are written into the last
        self._w = 0                               # index in the last chunk where the next entry goes
        self._r = 0                               # index in the first chunk of its first entry not expired yet
        self._sum = 0.0
        self._count = 0

    def add(self, now: float, total: float, count: int = 1) -> None:
        """Record `count` samples summing to `total` at time `now` (one entry per step keeps it O(1))."""
        if count <= 0:
            return
        w = self._w
        if w == 3 * CHUNK_ENTRIES:
            self._chunks.append(_chunk())
            w = 0
        d = self._chunks[-1]
        d[w] = now
        d[w + 1] = total
        d[w + 2] = count
        self._w = w + 3
        self._sum += total
        self._count += count

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        chunks, r = self._chunks, self._r
        s, c = self._sum, self._count
        while True:
            d = chunks[0]
            end = self._w if len(chunks) == 1 else len(d)
            while r < end and d[r] < horizon:
                s -= d[r + 1]
                c -= int(d[r + 2])
                r += 3
            if r < end or len(chunks) == 1:
                break
            chunks.popleft()
            r = 0
        self._sum, self._count, self._r = s, c, r
        if len(chunks) == 1 and r == self._w:     # empty: start the chunk over
            self._sum, self._count, self._r, self._w = 0.0, 0, 0, 0

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


def _chunk() -> array:
    """Room for CHUNK_ENTRIES entries, allocated once."""
    return array("d", bytes(24 * CHUNK_ENTRIES))
