"""What the serving cores record about each round and session; metrics are computed from these."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.workload.session import SLO


@dataclass(slots=True)
class RoundRecord:
    """Timeline and placement of one round of one session."""

    index: int
    arrival_s: float                 # the round's input became available (session arrival or tool result)
    input_tokens: int                # tokens of new input (l_incr as given by the workload)
    history_tokens: int = 0          # resident KV reused when the round's prefill ran (l_hist)
    recomputed_tokens: int = 0       # history that had to be prefilled again (evicted or preempted KV)
    prefill_where: str = ""          # "local" (on the bound decode/co-located worker) or "remote"
    prefill_worker: int = -1
    prefill_start_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0           # tokens generated so far
    itl_sum_s: float = 0.0           # sum of inter-token gaps after the first token
    itl_count: int = 0
    itl_max_s: float = 0.0
    kv_transfer_s: float = 0.0       # time spent moving this round's KV (history read + incremental write-back)
    preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.prefill_start_s is None else self.prefill_start_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(slots=True)
class SessionRecord:
    """A session's rounds and outcome; `failed` sessions carry the reason and are never dropped."""

    session_id: str
    arrival_s: float
    slo: SLO | None
    num_rounds: int
    decode_worker: int = -1
    rounds: list[RoundRecord] = field(default_factory=list)
    finish_s: float | None = None
    failed: bool = False
    fail_reason: str = ""

    @property
    def completed(self) -> bool:
        return self.finish_s is not None and not self.failed
