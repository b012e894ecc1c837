"""The windowed mean's flat-array storage gives bit-for-bit the running sums of a deque of (time, total, count) that
expires on read: routing reads these means, so a changed last bit could move a decision."""
from __future__ import annotations

import random
from collections import deque

import pytest

from tandem.core import stats
from tandem.core.stats import WindowedMean


class DequeMean:
    """Reference: entries in a deque, expired in order when the window is read."""

    def __init__(self, window_s: float) -> None:
        self.window_s, self.q, self.sum, self.count = window_s, deque(), 0.0, 0

    def add(self, now: float, total: float, count: int = 1) -> None:
        if count > 0:
            self.q.append((now, total, count))
            self.sum += total
            self.count += count

    def read(self, now: float) -> tuple[float, int]:
        while self.q and self.q[0][0] < now - self.window_s:
            _, total, count = self.q.popleft()
            self.sum -= total
            self.count -= count
        if not self.q:
            self.sum, self.count = 0.0, 0
        return self.sum, self.count


@pytest.mark.parametrize("seed,compact", [(0, 4), (1, 4), (2, 4096)])
def test_windowed_mean_matches_deque_bit_for_bit(seed: int, compact: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random samples at increasing times, reads now and then (some after long silences): every read agrees exactly."""
    monkeypatch.setattr(stats, "CHUNK_ENTRIES", compact)
    rng = random.Random(seed)
    w, ref = WindowedMean(2.5), DequeMean(2.5)
    now = 0.0
    for _ in range(5000):
        now += rng.expovariate(20.0)
        total, count = rng.random() * 0.1, rng.choice([0, 1, 1, 3])
        w.add(now, total, count)
        ref.add(now, total, count)
        if rng.random() < (0.3 if now % 40 < 5 else 0.002):     # bursts of reads, then long silences
            s, c = ref.read(now)
            assert (w.total(now), w.count(now)) == (s, c)
            assert w.mean(now) == (s / c if c else 0.0)
