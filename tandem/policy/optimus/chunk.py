"""Optimus §5.4: the chunk size c of each block-diffusion step (elastic), or a fixed one, or the whole block.

`elastic`: c* = argmax_c N_commit(c)·b / T(c, b) over the candidate sizes up to the block length, b the sequences
decoding this step: the size that commits the most tokens per second at this load; then each sequence's own c*, the
size committing the most per second of its own share of that step (a block whose positions were all tried commits one
token whatever its window, a fresh block beside it many: one size cannot serve both), where the commits seen tell it
apart from the common c's (by DEVIATION_ERRORS standard errors). Until the estimator has seen
enough steps, the step runs at the block size (Optimus observes the largest chunk first). Each sequence is priced
where it is (`SeqWindow`): a streaming window covers the first c masked positions of its block, or the rest of the
block where it has no more than c left, and commits N_commit of that window (commit.py: learnt by window, by how
much of the block is left and by how much of the window was tried); it carries besides them the K/V writes of the
positions the last step committed and the prompt's leftover tokens; T is the shell's price of the whole step (its
rows, of which the windows' are sampled, sequences and cached tokens), plus what the shell's steps took beyond that
price so far (`StepOverhead`, learnt from the steps' measured times: the work around the forward, per step and per
sequence, that T's timing leaves out).
`N` (an integer): every step at chunk N (streaming chunked decoding with a fixed window). `block`: plain block
diffusion, every step recomputing the whole block (BD-B: no reuse of the decoded positions' KV within it).
`auto` (the default): each request's own mode (`request_chunk`): the whole block for a request that wants reproducible
tokens (greedy or seeded), elastic windows for the others. An elastic window's size is chosen from the load and from
the commits seen so far, and the size changes what a step commits (a window of c computes the first c masked positions
without the masked suffix after them, and only its own positions are candidates), so the same greedy prompt decodes to
different tokens under different loads; a fixed chunk and the block do not depend on the load. Sequences whose mode
is not elastic ride in the sizer's steps with their windows pinned (`SeqWindow.pin`), priced with the step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from tandem.policy.optimus.commit import CommitEstimator, tried_kind
from tandem.policy.optimus.latency import StepOverhead

CHUNK_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)   # window sizes the elastic policy chooses among (up to the block)
WARMUP_OBSERVATIONS = 32                    # sequence-steps observed (at the block size) before the elastic choice
MIN_PRICE_SHARE = 0.1                       # a learnt overhead below zero takes a step's price down to this share
MIN_PRICE_S = 1e-9                          # a price never reaches 0 (windows added to prompts in a flat regime)
STALL_PRICES = 4.0                          # a step's overhead counts at most this many times its price (beyond: a
                                            # stall, a GC pause, not the step's work)
DEVIATION_ERRORS = 2.0                      # a sequence leaves the common c's window only for a size whose rate beats
                                            # it by this many standard errors of the difference (about 95%)


class ChunkMode(StrEnum):
    """How a diffusion step's window is sized."""

    AUTO = "auto"                          # per request: block when it wants reproducible tokens, else elastic
    ELASTIC = "elastic"                    # Optimus: c* from the load each step
    FIXED = "fixed"                        # streaming chunked decoding with a fixed c
    BLOCK = "block"                        # plain block diffusion: the whole block every step, no intra-block reuse


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """A validated chunk policy: its mode and, for FIXED, its size."""

    mode: ChunkMode = ChunkMode.ELASTIC
    size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", ChunkMode(self.mode))
        if self.mode is ChunkMode.FIXED and (isinstance(self.size, bool) or not isinstance(self.size, int)
                                             or self.size < 1):
            raise ValueError(f"a fixed chunk size must be an integer >= 1, got {self.size!r}")

    def __str__(self) -> str:
        return str(self.size) if self.mode is ChunkMode.FIXED else self.mode.value


DEFAULT_CHUNK = ChunkMode.AUTO.value      # the worker's and the engine's dllm_chunk when none is given
MAX_FIXED_CHUNK = 4096                      # the largest fixed chunk accepted (a window never exceeds the block)
REPRODUCIBLE_CHUNK = ChunkSpec(ChunkMode.BLOCK)   # what `auto` gives a greedy or seeded request: SDAR's own decoding


def parse_chunk(value: str | int | ChunkSpec) -> ChunkSpec:
    """`auto`, `elastic`, `block` or an integer in [1, MAX_FIXED_CHUNK] (a fixed chunk) as a ChunkSpec; ValueError
    otherwise."""
    if isinstance(value, ChunkSpec):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_FIXED_CHUNK:
        return ChunkSpec(ChunkMode.FIXED, value)
    if isinstance(value, str) and len(value) <= 16:
        v = value.strip().lower()
        if v in (ChunkMode.AUTO.value, ChunkMode.ELASTIC.value, ChunkMode.BLOCK.value):
            return ChunkSpec(ChunkMode(v))
        if v.isascii() and v.isdigit() and 1 <= int(v) <= MAX_FIXED_CHUNK:
            return ChunkSpec(ChunkMode.FIXED, int(v))
    raise ValueError(f"a diffusion chunk is 'auto', 'elastic', 'block' or an integer in [1, {MAX_FIXED_CHUNK}], "
                     f"got {value!r}")


def request_chunk(default: ChunkSpec, asked: ChunkSpec | None = None, reproducible: bool = False) -> ChunkSpec:
    """The chunk one request decodes with. Under a worker whose `default` is a fixed chunk or the block, that, for
    every request (the operator chose one load-independent mode for all). Under `elastic` or `auto`, the one the
    request asks for (`asked`; None or AUTO: none), else the default; AUTO resolves to the whole block
    (REPRODUCIBLE_CHUNK) for a request that wants reproducible tokens (greedy or seeded: an elastic window's size
    follows the load and changes what commits) and to elastic windows for the others (throughput, at the price of
    tokens that depend on what runs beside them)."""
    if default.mode in (ChunkMode.FIXED, ChunkMode.BLOCK):
        return default
    spec = asked if asked is not None and asked.mode is not ChunkMode.AUTO else default
    if spec.mode is ChunkMode.AUTO:
        return REPRODUCIBLE_CHUNK if reproducible else ChunkSpec(ChunkMode.ELASTIC)
    return spec


StepLatency = Callable[[int, int, int, int, int], float]   # (window rows, sequences, cached tokens they read, rows
                                                           # sampled: the windows', prefill rows beside them) -> seconds


class SeqWindow(NamedTuple):
    """A sequence as the sizer prices its window: what the window may cover, what it must carry, what it reads."""

    left: int            # masked positions of its active block (at most its tokens still to decode)
    pending: int = 0     # decoded positions whose K/V the window writes (streaming; rows outside c)
    extra: int = 0       # other rows riding along outside c (a prompt's leftover tokens)
    ctx: int = 0         # cached tokens its rows attend to
    tried: int = 0       # masked positions of its block an earlier window covered (the first ones)
    pin: int = 0         # elastic sizers: 0, the sizer sizes its window; c > 0, its window is min(c, left) whatever
                         # the load (a request's fixed chunk; its block: the block pinned, the block's decoded
                         # positions and prompt tokens, recomputed every step, counted in `extra`)


class _Load(NamedTuple):
    """The rows, sequences, cached tokens and sampled rows of the pinned windows riding in an elastic step."""

    rows: int = 0
    seqs: int = 0
    ctx: int = 0
    sampled: int = 0


class StepWindows(NamedTuple):
    """A diffusion step as the sizer plans it: its chunk, and the window of each sequence that decodes in it."""

    chunk: int           # the step's chunk size: the candidate its largest window was cut from (what /metrics shows)
    windows: list[int]   # masked positions each of the first len(windows) sequences covers; the others, and any
                         # whose window is 0, sit out


def fitting(rows: Iterable[int], budget: int) -> int:
    """How many of the sequences, in order, run within `budget` rows, each taking the rows given; at least one
    (a sequence whose step alone exceeds the budget still runs, or it would never decode)."""
    n = used = 0
    for r in rows:
        used += r
        if n and used > budget:
            break
        n += 1
    return n


class ChunkSizer:
    """Picks each diffusion step's window; learns N_commit from the commits it is told of."""

    def __init__(self, spec: ChunkSpec, block: int, latency: StepLatency,
                 estimator: CommitEstimator | None = None, warmup: int = WARMUP_OBSERVATIONS) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 2:
            raise ValueError(f"a diffusion block has at least 2 positions, got {block!r}")
        self.spec = spec
        self.block = block
        self.latency = latency
        self.estimator = estimator or CommitEstimator(block)
        self.warmup = warmup
        self.candidates = sorted({c for c in CHUNK_CANDIDATES if c < block} | {block})
        self.last = block
        self.steps_by_chunk: dict[int, int] = {}     # steps run at each chosen window (what /metrics shows)
        self.commit_counts: dict[int, int] = {}      # sequence-steps that committed k tokens
        self.overhead = StepOverhead()               # what the shell's steps take beyond `latency`, learnt online
        self._priced: tuple[int, int, int, int, int] | None = None   # the last elastic step as priced, until timed

    @property
    def elastic(self) -> bool:
        """Optimus's c*: the window of a sequence that names no chunk of its own is chosen each step from the load."""
        return self.spec.mode in (ChunkMode.ELASTIC, ChunkMode.AUTO)

    @property
    def recomputes_block(self) -> bool:
        """Plain block diffusion: every step computes the whole block (no reuse of its decoded positions)."""
        return self.spec.mode is ChunkMode.BLOCK

    def choose(self, seqs: Sequence[SeqWindow], room: int | None = None, prompts: int = 0) -> int:
        """The chunk of a step decoding `seqs` (at most the block length); see `plan`."""
        return self.plan(seqs, room, prompts).chunk

    def plan(self, seqs: Sequence[SeqWindow], room: int | None = None, prompts: int = 0) -> StepWindows:
        """The step's chunk and the windows of the sequences that decode in it: the first n of `seqs` in the order
        given, n = len(windows), less any whose window is 0. `room`: the query rows the step's budget leaves the
        windows (their K/V writes and extra rows already taken out; None: no limit); `prompts`: the prompt rows that
        fill the step whatever its windows, because more wait than it holds (0: the waiting prompts fit beside any
        window). The token budget is a hard cap on a step's rows, as in vLLM, whatever the mode: when the windows
        overflow the room, the first sequences whose rows fit decode and the others sit the step out (always at least
        one). A fixed chunk c gives each sequence min(c, left) and runs fewer sequences; the block gives each the rest
        of its block (block + K/V writes rows each, all within `room`); elastic weighs smaller windows for all against
        fewer sequences and sizes each sequence's window (see `_elastic`). Under elastic (and auto) a sequence may pin
        its window (`SeqWindow.pin`: a request's own fixed chunk or block): it covers min(pin, left) whatever the load,
        and the elastic windows beside it are priced with it in the step; the step's chunk is then the elastic one
        (the largest pin when every sequence pins one)."""
        mode = self.spec.mode
        if not self.elastic or not seqs:
            c = min(self.spec.size, self.block) if mode is ChunkMode.FIXED and seqs else self.block
            n = len(seqs)
            if room is not None and seqs:
                if mode is ChunkMode.BLOCK:          # the whole block and a completed block's first write
                    n = fitting(((self.block + s.pending) for s in seqs), room)
                else:
                    n = fitting(((min(c, s.left) + s.pending + s.extra) for s in seqs),
                                room + sum(s.pending + s.extra for s in seqs))
            windows = [s.left if s.left < c else c for s in seqs[:n]]
        else:
            free = [s for s in seqs if not s.pin]
            fixed = [s.left if s.left < s.pin else s.pin for s in seqs if s.pin]
            if not free:
                c = max(min(s.pin, self.block) for s in seqs)
                windows = self._fit(fixed, seqs, room)
            elif not fixed:
                c, windows = self._elastic(seqs, room, prompts, _Load())
            else:                                    # elastic windows beside pinned ones: priced with them
                pinned = [s for s in seqs if s.pin]
                load = _Load(sum(w + s.pending + s.extra for w, s in zip(fixed, pinned)), len(pinned),
                             sum(s.ctx for s in pinned), sum(fixed))
                c, mine = self._elastic(free, None if room is None else room - sum(fixed), prompts, load)
                mine_it = iter(mine + [0] * (len(free) - len(mine)))
                pins = iter(fixed)
                windows = self._fit([next(pins) if s.pin else next(mine_it) for s in seqs], seqs, room)
            if free:                                 # kept as priced until the step is timed
                run = [(w, s) for w, s in zip(windows, seqs) if w]
                sampled = sum(w for w, _ in run)
                self._priced = (sampled + sum(s.pending + s.extra for _, s in run), len(run),
                                sum(s.ctx for _, s in run), sampled, 0)
        self.last = c
        if seqs:
            self.steps_by_chunk[c] = self.steps_by_chunk.get(c, 0) + 1
        return StepWindows(c, windows)

    @staticmethod
    def _fit(windows: list[int], seqs: Sequence[SeqWindow], room: int | None) -> list[int]:
        """The windows cut to the first sequences whose rows (window, K/V writes, extra rows; none for a window of 0,
        which sits out) fit `room` plus the rows they all carry (at least one runs); trailing zeros dropped."""
        if room is not None:
            n = fitting((w + s.pending + s.extra if w else 0 for w, s in zip(windows, seqs)),
                        room + sum(s.pending + s.extra for s in seqs))
            windows = windows[:n]
        while windows and not windows[-1]:
            windows.pop()
        return windows

    def _elastic(self, seqs: Sequence[SeqWindow], room: int | None, prompts: int,
                 load: _Load) -> tuple[int, list[int]]:
        """(c, windows): the candidate c committing the most tokens per second (the first of equals), run by the
        first len(windows) sequences; when all of them decode, each then takes its own window (`_per_sequence`; c is
        then the smallest candidate holding the largest window). At the common c each sequence's window is min(c,
        left) masked positions (it stays in its active block), expected
        to commit N_commit of them; the step is priced on all its rows (the windows, the K/V writes and the extra
        rows, of which only the windows' are sampled), sequences and cached tokens, plus the overhead learnt so far.
        When prompts wait beyond the step (`prompts` > 0 rows fill it), every window row displaces a prompt row that
        will run later at the same cost: the windows are priced at what they add to a step of those prompts, less the
        per-step overhead (the prompts pay it anyway), so c* falls to the windows that commit the most per row where
        steps are compute-bound (serving capacity is then the total work per request). The windows stay within `room`
        query rows when given (the step's budget left to them), down to a window of 1; when even windows of 1 do not
        fit (the rows every window carries fill the budget: prompts' leftover tokens, K/V writes), each candidate c
        is run by the first sequences whose rows, carried ones included, fit the budget, the others sit the step out
        (rather than every window shrinking to 1, whatever c* would choose). During the warm-up: the largest that
        fits. `load`: the pinned windows riding in the step, added to every price."""
        fits = []                                    # (c, the windows of the sequences that decode)
        if room is None or room >= len(seqs):
            for cand in self.candidates:
                windows = [cand if cand < s.left else s.left for s in seqs]
                if room is not None and cand > 1 and sum(windows) > room:
                    break
                fits.append((cand, windows))
        else:                                        # windows of 1 overflow: a prefix of the sequences decodes
            budget = room + sum(s.pending + s.extra for s in seqs)
            for cand in self.candidates:
                windows = [cand if cand < s.left else s.left for s in seqs]
                n = fitting((w + s.pending + s.extra for w, s in zip(windows, seqs)), budget)
                fits.append((cand, windows[:n]))
        n_at: dict[tuple[int, int, int], tuple[float, float]] = {}
        of_n: dict[int, tuple[int, int]] = {}        # n -> cached tokens and carried rows of the first n sequences

        def first(n: int) -> tuple[int, int]:
            """The cached tokens and carried rows of the first n sequences (cached by n)."""
            if n not in of_n:
                of_n[n] = (sum(s.ctx for s in seqs[:n]), sum(s.pending + s.extra for s in seqs[:n]))
            return of_n[n]
        base = self.latency(0, 0, 0, 0, prompts) if prompts else 0.0
        over: dict[int, float] = {}                  # overhead by sequences decoding (the per-step part is the
                                                     # prompts' when they fill the step)

        def cost(n: int, sampled: int) -> float:
            """Seconds a step of the first n sequences' windows, `sampled` rows in all, adds."""
            if n not in over:
                m = n + load.seqs
                over[n] = self.overhead(m) - self.overhead(0) if prompts else self.overhead(m)
            ctx, carried = first(n)
            t = self.latency(sampled + carried + load.rows, n + load.seqs, ctx + load.ctx, sampled + load.sampled,
                             prompts) - base
            return max(t + over[n], MIN_PRICE_SHARE * t, MIN_PRICE_S)

        def price(windows: list[int]) -> float:
            """Seconds the step of these windows adds."""
            return cost(len(windows), sum(windows))
        if self.estimator.observations < self.warmup:
            c, windows = fits[-1]
        else:
            def judged(m: int, s: SeqWindow) -> tuple[float, float]:
                """A window of m's expected commits (N_commit where the sequence is) and that estimate's error."""
                key = (m, s.left, tried_kind(m, s.tried))   # what the estimate depends on
                got = n_at.get(key)
                if got is None:
                    got = n_at[key] = self.estimator.judged(m, s.left, s.tried)
                return got

            def gain(m: int, s: SeqWindow) -> float:
                """A window of m's expected commits."""
                return judged(m, s)[0]

            def rate(windows: list[int]) -> float:
                """Expected commits per second of a step of these windows (the first sequences')."""
                return sum(gain(m, s) for m, s in zip(windows, seqs)) / price(windows)
            c, windows = max(fits, key=lambda fit: rate(fit[1]))
            if len(windows) == len(seqs):
                windows = self._per_sequence(seqs, windows, room, judged, cost)
                c = next(cand for cand in self.candidates if cand >= max(windows))
        return c, windows

    def _per_sequence(self, seqs: Sequence[SeqWindow], windows: list[int], room: int | None,
                      judged: Callable[[int, SeqWindow], tuple[float, float]],
                      cost: Callable[[int, int], float]) -> list[int]:
        """Each sequence's own c*: from the common c's windows, the window (a candidate size, up to the rest of its
        block) committing the most per second of the sequence's own share of the step: the step's price split evenly,
        plus what the step's price moves by with this sequence's window at that size instead, and never below its
        share of a step of windows of one (ties: the size nearest the common c's). Where the sequences are alike this
        is the common c* (the step's rate and each share peak at the same size); where they differ, a block whose
        positions were tried, which commits one token whatever its window, takes a small one and a fresh block
        beside it a large one, which one size cannot give both. Each is priced at its own rate, not the step's: a
        sequence committing little per row keeps the window its own progress wants, rather than being cut to the
        rows the others use best and finishing last, alone. A sequence keeps the common c's window unless its own
        size's rate beats it by DEVIATION_ERRORS standard errors of the difference (the estimates' errors, over the
        shares): the estimates are means of whichever sequences ran each kind of window, and windows whose estimates
        differ by noise alone, taken per sequence, cost 6% in the simulator at 4-16 sequences (SDAR-8B on an H100,
        where one size serves all); a window a sequence left for a size that looked better is not run there again,
        so a low estimate of it was never corrected. The common c's windows when these would overflow `room`."""
        n, rows = len(windows), sum(windows)
        whole = cost(n, rows)
        least = cost(n, n) / n
        moved: dict[int, float] = {}                 # rows added (or dropped) -> what the step's price moves by

        def share(m: int, w: int) -> float:
            if m - w not in moved:
                moved[m - w] = cost(n, rows + m - w) - whole
            return max(whole / n + moved[m - w], least)

        def rate(m: int, s: SeqWindow, w: int) -> float:
            """The sequence's expected commits per second of its share at a window of m."""
            return judged(m, s)[0] / share(m, w)
        own = []
        chosen: dict[tuple[int, int, int], int] = {}   # (left, tried, common window) -> own window: all it depends on
        for s, w in zip(seqs, windows):
            m = chosen.get((s.left, s.tried, w))
            if m is None:
                options = {cand if cand < s.left else s.left for cand in self.candidates}
                m = max(options, key=lambda m, s=s, w=w: (rate(m, s, w), -abs(m - w)))
                if m != w and rate(m, s, w) - rate(w, s, w) <= DEVIATION_ERRORS * math.hypot(
                        judged(m, s)[1] / share(m, w), judged(w, s)[1] / share(w, w)):
                    m = w                            # not told apart from the common window by the commits seen
                chosen[(s.left, s.tried, w)] = m
            own.append(m)
        return windows if room is not None and sum(own) > room else own

    def observe_step(self, seconds: float | None) -> None:
        """The last step the sizer chose took `seconds` (None: it also ran other work, a prefill chunk, whose time
        is not the windows'): what it took beyond `latency`'s price feeds the overhead, at most STALL_PRICES times
        that price (one stalled step would otherwise tilt the next hundred choices)."""
        priced, self._priced = self._priced, None
        if priced is None or seconds is None:
            return
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a step's seconds must be finite and >= 0, got {seconds!r}")
        t = self.latency(*priced)
        self.overhead.add(priced[1], min(seconds - t, STALL_PRICES * t))

    def observe(self, m: int, committed: list[int], left: int | None = None, tried: int = 0) -> None:
        """The commits of windows of m masked positions in blocks with `left` masked (the rest of the block when not
        given), `tried` of them covered by an earlier window, a step decoded (those not cut short by max_tokens)."""
        self.estimator.observe(m, committed, left, tried)

    def count(self, committed: int) -> None:
        """One sequence-step committed this many tokens (every step, for the histogram)."""
        self.commit_counts[committed] = self.commit_counts.get(committed, 0) + 1

    def tokens_per_step(self) -> float:
        """Mean tokens committed per sequence per step so far (0 before any)."""
        n = sum(self.commit_counts.values())
        return sum(k * v for k, v in self.commit_counts.items()) / n if n else 0.0


__all__ = ["CHUNK_CANDIDATES", "DEFAULT_CHUNK", "MAX_FIXED_CHUNK", "REPRODUCIBLE_CHUNK", "ChunkMode", "ChunkSizer",
           "ChunkSpec", "SeqWindow", "StepLatency", "StepWindows", "fitting", "parse_chunk", "request_chunk"]
