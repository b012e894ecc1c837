"""The demo's load and SLO, derived from a `tandem profile` of this machine (pure: no I/O, no clock).

The rule:

- **Work per session.** Every round of the workload, at the demo's token scale, priced with the profile's AMPD
  costs as if it ran alone: a remote prefill of its new tokens after its history (T_pre(h, n) on the prefill
  worker), and its output decoded one token a step at its context (T_dec(1, ctx) on the decode worker). Summed per
  session and averaged over the sessions: `prefill_s` and `decode_s`.
- **Capacity.** 1P+1D sustains 1 / max(prefill_s, decode_s) sessions/s when the two workers step at once: each
  worker is one process, and the busier one (the decode worker, whose steps are mostly fixed cost at the tiny
  model's scale) bounds the rate. When the cores cannot run both at once (`parallel` = usable cores over torch
  threads per worker is 1: `taskset -c 0`, or two threads each on two cores), their steps take turns on the same
  cores and the bound is 1 / (prefill_s + decode_s): the profile times a step with the cores to itself. Decoding
  one sequence a step gives no credit for batching, so either bound is a conservative one.
- **Rate.** `load` (default 0.65) of that capacity.
- **Unloaded latencies.** Each round alone on the remote path: TTFT = its KV history moved to the prefill
  worker (T_kv(h)) + T_pre(h, n) + its KV moved back (T_kv(h + n)) + one decode step; ITL = T_dec(1, ctx). The
  SLO is `slo_factor` (default 5) times the 90th percentile of each over the workload's rounds, as AMPD and
  DistServe set SLOs as a multiple of the model's single-request latency.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.bench.demo_options import DEFAULT_LOAD, DEFAULT_SLO_FACTOR
from tandem.perf.ampd_cost import AMPDCostModel
from tandem.workload.session import SLO, Session

UNLOADED_PERCENTILE = 90


@dataclass(frozen=True, slots=True)
class RoundCost:
    """What one round costs alone, by the profile."""

    prefill_s: float          # T_pre(h, n) on the prefill worker
    decode_s: float           # its output tokens, one a step, on the decode worker
    ttft_s: float             # alone on the remote path: KV out, prefill, KV back, one decode step
    itl_s: float              # one decode step at its context


@dataclass(frozen=True, slots=True)
class Calibration:
    """The demo's rate and SLO and the figures they were derived from."""

    prefill_s: float          # mean prefill-worker seconds per session
    decode_s: float           # mean decode-worker seconds per session
    parallel: int             # worker steps the cores run at once (1 or 2)
    capacity: float           # sessions/s that 1P+1D sustains by the profile
    load: float
    rate: float               # sessions/s the demo offers
    unloaded_ttft_s: float    # p90 over rounds of the unloaded TTFT
    unloaded_itl_s: float     # p90 over rounds of the unloaded ITL
    slo_factor: float
    slo: SLO

    def describe(self) -> list[str]:
        """How the rate and the SLO were derived, one line each."""
        if self.parallel >= 2:
            bound = ("the " + ("decode" if self.decode_s >= self.prefill_s else "prefill") + " worker bounds it")
        else:
            bound = "the two workers share the cores one step at a time, so their sum bounds it"
        return [f"rate {self.rate:.2f} sessions/s = {self.load:g} x the {self.capacity:.2f}/s that the profile says "
                f"1P+1D sustains (per session {1e3 * self.prefill_s:.0f} ms of prefill, {1e3 * self.decode_s:.0f} ms "
                f"of decode one token a step; {bound})",
                f"SLO TTFT {1e3 * self.slo.ttft_s:.0f} ms, ITL {1e3 * self.slo.itl_s:.1f} ms = {self.slo_factor:g} x "
                f"the profiled unloaded p{UNLOADED_PERCENTILE} over the rounds (TTFT {1e3 * self.unloaded_ttft_s:.1f} "
                f"ms on the remote path, ITL {1e3 * self.unloaded_itl_s:.2f} ms)"]


def round_costs(session: Session, cost: AMPDCostModel) -> list[RoundCost]:
    """Each round of `session` priced alone with the profile's tp1 AMPD costs (history = every earlier input and
    output)."""
    out, hist = [], 0
    for r in session.rounds:
        n = r.input_tokens
        ctx = hist + n
        itl = cost.t_dec(1, 1, ctx)
        ttft = cost.t_kv(hist, 1, 1, True) + cost.t_pre(hist, n, 1) + cost.t_kv(ctx, 1, 1, True) + itl
        decode = sum(cost.t_dec(1, 1, ctx + i) for i in range(max(r.output_tokens - 1, 0)))
        out.append(RoundCost(cost.t_pre(hist, n, 1), decode, ttft, itl))
        hist = ctx + r.output_tokens
    return out


def calibrate(sessions: Sequence[Session], cost: AMPDCostModel, load: float = DEFAULT_LOAD,
              slo_factor: float = DEFAULT_SLO_FACTOR, parallel: int = 2) -> Calibration:
    """The demo's rate and SLO for `sessions` (already at the demo's token scale) on 1P+1D by the profile's costs,
    the two workers stepping at once when `parallel` >= 2, else taking turns."""
    if not sessions:
        raise ValueError("calibrate needs at least one session")
    if not 0 < load <= 1:
        raise ValueError(f"load must lie in (0, 1], got {load}")
    if not slo_factor > 0:
        raise ValueError(f"slo_factor must be > 0, got {slo_factor}")
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    per = [round_costs(s, cost) for s in sessions]
    prefill = float(np.mean([sum(r.prefill_s for r in rs) for rs in per]))
    decode = float(np.mean([sum(r.decode_s for r in rs) for rs in per]))
    capacity = 1.0 / (max(prefill, decode) if parallel >= 2 else prefill + decode)
    ttft = float(np.percentile([r.ttft_s for rs in per for r in rs], UNLOADED_PERCENTILE))
    itl = float(np.percentile([r.itl_s for rs in per for r in rs], UNLOADED_PERCENTILE))
    return Calibration(prefill, decode, min(parallel, 2), capacity, load, load * capacity, ttft, itl, slo_factor,
                       SLO(slo_factor * ttft, slo_factor * itl))
