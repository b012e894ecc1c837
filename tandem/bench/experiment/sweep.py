"""The sweep's entry point: search deployments, run every (workload, policy, rate) cell, write the report."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Executor
from pathlib import Path

from tandem.bench.experiment.pool import Runner
from tandem.bench.experiment.report import BASELINES, write_outputs, relative_improvement
from tandem.bench.experiment.search import plan_cells, search_deployments, cell_tasks, plan_deploy, search_rates
from tandem.bench.experiment.spec import (ExperimentError, ExperimentSpec, canonical_gpu, canonical_model,
                                          reference_rate, validate_spec, workload_gpus, workload_slo)
from tandem.bench.experiment.tasks import Task, TaskResult, cell_summary


def run_experiment(spec: ExperimentSpec, out_dir: str | Path, progress: bool = True,
                   executor: Executor | None = None) -> dict:
    """Search deployments, run every (workload, policy, rate) cell, write the report to `out_dir`; the simulations
    run on `executor` when given (e.g. Ray tasks), else in spec.jobs processes. The same spec gives the same
    results.json whatever runs it (wall times and parallelism go to run.json)."""
    t0 = time.perf_counter()
    validate_spec(spec)
    model, gpu = canonical_model(spec.model), canonical_gpu(spec.gpu)
    spec = dataclasses.replace(spec, model=model, gpu=gpu)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref = reference_rate(spec)
    plans = plan_cells(spec, model, gpu)

    n_rates = len(search_rates(spec, ref))
    n_search = sum(len(p["candidates"]) for p in plans.values() if p["source"] == "search") * len(spec.seeds) * n_rates
    n_runs = len(plans) * len(spec.rates) * len(spec.seeds)
    n_reused = sum(1 for p in plans.values() if p["source"] == "search") * len(spec.seeds) * (
        n_rates if spec.search_all_rates else (ref in spec.rates))
    runner = Runner(spec.jobs, progress, n_search + n_runs - n_reused, executor)
    try:
        reuse = search_deployments(spec, model, gpu, plans, runner, ref)
        todo: list[Task] = []
        for (w, p), plan in plans.items():
            for r in spec.rates:
                if (w, p, plan_deploy(plan, r), float(r)) not in reuse:
                    todo.extend(cell_tasks(spec, model, gpu, w, p, plan_deploy(plan, r), r))
        grouped: dict[tuple, list[TaskResult]] = {k: list(v) for k, v in reuse.items()}
        for res in runner.run(todo, "run"):
            t = res.task
            if res.error:
                raise ExperimentError(f"{t.workload}/{t.policy} on {t.deploy} at {t.rate:g}/s: {res.error}")
            grouped.setdefault((t.workload, t.policy, t.deploy, t.rate), []).append(res)
    except BaseException:
        runner.close(cancel=True)
        raise
    runner.close()

    cells = []
    for (w, p), plan in plans.items():
        slo = workload_slo(spec, w)
        for r in spec.rates:
            runs = grouped[w, p, plan_deploy(plan, r), float(r)]
            cell = {"workload": w, "policy": p, "rate": float(r), "deploy": plan_deploy(plan, r),
                    "gpus": workload_gpus(spec, w), "model": model, "gpu": gpu,
                    "slo_ttft_s": slo.ttft_s if slo else None, "slo_itl_s": slo.itl_s if slo else None,
                    "seeds": list(spec.seeds)}
            cell.update(cell_summary(runs))
            cells.append(cell)
    improvement = {}
    if "ampd" in spec.policies:
        for b in BASELINES:
            if b in spec.policies and (imp := relative_improvement(cells, b)) is not None:
                improvement[b] = imp
    result = {
        "spec": dataclasses.asdict(spec),
        "reference_rate": ref,
        "deployments": [{"workload": w, "policy": p, "gpus": workload_gpus(spec, w),
                         **{k: ({f"{r:g}": d for r, d in v.items()} if k == "deploy_by_rate" else v)
                            for k, v in plan.items()}}
                        for (w, p), plan in plans.items()],
        "cells": cells,
        "improvement": improvement,
        "wall_s": time.perf_counter() - t0,
        "executor": "local" if executor is None else type(executor).__name__,
    }
    result["files"] = write_outputs(out_dir, result, spec.policies)
    return result
