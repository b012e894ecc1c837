"""Serving metrics computed from the cores' session records; names follow vLLM where one exists.

Definitions (all times in seconds; an empty population gives None, which JSON writes as null):

Sessions
- `sessions_total`: every record, failed or not.
- `sessions_completed`: not failed and finished; `sessions_failed`: failed (`fail_reasons` counts them by kind, the part of each reason before ': ');
  `sessions_unfinished`: neither (still running when the simulation stopped).
- `slo_attainment`: over sessions that carry an SLO, the fraction that attain it. A session attains
  its SLO when it completed, all its `num_rounds` rounds produced a first token, every round's
  TTFT <= `slo.ttft_s`, and its mean ITL (sum of `itl_sum_s` over rounds / sum of `itl_count`)
  <= `slo.itl_s` (a session with no inter-token gaps has mean ITL 0). Failed and unfinished
  sessions are misses. Sessions without an SLO are excluded (None if no session has one).
- `round_slo_attainment`: over all `num_rounds` rounds of the sessions with an SLO, the fraction
  that finished with TTFT <= `slo.ttft_s` and round mean ITL (`itl_sum_s / itl_count`, 0 without
  gaps) <= `slo.itl_s`. Rounds that never ran or never finished are misses.
- `goodput_sessions_per_s`: SLO-attaining sessions / `sim_time_s`.

Rounds (a round counts for a latency metric once that latency is known)
- `ttft_initial_*`: TTFT of round 0 (first_token_s - arrival_s); `ttft_incremental_*`: rounds > 0;
  `ttft_p95_s`: all rounds together.
- `itl_mean_s`: mean over every inter-token gap of every round (sum itl_sum_s / sum itl_count),
  as vLLM's mean ITL. `itl_p95_s`, `itl_p99_s`: percentiles of the per-round mean ITL (rounds with
  at least one gap), since records keep sums, not every gap. `itl_max_s`: the largest single gap.
- `tpot_mean_s`, `tpot_p95_s`: per finished round with >= 2 output tokens,
  (finish_s - first_token_s) / (output_tokens - 1), as vLLM's TPOT.
- `e2e_mean_s`, `e2e_p95_s`: per finished round, finish_s - arrival_s;
  `session_e2e_mean_s`: per completed session, finish_s - arrival_s.
- `queue_mean_s`, `queue_p95_s`: per prefilled round, prefill_start_s - arrival_s.
- `kv_transfer_mean_s`: mean `kv_transfer_s` over prefilled rounds (local rounds count with their
  own, often zero, transfer time); `kv_transfer_remote_mean_s`: over remote-prefilled rounds only.
- `local_prefill_fraction`: prefilled rounds whose prefill_where is not "remote" (so "local" and
  co-located prefills) / prefilled rounds. A round is prefilled when prefill_where is set or
  prefill_start_s is known.
- `rounds_total` (sum of num_rounds), `rounds_completed` (rounds with finish_s),
  `preemptions`, `recomputed_tokens`, `kv_failures` (KV transfers failed or timed out, each recomputed
  locally), `kv_fallback_tokens` (tokens prefilled again after a failed write-back) (sums over rounds).
- `throughput_output_tokens_per_s`: output tokens of all rounds / `sim_time_s`;
  `throughput_input_tokens_per_s`: input tokens of rounds whose prefill finished / `sim_time_s`.

Percentiles use numpy's default (linear interpolation).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from tandem.workload.records import RoundRecord, SessionRecord


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _ratio(num: float, den: float) -> float | None:
    return float(num) / den if den > 0 else None


def round_mean_itl(r: RoundRecord) -> float:
    """Mean inter-token gap of one round; 0 when the round has no gaps (at most one output token)."""
    return r.itl_sum_s / r.itl_count if r.itl_count > 0 else 0.0


def session_mean_itl(s: SessionRecord) -> float:
    """Mean inter-token gap over all rounds of a session (gap-weighted); 0 without gaps."""
    count = sum(r.itl_count for r in s.rounds)
    return sum(r.itl_sum_s for r in s.rounds) / count if count > 0 else 0.0


def round_attains(r: RoundRecord, s: SessionRecord) -> bool:
    """Whether a round finished within its session's TTFT SLO and with mean ITL within its ITL SLO."""
    if s.slo is None or r.finish_s is None or r.ttft_s is None:
        return False
    return r.ttft_s <= s.slo.ttft_s and round_mean_itl(r) <= s.slo.itl_s


def session_attains(s: SessionRecord) -> bool:
    """Whether a session completed every round with TTFT <= its TTFT SLO and mean ITL <= its ITL SLO."""
    if s.slo is None or not s.completed or len(s.rounds) < s.num_rounds:
        return False
    for r in s.rounds:
        if r.ttft_s is None or r.ttft_s > s.slo.ttft_s:
            return False
    return session_mean_itl(s) <= s.slo.itl_s


def _prefilled(r: RoundRecord) -> bool:
    return bool(r.prefill_where) or r.prefill_start_s is not None


def _latency_block(prefix: str, xs: list[float]) -> dict:
    return {
        f"{prefix}_mean_s": _mean(xs),
        f"{prefix}_p50_s": _pct(xs, 50),
        f"{prefix}_p95_s": _pct(xs, 95),
        f"{prefix}_p99_s": _pct(xs, 99),
    }


def fail_kind(reason: str) -> str:
    """The category of a failure reason: the part before the first ': ' (details follow it)."""
    return (reason or "unknown").split(": ", 1)[0]


def summarize(records: Iterable[SessionRecord], sim_time_s: float) -> dict:
    """All serving metrics of one run as a flat JSON-ready dict (see the module docstring)."""
    records = list(records)
    rounds = [r for s in records for r in s.rounds]

    with_slo = [s for s in records if s.slo is not None]
    attained = sum(1 for s in with_slo if session_attains(s))
    slo_rounds_total = sum(s.num_rounds for s in with_slo)
    slo_rounds_ok = sum(1 for s in with_slo for r in s.rounds if round_attains(r, s))

    ttft_init = [r.ttft_s for r in rounds if r.index == 0 and r.ttft_s is not None]
    ttft_incr = [r.ttft_s for r in rounds if r.index > 0 and r.ttft_s is not None]
    round_itl = [round_mean_itl(r) for r in rounds if r.itl_count > 0]
    itl_sum = sum(r.itl_sum_s for r in rounds)
    itl_count = sum(r.itl_count for r in rounds)
    tpot = [
        (r.finish_s - r.first_token_s) / (r.output_tokens - 1)
        for r in rounds
        if r.finish_s is not None and r.first_token_s is not None and r.output_tokens >= 2
    ]
    e2e = [r.e2e_s for r in rounds if r.e2e_s is not None]
    session_e2e = [s.finish_s - s.arrival_s for s in records if s.completed]
    prefilled = [r for r in rounds if _prefilled(r)]
    queue = [r.queue_s for r in prefilled if r.queue_s is not None]
    remote = [r for r in prefilled if r.prefill_where == "remote"]
    failed = [s for s in records if s.failed]
    completed = sum(1 for s in records if s.completed)

    out: dict = {
        "sessions_total": len(records),
        "sessions_completed": completed,
        "sessions_failed": len(failed),
        "sessions_unfinished": len(records) - completed - len(failed),
        "fail_reasons": dict(sorted(Counter(fail_kind(s.fail_reason) for s in failed).items())),
        "sessions_with_slo": len(with_slo),
        "sessions_slo_attained": attained,
        "slo_attainment": _ratio(attained, len(with_slo)),
        "round_slo_attainment": _ratio(slo_rounds_ok, slo_rounds_total),
        "goodput_sessions_per_s": _ratio(attained, sim_time_s) if with_slo else None,
    }
    out.update(_latency_block("ttft_initial", ttft_init))
    out.update(_latency_block("ttft_incremental", ttft_incr))
    out["ttft_p95_s"] = _pct(ttft_init + ttft_incr, 95)
    out.update({
        "itl_mean_s": _ratio(itl_sum, itl_count),
        "itl_p95_s": _pct(round_itl, 95),
        "itl_p99_s": _pct(round_itl, 99),
        "itl_max_s": max((r.itl_max_s for r in rounds if r.itl_count > 0), default=None),
        "tpot_mean_s": _mean(tpot),
        "tpot_p95_s": _pct(tpot, 95),
        "e2e_mean_s": _mean(e2e),
        "e2e_p95_s": _pct(e2e, 95),
        "session_e2e_mean_s": _mean(session_e2e),
        "queue_mean_s": _mean(queue),
        "queue_p95_s": _pct(queue, 95),
        "kv_transfer_mean_s": _mean([r.kv_transfer_s for r in prefilled]),
        "kv_transfer_remote_mean_s": _mean([r.kv_transfer_s for r in remote]),
        "local_prefill_fraction": _ratio(len(prefilled) - len(remote), len(prefilled)),
        "rounds_total": sum(s.num_rounds for s in records),
        "rounds_completed": sum(1 for r in rounds if r.finish_s is not None),
        "preemptions": sum(r.preemptions for r in rounds),
        "recomputed_tokens": sum(r.recomputed_tokens for r in rounds),
        "kv_failures": sum(r.kv_failures for r in rounds),
        "kv_fallback_tokens": sum(r.kv_fallback_tokens for r in rounds),
        "throughput_output_tokens_per_s": _ratio(sum(r.output_tokens for r in rounds), sim_time_s),
        "throughput_input_tokens_per_s": _ratio(
            sum(r.input_tokens for r in rounds if r.first_token_s is not None), sim_time_s),
    })
    return out
