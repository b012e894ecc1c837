"""Optimus §5.4: the chunk size c of each block-diffusion step (elastic), or a fixed one, or the whole block.

`elastic`: c* = argmax_c N_commit(c)·b / T(c, b) over the candidate sizes up to the block length, b the sequences
decoding this step: the size that commits the most tokens per second at this load. Until the estimator has seen
enough steps, the step runs at the block size (Optimus observes the largest chunk first). Each sequence is priced
where it is (`SeqWindow`): a streaming window first writes the K/V of the positions the last step committed, then
covers masked positions up to c, never past its block, so its commits are N_commit of what is left for the masked
ones; T is the shell's price of the whole step (its rows, sequences and cached tokens).
`N` (an integer): every step at chunk N (streaming chunked decoding with a fixed window). `block`: plain block
diffusion, every step recomputing the whole block (BD-B: no reuse of the decoded positions' KV within it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from tandem.policy.optimus.commit import CommitEstimator

CHUNK_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)   # window sizes the elastic policy chooses among (up to the block)
WARMUP_OBSERVATIONS = 32                    # sequence-steps observed (at the block size) before the elastic choice


class ChunkMode(StrEnum):
    """How a diffusion step's window is sized."""

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


def parse_chunk(value: str | int | ChunkSpec) -> ChunkSpec:
    """`elastic`, `block` or a positive integer (a fixed chunk) as a ChunkSpec; ValueError otherwise."""
    if isinstance(value, ChunkSpec):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return ChunkSpec(ChunkMode.FIXED, value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in (ChunkMode.ELASTIC.value, ChunkMode.BLOCK.value):
            return ChunkSpec(ChunkMode(v))
        if v.isdigit() and int(v) >= 1:
            return ChunkSpec(ChunkMode.FIXED, int(v))
    raise ValueError(f"a diffusion chunk is 'elastic', 'block' or a positive integer, got {value!r}")


StepLatency = Callable[[int, int, int], float]   # (query rows, sequences, cached tokens they read) -> seconds


class SeqWindow(NamedTuple):
    """A sequence as the sizer prices its window: what the window may cover, what it must carry, what it reads."""

    left: int            # masked positions of its active block (at most its tokens still to decode)
    pending: int = 0     # decoded positions whose K/V the window writes first (streaming)
    extra: int = 0       # rows riding along outside the window (a prompt's leftover tokens)
    ctx: int = 0         # cached tokens its rows attend to


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

    @property
    def recomputes_block(self) -> bool:
        """Plain block diffusion: every step computes the whole block (no reuse of its decoded positions)."""
        return self.spec.mode is ChunkMode.BLOCK

    def choose(self, seqs: Sequence[SeqWindow], room: int | None = None) -> int:
        """The window of a step decoding `seqs` (at most the block length). Elastic: the candidate c committing the
        most tokens per second, each sequence's window min(c, left + pending) (it stays in the active block) plus its
        extra rows, its expected commits N_commit of the masked positions the window has after its K/V writes, the
        step priced on all its rows, sequences and cached tokens; the windows within `room` query rows when given (the step's
        budget left to them, extra rows already taken out), down to a window of 1."""
        mode, b = self.spec.mode, len(seqs)
        if mode is ChunkMode.BLOCK or b <= 0:
            c = self.block
        elif mode is ChunkMode.FIXED:
            c = min(self.spec.size, self.block)
        else:
            ctx = sum(s.ctx for s in seqs)
            extra = sum(s.extra for s in seqs)
            sc: dict[int, float] = {}
            warm = self.estimator.observations < self.warmup   # warm-up: the largest window the room allows
            best, c = -1.0, 1
            for cand in (self.candidates[::-1] if warm else self.candidates):
                rows, commits = extra, 0.0
                for s in seqs:
                    w = cand if cand < s.left + s.pending else s.left + s.pending
                    rows += w
                    m = w - s.pending                  # the window's masked positions, after its writes
                    if not warm and m > 0:
                        got = sc.get(m)
                        if got is None:
                            got = sc[m] = self.estimator(m)
                        commits += got
                if room is not None and cand > 1 and rows - extra > room:
                    if warm:
                        continue
                    break
                if warm:
                    c = cand
                    break
                rate = commits / self.latency(rows, b, ctx)
                if rate > best:
                    best, c = rate, cand
        self.last = c
        if b > 0:
            self.steps_by_chunk[c] = self.steps_by_chunk.get(c, 0) + 1
        return c

    def observe(self, c: int, committed: list[int]) -> None:
        """The commits of the sequences a step at window c decoded (those not cut short by max_tokens)."""
        self.estimator.observe(c, committed)

    def count(self, committed: int) -> None:
        """One sequence-step committed this many tokens (every step, for the histogram)."""
        self.commit_counts[committed] = self.commit_counts.get(committed, 0) + 1

    def tokens_per_step(self) -> float:
        """Mean tokens committed per sequence per step so far (0 before any)."""
        n = sum(self.commit_counts.values())
        return sum(k * v for k, v in self.commit_counts.items()) / n if n else 0.0


__all__ = ["CHUNK_CANDIDATES", "ChunkMode", "ChunkSizer", "ChunkSpec", "SeqWindow", "StepLatency", "parse_chunk"]
