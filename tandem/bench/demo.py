"""`tandem demo`: the same sessions served live by AMPD and by a baseline, one after the other, each beside what the
simulator predicts for it from the same profile (the calibration rule: tandem.bench.demo_calibration).

The caller (the CLI) supplies how a server is started for a policy (`Serve`); this module plans the run (sessions,
calibrated rate and SLO), replays the sessions through HTTP, simulates them, and returns everything measured.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncContextManager

from tandem.bench.demo_calibration import Calibration, calibrate
from tandem.bench.demo_options import DEFAULT_BASELINE, DEFAULT_LOAD, DEFAULT_SLO_FACTOR, DEFAULT_THREADS
from tandem.bench.demo_runtime import Probe, probe_sessions, run_probe, runtime_block, ttfts
from tandem.bench.serve_client import BenchConfig, BenchResult, run_bench, scale_session
from tandem.perf.step_model import Profile
from tandem.workload.generators import generate
from tandem.workload.metrics import summarize
from tandem.workload.records import SessionRecord
from tandem.workload.session import SLO, Round, Session

WARMUP_SESSIONS = 2              # short sessions each fresh server answers before the measured ones (a cold
WARMUP_ROUND = Round(64, 4)      # server's first prefill is many times slower than the next)
PROBE_APART_S = 30.0             # the simulated probe's sessions this far apart: each alone, as replayed

Serve = Callable[[str], AsyncContextManager[str]]   # policy -> an async context serving it, yielding its URL
SessionDone = Callable[[SessionRecord], None]


def demo_threads(requested: int | None, environ: Mapping[str, str] | None = None) -> int:
    """Torch threads per worker: `requested` (--threads), else OMP_NUM_THREADS when it is a positive integer, else
    DEFAULT_THREADS."""
    if requested is not None:
        return requested
    env = os.environ if environ is None else environ
    text = env.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else DEFAULT_THREADS


@dataclass
class DemoPlan:
    """What the demo replays: the workload at its token scale, the rate and SLO, the policies."""

    workload: str
    sessions: list[Session]          # at the demo's token scale, arrivals at `rate`, every session with `slo`
    rate: float
    slo: SLO
    calibration: Calibration
    policies: tuple[str, ...]        # AMPD first, then the baseline
    scale: float
    max_tokens_cap: int | None
    seed: int
    rate_given: bool = False         # --rate overrode the calibrated rate
    slo_given: bool = False          # --slo-ttft / --slo-itl overrode the calibrated SLO


def plan_demo(profile: Profile, workload: str = "toolbench", num_sessions: int = 30, scale: float = 0.5,
              max_tokens_cap: int | None = 16, seed: int = 0, rate: float | None = None,
              slo_ttft_s: float | None = None, slo_itl_s: float | None = None, load: float = DEFAULT_LOAD,
              slo_factor: float = DEFAULT_SLO_FACTOR, baseline: str = DEFAULT_BASELINE,
              parallel: int = 2) -> DemoPlan:
    """The demo's sessions, rate and SLO: calibrated from `profile` (demo_calibration; `parallel`: worker steps the
    cores run at once), each overridden when given."""
    shapes = [scale_session(s, scale, max_tokens_cap) for s in generate(workload, num_sessions, 1.0, seed)]
    cal = calibrate(shapes, profile.ampd, load, slo_factor, parallel)
    r = cal.rate if rate is None else rate
    slo = SLO(cal.slo.ttft_s if slo_ttft_s is None else slo_ttft_s, cal.slo.itl_s if slo_itl_s is None else slo_itl_s)
    # the same token counts (they do not depend on the rate), arrivals at the demo's rate
    sessions = [scale_session(s, scale, max_tokens_cap) for s in generate(workload, num_sessions, r, seed, slo=slo)]
    policies = ("ampd",) if baseline == "ampd" else ("ampd", baseline)
    return DemoPlan(workload, sessions, r, slo, cal, policies, scale, max_tokens_cap, seed,
                    rate_given=rate is not None, slo_given=slo_ttft_s is not None or slo_itl_s is not None)


@dataclass
class PolicyRun:
    """One policy's live run and its simulation."""

    policy: str
    measured: dict                                   # bench_metrics of the live run
    records: list[SessionRecord]
    simulated: dict = field(default_factory=dict)    # summarize() of the simulation (the profile's steps only)
    sim_records: list[SessionRecord] = field(default_factory=list)
    simulated_rt: dict = field(default_factory=dict)     # the simulation with the measured runtime block
    sim_rt_records: list[SessionRecord] = field(default_factory=list)
    load_avg: tuple[float, float, float] | None = None   # the host's load averages when the run ended


def deployment(policy: str) -> str:
    """The simulated deployment of the demo's two worker processes for `policy`: 1P+1D, or two co-located."""
    from tandem.policy.presets import get_policy
    return "P:tp1x1,D:tp1x1" if get_policy(policy).disaggregated else "C:tp1x2"


def simulate_sessions(sessions: list[Session], policy: str, profile: Profile, perf_path: str | Path,
                      seed: int) -> tuple[dict, list]:
    """The simulator's run of `sessions` under `policy` on the demo's deployment, priced by the profile file."""
    from tandem.sim.cluster import SimConfig, simulate
    cfg = SimConfig(model=profile.name, gpu=profile.device_name, gpus=2, deploy=deployment(policy), policy=policy,
                    seed=seed, perf=str(perf_path))
    res = simulate([dataclasses.replace(s) for s in sessions], cfg)
    return summarize(res.records, res.sim_time_s), res.records


def simulate_policy(plan: DemoPlan, policy: str, profile: Profile, perf_path: str | Path) -> tuple[dict, list]:
    """The simulator's run of the plan's sessions under `policy` on the demo's deployment, priced by the profile."""
    return simulate_sessions(plan.sessions, policy, profile, perf_path, plan.seed)


def with_runtime(perf_path: str | Path, runtime: dict, out: str | Path) -> Path:
    """A copy of the profile file at `perf_path` with `runtime` as its runtime block, written to `out`."""
    d = json.loads(Path(perf_path).read_text())
    d["runtime"] = runtime
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, indent=1) + "\n")
    return out


def measure_runtime(probe: Probe, policy: str, profile: Profile, perf_path: str | Path, out: str | Path,
                    step_factor: dict, cores: int, seed: int) -> dict:
    """The runtime block from the probe replayed on `policy`'s server (demo_runtime), the probe simulated alike."""
    sessions = probe_sessions()
    apart = [dataclasses.replace(s, arrival_s=PROBE_APART_S * i) for i, s in enumerate(sessions)]

    def simulated(rt: dict) -> dict:
        return ttfts(simulate_sessions(apart, policy, profile, with_runtime(perf_path, rt, out), seed)[1])

    return runtime_block(probe, sessions, lambda c: profile.step_model.decode_time(1, c), step_factor, cores,
                         simulated)


def warmup_sessions() -> list[Session]:
    """A fresh server's warm-up: a few one-round sessions, their own text (nothing the measured sessions reuse)."""
    return [Session(f"warmup-{i}", 0.0, [WARMUP_ROUND]) for i in range(WARMUP_SESSIONS)]


async def run_policy(plan: DemoPlan, url: str, tokenizer, on_session_done: SessionDone | None = None,
                     probe: bool = False) -> tuple[BenchResult, Probe | None]:
    """Warm the server at `url` up (and run the runtime probe on it when `probe`), then replay the plan's sessions
    through /v1/completions; the bench's result and the probe's."""
    cfg = BenchConfig(url=url, endpoint="completions", scale=1.0, max_tokens_cap=None,   # sessions already scaled
                      tokenizer=tokenizer, seed=plan.seed)
    await run_bench(warmup_sessions(), cfg)
    measured = None
    if probe:
        async def replay(sessions: list[Session]) -> list[SessionRecord]:
            return (await run_bench(sessions, cfg)).records
        measured = await run_probe(replay)
    return await run_bench(plan.sessions, dataclasses.replace(cfg, on_session_done=on_session_done)), measured


@dataclass
class RuntimeSetup:
    """Where the demo measures the runtime for the simulator: the profile with the measured block goes to `path`;
    the speed check's factors and the cores this process may run on go into the block."""

    path: Path
    step_factor: dict
    cores: int


async def run_demo(plan: DemoPlan, serve: Serve, tokenizer, profile: Profile, perf_path: str | Path,
                   on_policy: Callable[[str], SessionDone | None] | None = None,
                   runtime: RuntimeSetup | None = None) -> tuple[list[PolicyRun], dict | None]:
    """Each policy of the plan in turn: a server started by `serve`, the sessions replayed, the server stopped; then
    the same sessions simulated. `on_policy(policy)` may return a per-session callback (a progress bar). With
    `runtime`, each server runs the runtime probe before its sessions, and each policy is simulated again with
    the block measured on the first one (returned beside the runs)."""
    runs, probe = [], None
    for policy in plan.policies:
        done = on_policy(policy) if on_policy is not None else None
        async with serve(policy) as url:
            # every server runs the probe (the same work before the measured sessions); the first one's is kept
            res, p = await run_policy(plan, url, tokenizer, done, probe=runtime is not None)
        probe = probe or p
        load = None
        with contextlib.suppress(OSError):
            load = os.getloadavg()
        runs.append(PolicyRun(policy, res.metrics(), res.records, load_avg=load))
    for run in runs:
        run.simulated, run.sim_records = simulate_policy(plan, run.policy, profile, perf_path)
    block = None
    if runtime is not None and probe is not None:
        block = measure_runtime(probe, plan.policies[0], profile, perf_path, runtime.path, runtime.step_factor,
                                runtime.cores, plan.seed)
        with_runtime(perf_path, block, runtime.path)
        for run in runs:
            run.simulated_rt, run.sim_rt_records = simulate_policy(plan, run.policy, profile, runtime.path)
    return runs, block
