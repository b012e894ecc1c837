"""dLLM-Serve §2.3 / §5.2: the Refresh and Reuse phases of a block-diffusion request (LLaDA-style: bidirectional,
block-level generation over a cache that goes stale).

A request generates G tokens in blocks of B positions that start at the prompt's end (the last block may be
shorter). Every step of a block computes its whole active block and commits some of its positions; the phase of a
step decides what else it computes:

- **Refresh** (the whole sequence's Q/K/V recomputed and the KV cache rewritten): at the start of every block and,
  with `refresh_interval` > 0, every that many steps after the block's cache was written;
- **Reuse** (only the active block's positions, against the cached KV of everything else): the other steps.

`delay_step` is dLLM-Serve's (and Sparse-dLLM's) `SparseConfig.delay_step` (default 1), read from its
`PerRequestSparseState.advance_step`: the first `delay_step` steps of a block run full attention over the whole
sequence *without* writing the cache (cache state 0: the block's first tokens are still moving, dKV-Cache's delayed
caching), step `delay_step` recomputes the whole sequence and writes the cache (state 1), and only the steps after
it reuse it (state 2). So a block starts with `delay_step + 1` full-length steps, and 0 gives one (Fast-dLLM's dual
cache: refresh at each block transition). Both full-length kinds cost the sequence length in query tokens; they
differ only in whether the step writes KV (`Phase.FULL` does not, `Phase.REFRESH` does).

The sequence length a full-length step recomputes (`RefreshSpan`):

- `full`: the whole canvas, prompt + the generation length G (LLaDA keeps every masked position of the answer in
  the sequence from the start: dLLM-Serve's `len(seq)`, constant for the request's life); a Reuse step attends to
  the retained KV of the prompt and of the masked suffix (the dual cache);
- `prefix`: prompt + generated + the active block (block-causal models such as SDAR, where the positions after
  the active block do not exist yet); the Refresh grows block by block up to P + G.
- `aligned`: `prefix` with SDAR's block layout: blocks aligned to absolute positions (block k is positions kB ..
  kB+B-1), so the prompt's leftover P mod B tokens start the first block and it has B - P mod B answer positions;
  every step computes the whole active block (B query rows, positions past G included, as the engine runs them), a
  full-length step positions 0 .. the active block's end, and the peak is P + G rounded up to whole blocks.
- `canvas`: `full` as LLaDA's generate and Fast-dLLM lay the canvas out (what the engine computes for a
  bidirectional model): prompt + G rounded up to whole blocks (every block B positions; positions past G stay masked
  and are computed, never committed), blocks from the prompt's end; a full-length step recomputes the whole canvas,
  and a Reuse step is Fast-dLLM's prefix cache: the active block *and the masked canvas after it* are queries, only
  the prefix (prompt + completed blocks) is cached, so a Reuse reads ⌊ρ·prefix⌋ retained keys.

KV (dLLM-Serve §4.5, head-centric sparse KV): a request keeps the top ⌈ρ·L⌉ positions per KV head of its sequence
of L = P + G in a dense buffer whose size is fixed for its life (dLLM-Serve's `max_sparse_token`, allocated at
admission); a Reuse step attends to ⌊ρ·(context)⌋ retained keys of the context outside its active block (at least
one) plus the block itself. ρ = 1 is the dense cache (Fast-dLLM).

This module is sans-I/O: plain state and arithmetic, driven by the worker core (tandem/core/worker.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from tandem.policy.checks import check_int

DEFAULT_DELAY_STEP = 1          # dLLM-Serve's SparseConfig.delay_step
DEFAULT_RETENTION = 1.0         # the dense cache; dLLM-Serve runs 0.5 (its Table 3)


class Phase(StrEnum):
    """What one step of a request computes."""

    FULL = "full"          # the whole sequence, full attention, no cache written (a delay step; dLLM-Serve state 0)
    REFRESH = "refresh"    # the whole sequence, its KV cache (re)written (state 1)
    REUSE = "reuse"        # the active block only, against the cached KV (state 2)

    @property
    def full_length(self) -> bool:
        """Whether the step recomputes the whole sequence (a Refresh in cost and admission terms)."""
        return self is not Phase.REUSE


class RefreshSpan(StrEnum):
    """Which positions a full-length step recomputes."""

    FULL = "full"          # prompt + the whole generation length (LLaDA's masked canvas)
    PREFIX = "prefix"      # prompt + generated + the active block (block-causal models)
    ALIGNED = "aligned"    # prefix, with blocks aligned to absolute positions (SDAR's layout, the engine's)
    CANVAS = "canvas"      # full, canvas rounded up to whole blocks, Reuse = Fast-dLLM's prefix cache (LLaDA's
                           # layout in the engine: the block and the masks after it recomputed, the prefix cached)


@dataclass(frozen=True, slots=True)
class PhaseSpec:
    """A validated Refresh/Reuse policy."""

    block: int
    delay_step: int = DEFAULT_DELAY_STEP
    refresh_interval: int = 0              # > 0: also refresh every this many steps after the block's cache write
    span: RefreshSpan = RefreshSpan.FULL
    retention: float = DEFAULT_RETENTION   # ρ: share of the sequence's positions whose KV a request keeps per head

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2:
            raise ValueError(f"a diffusion block has at least 2 positions, got {self.block!r}")
        check_int("delay_step", self.delay_step, 0)
        check_int("refresh_interval", self.refresh_interval, 0)
        object.__setattr__(self, "span", RefreshSpan(self.span))
        r = self.retention
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"the KV retention ratio must be in (0, 1], got {r!r}")

    def phase_at(self, block_step: int) -> Phase:
        """The phase of the block's step `block_step` (0 = the block's first step)."""
        d = self.delay_step
        if block_step < d:
            return Phase.FULL
        if block_step == d:
            return Phase.REFRESH
        k = self.refresh_interval
        if k and (block_step - d) % k == 0:
            return Phase.REFRESH
        return Phase.REUSE


@dataclass(slots=True, eq=False)
class PhaseState:
    """One request's progress through its blocks, and what admission and the starvation bound read of it."""

    prompt: int                 # P: the tokens before the answer (history + new input)
    gen: int                    # G: the generation length (the round's output tokens)
    order: int                  # admission order (FCFS rank among the running)
    last_run: int               # the last step index it ran in (its admission step before its first)
    kv_tokens: int              # its fixed KV buffer, in token positions (⌈ρ·(P + G)⌉)
    generated: int = 0          # positions of the answer committed so far
    block_step: int = 0         # steps run in the active block so far
    deferred: int = 0           # consecutive steps it has waited (running, not scheduled)
    steps: int = 0              # steps it has run


class PhaseSchedule:
    """The phase arithmetic of a PhaseSpec: each request's next phase, its query tokens (the admission currency),
    the positions it may commit, the keys a Reuse step reads, and the fixed KV buffer."""

    def __init__(self, spec: PhaseSpec) -> None:
        self.spec = spec
        self.block = spec.block

    # ---------------------------------------------------------------- sizes
    def peak_tokens(self, prompt: int, gen: int) -> int:
        """The largest Refresh of a request: its whole sequence at the end of generation, P + G (aligned: rounded up
        to whole blocks; canvas: P + G rounded up to whole blocks)."""
        if self.spec.span is RefreshSpan.ALIGNED:
            return -(-(prompt + gen) // self.block) * self.block
        if self.spec.span is RefreshSpan.CANVAS:
            return prompt + self.canvas_gen(gen)
        return prompt + gen

    def canvas_gen(self, gen: int) -> int:
        """The masked canvas of LLaDA's layout: G rounded up to whole blocks (LLaDA's gen_length)."""
        return -(-gen // self.block) * self.block

    def kv_tokens(self, prompt: int, gen: int) -> int:
        """The positions its dense KV buffer holds for its whole life: ⌈ρ·(P + G)⌉, at least 1."""
        return max(1, math.ceil(self.spec.retention * (prompt + gen) - 1e-9))

    def first_tokens(self, prompt: int, gen: int) -> int:
        """Query tokens of a request's first step (a full-length step of its first block)."""
        if self.spec.span in (RefreshSpan.FULL, RefreshSpan.CANVAS):
            return self.peak_tokens(prompt, gen)
        if self.spec.span is RefreshSpan.ALIGNED:
            return prompt // self.block * self.block + self.block
        return prompt + min(self.block, gen)

    def new(self, prompt: int, gen: int, order: int, step: int) -> PhaseState:
        """The state of a request admitted at step `step` (it runs that step, at its block's step 0)."""
        return PhaseState(prompt, gen, order, step, self.kv_tokens(prompt, gen))

    # ---------------------------------------------------------------- per step
    def phase(self, st: PhaseState) -> Phase:
        return self.spec.phase_at(st.block_step)

    def block_start(self, st: PhaseState) -> int:
        """Answer position where the active block starts (aligned: negative in a first block the prompt shares)."""
        if self.spec.span is RefreshSpan.ALIGNED:
            return (st.prompt + st.generated) // self.block * self.block - st.prompt
        return st.generated - st.generated % self.block

    def block_len(self, st: PhaseState) -> int:
        """Positions of the active block (the last one may be shorter; aligned: always B, every row computed)."""
        if self.spec.span is RefreshSpan.ALIGNED:
            return self.block
        start = self.block_start(st)
        return min(self.block, st.gen - start) if st.gen > start else self.block

    def left(self, st: PhaseState) -> int:
        """Positions of the active block still to commit: what this step may commit."""
        end = self.block_start(st) + self.block_len(st)
        if self.spec.span is RefreshSpan.ALIGNED:
            end = min(end, st.gen)
        return max(1, end - st.generated)

    def sequence_tokens(self, st: PhaseState) -> int:
        """The length a full-length step recomputes now."""
        if self.spec.span in (RefreshSpan.FULL, RefreshSpan.CANVAS):
            return self.peak_tokens(st.prompt, st.gen)
        return st.prompt + self.block_start(st) + self.block_len(st)

    def demand(self, st: PhaseState) -> int:
        """Query tokens of the request's next step: the sequence length (Refresh) or its active block (Reuse; canvas:
        the block and the masked canvas after it)."""
        if self.phase(st).full_length:
            return self.sequence_tokens(st)
        if self.spec.span is RefreshSpan.CANVAS:
            return self.canvas_gen(st.gen) - self.block_start(st)
        return self.block_len(st)

    def reuse_context(self, st: PhaseState) -> int:
        """Keys a Reuse step reads besides its queries: the retained positions of the context outside the block
        (canvas: of the cached prefix)."""
        if self.spec.span is RefreshSpan.CANVAS:
            ctx = st.prompt + self.block_start(st)
        else:
            ctx = self.sequence_tokens(st) - self.block_len(st)
        return max(1, int(self.spec.retention * ctx + 1e-9)) if ctx > 0 else 0

    def advance(self, st: PhaseState, committed: int) -> None:
        """The request ran a step and committed `committed` positions: the block's step count goes on, or the next
        block starts at its step 0 when this one is complete."""
        shift = st.prompt if self.spec.span is RefreshSpan.ALIGNED else 0
        before = (shift + st.generated) // self.block
        st.generated += committed
        st.steps += 1
        if (shift + st.generated) // self.block != before or st.generated >= st.gen:
            st.block_step = 0
        else:
            st.block_step += 1


def canvas_max_tokens(prompt: int, max_tokens: int | None, block: int, max_len: int) -> int:
    """A round's G on a LLaDA canvas (span `canvas`): the requested max_tokens (None: all it can), clamped so that
    the prompt and G rounded up to whole blocks fit max_len positions; ValueError when not one block fits."""
    fit = (max_len - prompt) // block * block
    if fit < 1:
        raise ValueError(f"a prompt of {prompt} tokens leaves less than one diffusion block ({block} positions) of the "
                         f"model's {max_len}: a LLaDA canvas is the prompt and whole blocks of mask tokens")
    return fit if max_tokens is None else min(int(max_tokens), fit)


__all__ = ["DEFAULT_DELAY_STEP", "DEFAULT_RETENTION", "Phase", "PhaseSchedule", "PhaseSpec", "PhaseState",
           "RefreshSpan", "canvas_max_tokens"]
