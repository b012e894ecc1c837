"""What an experiment sweeps (ExperimentSpec), its validation, and each workload's GPUs, SLO and search rate."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.workload.session import SLO

DEFAULT_GPUS = 8  # for workloads AMPD did not run (e.g. agentic-long)
COLOCATED_POLICIES: tuple[str, ...] = ("vllm", "continuum")


class ExperimentError(ValueError):
    """An experiment specification is invalid or no deployment of a cell can run."""


def policy_is_colocated(policy: str) -> bool:
    """Whether `policy` serves on co-located workers (C:...) rather than a P/D deployment."""
    from tandem.policy.presets import POLICIES

    spec = POLICIES.get(policy)
    return policy in COLOCATED_POLICIES if spec is None else not spec.disaggregated


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
    """A workload's SLO: the spec's override, else AMPD's for (model, workload), else the workload's own
    (chat-multiturn: LAPS's), else None."""
    if workload in spec.slos:
        return spec.slos[workload]
    from tandem.workload.generators import default_slo
    return default_slo(canonical_model(spec.model), workload)


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
