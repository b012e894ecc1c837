"""Messages between the sans-I/O cores and their shells: tasks, step plans and results, events."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from tandem.perf.batch_shape import BatchShape
from tandem.policy.task import COLOCATED, DECODE, PREFILL, PrefillTask, Role

# Worker roles and the prefill task live with the policies that read them.
__all__ = ["PREFILL", "DECODE", "COLOCATED", "Role", "PrefillTask", "SeqState", "Seq", "StepKind", "PlanEntry",
           "Swap", "SwapKind", "StepPlan", "StepResult", "FetchHistory", "PrefillDone", "FirstToken", "RoundDone", "SessionFailed"]


class SeqState(Enum):
    """Where a session's residency on its worker stands."""

    NEW = "new"                 # bound, nothing resident yet
    PREFILL = "prefill"         # a round's prefill is queued or running (locally or remotely)
    RUNNING = "running"         # decoding
    IDLE = "idle"               # between rounds, KV resident (evictable unless pinned)
    EVICTED = "evicted"         # between rounds, KV dropped for memory
    FAILED = "failed"           # the worker cannot hold it
    RELEASED = "released"       # the session ended here (its KV freed)
    SWAPPED = "swapped"         # preempted by swap: its KV waits in host memory to be copied back
    OFFLOADED = "offloaded"     # between rounds, its KV only in the worker's host tier (core/host_tier.py)


@dataclass(slots=True, eq=False)
class Seq:
    """A session's KV residency on a decode or co-located worker, and its decoding progress."""

    session_id: str
    num_tokens: int = 0         # tokens whose KV is resident
    to_decode: int = 0          # tokens still to generate in the current round
    last_token_s: float = -1.0  # time of the previous token of this round (-1: none yet)
    state: SeqState = SeqState.NEW
    retain_until: float = 0.0   # while idle, KV is pinned until then (Continuum TTL)
    order: int = 0              # admission order: preemption victims are the latest admitted
    itl_sum: float = 0.0
    itl_count: int = 0
    itl_max: float = 0.0
    cap: int = 0                # tokens the held blocks can store
    preemptions: int = 0
    query_tokens: int = 1       # query tokens its next decode step computes (1: AR; c: a diffusion chunk)
    writes_kv: bool = True      # whether that step writes KV (a diffusion denoise writes only at commit)
    commit_cap: int = 1         # tokens that step may commit (its window within the active diffusion block)
    kv_pending: int = 0         # diffusion: committed tokens whose K/V are not written yet (the next window's first
                                # positions; plain block diffusion: a completed block, written by the next step)
    kv_prompt: int = 0          # streaming diffusion: the prompt's leftover tokens (its last, partial block), computed
                                # and rewritten with every window of that block, outside the chunk (fixed inputs)
    tried: int = 0              # diffusion: masked positions of the active block some window has covered (they stayed
                                # below the threshold then: N_commit learns them apart from untried ones)
    first_due: tuple[float, float | None] | None = None   # diffusion: the round's first token is its first
                                # commit; (prefill start, enqueue time of a local prefill) until then
    swapped_blocks: int = 0     # preempted by swap: KV blocks it holds in host memory
    host_tokens: int = 0        # host tier: leading positions its host run holds (written)
    expect_s: float = 0.0       # host tier: when its next round is expected (idle only)
    idle_since: float = -1.0    # host tier: when its last round ended (-1: not idle)
    loading: object = None      # host tier: the copy bringing its KV back (its blocks are not read until it lands)
    copy_out: object = None     # host tier: the copy taking its KV out (its blocks are not evicted until it lands)
    prefetched: bool = False    # host tier: its KV came back ahead of the round


class SwapKind(Enum):
    """Which way a swap moves a preempted sequence's KV."""

    OUT = "out"                 # device blocks -> host memory (the sequence is preempted)
    IN = "in"                   # host memory -> device blocks (the sequence resumes)
    DROP = "drop"               # forget the host copy (the session ended while swapped out; no blocks)


@dataclass(slots=True, frozen=True)
class Swap:
    """Copy a sequence's KV between the device pool and host memory (vLLM's preemption by swap): `blocks` are the
    device blocks it leaves (OUT) or comes back to (IN), in block-table order (DROP: none). Shells carry swaps out in the order
    the core made them, before the next forward: a block an OUT frees may be handed out again in the same plan."""

    kind: SwapKind
    session_id: str
    blocks: tuple[int, ...]


class StepKind(Enum):
    """What a scheduled sequence does in a step."""

    PREFILL = "prefill"         # a prefill chunk: n query tokens, writes their KV
    DECODE = "decode"           # a decode step: query_tokens positions, commits 0..query_tokens tokens


class PlanEntry(NamedTuple):
    """One scheduled sequence of a step, as an executor reads it."""

    kind: StepKind
    session_id: str
    query_tokens: int
    writes_kv: bool


@dataclass(slots=True)
class StepPlan:
    """What a worker runs in one iteration: prefill chunks (task, query tokens) and decoding sequences (each
    computing `seq.query_tokens` positions, set by the scheduler for this step)."""

    worker: int
    prefill: list[tuple[PrefillTask, int]] = field(default_factory=list)
    decode: list[Seq] = field(default_factory=list)
    shape: BatchShape = field(default_factory=BatchShape)

    def entries(self) -> list[PlanEntry]:
        """Every scheduled sequence with its query tokens and whether it writes KV."""
        out = [PlanEntry(StepKind.PREFILL, t.session_id, n, True) for t, n in self.prefill]
        out += [PlanEntry(StepKind.DECODE, s.session_id, s.query_tokens, s.writes_kv) for s in self.decode]
        return out


@dataclass(slots=True)
class StepResult:
    """What an executor reports back: elapsed time, tokens committed per decoding session (0..query_tokens;
    None: every decoding sequence committed all its query tokens) and the rounds a stop rule ended."""

    elapsed_s: float
    committed: dict[str, int] | None = None
    finished: frozenset[str] | set[str] = frozenset()   # sessions whose round stopped this step (EOS, stop)


# ---- events a worker core emits (the shell forwards them to the coordinator core) ----

@dataclass(slots=True)
class FetchHistory:
    """A remote prefill task is about to run: read `tokens` of history KV from its decode worker."""

    task: PrefillTask
    tokens: int


@dataclass(slots=True)
class PrefillDone:
    """A prefill finished on `worker`; for remote tasks the new KV must now go back to the decode worker."""

    task: PrefillTask
    worker: int
    time_s: float


@dataclass(slots=True)
class FirstToken:
    """A round's first token is out on its decode/co-located worker (TTFT ends here)."""

    session_id: str
    worker: int
    time_s: float
    prefill_start_s: float


@dataclass(slots=True)
class RoundDone:
    """A round finished decoding; carries the round's ITL statistics."""

    session_id: str
    worker: int
    time_s: float
    output_tokens: int          # tokens the round generated (the first one included)
    itl_sum: float
    itl_count: int
    itl_max: float
    preemptions: int


@dataclass(slots=True)
class SessionFailed:
    """A session cannot continue on `worker` (e.g. its KV can never fit); the reason is reported."""

    session_id: str
    worker: int
    time_s: float
    reason: str
