"""One simulation of a sweep (a cell at one seed), running it, and pooling a cell's seeds into a summary."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.workload.metrics import summarize
from tandem.workload.session import SLO


@dataclass(frozen=True, slots=True)
class Task:
    """One simulation: a workload at a rate and seed, served by a policy on a deployment."""

    workload: str
    policy: str
    deploy: str
    rate: float
    seed: int
    sessions: int
    gpus: int
    slo: SLO | None
    model: str
    gpu: str
    sim: tuple[tuple[str, Any], ...] = ()
    prefill_basis: str = "input"


@dataclass(slots=True)
class TaskResult:
    """What one simulation returned (records for pooling), or the error that stopped it."""

    task: Task
    records: list = field(default_factory=list)
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0
    deployment: str = ""
    error: str = ""


def run_task(task: Task) -> TaskResult:
    """Generate the task's sessions and simulate them; configuration errors are returned, not raised."""
    from tandem.perf.errors import DoesNotFitError, ParallelismError
    from tandem.sim.cluster import ConfigError, SimConfig, simulate
    from tandem.workload.generators import generate

    sessions = generate(task.workload, task.sessions, task.rate, task.seed, slo=task.slo,
                        prefill_basis=task.prefill_basis)
    cfg = SimConfig(model=task.model, gpu=task.gpu, gpus=task.gpus, deploy=task.deploy,
                    policy=task.policy, seed=task.seed, **dict(task.sim))
    t0 = time.perf_counter()
    try:
        res = simulate(sessions, cfg)
    except (ConfigError, DoesNotFitError, ParallelismError) as e:
        return TaskResult(task, error=f"{type(e).__name__}: {e}")
    wall = getattr(res, "wall_s", None)
    return TaskResult(task, records=list(res.records), sim_time_s=float(res.sim_time_s),
                      wall_s=float(wall if wall is not None else time.perf_counter() - t0),
                      events=int(getattr(res, "events", 0)), deployment=str(getattr(res, "deployment", task.deploy)))


def cell_summary(results: Sequence[TaskResult]) -> dict:
    """Pool the seeds of one cell: summarize() over all their records, plus run totals."""
    records = [r for res in results for r in res.records]
    sim_time = sum(res.sim_time_s for res in results)
    out = summarize(records, sim_time)
    out["sim_time_s"] = sim_time
    out["wall_s"] = sum(res.wall_s for res in results)
    out["events"] = sum(res.events for res in results)
    out["slo_attainment_by_seed"] = [summarize(res.records, res.sim_time_s)["slo_attainment"] for res in results]
    return out
