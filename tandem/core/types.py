"""Messages between the sans-I/O cores and their shells: tasks, step plans and results, events."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.perf.roofline import BatchShape

# Worker roles.
PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"


@dataclass(slots=True, eq=False)
class PrefillTask:
    """One prefill (initial, incremental, or recompute) of one session round (ARCHITECTURE: PrefillTask)."""

    session_id: str
    round_idx: int
    l_hist: int                 # resident history KV the task attends to (read lazily when remote)
    l_incr: int                 # tokens to compute
    enqueue_s: float            # when the round's input arrived: the TTFT clock starts here
    ttft_slo_s: float = math.inf
    itl_slo_s: float = math.inf
    output_tokens: int = 1      # tokens the round generates (the first comes from this prefill)
    decode_worker: int = -1     # the worker holding (and keeping) the session's KV
    worker: int = -1            # where the task runs
    local: bool = True          # runs on decode_worker itself
    recompute: bool = False     # re-prefill of a preempted sequence: emits no first token
    postponed: int = 0          # AMPD Alg. 2 postponement counter
    est_s: float = 0.0          # estimated compute time on `worker` (perf model), for queue estimates
    done: int = 0               # tokens computed so far (chunked prefill)
    kv_ready: bool = True       # history present on `worker` (remote tasks wait for their lazy read)
    start_s: float | None = None
    block_hashes: tuple[int, ...] = ()  # chained hashes of the full blocks of history + new tokens (prefix cache)
    cached: int = 0             # tokens of l_incr found in the prefix cache at admission (not computed)
    hashed: int = 0             # leading blocks registered in the prefix cache so far

    @property
    def remaining(self) -> int:
        return self.l_incr - self.done


@dataclass(slots=True, eq=False)
class Seq:
    """A session's KV residency on a decode or co-located worker, and its decoding progress."""

    session_id: str
    num_tokens: int = 0         # tokens whose KV is resident
    to_decode: int = 0          # tokens still to generate in the current round
    last_token_s: float = -1.0  # time of the previous token of this round (-1: none yet)
    state: str = "new"          # new | prefill | running | idle | evicted
    retain_until: float = 0.0   # while idle, KV is pinned until then (Continuum TTL)
    order: int = 0              # admission order: preemption victims are the latest admitted
    itl_sum: float = 0.0
    itl_count: int = 0
    itl_max: float = 0.0
    cap: int = 0                # tokens the held blocks can store
    preemptions: int = 0


@dataclass(slots=True)
class StepPlan:
    """What a worker runs in one iteration: prefill chunks (task, tokens) and decoding sequences."""

    worker: int
    prefill: list[tuple[PrefillTask, int]] = field(default_factory=list)
    decode: list[Seq] = field(default_factory=list)
    shape: BatchShape = field(default_factory=BatchShape)


@dataclass(slots=True)
class StepResult:
    """What an executor reports back: elapsed time, sampled tokens and finished rounds when real."""

    elapsed_s: float
    tokens: dict[str, list[int]] | None = None
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
