"""What policies read: a prefill task (routing and reordering decide on it) and the worker roles."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    """A worker's role; equal to its lower-case name, which is also its wire form."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


PREFILL, DECODE, COLOCATED = Role.PREFILL, Role.DECODE, Role.COLOCATED


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
    full_prefill: bool = False  # every prompt token computed on decode_worker (prompt logprobs need each position):
                                # never routed remote, takes no prefix-cache blocks
    hist_compute: int = 0       # history tokens a remote task computes itself instead of reading them (vLLM's PD:
                                # the prefill instance gets the whole prompt); its KV still goes out from l_hist

    @property
    def work(self) -> int:
        """Tokens this task computes: the recomputed history, then the new tokens."""
        return self.hist_compute + self.l_incr

    @property
    def first(self) -> int:
        """Position of the first token this task computes (the KV before it is read or resident)."""
        return self.l_hist - self.hist_compute

    @property
    def remaining(self) -> int:
        return self.hist_compute + self.l_incr - self.done
