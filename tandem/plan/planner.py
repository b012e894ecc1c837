"""Offline deployment planning (AMPD §5, App. A): choose prefill and decode workers and their TP degrees.

`plan()` returns the top-k deployments of a GPU budget for a workload and SLO; `exhaustive()` simulates
every feasible deployment and ranks them by the same objective (the baseline of the optimality check).

Two modes (docs/planner.md):
- exact (budgets up to `exact_max_gpus`, 16 by default): every maximal deployment is simulated on the
  full cluster (runs that provably cannot enter the top k stop early); the MILP (milp.py) over the
  resulting coefficients gives the top k. Equal to the exhaustive optimum whenever adding a replica
  never makes a deployment worse (the optimality benchmark checks this against exhaustive search).
- slice (larger budgets): the same exact search on a slice of `slice_gpus` GPUs that receives
  slice_gpus / N of the traffic (the same sessions, arrivals stretched by N / slice_gpus), then the
  best slice deployments, scaled up to N GPUs, are simulated on the full cluster and ranked by
  their full-cluster objective. What is reported is always a full-cluster simulation.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from tandem.plan.coefficients import (INF, Evaluator, Measurement, RunCache, SimSpec, Stats, Workload,
                                      default_cache_dir, share)
from tandem.plan.milp import Coefficients, solve_topk
from tandem.plan.options import DEFAULT_TOP_K, EXACT_MAX_GPUS, SLICE_GPUS
from tandem.plan.space import (DEGREES, Pair, PlanError, explain_no_fit, feasible_degrees, min_kv_tokens, pairs,
                               slice_gpus_for)
from tandem.workload.session import Session

EXTRA_VERIFY = 0   # slice mode: full-cluster runs beyond the top k
SLICE_FRACTION = 0.5
SLICE_MIN_SESSIONS = 64
"""Slice mode simulates the first max(SLICE_MIN_SESSIONS, SLICE_FRACTION x S) of the S sessions."""


@dataclass(slots=True)
class Ranked:
    """One deployment of a ranking and its full-cluster measurement."""

    rank: int
    pair: Pair
    m: Measurement
    slice_z: float | None = None   # slice mode: the slice's Z that put it on the shortlist


@dataclass(slots=True)
class PlanResult:
    model: str
    gpu: str
    budget: int
    method: str                        # "exact", "slice" or "exhaustive"
    ranked: list[Ranked]
    degrees: list[int]
    excluded_degrees: dict[int, str]
    min_kv_tokens: int
    candidates: int                    # deployments the search considered
    stats: Stats
    wall_s: float
    slice_gpus: int | None = None
    slo_problem: str = ""              # non-empty when no deployment meets the SLO at P95
    phases: dict[str, float] = field(default_factory=dict)   # wall seconds per phase
    slos: set[tuple[float, float]] = field(default_factory=set)  # distinct (TTFT, ITL) SLOs of the sessions

    @property
    def best(self) -> Ranked:
        return self.ranked[0]


@dataclass(slots=True)
class PlanInputs:
    """What plan() and exhaustive() take (see `plan` for the meaning of each field)."""

    model: str
    gpu: str
    budget: int
    sessions: list[Session]
    policy: str = "ampd"
    seed: int = 0
    top_k: int = DEFAULT_TOP_K
    jobs: int = 1
    executor: Executor | None = None   # runs the simulations instead of `jobs` local processes (e.g. Ray tasks)
    cache_dir: str | Path | None = field(default_factory=default_cache_dir)
    exact_max_gpus: int = EXACT_MAX_GPUS
    slice_gpus: int = SLICE_GPUS
    degrees: tuple[int, ...] = DEGREES
    extra_verify: int = EXTRA_VERIFY
    slice_fraction: float = SLICE_FRACTION
    sim: tuple[tuple[str, object], ...] = ()


def slice_sessions(total: int, fraction: float) -> int:
    """How many of the sessions (the first ones) a slice simulates."""
    return min(total, max(SLICE_MIN_SESSIONS, math.ceil(total * fraction)))


def _check(inp: PlanInputs) -> tuple[str, str]:
    from tandem.perf.hardware import get_gpu
    from tandem.perf.models import get_model

    model, gpu = get_model(inp.model).name, get_gpu(inp.gpu).name
    if isinstance(inp.budget, bool) or not isinstance(inp.budget, int) or inp.budget < 1:
        raise PlanError(f"the GPU budget must be an integer >= 1, got {inp.budget!r}")
    if inp.top_k < 1:
        raise PlanError(f"top k must be >= 1, got {inp.top_k}")
    if not inp.sessions:
        raise PlanError("the workload has no sessions")
    missing = [s.session_id for s in inp.sessions if s.slo is None]
    if missing:
        raise PlanError(f"{len(missing)} session(s) have no SLO (first: {missing[0]!r}); give --slo-ttft and --slo-itl")
    from tandem.policy.presets import POLICIES
    spec = POLICIES.get(inp.policy)
    if spec is None:
        raise PlanError(f"unknown policy {inp.policy!r} (valid: {', '.join(POLICIES)})")
    if not spec.disaggregated:
        raise PlanError(f"policy {inp.policy} serves co-located workers; the planner plans prefill/decode deployments")
    return model, gpu


def _space(inp: PlanInputs, model: str, gpu: str) -> tuple[list[int], dict[int, str], int]:
    from tandem.perf.models import get_model

    min_kv = min_kv_tokens(inp.sessions, get_model(model).max_context)
    degrees, why = feasible_degrees(model, gpu, inp.budget, min_kv, inp.degrees)
    if not degrees or 2 * min(degrees) > inp.budget:
        raise PlanError(explain_no_fit(model, gpu, inp.budget, min_kv, inp.degrees))
    small = min(degrees)
    for n in [n for n in degrees if n + small > inp.budget]:
        why[n] = f"tp{n} with the smallest partner (tp{small}) needs {n + small} GPUs, more than {inp.budget}"
        degrees.remove(n)
    return degrees, why, min_kv


def _search_order(cands: list[Pair]) -> list[Pair]:
    """Order in which an exact search simulates candidates: likely-good first, so the cutoff tightens
    early and later runs stop sooner (the order never changes the result). Larger degrees first (lower
    per-request latency, which a P95 objective rewards), then prefill-leaning splits: AMPD routing holds
    TTFT near its SLO and ITL falls as prefill capacity grows."""
    def key(p: Pair):
        share = p.n * p.x / p.gpus
        return (-min(p.n, p.m), round(abs(share - 0.6), 3), -max(p.n, p.m), p)
    return sorted(cands, key=key)


def _above(bound: float) -> float:
    """A stopped run proved Z > bound; nudge the coefficient above it so that a tie with the k-th best
    exact value is not a tie for the solver (a stopped run chosen anyway is re-run exactly)."""
    return bound + max(1e-6 * bound, 1e-6)


def _rank_key(p: Pair, m: Measurement):
    return (m.z, p.gpus, p.deploy)


def _exact_search(ev: Evaluator, wl: Workload, budget: int, degrees: list[int], k: int,
                  progress: Callable[[str], None] | None, label: str) -> tuple[list[tuple[Pair, Measurement]], int]:
    """Top-k maximal deployments of `budget` GPUs, by simulated Z (exact values), and the candidate count."""
    cands = _search_order(pairs(degrees, budget, maximal_only=True))
    best: list[float] = []       # the k smallest exact Z so far

    def cutoff() -> float:
        return best[k - 1] if len(best) >= k else INF

    def seen(m: Measurement) -> None:
        if m.exact and math.isfinite(m.z):
            best.append(m.z)
            best.sort()
            del best[k:]
        if progress is not None:
            progress(label)

    by_deploy = {p.deploy: p for p in cands}
    meas = ev.evaluate(wl, [p.deploy for p in cands], budget, cutoff, seen)
    coef = Coefficients(budget)
    while True:
        for d, m in meas.items():
            p = by_deploy[d]
            if m.exact:
                coef.set_pair(p, m.ttft_norm, m.itl_norm)
            else:             # stopped early: Z > cutoff, so both coefficients are lower-bounded by it
                coef.set_pair(p, _above(m.z), _above(m.z))
        sols = solve_topk(coef, k)
        lazy = [s.pair.deploy for s in sols if not meas[s.pair.deploy].exact]
        if not lazy:
            break
        meas.update(ev.evaluate(wl, lazy, budget))      # a bound reached the top k: measure it exactly
    return [(s.pair, meas[s.pair.deploy]) for s in sols], len(cands)


def _slo_problem(model: str, gpu: str, budget: int, best: Ranked, sessions: Sequence[Session]) -> str:
    m = best.m
    if m.z <= 1.0:
        return ""
    slos = {(s.slo.ttft_s, s.slo.itl_s) for s in sessions}
    one = len(slos) == 1
    ttft_slo, itl_slo = next(iter(slos)) if one else (None, None)
    parts = []
    if m.ttft_norm is not None and m.ttft_norm > 1:
        slo = f" {ttft_slo:g} s" if one else ""
        parts.append(f"TTFT SLO{slo}: best predicted P95 TTFT {m.ttft_p95_s:.3g} s (x{m.ttft_norm:.2f} the SLO)")
    if m.itl_norm is not None and m.itl_norm > 1:
        slo = f" {itl_slo * 1000:g} ms" if one else ""
        parts.append(f"ITL SLO{slo}: best predicted P95 ITL {m.itl_p95_s * 1000:.3g} ms (x{m.itl_norm:.2f} the SLO)")
    return (f"no deployment of {budget} x {gpu} meets the " + " and the ".join(parts)
            + f" ({best.pair.deploy}, SLO attainment {100 * (m.slo_attainment or 0):.1f}%)")


def plan(inp: PlanInputs, progress: Callable[[str, int], None] | None = None) -> PlanResult:
    """The top-k deployments of `inp.budget` GPUs for `inp.sessions` (docs/planner.md).

    `progress(label, total)` is called once per finished run (total: the runs planned so far).
    Raises PlanError when the model cannot be deployed on the budget at all.
    """
    t0 = time.perf_counter()
    model, gpu = _check(inp)
    degrees, why, min_kv = _space(inp, model, gpu)
    spec = SimSpec(model, gpu, inp.policy, inp.seed, tuple(inp.sim))
    wl = Workload(list(inp.sessions))
    k = inp.top_k
    exact = inp.budget <= inp.exact_max_gpus
    n0 = inp.budget if exact else slice_gpus_for(inp.budget, inp.slice_gpus)
    total = len(pairs(degrees, n0, maximal_only=True)) + (0 if exact else k + inp.extra_verify)
    tick = (lambda label: progress(label, total)) if progress is not None else None
    share(wl)
    if not exact:
        sl = Workload(wl.sessions[:slice_sessions(len(wl.sessions), inp.slice_fraction)]).stretched(inp.budget / n0)
        share(sl)
    phases = {"setup": time.perf_counter() - t0}
    with Evaluator(spec, inp.jobs, RunCache(inp.cache_dir), executor=inp.executor) as ev:
        t1 = time.perf_counter()
        if exact:
            top, ncand = _exact_search(ev, wl, inp.budget, degrees, k, tick, f"{inp.budget} GPUs")
            ranked = [Ranked(i + 1, p, m) for i, (p, m) in enumerate(top)]
            method, slice_n = "exact", None
            phases["search"] = time.perf_counter() - t1
        else:
            factor = inp.budget / n0
            stop, ncand = _exact_search(ev, sl, n0, degrees, k + inp.extra_verify, tick, f"slice of {n0} GPUs")
            phases["slice"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            short: dict[str, tuple[Pair, float]] = {}
            for p, m in stop:
                q = p.scaled(factor, inp.budget)
                short.setdefault(q.deploy, (q, m.z))
            full = _verify(ev, wl, inp.budget, list(short.values()), k, tick)
            ranked = [Ranked(i + 1, p, m, zs) for i, (p, m, zs) in enumerate(full)]
            method, slice_n = "slice", n0
            phases["verify"] = time.perf_counter() - t1
        t1 = time.perf_counter()
    phases["shutdown"] = time.perf_counter() - t1
    result = PlanResult(model, gpu, inp.budget, method, ranked, degrees, why, min_kv, ncand, ev.stats,
                        time.perf_counter() - t0, slice_n, phases=phases)
    result.slos = {(s.slo.ttft_s, s.slo.itl_s) for s in inp.sessions}
    if ranked:
        result.slo_problem = _slo_problem(model, gpu, inp.budget, ranked[0], inp.sessions)
    if not ranked or not math.isfinite(ranked[0].m.z):
        raise PlanError(f"no deployment of {inp.budget} x {gpu} serves every servable round of the workload "
                        f"(every candidate fails sessions)")
    return result


def _verify(ev: Evaluator, wl: Workload, budget: int, short: list[tuple[Pair, float]], k: int,
            tick) -> list[tuple[Pair, Measurement, float]]:
    """Simulate the shortlist on the full cluster; the top k by the MILP over the full-cluster coefficients."""
    best: list[float] = []

    def cutoff() -> float:
        return best[k - 1] if len(best) >= k else INF

    def seen(m: Measurement) -> None:
        if m.exact and math.isfinite(m.z):
            best.append(m.z)
            best.sort()
            del best[k:]
        if tick is not None:
            tick(f"{budget} GPUs")

    meas = ev.evaluate(wl, [p.deploy for p, _ in short], budget, cutoff, seen)
    slice_z = {p.deploy: z for p, z in short}
    by = {p.deploy: p for p, _ in short}
    coef = Coefficients(budget)
    for d, m in meas.items():
        if m.exact:
            coef.set_pair(by[d], m.ttft_norm, m.itl_norm)
        else:
            coef.set_pair(by[d], _above(m.z), _above(m.z))
    sols = solve_topk(coef, k)
    return [(s.pair, meas[s.pair.deploy], slice_z[s.pair.deploy]) for s in sols if meas[s.pair.deploy].exact]


def exhaustive(inp: PlanInputs, progress: Callable[[str, int], None] | None = None,
               maximal_only: bool = False) -> PlanResult:
    """Simulate every feasible deployment (<= budget GPUs, each worker fitting the model) fully and rank
    them by the planner's objective (ties: fewer GPUs, then the deployment string)."""
    t0 = time.perf_counter()
    model, gpu = _check(inp)
    degrees, why, min_kv = _space(inp, model, gpu)
    spec = SimSpec(model, gpu, inp.policy, inp.seed, tuple(inp.sim))
    wl = Workload(list(inp.sessions))
    cands = pairs(degrees, inp.budget, maximal_only=maximal_only)
    tick = (lambda m: progress("exhaustive", len(cands))) if progress is not None else None
    share(wl)
    with Evaluator(spec, inp.jobs, RunCache(inp.cache_dir), on_done=tick, executor=inp.executor) as ev:
        meas = ev.evaluate(wl, [p.deploy for p in cands], inp.budget)
    order = sorted(cands, key=lambda p: _rank_key(p, meas[p.deploy]))
    ranked = [Ranked(i + 1, p, meas[p.deploy]) for i, p in enumerate(order)]
    result = PlanResult(model, gpu, inp.budget, "exhaustive", ranked, degrees, why, min_kv, len(cands), ev.stats,
                        time.perf_counter() - t0)
    result.slos = {(s.slo.ttft_s, s.slo.itl_s) for s in inp.sessions}
    if ranked:
        result.slo_problem = _slo_problem(model, gpu, inp.budget, ranked[0], inp.sessions)
    return result
