"""The cost models' predictions of a tensor-parallel engine's steps, beside the steps the engine ran.

Two paths, each the one a shell uses, none invented here:
- a `tandem profile` step timer (`Profile.step_timer(tp)`), which the simulator prices a tp worker's steps with: the
  fitted model of a profile taken at that degree, or from a tp1 profile the sharded compute plus the all-reduces it
  measured on the host (tandem.perf.collective);
- the nominal CPU roofline the live runtime routes with when it has no profile (`tandem.runtime.costs`,
  `serving_cost_model(..., tps=(1, 2))`): AMPD's T_pre per prefill chunk and T_dec per decode batch, with compute
  and KV reads divided by tp and no collective term. A step's prediction is the sum of its chunks' T_pre and its
  decode rows' T_dec (how a worker's queue estimate adds them).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from tandem.perf.ampd_cost import AMPDCostModel
from tandem.perf.batch_shape import BatchShape
from tandem.perf.step_timer import StepTimer


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its batch shape, its prefill chunks (history tokens, new tokens) and its execute seconds."""

    shape: BatchShape
    chunks: tuple[tuple[int, int], ...]
    seconds: float


def record_steps(engine) -> list[StepRecord]:
    """Record every later step of `engine` (an LLMEngine) into the returned list: its plan's shape and chunks and
    the model run's seconds (the engine's execute time, as its StepStats.execute_s counts it)."""
    steps: list[StepRecord] = []
    finish = engine.finish_step

    def finish_and_record(prep, out):
        plan = prep.plan
        if plan is not None and prep.runs:
            steps.append(StepRecord(replace(plan.shape), tuple((t.first + t.done, n) for t, n in plan.prefill),
                                    prep.t2 - prep.t1))
        return finish(prep, out)

    engine.finish_step = finish_and_record
    return steps


def nominal_step_s(cost: AMPDCostModel, step: StepRecord, tp: int) -> float:
    """Seconds of one step on a tp worker by AMPD's T_pre (each prefill chunk) plus T_dec (the decode rows)."""
    s = step.shape
    return sum(cost.t_pre(h, n, tp) for h, n in step.chunks) + cost.t_dec(s.num_decode, tp, s.decode_ctx_tokens)


def mean_predicted_s(steps: Sequence[StepRecord], timer: StepTimer | None = None, cost: AMPDCostModel | None = None,
                     tp: int = 1) -> float:
    """Mean predicted seconds of `steps`: by a step timer (a profile's, for the steps' degree) or by `cost` at tp."""
    if not steps:
        raise ValueError("no steps to predict")
    if (timer is None) == (cost is None):
        raise ValueError("give exactly one of a step timer or an AMPD cost model")
    if timer is not None:
        return sum(timer.step_time(r.shape) for r in steps) / len(steps)
    return sum(nominal_step_s(cost, r, tp) for r in steps) / len(steps)


def error_pct(predicted: float, measured: float) -> float:
    """Signed error of a prediction in percent of the measurement (negative: the model is too fast)."""
    return 100.0 * (predicted - measured) / measured


__all__ = ["StepRecord", "record_steps", "nominal_step_s", "mean_predicted_s", "error_pct"]
