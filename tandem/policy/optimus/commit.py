"""Optimus §5.3: N_commit(c), the tokens a step of chunk size c commits per sequence, estimated online.

Token utilisation (committed tokens / c) falls as c grows: a larger window commits more positions per step but with
diminishing returns. Optimus observes the commits of steps at the largest window early in decoding, builds from them
an empirical mapping from window size to commits, and keeps updating it. Here every step's commits update it, at
whatever window it ran:

- a step is read as finding a stretch of L positions it can commit, of which a window of c commits min(L, c): a
  sequence that committed k < c positions shows L = k; one that committed all c shows only L >= c (censored);
- the distribution of L is the Kaplan-Meier estimate over those observations: hazard h(j) = (stretches ending at j)
  / (stretches whose fate at j is known: ending at j, or known to go past it; a window full at c says nothing about
  position c itself), survival S(j) = P(L >= j) = Π_{i<j} (1 − h(i));
- old observations fade position by position: the evidence about position j is decayed by each new observation
  whose fate at j is known (a half-life of DEFAULT_HALFLIFE of them), not by every observation. So a run of small
  windows, which say nothing about the far positions, leaves what larger windows showed there as it was; with one
  clock for all positions (before) the far positions' evidence shrank to the last few large windows seen, whose
  noise the sizer then followed down to windows of 1, where it stayed (LLaDA2.0-16B in the simulator: N(32)
  estimated 1.1 against 2.5);
- N(c) = E[min(L, c)] = Σ_{j=1..c} S(j). Past the longest window observed, the hazard is the pooled one of the
  observed positions beyond the first (a geometric tail); with nothing observed past the first position, no stretch is
  assumed (N(c) = 1).

So small windows inform the small positions and never erase what larger ones showed; before any observation
N(c) = 1 (a diffusion step commits at least one token), which is why the sizer starts at the block size. Sans-I/O:
observations come in as numbers.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

DEFAULT_HALFLIFE = 256      # sequence-steps after which an observation weighs half as much


class CommitEstimator:
    """Online N_commit(c) for chunk sizes up to the block size `block`."""

    def __init__(self, block: int, halflife: float = DEFAULT_HALFLIFE) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an integer >= 1, got {block!r}")
        if not (isinstance(halflife, (int, float)) and halflife > 0):
            raise ValueError(f"halflife must be > 0, got {halflife!r}")
        self.block = block
        self._decay = math.exp(-math.log(2) / halflife)
        self._ended = [0.0] * (block + 2)      # decayed weight of stretches seen to end at j (k = j < window)
        self._passed = [0.0] * (block + 2)     # decayed weight of stretches seen to go past j (k > j)
        self.observations = 0                  # sequence-steps observed (undecayed)
        self._cache: list[float] | None = None

    def observe(self, c: int, committed: Iterable[int]) -> None:
        """A step at window c committed these counts (one per sequence; the window at most the block)."""
        got = [int(k) for k in committed]
        if not 1 <= c <= self.block or any(k < 0 or k > c for k in got):
            raise ValueError(f"a step of window {c} (block {self.block}) cannot commit {got}")
        got = [k for k in got if k > 0]          # a step that committed nothing says nothing about stretches
        if not got:
            return
        at = Counter(got)                        # this step's commits k: a stretch ended at k (censored if k = c)
        passed = 0                               # stretches of this step going past j: k > j
        for j in range(c, 0, -1):
            ended = at[j] if j < c else 0
            n = ended + passed                   # observations whose fate at j is known
            if n:
                d = self._decay ** n
                self._ended[j] = self._ended[j] * d + ended
                self._passed[j] = self._passed[j] * d + passed
            passed += at[j]
        self.observations += len(got)
        self._cache = None

    def survival(self) -> list[float]:
        """S(j) = P(L >= j) for j = 0..block (S(0) = S(1) = 1)."""
        if self._cache is not None:
            return self._cache
        B = self.block
        at_risk = [e + p for e, p in zip(self._ended, self._passed)]   # weight whose fate at j is known
        ended_beyond = sum(self._ended[2:B + 1])
        exposure_beyond = sum(at_risk[2:B + 1])
        tail = ended_beyond / exposure_beyond if exposure_beyond > 0 else 1.0   # nothing seen past 1: no stretch
        s = [1.0, 1.0]
        for j in range(1, B):
            h = self._ended[j] / at_risk[j] if at_risk[j] > 0 else tail
            s.append(s[-1] * (1.0 - h))
        self._cache = s
        return s

    def __call__(self, c: int) -> float:
        """Estimated commits per sequence of a step at window c, within [1, c] (1 before any observation)."""
        if c < 1:
            raise ValueError(f"chunk size must be >= 1, got {c}")
        s = self.survival()
        n = sum(s[1:min(c, self.block) + 1])
        return min(float(c), max(1.0, n))


__all__ = ["CommitEstimator"]
