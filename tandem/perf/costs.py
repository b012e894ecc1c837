"""Which step-time model a simulated worker gets: measured operator tables, derived ones, or the roofline.

`--cost-model auto` (the default) is measured wherever data exist (the GPU's own tables, or a GPU of the same
architecture to derive from) and the roofline elsewhere, with a note; `measured` insists and fails with one line
naming what is missing; `roofline` is the datasheet roofline. `--perf FILE` (a `tandem profile` fit) is separate.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tandem.perf.ampd_cost import AMPDCostModel, from_timers
from tandem.perf.hardware import get_gpu
from tandem.perf.measured.derive import derived_ops
from tandem.perf.measured.source import DEFAULT_FRAMEWORK, FRAMEWORKS, CostLabel, MissingCostData
from tandem.perf.measured.step import MeasuredStep
from tandem.perf.models import ModelSpec
from tandem.perf.roofline import Roofline
from tandem.perf.step_timer import StepTimer

COST_MODELS = ("auto", "measured", "roofline")
DEFAULT_COST_MODEL = "auto"


@dataclass(frozen=True)
class CostChoice:
    """The cost model a run uses, and the note to show when `auto` fell back to the roofline."""

    model: str                    # "measured" or "roofline" (measured covers derived GPUs)
    framework: str
    label: CostLabel
    note: str | None = None
    donor: str | None = None      # derive from this GPU's tables even where the GPU has its own (validation)


def choose_cost_model(cost_model: str, gpu: str, framework: str = DEFAULT_FRAMEWORK, donor: str | None = None
                      ) -> CostChoice:
    """Resolve `cost_model` for a GPU; ValueError for a bad name, MissingCostData when measured is impossible.
    `donor` derives the GPU's costs from that GPU's tables even where it has its own (the derivation's check)."""
    if cost_model not in COST_MODELS:
        raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"--cost-framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if cost_model == "roofline":
        return CostChoice("roofline", framework, CostLabel("roofline"))
    try:
        _, label = derived_ops(get_gpu(gpu), framework, donor)
    except MissingCostData as e:
        if cost_model == "measured":
            raise
        return CostChoice("roofline", framework, CostLabel("roofline"),
                          note=f"note: step costs from the roofline ({e})")
    return CostChoice("measured", framework, label, donor=donor)


@lru_cache(maxsize=256)
def step_timer(model: ModelSpec, gpu: str, tp: int, choice: CostChoice, ep: int = 1) -> StepTimer:
    """The step timer of one worker (experts sharded over ep of its tp GPUs) under a resolved cost choice (cached:
    timers hold no state once built, and a sweep or a planner builds the same workers many times)."""
    if choice.model == "roofline":
        return Roofline(model, gpu, tp, ep)
    return MeasuredStep(model, gpu, tp, choice.framework, choice.donor, ep)


@lru_cache(maxsize=64)
def routing_costs(model: ModelSpec, gpu: str, tps: tuple[int, ...], choice: CostChoice) -> AMPDCostModel:
    """AMPD's T_pre / T_dec / T_kv for workers of these tp degrees, fitted to their step timers (cached)."""
    if choice.model == "roofline" and model.weight_dtype == "bf16" and model.kv_dtype == "bf16":
        return AMPDCostModel.from_roofline(model.name, gpu, tps)
    # ep passed as the simulator passes it, so both share one cached timer per worker (lru_cache keys on the call)
    return from_timers({tp: step_timer(model, gpu, tp, choice, 1) for tp in tps}, source=str(choice.label))
