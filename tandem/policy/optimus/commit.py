"""Optimus §5.3: N_commit(c), the tokens a step of chunk size c commits per sequence, estimated online.

Optimus builds an empirical mapping from window size to commits out of the steps it runs (the largest chunk early
in decoding) and keeps updating it. Here the mapping is kept per kind of window, from the commits of the windows
actually run, and per how much of the block is left, which moves the commits more than the window does (the trained
tiny SDAR model as first committed, before its retraining, greedy, threshold 0.9, 250 held-out prompts: a chunk-16
window commits 1.2 as the first window of a block, 7.9 with 17-24 masked positions left; the last 8 positions of a
block, 1.0 after chunk-32 steps):

- a window covering the *rest* of its block (m masked positions left, which any chunk c >= m leaves as they are) is
  an entry of its own by m; a *full* window of c (its block has more masked after it) by c and by the band of
  masked positions left in its block (DEPTH_BUCKETS bands);
- either by whether none, some or all of its positions were *tried* (`Tried`: covered by an earlier window of the
  block and left masked, below the threshold then). On the tiny model as retrained (a closed loop of 32
  on the CPU engine) a rest window of 20 untried positions commits 18.7 and of 20 tried ones 1.0: pooled, both were
  priced at 10-13, and windows that commit all or one looked like windows that commit half;
- each entry keeps the decayed mean and spread of its own windows' commits (a half-life of DEFAULT_HALFLIFE of them:
  a window run elsewhere fades nothing there, so a run of windows of 1 leaves what larger ones showed as it was);
- an entry is pooled with its group (full windows of its size in every band; rest windows of its band of m; of its
  kind of tried either way) by
  empirical Bayes: its estimate is (its commits + w0 x the group's mean) / (its windows + w0), w0 = σ² / τ², one
  window's variance over the variance of the entries' true means (method of moments). Where the entries differ only
  by noise (the simulator, whose draws do not depend on the depth) w0 is infinite and the group decides; where they
  differ (the tiny model's bands) each entry follows its own windows. Per-entry means alone were led by a few
  unlucky draws in the simulator at one sequence (0.86x chunk 32);
- the group's mean counts OPTIMISM_WEIGHT pseudo-windows of min(m, the best mean seen among windows of its kind of
  tried, or anywhere while none of its kind was seen), so a window size never run looks as good as the best of its
  kind and gets tried once what it may save is worth its cost. Not the best anywhere: with windows sized per
  sequence, a window over tried positions priced at what untried ones commit (18.7 of 20) was run, committed 1-2,
  and was run again at the next size up, for a dozen steps of a batch of 32 (the CPU engine, one wave of requests).

Why not infer small windows from a large one (the positions a block-size step committed among its first c, or the
stretch reading tandem used before: a window of c commits min(L, c) of a stretch L, Kaplan-Meier over all windows):
on the tiny model (as first committed) a window of c commits far more than the first c positions of a
larger window did (c = 4: 2.10 against 1.39 from chunk-32 steps; c = 8: 3.48 against 2.25), because positions past
the window are absent, not masked, and the model is surer without them; read as stretches, windows 2-8 were
undervalued by a third, elastic fell to windows of 1, which show nothing beyond themselves, and stayed there (0.905x
chunk 16 at 64 sequences on the CPU engine).

Before any observation N(c) = 1 (a diffusion step commits at least one token), which is why the sizer starts at the
block size. Sans-I/O: observations come in as numbers.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from enum import IntEnum

from tandem.policy.checks import check_int


DEFAULT_HALFLIFE = 256      # windows of one entry after which an observation there weighs half as much
OPTIMISM_WEIGHT = 4.0       # pseudo-windows of "as good as the best seen" in a group of entries
DEPTH_BUCKETS = 8           # a block's masked positions left, in this many bands, condition full windows' commits


class Tried(IntEnum):
    """How many of a window's positions an earlier window of the block covered (they stayed masked: below the
    threshold then)."""

    NONE = 0
    SOME = 1
    ALL = 2


def tried_kind(m: int, tried: int) -> Tried:
    """Whether none, some or all of a window of m positions were tried (the block's first `tried` masked were)."""
    return Tried.NONE if tried == 0 else Tried.ALL if tried >= m else Tried.SOME


def _check_tried(tried: int, left: int) -> None:
    """A window's tried positions are 0..left of its block's masked ones (ValueError otherwise)."""
    if isinstance(tried, bool) or not isinstance(tried, int) or not 0 <= tried <= left:
        raise ValueError(f"a block with {left} masked positions has 0..{left} of them tried, got {tried!r}")


class _Entry:
    """Decayed weight, sum and sum of squares of the commits of one kind of window."""

    __slots__ = ("w", "s", "ss")

    def __init__(self) -> None:
        self.w = self.s = self.ss = 0.0

    def add(self, got: list[int], d: float) -> None:
        self.w = self.w * d + len(got)
        self.s = self.s * d + sum(got)
        self.ss = self.ss * d + sum(k * k for k in got)

    @property
    def mean(self) -> float:
        return self.s / self.w


class CommitEstimator:
    """Online N_commit for windows of up to the block size `block` masked positions."""

    def __init__(self, block: int, halflife: float = DEFAULT_HALFLIFE) -> None:
        check_int("block", block, 1)
        if not (isinstance(halflife, (int, float)) and halflife > 0):
            raise ValueError(f"halflife must be > 0, got {halflife!r}")
        self.block = block
        self._decay = math.exp(-math.log(2) / halflife)
        self._band = max(1, -(-block // DEPTH_BUCKETS))    # masked positions per band
        self._seen: dict[tuple, _Entry] = {}
        self._members: dict[tuple, list[_Entry]] = {}     # group -> its entries
        self.observations = 0                              # windows observed (undecayed)
        self._cache: dict[tuple, tuple[float, float]] = {}   # estimates and their errors, groups' pooling and the
        self._groups: dict[tuple, tuple[float, float, float, float | None]] = {}   # best mean seen, until the next
                                                                                   # observation
        self._best: dict[Tried | None, float] | None = None     # the best mean of each kind of tried, and of all (None)

    def _entry(self, m: int, left: int, tried: int) -> tuple:
        """Where a window's commits are kept: the rest of its block by m, a full window by m and its band of left;
        either by whether none, some or all of its positions were tried before (`Tried`)."""
        kind = tried_kind(m, tried)
        return ("rest", m, kind) if m >= left else ("full", m, (left - 1) // self._band, kind)

    def _group(self, key: tuple) -> tuple:
        """The entries an entry is pooled with: full windows of its size; rest windows of its band of m."""
        return ("full", key[1], key[-1]) if key[0] == "full" else ("rest", (key[1] - 1) // self._band, key[-1])

    def observe(self, m: int, committed: Iterable[int], left: int | None = None, tried: int = 0) -> None:
        """Windows of m masked positions, in blocks with `left` masked positions (m: the rest of the block) of which
        the first `tried` were in an earlier window of the block, committed these counts (one per sequence)."""
        got = [int(k) for k in committed]
        left = m if left is None else left
        if not 1 <= m <= min(left, self.block) or left > self.block or any(k < 0 or k > m for k in got):
            raise ValueError(f"a window of {m} in a block with {left} masked (block {self.block}) cannot commit "
                             f"{got}")
        _check_tried(tried, left)
        if not got:
            return
        key = self._entry(m, left, tried)
        e = self._seen.get(key)
        if e is None:
            e = self._seen[key] = _Entry()
            self._members.setdefault(self._group(key), []).append(e)
        e.add(got, self._decay ** len(got))
        self.observations += len(got)
        self._cache.clear()
        self._groups.clear()
        self._best = None

    def _pooling(self, group: tuple) -> tuple[float, float, float, float | None]:
        """A group's decayed windows and commits, how many windows of its own an entry needs to outweigh the
        group's mean: w0 = σ² / τ², one window's variance over the variance of the entries' true means (method of
        moments; infinite while the entries look alike), and σ² (None while the group has no more windows than
        entries). Cached until the next observation."""
        got = self._groups.get(group)
        if got is not None:
            return got
        members = self._members.get(group, [])
        w = sum(e.w for e in members)
        s = sum(e.s for e in members)
        w0 = math.inf
        squares = sum(max(0.0, e.ss - e.s * e.s / e.w) for e in members)
        var = squares / (w - len(members)) if w > len(members) else None   # one window's variance
        if len(members) >= 2:
            within = squares / max(1e-9, w - len(members))
            q = sum(e.w * (e.mean - s / w) ** 2 for e in members)
            spread = (q - (len(members) - 1) * within) / (w - sum(e.w * e.w for e in members) / w)
            if spread > 0:
                w0 = within / spread
        got = self._groups[group] = (w, s, w0, var)
        return got

    def estimate(self, m: int, left: int | None = None, tried: int = 0) -> float:
        """Expected commits of a window of m masked positions in a block with `left` masked (the rest of the block
        when not given or m >= left), the first `tried` of them covered by an earlier window, within [1, m]."""
        return self.judged(m, left, tried)[0]

    def error(self, m: int, left: int | None = None, tried: int = 0) -> float:
        """The standard error of `estimate`: one window's spread in its group over the square root of the windows
        the estimate stands on (its own and its share of the group's, or the group's and the optimism's); a group
        with no more windows than entries counts the widest spread on [1, m]."""
        return self.judged(m, left, tried)[1]

    def judged(self, m: int, left: int | None = None, tried: int = 0) -> tuple[float, float]:
        """(`estimate`, `error`) of a window in one lookup, cached until the next observation."""
        left = m if left is None else left
        if not 1 <= m <= self.block or left < m or left > self.block:
            raise ValueError(f"a window has 1..{self.block} masked positions of the block's left, got {m} of {left}")
        _check_tried(tried, left)
        key = self._entry(m, left, tried)
        got = self._cache.get(key)
        if got is not None:
            return got
        best = self._best
        if best is None:
            best = self._best = {None: 1.0}
            for k, e in self._seen.items():
                best[k[-1]] = max(best.get(k[-1], 1.0), e.mean)
                best[None] = max(best[None], e.mean)
        gw, gs, w0, var = self._pooling(self._group(key))
        prior = (gs + OPTIMISM_WEIGHT * min(float(m), best.get(key[-1], best[None]))) / (gw + OPTIMISM_WEIGHT)
        e = self._seen.get(key)
        if e is None or math.isinf(w0):
            est, windows = prior, gw + OPTIMISM_WEIGHT
        else:
            est, windows = (e.s + w0 * prior) / (e.w + w0), e.w + w0
        if var is None:
            var = ((m - 1) / 2) ** 2
        got = self._cache[key] = (min(float(m), max(1.0, est)), math.sqrt(var / windows))
        return got

    def __call__(self, c: int, left: int | None = None, tried: int = 0) -> float:
        """Estimated commits of a step at chunk c for a sequence with `left` masked positions in its block (a fresh
        block when not given), `tried` of them covered before: a full window of c, or the rest of the block when
        c >= left."""
        if c < 1:
            raise ValueError(f"chunk size must be >= 1, got {c}")
        left = self.block if left is None else left
        return self.estimate(min(c, left), left, tried)


__all__ = ["CommitEstimator", "Tried", "tried_kind"]
