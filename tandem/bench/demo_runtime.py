"""What the live runtime adds around the engine's steps, measured by the demo on its first server before the
measured sessions, so that the simulator's second prediction prices the runtime as well as the steps.

A quick profile times engine steps alone; a live round also pays the HTTP request and response, the messages
between the coordinator and the workers, the worker loop between two steps, and the serving process's own CPU
(HTTP server, coordinator, client) on the cores the workers step on. The probe (never the workload) replays
PROBE_SESSIONS one at a time on the idle server and reads off, as benchmarks/sim_to_real.py does at length:

- `step_gap_s`: the median over the probe's rounds of its mean ITL minus the profiled decode step at its contexts
  (times the speed check's decode factor);
- `host_token_s`: this process's CPU seconds over the probe, beyond its idle rate, per output token; `cores`: the
  cores this process may run on (the simulator shares them between the workers' steps and that CPU);
- `request_s`: the median over the probe's rounds of the measured TTFT minus the simulated TTFT with the two above
  (request and response latency and the messages' hops together: `hop_s` and `output_s` stay 0).

Nothing is fitted to the workload: three medians and a ratio of CPU seconds to tokens, on a probe of its own.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from tandem.workload.records import SessionRecord
from tandem.workload.session import Round, Session

PROBE_FIRST = (64, 256, 512)     # new tokens of each probe session's first round (two passes)
PROBE_NEXT = 48                  # new tokens of its second round (history: the first round)
PROBE_OUTPUT = 16                # output tokens of every probe round
PROBE_GAP_S = 0.05               # tool gap between a probe session's two rounds
IDLE_WINDOW_S = 0.3              # this process's idle CPU rate is measured over this long before the probe
SOURCE = ("tandem demo's runtime probe on the idle server: step_gap_s = median of each round's mean ITL minus the "
          "profiled decode step; host_token_s = this process's CPU (HTTP, coordinator, client) beyond its idle rate "
          "per output token; request_s = median of measured minus simulated TTFT (hops included, hop_s 0)")


def probe_sessions() -> list[Session]:
    """The probe: two-round sessions, replayed one at a time (their own text: nothing the workload reuses)."""
    return [Session(f"probe-{i}", 0.0, [Round(n, PROBE_OUTPUT, PROBE_GAP_S), Round(PROBE_NEXT, PROBE_OUTPUT)])
            for i, n in enumerate(PROBE_FIRST * 2)]


@dataclass
class Probe:
    """The probe's replay: its records and this process's CPU around it."""

    records: list[SessionRecord]
    cpu_s: float                 # this process's CPU seconds during the probe
    wall_s: float
    idle_cpu_rate: float         # its CPU seconds per second before the probe, with nothing asked of the server

    @property
    def host_cpu_s(self) -> float:
        """CPU seconds the probe's rounds cost this process beyond its idle rate."""
        return max(0.0, self.cpu_s - self.idle_cpu_rate * self.wall_s)


async def run_probe(replay: Callable[[list[Session]], Awaitable[list[SessionRecord]]]) -> Probe:
    """This process's idle CPU rate, then each probe session replayed alone by `replay`."""
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(IDLE_WINDOW_S)
    idle = (time.process_time() - c0) / (time.perf_counter() - t0)
    c0, t0 = time.process_time(), time.perf_counter()
    records: list[SessionRecord] = []
    for s in probe_sessions():
        records += await replay([s])
    return Probe(records, time.process_time() - c0, time.perf_counter() - t0, idle)


def decode_contexts(session: Session) -> list[list[int]]:
    """Per round of `session`, the KV length of each decode step after its first token (history + input + j)."""
    out, hist = [], 0
    for r in session.rounds:
        ctx = hist + r.input_tokens
        out.append([ctx + j for j in range(1, r.output_tokens)])
        hist = ctx + r.output_tokens
    return out


def step_gap(records: Sequence[SessionRecord], sessions: Sequence[Session], decode_time: Callable[[int], float],
             decode_factor: float = 1.0) -> float:
    """The worker loop's time between steps: median over rounds of the mean ITL minus the mean profiled decode step
    (`decode_time(ctx)` x `decode_factor`) at the round's contexts; 0 when no round has two tokens or less."""
    by_id = {s.session_id: s for s in sessions}
    gaps = []
    for rec in records:
        ctxs = decode_contexts(by_id[rec.session_id])
        for r in rec.rounds:
            if r.itl_count > 0 and ctxs[r.index]:
                pred = statistics.mean(decode_time(c) for c in ctxs[r.index]) * decode_factor
                gaps.append(r.itl_sum_s / r.itl_count - pred)
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def ttfts(records: Sequence[SessionRecord]) -> dict[tuple[str, int], float]:
    """Every round's TTFT by (session, round)."""
    return {(s.session_id, r.index): r.ttft_s for s in records for r in s.rounds if r.ttft_s is not None}


def request_latency(measured: Mapping[tuple[str, int], float], simulated: Mapping[tuple[str, int], float]) -> float:
    """The median over the rounds both have of measured minus simulated TTFT (0 when negative or none)."""
    resid = [measured[k] - simulated[k] for k in measured if k in simulated]
    return max(0.0, statistics.median(resid)) if resid else 0.0


def runtime_block(probe: Probe, sessions: Sequence[Session], decode_time: Callable[[int], float],
                  step_factor: Mapping[str, float], cores: int,
                  simulate_ttfts: Callable[[dict], Mapping[tuple[str, int], float]]) -> dict:
    """The profile's `runtime` block from the probe (see the module doc); `simulate_ttfts(runtime)` simulates the
    probe's sessions, each alone, with a runtime block and returns their TTFTs."""
    tokens = sum(r.output_tokens for s in probe.records for r in s.rounds)
    rt = {"request_s": 0.0, "output_s": 0.0, "hop_s": 0.0, "msg_s": 0.0, "host_round_s": 0.0,
          "step_gap_s": step_gap(probe.records, sessions, decode_time, step_factor.get("decode", 1.0)),
          "host_token_s": probe.host_cpu_s / max(tokens, 1), "cores": int(cores),
          "step_factor": {"prefill": float(step_factor.get("prefill", 1.0)),
                          "decode": float(step_factor.get("decode", 1.0))}}
    rt["request_s"] = request_latency(ttfts(probe.records), simulate_ttfts(rt))
    rt["source"] = SOURCE
    return rt


def describe(rt: Mapping) -> str:
    """One line: the measured runtime block."""
    return (f"runtime measured on the idle server: request+response {1e3 * rt['request_s']:.1f} ms a round, "
            f"{1e3 * rt['step_gap_s']:.2f} ms between steps, {1e3 * rt['host_token_s']:.2f} ms of serving CPU a "
            f"token on {rt['cores']} core(s)")
