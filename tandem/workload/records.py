"""What the serving cores record about each round and session; metrics are computed from these."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.workload.session import SLO


@dataclass(slots=True)
class RoundRecord:
    """Timeline and placement of one round of one session."""

    index: int
    arrival_s: float                 # the round's input became available (session arrival or tool result)
    input_tokens: int                # tokens of new input (l_incr as given by the workload)
    history_tokens: int = 0          # resident KV reused when the round's prefill ran (l_hist)
    recomputed_tokens: int = 0       # history prefilled again (evicted or preempted KV; vllm-pd: recomputed remotely)
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
    kv_failures: int = 0             # KV transfers of this round that failed or timed out (then recomputed locally)
    kv_fallback_tokens: int = 0      # tokens computed again on the decode worker after a failed KV write-back

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


# --------------------------------------------------------------------------- per-round records as JSONL

_DERIVED = ("ttft_s", "queue_s", "e2e_s")


def record_to_json(rec: SessionRecord) -> dict:
    """One session's record as plain JSON: every field, each round with its TTFT, queueing and E2E times."""
    rounds = []
    for r in rec.rounds:
        d = {f: getattr(r, f) for f in RoundRecord.__dataclass_fields__}
        d.update({k: getattr(r, k) for k in _DERIVED})
        d["itl_mean_s"] = r.itl_sum_s / r.itl_count if r.itl_count else None
        rounds.append(d)
    slo = None if rec.slo is None else {"ttft_s": rec.slo.ttft_s, "itl_s": rec.slo.itl_s}
    return {"session_id": rec.session_id, "arrival_s": rec.arrival_s, "slo": slo, "num_rounds": rec.num_rounds,
            "decode_worker": rec.decode_worker, "finish_s": rec.finish_s, "completed": rec.completed,
            "failed": rec.failed, "fail_reason": rec.fail_reason, "rounds": rounds}


def record_from_json(d: dict) -> SessionRecord:
    """The SessionRecord that record_to_json wrote (derived fields are recomputed, not read)."""
    fields = RoundRecord.__dataclass_fields__
    rounds = [RoundRecord(**{k: v for k, v in r.items() if k in fields}) for r in d["rounds"]]
    slo = None if d["slo"] is None else SLO(d["slo"]["ttft_s"], d["slo"]["itl_s"])
    return SessionRecord(d["session_id"], d["arrival_s"], slo, d["num_rounds"], d["decode_worker"], rounds,
                         d["finish_s"], d["failed"], d["fail_reason"])


def dump_records(records: list[SessionRecord], path) -> None:
    """Write one JSON line per session record (`tandem simulate|bench --records FILE`)."""
    with Path(path).open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(record_to_json(rec), separators=(",", ":")) + "\n" for rec in records)


def load_records(path) -> list[SessionRecord]:
    """Read what dump_records wrote, e.g. to recompute metrics with workload.metrics.summarize."""
    with Path(path).open(encoding="utf-8") as f:
        return [record_from_json(json.loads(line)) for line in f if line.strip()]
