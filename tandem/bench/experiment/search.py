"""The deployment search: each (workload, policy)'s fixed, shared or searched deployment, chosen by simulation."""
from __future__ import annotations

import math

from tandem.bench.experiment.candidates import check_fits, deployment_candidates
from tandem.bench.experiment.spec import (ExperimentError, ExperimentSpec, policy_is_colocated, workload_gpus,
                                          workload_slo)
from tandem.bench.experiment.tasks import Task, TaskResult, cell_summary
from tandem.core.deploy import parse_deploy


def _score(summary: dict) -> tuple:
    att = summary.get("slo_attainment")
    p95 = summary.get("ttft_p95_s")
    return (-(att if att is not None else -1.0), p95 if p95 is not None else math.inf)


def _fixed_deploy(spec: ExperimentSpec, workload: str, policy: str, gpus: int) -> str | None:
    d = spec.deploys.get(f"{workload}/{policy}") or spec.deploys.get(policy)
    if d is None:
        return None
    if f"{workload}/{policy}" not in spec.deploys and parse_deploy(d).gpus != gpus:
        return None  # a policy-wide fixed deployment applies only to workloads with its GPU count
    parse_deploy(d, gpus)
    return d


def plan_cells(spec: ExperimentSpec, model: str, gpu: str) -> dict[tuple[str, str], dict]:
    plans: dict[tuple[str, str], dict] = {}
    for w in spec.workloads:
        gpus = workload_gpus(spec, w)
        for p in spec.policies:
            fixed = _fixed_deploy(spec, w, p, gpus)
            if fixed is not None:
                check_fits(model, gpu, fixed)
                plans[w, p] = {"deploy": fixed, "source": "fixed", "candidates": []}
            elif p in spec.share_deploy and spec.share_deploy[p] in spec.policies:
                plans[w, p] = {"deploy": None, "source": f"shared:{spec.share_deploy[p]}", "candidates": []}
            else:
                cands = deployment_candidates(model, gpu, gpus, policy_is_colocated(p), spec.max_candidates)
                if not cands:
                    kind = "co-located" if policy_is_colocated(p) else "P/D"
                    raise ExperimentError(f"no {kind} deployment of {model} on {gpus} x {gpu} fits ({w}, {p})")
                plans[w, p] = {"deploy": cands[0] if len(cands) == 1 else None,
                               "source": "search" if len(cands) > 1 else "only", "candidates": cands}
    return plans


def cell_tasks(spec: ExperimentSpec, model: str, gpu: str, w: str, p: str, deploy: str, rate: float) -> list[Task]:
    sim = tuple(sorted(spec.sim.items()))
    return [Task(w, p, deploy, float(rate), s, spec.sessions, workload_gpus(spec, w), workload_slo(spec, w),
                 model, gpu, sim, spec.prefill_basis) for s in spec.seeds]


def search_rates(spec: ExperimentSpec, ref_rate: float) -> list[float]:
    """Rates at which deployment candidates are simulated."""
    return [float(r) for r in spec.rates] if spec.search_all_rates else [float(ref_rate)]


def plan_deploy(plan: dict, rate: float) -> str:
    """The deployment a plan runs at `rate`: its per-rate choice when it has one, else its single choice."""
    return plan.get("deploy_by_rate", {}).get(float(rate), plan["deploy"])


def search_deployments(spec, model, gpu, plans, runner, ref_rate) -> dict[tuple, list[TaskResult]]:
    """Simulate every candidate at the search rates; pick each plan's best by mean SLO attainment
    over those rates (ties: lower mean TTFT p95), and with `deploy_per_rate` also each rate's best;
    return the winners' runs for reuse."""
    rates = search_rates(spec, ref_rate)
    keys = [(w, p, d) for (w, p), plan in plans.items() if plan["source"] == "search" for d in plan["candidates"]]
    tasks = [t for (w, p, d) in keys for r in rates for t in cell_tasks(spec, model, gpu, w, p, d, r)]
    results = runner.run(tasks, "search")
    grouped: dict[tuple, list[TaskResult]] = {}
    for r in results:
        grouped.setdefault((r.task.workload, r.task.policy, r.task.deploy, r.task.rate), []).append(r)
    reuse: dict[tuple, list[TaskResult]] = {}
    for (w, p), plan in plans.items():
        if plan["source"] != "search":
            continue
        scored = []
        per_rate: dict[float, list] = {r: [] for r in rates}
        for order, d in enumerate(plan["candidates"]):
            runs = [grouped[w, p, d, r] for r in rates]
            errors = [x.error for rs in runs for x in rs if x.error]
            if errors:
                scored.append(({"deploy": d, "error": errors[0]}, None))
                continue
            keys_ = [_score(cell_summary(rs)) for rs in runs]
            for r, k in zip(rates, keys_):
                per_rate[r].append((k, order, d))
            att = -sum(k[0] for k in keys_) / len(keys_)
            p95 = sum(k[1] for k in keys_) / len(keys_)
            entry = {"deploy": d, "slo_attainment": att, "ttft_p95_s": p95,
                     "slo_attainment_by_rate": {f"{r:g}": -k[0] for r, k in zip(rates, keys_)}}
            scored.append((entry, ((-att, p95), order)))
        plan["candidates"] = [c for c, _ in scored]
        ok = [(key, c) for c, key in scored if key is not None]
        if not ok:
            raise ExperimentError(f"no candidate deployment could run ({w}, {p}): {scored[0][0].get('error')}")
        plan["deploy"] = min(ok, key=lambda kc: kc[0])[1]["deploy"]
        if spec.deploy_per_rate:
            plan["deploy_by_rate"] = {r: min(per_rate[r])[2] for r in rates}
        for r in rates:
            reuse[w, p, plan_deploy(plan, r), r] = grouped[w, p, plan_deploy(plan, r), r]
    for (w, p), plan in plans.items():
        if plan["source"].startswith("shared:"):
            src = plans[w, spec.share_deploy[p]]
            plan["deploy"] = src["deploy"]
            if "deploy_by_rate" in src:
                plan["deploy_by_rate"] = dict(src["deploy_by_rate"])
    return reuse
