"""Optimus §5.3: N_commit(c), the tokens a step of chunk size c commits per sequence, estimated online.

Token utilisation (committed tokens / c) falls as c grows: a larger window commits more positions per step but with
diminishing returns. Optimus observes the commits of steps at the largest window (the block) early in decoding and
builds from them an empirical mapping from window size to commits, updated as decoding goes on. Here:

- the commits k observed at the block size are kept as a decayed histogram, and a window of c is expected to commit
  what those steps committed within their first c positions, N(c) = E[min(k, c)] (positions past the window cannot
  commit; those inside it commit as they would have);
- a size observed often enough (min_observations sequences) is estimated by its own exponentially weighted mean;
- before anything was seen at the block size, a size not observed yet scales the other sizes' evidence by a prior
  curve r(c) = (c/B)^gamma; before any observation, N(c) = 1 (a diffusion step commits at least one token).

Sans-I/O: observations come in as numbers.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

DEFAULT_GAMMA = 0.5         # prior r(c) = (c/B)^gamma, used only before any step at the block size was observed
DEFAULT_HALFLIFE = 64       # steps after which an observation weighs half as much
MIN_OBSERVATIONS = 8        # sequences observed at a size before its own mean replaces the estimate


class CommitEstimator:
    """Online N_commit(c) for chunk sizes up to the block size `block`."""

    def __init__(self, block: int, gamma: float = DEFAULT_GAMMA, ratio: Callable[[int], float] | None = None,
                 halflife: float = DEFAULT_HALFLIFE, min_observations: int = MIN_OBSERVATIONS) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an integer >= 1, got {block!r}")
        if not (isinstance(gamma, (int, float)) and 0 < gamma <= 1):
            raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
        if not (isinstance(halflife, (int, float)) and halflife > 0):
            raise ValueError(f"halflife must be > 0, got {halflife!r}")
        self.block = block
        self._ratio = ratio or (lambda c: (c / block) ** gamma)
        self._decay = math.exp(-math.log(2) / halflife)
        self.min_observations = min_observations
        self._sum: dict[int, float] = {}       # decayed Σ commits per size
        self._weight: dict[int, float] = {}    # decayed Σ sequences per size
        self._count: dict[int, int] = {}       # sequences observed per size (undecayed)
        self._at_block: dict[int, float] = {}  # decayed histogram of the commits observed at the block size

    def observe(self, c: int, committed: Iterable[int]) -> None:
        """A step at chunk size c committed these counts (one per sequence)."""
        got = [int(k) for k in committed]
        if not got:
            return
        if c < 1 or any(k < 0 or k > c for k in got):
            raise ValueError(f"a step of chunk {c} cannot commit {got}")
        d = self._decay
        self._sum[c] = self._sum.get(c, 0.0) * d + sum(got)
        self._weight[c] = self._weight.get(c, 0.0) * d + len(got)
        self._count[c] = self._count.get(c, 0) + len(got)
        if c == self.block:
            hist = self._at_block
            for k in hist:
                hist[k] *= d
            for k in got:
                hist[k] = hist.get(k, 0.0) + 1.0

    def observed(self, c: int) -> int:
        """Sequences observed at chunk size c so far."""
        return self._count.get(c, 0)

    def block_estimate(self) -> float | None:
        """N(B) inferred from every observed size through the prior curve (None before any observation)."""
        num = den = 0.0
        for c, w in self._weight.items():
            if w > 0:
                num += self._sum[c] / self._ratio(c)
                den += w
        return num / den if den > 0 else None

    def __call__(self, c: int) -> float:
        """Estimated commits per sequence of a step at chunk size c, within [1, c] (1 before any observation)."""
        if c < 1:
            raise ValueError(f"chunk size must be >= 1, got {c}")
        if self._count.get(c, 0) >= self.min_observations:
            n = self._sum[c] / self._weight[c]
        elif self._at_block:
            total = sum(self._at_block.values())
            n = sum(w * min(k, c) for k, w in self._at_block.items()) / total
        else:
            nb = self.block_estimate()
            n = 1.0 if nb is None else nb * self._ratio(c)
        return min(float(c), max(1.0, n))


__all__ = ["CommitEstimator", "DEFAULT_GAMMA"]
