"""The coordinator's deadlines (KV transfer timeouts, idle-session expiries) and the one Timer it keeps asked of its
shell: the earliest deadline not yet known to be stale."""
from __future__ import annotations

import heapq
import math
from typing import Callable

from tandem.core.actions import Timer


class Deadlines:
    """A heap of (at, kind, key) deadlines; `stale(kind, key)` says which no longer matter (checked when they fall
    due and before re-arming, so a stale deadline asks for no tick)."""

    def __init__(self, stale: Callable[[int, object], bool]) -> None:
        self.stale = stale
        self.heap: list[tuple[float, int, int, object]] = []
        self.n = 0
        self.armed = math.inf                            # the earliest Timer asked of the shell

    def arm(self, at: float, kind: int, key, out: list) -> None:
        """Add a deadline; a Timer goes to `out` when it is earlier than the one asked for."""
        if at == math.inf:
            return
        self.n += 1
        heapq.heappush(self.heap, (at, self.n, kind, key))
        if at < self.armed:
            self.armed = at
            out.append(Timer(at))

    def due(self, now: float) -> list[tuple[int, object]]:
        """The (kind, key) of every live deadline due by `now`, in order (stale ones dropped)."""
        dl, out = self.heap, []
        if self.armed <= now:
            self.armed = math.inf
        while dl and dl[0][0] <= now:
            _, _, kind, key = heapq.heappop(dl)
            if not self.stale(kind, key):
                out.append((kind, key))
        return out

    def rearm(self, out: list) -> None:
        """After the due ones are handled: drop stale heads and ask for the next live deadline's Timer."""
        dl = self.heap
        while dl and self.stale(dl[0][2], dl[0][3]):
            heapq.heappop(dl)
        if dl and dl[0][0] < self.armed:
            self.armed = dl[0][0]
            out.append(Timer(self.armed))
