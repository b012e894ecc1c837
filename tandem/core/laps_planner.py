"""The LAPS step planner of a prefill worker in temporal mode: each step a dispatched batch of short prefills (in
its graph bucket) or a chunk of one long prefill, as tandem/core/laps_sched.py decides."""
from __future__ import annotations

import math

from tandem.core.chunked_planner import ChunkedPlanner
from tandem.core.residency import WorkerHost
from tandem.core.types import StepPlan


class LapsPlanner(ChunkedPlanner):
    """LAPS buckets (split on); with split off a LAPS prefill worker plans chunked steps (ChunkedPlanner)."""

    def plan(self, core: WorkerHost, now: float) -> StepPlan | None:
        """The LapsScheduler's step; with none, the worker wakes when AWD decides next."""
        laps = core.laps
        plan = laps.schedule(core, now)
        core.wake_s = laps.wake_at_s if plan is None else math.inf
        return plan


__all__ = ["LapsPlanner"]
