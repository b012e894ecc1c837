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

import json
from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from tandem.workload.records import RoundRecord, SessionRecord, record_to_json


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
    acc = MetricsAccumulator()
    for s in records:
        acc.add(s)
    return acc.result(sim_time_s)


class MetricsAccumulator:
    """What `summarize` reads of the records, gathered one session record at a time (in the records' order, so every
    sum and mean is taken over the same values in the same order): a run can fold its records in as they end and keep
    flat arrays of floats instead of the records."""

    __slots__ = ("sessions", "completed", "failed", "fail_kinds", "with_slo", "attained", "slo_rounds_total",
                 "slo_rounds_ok", "ttft_init", "ttft_incr", "round_itl", "itl_sums", "itl_count", "itl_max", "tpot",
                 "e2e", "session_e2e", "queue", "kv_prefilled", "kv_remote", "rounds_total", "rounds_completed",
                 "preemptions", "recomputed_tokens", "kv_failures", "kv_fallback_tokens", "output_tokens",
                 "input_tokens")

    def __init__(self) -> None:
        self.sessions = self.completed = self.failed = self.with_slo = self.attained = 0
        self.fail_kinds: Counter[str] = Counter()
        self.slo_rounds_total = self.slo_rounds_ok = self.itl_count = self.rounds_total = self.rounds_completed = 0
        self.preemptions = self.recomputed_tokens = self.kv_failures = self.kv_fallback_tokens = 0
        self.output_tokens = self.input_tokens = 0
        self.itl_max: float | None = None
        self.ttft_init, self.ttft_incr, self.round_itl, self.itl_sums = array("d"), array("d"), array("d"), array("d")
        self.tpot, self.e2e, self.session_e2e, self.queue = array("d"), array("d"), array("d"), array("d")
        self.kv_prefilled, self.kv_remote = array("d"), array("d")

    def add(self, s: SessionRecord) -> None:
        """Fold in one session's record."""
        self.sessions += 1
        if s.completed:
            self.completed += 1
            self.session_e2e.append(s.finish_s - s.arrival_s)
        if s.failed:
            self.failed += 1
            self.fail_kinds[fail_kind(s.fail_reason)] += 1
        if s.slo is not None:
            self.with_slo += 1
            self.attained += session_attains(s)
            self.slo_rounds_total += s.num_rounds
            self.slo_rounds_ok += sum(1 for r in s.rounds if round_attains(r, s))
        self.rounds_total += s.num_rounds
        for r in s.rounds:
            ttft = r.ttft_s
            if ttft is not None:
                (self.ttft_init if r.index == 0 else self.ttft_incr).append(ttft)
            if r.itl_count > 0:
                self.round_itl.append(round_mean_itl(r))
                if self.itl_max is None or r.itl_max_s > self.itl_max:
                    self.itl_max = r.itl_max_s
            self.itl_sums.append(r.itl_sum_s)
            self.itl_count += r.itl_count
            if r.finish_s is not None:
                self.rounds_completed += 1
                self.e2e.append(r.finish_s - r.arrival_s)
                if r.first_token_s is not None and r.output_tokens >= 2:
                    self.tpot.append((r.finish_s - r.first_token_s) / (r.output_tokens - 1))
            if _prefilled(r):
                if r.queue_s is not None:
                    self.queue.append(r.queue_s)
                self.kv_prefilled.append(r.kv_transfer_s)
                if r.prefill_where == "remote":
                    self.kv_remote.append(r.kv_transfer_s)
            self.preemptions += r.preemptions
            self.recomputed_tokens += r.recomputed_tokens
            self.kv_failures += r.kv_failures
            self.kv_fallback_tokens += r.kv_fallback_tokens
            self.output_tokens += r.output_tokens
            if r.first_token_s is not None:
                self.input_tokens += r.input_tokens

    def result(self, sim_time_s: float) -> dict:
        """The metrics of the records folded in so far (see the module docstring)."""
        with_slo, attained = self.with_slo, self.attained
        prefilled, remote = len(self.kv_prefilled), len(self.kv_remote)
        out: dict = {
            "sessions_total": self.sessions,
            "sessions_completed": self.completed,
            "sessions_failed": self.failed,
            "sessions_unfinished": self.sessions - self.completed - self.failed,
            "fail_reasons": dict(sorted(self.fail_kinds.items())),
            "sessions_with_slo": with_slo,
            "sessions_slo_attained": attained,
            "slo_attainment": _ratio(attained, with_slo),
            "round_slo_attainment": _ratio(self.slo_rounds_ok, self.slo_rounds_total),
            "goodput_sessions_per_s": _ratio(attained, sim_time_s) if with_slo else None,
        }
        out.update(_latency_block("ttft_initial", self.ttft_init))
        out.update(_latency_block("ttft_incremental", self.ttft_incr))
        out["ttft_p95_s"] = _pct(self.ttft_init + self.ttft_incr, 95)
        out.update({
            "itl_mean_s": _ratio(sum(self.itl_sums), self.itl_count),
            "itl_p95_s": _pct(self.round_itl, 95),
            "itl_p99_s": _pct(self.round_itl, 99),
            "itl_max_s": self.itl_max,
            "tpot_mean_s": _mean(self.tpot),
            "tpot_p95_s": _pct(self.tpot, 95),
            "e2e_mean_s": _mean(self.e2e),
            "e2e_p95_s": _pct(self.e2e, 95),
            "session_e2e_mean_s": _mean(self.session_e2e),
            "queue_mean_s": _mean(self.queue),
            "queue_p95_s": _pct(self.queue, 95),
            "kv_transfer_mean_s": _mean(self.kv_prefilled),
            "kv_transfer_remote_mean_s": _mean(self.kv_remote),
            "local_prefill_fraction": _ratio(prefilled - remote, prefilled),
            "rounds_total": self.rounds_total,
            "rounds_completed": self.rounds_completed,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "kv_failures": self.kv_failures,
            "kv_fallback_tokens": self.kv_fallback_tokens,
            "throughput_output_tokens_per_s": _ratio(self.output_tokens, sim_time_s),
            "throughput_input_tokens_per_s": _ratio(self.input_tokens, sim_time_s),
        })
        return out


class RecordStream:
    """Session records taken as they end: each folded into the metrics and, with `path`, written as one JSON line
    (as dump_records writes them); none is kept, so a run of a million rounds holds flat arrays, not records."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.metrics = MetricsAccumulator()
        self._file = Path(path).open("w", encoding="utf-8") if path is not None else None

    def add(self, rec: SessionRecord) -> None:
        """Take one ended session's record."""
        self.metrics.add(rec)
        if self._file is not None:
            self._file.write(json.dumps(record_to_json(rec), separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Finish the JSONL file (if any)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self, sim_time_s: float) -> dict:
        """summarize() of every record taken, in the order they were taken."""
        return self.metrics.result(sim_time_s)
