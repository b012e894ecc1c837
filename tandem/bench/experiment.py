"""Experiment sweeps (AMPD §7): workloads x policies x arrival rates, each policy on its best deployment.

For every (workload, policy) the deployment is chosen by a small search (see `deployment_candidates`):
every candidate is simulated at the reference rate (the median of the rates, the upper one when their
number is even) and scored by SLO attainment, ties broken by lower TTFT p95 (all rounds), then by
candidate order. The chosen deployment then runs at every rate (the search run at the reference rate
is reused as that cell). This mirrors the paper's protocol: AMPD's deployment comes from its planner,
the baselines' are tuned and their best is reported.

Every cell pools the session records of all its seeds into one `summarize()`; per-seed attainment is
kept in `slo_attainment_by_seed`.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.core.deploy import parse_deploy
from tandem.workload.metrics import summarize
from tandem.workload.session import SLO

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
DEFAULT_GPUS = 8  # for workloads AMPD did not run (e.g. agentic-long)
COLOCATED_POLICIES: tuple[str, ...] = ("vllm", "continuum")
ABLATION_POLICIES: tuple[str, ...] = ("ampd-no-pr", "ampd-no-ar-pr")
BASELINES: tuple[str, ...] = ("dynamo", "vllm", "continuum", "ampd-no-pr", "ampd-no-ar-pr")

PAPER_IMPROVEMENT: dict[str, str] = {
    "dynamo": "+67.29% on average (up to +967.54%)",
    "vllm": "+339.74% on average (up to +3435.1%)",
    "continuum": "not reported (often tied with vLLM)",
    "ampd-no-pr": "+13.42% to +14.81% (prefill reordering, Fig. 5)",
    "ampd-no-ar-pr": "+44.47% to +402% (routing + reordering, Fig. 5)",
}
"""AMPD's reported gain in SLO attainment over each baseline (§7.2)."""

PAPER_MEAN_IMPROVEMENT: dict[str, float] = {"dynamo": 0.6729, "vllm": 3.3974}


class ExperimentError(ValueError):
    """An experiment specification is invalid or no deployment of a cell can run."""


def policy_is_colocated(policy: str) -> bool:
    """Whether `policy` serves on co-located workers (C:...) rather than a P/D deployment."""
    try:
        from tandem.sim.cluster import POLICIES
    except ImportError:
        return policy in COLOCATED_POLICIES
    spec = POLICIES.get(policy) if isinstance(POLICIES, dict) else None
    if spec is not None and hasattr(spec, "disaggregated"):
        return not spec.disaggregated
    return policy in COLOCATED_POLICIES


# --------------------------------------------------------------------------- specification


@dataclass(slots=True)
class ExperimentSpec:
    """What to sweep. Empty `gpus`/`slos` entries fall back to AMPD's (PAPER_GPUS, PAPER_SLOS)."""

    model: str = "llama-3.1-70b"
    gpu: str = "h20"
    workloads: list[str] = field(default_factory=lambda: ["toolbench", "gaia", "hotpotqa", "dureader"])
    policies: list[str] = field(default_factory=lambda: ["ampd", "dynamo", "vllm", "continuum"])
    rates: list[float] = field(default_factory=lambda: [0.8, 1.2, 1.6, 2.0, 2.4])
    sessions: int = 100                       # per cell and seed; AMPD's runs have ~99 sessions
    seeds: list[int] = field(default_factory=lambda: [0])
    gpus: dict[str, int] = field(default_factory=dict)          # workload -> GPUs (override)
    slos: dict[str, SLO | None] = field(default_factory=dict)   # workload -> SLO (override; None: no SLO)
    deploys: dict[str, str] = field(default_factory=dict)       # "policy" or "workload/policy" -> fixed deployment
    share_deploy: dict[str, str] = field(default_factory=dict)  # policy -> policy whose chosen deployment it reuses
    max_candidates: int = 12                  # per (workload, policy) in the deployment search
    reference_rate: float | None = None       # search rate when search_all_rates is off; default: median of `rates`
    search_all_rates: bool = True             # score candidates by mean SLO attainment over every rate
    deploy_per_rate: bool = False             # pick each rate's best candidate (as a planner given the rate would)
    prefill_basis: str = "input"              # what Table 1's prefill length measures (see workload.generators)
    jobs: int = 1                             # worker processes
    sim: dict[str, Any] = field(default_factory=dict)           # extra SimConfig fields
    name: str = "custom"


PRESETS: dict[str, ExperimentSpec] = {
    "demo": ExperimentSpec(
        name="demo", model="llama-3.1-70b", gpu="h20", workloads=["toolbench", "hotpotqa"],
        policies=["ampd", "dynamo", "vllm", "continuum"], rates=[0.8, 1.6, 2.4], sessions=60,
        # each policy's winner of the deployment search at 1.6 req/s on toolbench (hotpotqa agrees)
        deploys={"ampd": "P:tp4x1,D:tp4x1", "dynamo": "P:tp2x3,D:tp2x1",
                 "vllm": "C:tp8x1", "continuum": "C:tp8x1"},
    ),
    "paper": ExperimentSpec(
        name="paper", model="llama-3.1-70b", gpu="h20", workloads=["toolbench", "gaia", "hotpotqa", "dureader"],
        policies=["ampd", "dynamo", "vllm", "continuum"], rates=[0.8, 1.2, 1.6, 2.0, 2.4], sessions=100,
    ),
    "ablation": ExperimentSpec(
        name="ablation", model="llama-3.1-70b", gpu="h20", workloads=["dureader", "gaia"],
        policies=["ampd-no-ar-pr", "ampd-no-pr", "ampd"], rates=[2.0], sessions=100,
        share_deploy={"ampd-no-pr": "ampd", "ampd-no-ar-pr": "ampd"},
    ),
}
"""demo: small and fast, fixed 8-GPU deployments (no search); paper: the AMPD Fig. 4 grid for Llama-3.1-70B
on H20; ablation: AMPD Fig. 5 (DuReader and GAIA at 2 req/s, the variants on AMPD's chosen deployment)."""


def preset(name: str, **overrides: Any) -> ExperimentSpec:
    """A copy of PRESETS[name] with fields replaced by the non-None `overrides`."""
    if name not in PRESETS:
        raise ExperimentError(f"unknown preset {name!r} (valid: {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def _paper_tables() -> tuple[dict, dict, tuple]:
    from tandem.workload import generators as g
    names = tuple(getattr(g, "GENERATOR_NAMES", tuple(g.WORKLOADS)))
    return g.PAPER_GPUS, g.PAPER_SLOS, names


def canonical_model(name: str) -> str:
    """The catalogue name of a model (aliases and HF ids resolved); UnknownNameError if unknown."""
    from tandem.perf.models import get_model
    return get_model(name).name


def canonical_gpu(name: str) -> str:
    """The catalogue name of a GPU; UnknownNameError if unknown."""
    from tandem.perf.hardware import get_gpu
    return get_gpu(name).name


def workload_gpus(spec: ExperimentSpec, workload: str) -> int:
    """GPUs of a workload's cluster: the spec's override, else AMPD's, else DEFAULT_GPUS."""
    paper_gpus, _, _ = _paper_tables()
    return int(spec.gpus.get(workload, paper_gpus.get(workload, DEFAULT_GPUS)))


def workload_slo(spec: ExperimentSpec, workload: str) -> SLO | None:
    """A workload's SLO: the spec's override, else AMPD's for (model, workload), else None."""
    if workload in spec.slos:
        return spec.slos[workload]
    _, paper_slos, _ = _paper_tables()
    return paper_slos.get((canonical_model(spec.model), workload))


def reference_rate(spec: ExperimentSpec) -> float:
    """The rate deployments are searched at: the spec's, else the median rate (upper one when even)."""
    if spec.reference_rate is not None:
        return float(spec.reference_rate)
    rates = sorted(spec.rates)
    return float(rates[len(rates) // 2])


def validate_spec(spec: ExperimentSpec) -> None:
    """Raise ExperimentError (or the catalogue's own error) for anything that cannot run."""
    from tandem.sim.cluster import POLICIES
    _, _, workloads = _paper_tables()
    canonical_model(spec.model)
    canonical_gpu(spec.gpu)
    for what, values in (("workloads", spec.workloads), ("policies", spec.policies),
                         ("rates", spec.rates), ("seeds", spec.seeds)):
        if not values:
            raise ExperimentError(f"an experiment needs at least one of {what}")
        if len(set(values)) != len(values):
            raise ExperimentError(f"{what} repeat a value: {', '.join(map(str, values))}")
    for w in spec.workloads:
        if w not in workloads:
            raise ExperimentError(f"unknown workload {w!r} (valid: {', '.join(workloads)})")
    for p in spec.policies:
        if p not in POLICIES:
            raise ExperimentError(f"unknown policy {p!r} (valid: {', '.join(POLICIES)})")
    for r in spec.rates:
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise ExperimentError(f"rates must be > 0 sessions/s, got {r!r}")
    for s in spec.seeds:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ExperimentError(f"seeds must be integers >= 0, got {s!r}")
    if spec.sessions < 1:
        raise ExperimentError(f"sessions must be >= 1, got {spec.sessions}")
    if spec.jobs < 1:
        raise ExperimentError(f"jobs must be >= 1, got {spec.jobs}")
    if spec.max_candidates < 1:
        raise ExperimentError(f"max_candidates must be >= 1, got {spec.max_candidates}")
    from tandem.workload.generators import PREFILL_BASES
    if spec.prefill_basis not in PREFILL_BASES:
        raise ExperimentError(f"prefill_basis must be one of {', '.join(PREFILL_BASES)}, got {spec.prefill_basis!r}")
    if spec.deploy_per_rate and not spec.search_all_rates:
        raise ExperimentError("deploy_per_rate needs search_all_rates (every candidate simulated at every rate)")
    for p, src in spec.share_deploy.items():
        if p in spec.policies and src in spec.share_deploy:
            raise ExperimentError(f"{p} shares the deployment of {src}, which itself shares another's")
        if p in spec.policies and src not in spec.policies:
            raise ExperimentError(f"{p} shares the deployment of {src}, which is not among the policies")
        if p in spec.policies and policy_is_colocated(p) != policy_is_colocated(src):
            raise ExperimentError(f"{p} cannot share the deployment of {src}: one is co-located, one is not")
    _sim_config_class_check(spec.sim)


def _sim_config_class_check(extra: dict) -> None:
    from tandem.sim.cluster import SimConfig
    names = {f.name for f in dataclasses.fields(SimConfig)}
    unknown = sorted(set(extra) - names)
    if unknown:
        raise ExperimentError(f"unknown simulator setting(s) {', '.join(unknown)} (SimConfig has: {', '.join(sorted(names))})")


# --------------------------------------------------------------------------- deployment candidates


def fitting_tps(model: str, gpu: str, gpus: int, tps: Iterable[int] = TP_DEGREES) -> list[int]:
    """Tensor-parallel degrees (<= gpus) at which one worker holds the model with room for KV."""
    from tandem.perf.errors import DoesNotFitError, ParallelismError
    from tandem.perf.roofline import kv_capacity_tokens
    out = []
    for tp in tps:
        if tp > gpus:
            continue
        try:
            if kv_capacity_tokens(model, gpu, tp) > 0:
                out.append(tp)
        except (DoesNotFitError, ParallelismError):
            continue
    return out


def check_fits(model: str, gpu: str, deploy: str) -> None:
    """Raise DoesNotFitError (or ParallelismError) unless every worker of `deploy` holds the model."""
    from tandem.perf.roofline import kv_capacity_tokens
    for tp in sorted({g.tp for g in parse_deploy(deploy).groups}):
        kv_capacity_tokens(model, gpu, tp)


def _disaggregated(tps: Sequence[int], gpus: int, cap: int) -> list[str]:
    step = max(gpus // 8, 1)
    by_pair: dict[tuple[int, int], list[tuple[bool, int, int, str]]] = {}
    for ta in tps:
        for tb in tps:
            for na in range(1, gpus // ta + 1):
                rest = gpus - ta * na
                if rest <= 0 or rest % tb:
                    continue
                nb = rest // tb
                gp, gd = ta * na, tb * nb
                coarse = gp % step != 0  # off the grid of multiples of gpus/8: tried last
                by_pair.setdefault((ta, tb), []).append((coarse, abs(gp - gd), -gd, f"P:tp{ta}x{na},D:tp{tb}x{nb}"))
    pairs = sorted(by_pair, key=lambda p: (abs(math.log2(p[0]) - math.log2(p[1])), max(p), p))
    queues = [[d for *_, d in sorted(by_pair[p])] for p in pairs]
    out: list[str] = []
    depth = 0
    while len(out) < cap and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out) < cap:
                out.append(q[depth])
        depth += 1
    return out


def deployment_candidates(model: str, gpu: str, gpus: int, colocated: bool, cap: int = 12) -> list[str]:
    """Deployments using exactly `gpus` GPUs whose every worker fits the model, at most `cap` of them.

    Co-located: C:tp x (gpus/tp) for each fitting tp in {1, 2, 4, 8} dividing `gpus`.
    Disaggregated: P:tp_a x n_a, D:tp_b x n_b with tp_a n_a + tp_b n_b = gpus. When there are more
    than `cap`, they are taken round-robin over the (tp_a, tp_b) pairs (equal degrees first, then
    by how far apart the degrees are, then smaller), each pair's splits from the most balanced
    (|P GPUs - D GPUs| smallest, more decode GPUs first), splits whose prefill GPUs are a multiple
    of gpus/8 before the others; so the kept set spans every parallelism pairing before it spans
    less balanced splits, and those in coarse steps (16/16, then 12/20, 20/12 on 32 GPUs).
    """
    tps = fitting_tps(model, gpu, gpus)
    if colocated:
        return [f"C:tp{tp}x{gpus // tp}" for tp in tps if gpus % tp == 0][:cap]
    return _disaggregated(tps, gpus, cap)


# --------------------------------------------------------------------------- running cells


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


def _score(summary: dict) -> tuple:
    att = summary.get("slo_attainment")
    p95 = summary.get("ttft_p95_s")
    return (-(att if att is not None else -1.0), p95 if p95 is not None else math.inf)


def _ignore_sigint() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops them (no traceback from each worker)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Runner:
    """Runs tasks in-process or in a process pool, advancing an optional rich progress bar."""

    def __init__(self, jobs: int, progress: bool, total: int):
        self.jobs = jobs
        self.pool = ProcessPoolExecutor(max_workers=jobs, initializer=_ignore_sigint) if jobs > 1 else None
        self.bar = None
        self.bar_task = None
        if progress:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self.bar = Progress(TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                transient=False)
            self.bar.start()
            self.bar_task = self.bar.add_task("simulating", total=total)

    def run(self, tasks: Sequence[Task], label: str) -> list[TaskResult]:
        """Run `tasks`; results in the order given."""
        out: list[TaskResult | None] = [None] * len(tasks)
        if self.pool is None:
            for i, t in enumerate(tasks):
                self._describe(label, t)
                out[i] = run_task(t)
                self._advance()
        else:
            futures = {self.pool.submit(run_task, t): i for i, t in enumerate(tasks)}
            for fut in as_completed(futures):
                i = futures[fut]
                out[i] = fut.result()
                self._describe(label, tasks[i])
                self._advance()
        return out  # type: ignore[return-value]

    def _describe(self, label: str, t: Task) -> None:
        if self.bar is not None:
            self.bar.update(self.bar_task, description=f"{label} {t.workload}/{t.policy} @{t.rate:g}")

    def _advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.bar_task)

    def close(self, cancel: bool = False) -> None:
        """Stop the bar and the pool (cancelling queued work when `cancel`)."""
        if self.bar is not None:
            self.bar.stop()
        if self.pool is not None:
            if cancel:  # Ctrl-C or an error: stop the workers now rather than after their current run
                for proc in list(getattr(self.pool, "_processes", {}).values()):
                    proc.terminate()
            self.pool.shutdown(wait=not cancel, cancel_futures=cancel)


def _fixed_deploy(spec: ExperimentSpec, workload: str, policy: str, gpus: int) -> str | None:
    d = spec.deploys.get(f"{workload}/{policy}") or spec.deploys.get(policy)
    if d is None:
        return None
    if f"{workload}/{policy}" not in spec.deploys and parse_deploy(d).gpus != gpus:
        return None  # a policy-wide fixed deployment applies only to workloads with its GPU count
    parse_deploy(d, gpus)
    return d


def _plan(spec: ExperimentSpec, model: str, gpu: str) -> dict[tuple[str, str], dict]:
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


def _tasks(spec: ExperimentSpec, model: str, gpu: str, w: str, p: str, deploy: str, rate: float) -> list[Task]:
    sim = tuple(sorted(spec.sim.items()))
    return [Task(w, p, deploy, float(rate), s, spec.sessions, workload_gpus(spec, w), workload_slo(spec, w),
                 model, gpu, sim, spec.prefill_basis) for s in spec.seeds]


def search_rates(spec: ExperimentSpec, ref_rate: float) -> list[float]:
    """Rates at which deployment candidates are simulated."""
    return [float(r) for r in spec.rates] if spec.search_all_rates else [float(ref_rate)]


def plan_deploy(plan: dict, rate: float) -> str:
    """The deployment a plan runs at `rate`: its per-rate choice when it has one, else its single choice."""
    return plan.get("deploy_by_rate", {}).get(float(rate), plan["deploy"])


def _search(spec, model, gpu, plans, runner, ref_rate) -> dict[tuple, list[TaskResult]]:
    """Simulate every candidate at the search rates; pick each plan's best by mean SLO attainment
    over those rates (ties: lower mean TTFT p95), and with `deploy_per_rate` also each rate's best;
    return the winners' runs for reuse."""
    rates = search_rates(spec, ref_rate)
    keys = [(w, p, d) for (w, p), plan in plans.items() if plan["source"] == "search" for d in plan["candidates"]]
    tasks = [t for (w, p, d) in keys for r in rates for t in _tasks(spec, model, gpu, w, p, d, r)]
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


# --------------------------------------------------------------------------- improvement and outputs


def relative_improvement(cells: Sequence[dict], baseline: str, target: str = "ampd",
                         metric: str = "slo_attainment") -> dict | None:
    """Mean over cells (workload, rate) of (target - baseline)/baseline where baseline > 0, and how often target >= baseline."""
    by = {(c["workload"], c["rate"], c["policy"]): c.get(metric) for c in cells}
    pairs = [(v, by[w, r, baseline]) for (w, r, p), v in by.items()
             if p == target and v is not None and by.get((w, r, baseline)) is not None]
    if not pairs:
        return None
    rel = [(a - b) / b for a, b in pairs if b > 0]
    return {
        "baseline": baseline,
        "cells": len(pairs),
        "cells_baseline_positive": len(rel),
        "mean_relative_improvement": sum(rel) / len(rel) if rel else None,
        "max_relative_improvement": max(rel) if rel else None,
        "cells_ampd_at_least_baseline": sum(1 for a, b in pairs if a >= b),
        "paper": PAPER_IMPROVEMENT.get(baseline, ""),
    }


def _table_columns() -> list:
    from tandem.sim.report import Column, ms, pct
    return [
        Column("workload", "workload"), Column("policy", "policy"), Column("rate", "rate", "g"),
        Column("deploy", "deploy"), Column("slo_attainment", "SLO", pct),
        Column("round_slo_attainment", "round SLO", pct),
        Column("ttft_initial_p95_s", "TTFT0 p95 s", ".3f"), Column("ttft_incremental_p95_s", "TTFTi p95 s", ".3f"),
        Column("itl_mean_s", "ITL ms", ms), Column("local_prefill_fraction", "local", pct),
        Column("sessions_completed", "done", "d"), Column("sessions_failed", "failed", "d"),
        Column("wall_s", "wall s", ".1f"),
    ]


def summary_text(improvement: dict[str, dict]) -> str:
    """Markdown lines: AMPD's mean relative gain over each baseline beside the paper's."""
    lines = ["| baseline | AMPD mean gain in SLO attainment | cells AMPD >= baseline | paper |", "|---|---|---|---|"]
    for b, imp in improvement.items():
        mean = imp["mean_relative_improvement"]
        gain = "-" if mean is None else f"{100 * mean:+.2f}%"
        lines.append(f"| {b} | {gain} | {imp['cells_ampd_at_least_baseline']}/{imp['cells']} | {imp['paper']} |")
    return "\n".join(lines) + "\n"


def _write_outputs(out_dir: Path, result: dict, policies: Sequence[str]) -> dict[str, str]:
    from tandem.sim import report
    cols = _table_columns()
    files = {}
    files["results"] = report.write_json(result, out_dir / "results.json")
    title = f"{result['spec']['model']} on {result['spec']['gpu']}"
    files["table_txt"] = report.write_text(report.format_table(result["cells"], cols, title=title, color=False),
                                           out_dir / "table.txt")
    md = f"# {result['spec']['name']}: {title}\n\n" + report.format_markdown(result["cells"], cols)
    if result["improvement"]:
        md += "\n## AMPD relative improvement\n\n" + summary_text(result["improvement"])
    files["table_md"] = report.write_text(md, out_dir / "table.md")
    files["summary"] = report.write_text(_summary_md(result), out_dir / "summary.md")
    files["slo_vs_rate"] = report.plot_slo_vs_rate(result["cells"], out_dir / "slo_vs_rate.png")
    if any(p in ABLATION_POLICIES for p in policies):
        files["ablation"] = report.plot_ablation(result["cells"], out_dir / "ablation.png",
                                                 rate=result["reference_rate"])
    return {k: str(v) for k, v in files.items()}


def _summary_md(result: dict) -> str:
    spec = result["spec"]
    lines = [f"# Experiment `{spec['name']}`", "",
             f"- model {spec['model']} on {spec['gpu']}; workloads {', '.join(spec['workloads'])}; "
             f"policies {', '.join(spec['policies'])}",
             f"- rates {', '.join(f'{r:g}' for r in spec['rates'])} sessions/s; {spec['sessions']} sessions per cell "
             f"and seed; seeds {', '.join(map(str, spec['seeds']))}",
             ("- deployments chosen per rate (each rate's best SLO attainment)" if spec.get("deploy_per_rate")
              else "- deployments searched at every rate (best mean SLO attainment)" if spec.get("search_all_rates")
              else f"- deployments searched at {result['reference_rate']:g} sessions/s") + f"; wall time {result['wall_s']:.1f} s",
             f"- Table 1 prefill length read as: {spec.get('prefill_basis', 'input')} "
             "(input: new tokens per round; prompt: each round's whole prompt)",
             "", "## Deployments", "", "| workload | policy | deploy | how |", "|---|---|---|---|"]
    for d in result["deployments"]:
        by_rate = d.get("deploy_by_rate")
        deploy = ("; ".join(f"{r}: {x}" for r, x in by_rate.items()) if by_rate and len(set(by_rate.values())) > 1
                  else d["deploy"])
        lines.append(f"| {d['workload']} | {d['policy']} | {deploy} | {d['source']} |")
    if result["improvement"]:
        lines += ["", "## AMPD relative improvement in SLO attainment", "",
                  "Mean over cells (workload, rate) of (AMPD - baseline) / baseline where baseline > 0.", "",
                  summary_text(result["improvement"])]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- entry point


def run_experiment(spec: ExperimentSpec, out_dir: str | Path, progress: bool = True) -> dict:
    """Search deployments, run every (workload, policy, rate) cell, write the report to `out_dir`."""
    t0 = time.perf_counter()
    validate_spec(spec)
    model, gpu = canonical_model(spec.model), canonical_gpu(spec.gpu)
    spec = dataclasses.replace(spec, model=model, gpu=gpu)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref = reference_rate(spec)
    plans = _plan(spec, model, gpu)

    n_rates = len(search_rates(spec, ref))
    n_search = sum(len(p["candidates"]) for p in plans.values() if p["source"] == "search") * len(spec.seeds) * n_rates
    n_runs = len(plans) * len(spec.rates) * len(spec.seeds)
    n_reused = sum(1 for p in plans.values() if p["source"] == "search") * len(spec.seeds) * (
        n_rates if spec.search_all_rates else (ref in spec.rates))
    runner = _Runner(spec.jobs, progress, n_search + n_runs - n_reused)
    try:
        reuse = _search(spec, model, gpu, plans, runner, ref)
        todo: list[Task] = []
        for (w, p), plan in plans.items():
            for r in spec.rates:
                if (w, p, plan_deploy(plan, r), float(r)) not in reuse:
                    todo.extend(_tasks(spec, model, gpu, w, p, plan_deploy(plan, r), r))
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
    }
    result["files"] = _write_outputs(out_dir, result, spec.policies)
    return result


def format_cells(cells: Sequence[dict], color: bool | None = None) -> str:
    """The experiment's result table as text (what `tandem experiment` prints)."""
    from tandem.sim.report import format_table
    return format_table(cells, _table_columns(), color=color)
