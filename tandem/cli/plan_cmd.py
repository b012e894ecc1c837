"""`tandem plan`: the AMPD offline planner (docs/planner.md) on the command line.

    tandem plan --model llama-3.1-70b --gpu h20 --gpus 16 --workload toolbench --rate 2.4
    tandem simulate --gpus 16 --workload toolbench --rate 2.4 \\
        --deploy "$(tandem plan --gpus 16 --workload toolbench --rate 2.4 --format deploy)"

Prints the top-k deployments like AMPD Table 2 with their predicted (simulated) P95 latencies and
SLO attainment. Exit status 2 with a one-line message when the model does not fit the GPUs, or
when even the best deployment misses an SLO at P95 (after printing the plan; --best-effort: 0).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shlex
import sys
from pathlib import Path

from tandem.bench.sweep_options import SweepOptions
from tandem.cli.args import add_knobs
from tandem.cli.commands import COMMAND_HELP
from tandem.cli.common import (CLIError, StderrBar, cost_fields, cost_note, flush_notes, load_workload, percent,
                               ray_executor)
from tandem.cli.options import PlanOutputOptions
from tandem.plan.options import DEFAULT_JOBS, PlanOptions
from tandem.sim.config import COST_KNOBS, SimConfig, SimTarget
from tandem.workload.options import DEFAULT_RATE, DEFAULT_SESSIONS, WorkloadOptions


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `plan` on the subparsers `sub` of the tandem parser."""
    p = sub.add_parser("plan", help=COMMAND_HELP["plan"],
                       description="Search the prefill/decode deployments of --gpus GPUs (TP degrees 1, 2, 4, 8) "
                                   "for the one whose worst P95 latency relative to the SLO (TTFT for prefill, "
                                   "ITL for decode) is lowest, by simulating them (AMPD §5, docs/planner.md). "
                                   "--sessions sessions are simulated per deployment; a trace's or file's sessions "
                                   "are re-timed at --rate when it is given (--override-arrivals is implied).")
    add_knobs(p, WorkloadOptions, ("workload",), required=("workload",))
    add_knobs(p, SimTarget, ("model", "gpu"))
    add_knobs(p, PlanOptions, ("gpus",))
    add_knobs(p, WorkloadOptions, ("rate", "override_arrivals", "slo_ttft", "slo_itl", "sessions", "seed"))
    add_knobs(p, SimConfig, ("policy", *COST_KNOBS))
    add_knobs(p, PlanOptions, ("top_k", "jobs"))
    add_knobs(p, SweepOptions, ("ray", "ray_address"))
    add_knobs(p, PlanOptions, ("cache_dir", "no_cache", "exact", "exhaustive"))
    add_knobs(p, PlanOutputOptions)
    add_knobs(p, SweepOptions, ("no_progress",))
    p.set_defaults(func=cmd_plan)
    return p


# --------------------------------------------------------------------------- running


class _Bar(StderrBar):
    """A progress bar with one line per stage (plan, exhaustive), whose total follows the planner."""

    def __init__(self, enabled: bool):
        super().__init__(enabled, "{task.description:<30}")
        self.task = None

    def stage(self, name: str) -> None:
        if self.bar is not None:
            self.task = self.bar.add_task(name, total=None)
            self.done = 0

    def __call__(self, label: str, total: int) -> None:
        if self.bar is None or self.task is None:
            return
        self.done += 1
        self.bar.update(self.task, description=f"simulating {label}", completed=self.done,
                        total=max(self.done, total))


def _sessions(args, model: str):
    """The planner's sessions (with SLOs), the rate applied (None: the file's own times) and a description."""
    from tandem.workload import generators

    is_gen = args.workload in generators.GENERATOR_NAMES
    args.override_arrivals = (not is_gen) and args.rate is not None
    if is_gen and generators.default_slo(model, args.workload) is None and (
            args.slo_ttft is None or args.slo_itl is None):
        raise CLIError(f"give --slo-ttft and --slo-itl: no default SLO for {model} on {args.workload}")
    sessions, rate, kind = load_workload(args, model)
    if any(s.slo is None for s in sessions):
        raise CLIError("the planner needs an SLO for every session: give --slo-ttft and --slo-itl")
    if is_gen and rate is None:
        rate = DEFAULT_RATE
    return sessions, rate, kind


def _reproduce(args, model: str, gpu: str, deploy: str, rate, kind: str) -> str:
    """The `tandem simulate` command that re-runs one planned deployment on the same sessions."""
    cmd = ["tandem", "simulate", "--model", model, "--gpu", gpu, "--gpus", str(args.gpus),
           "--workload", args.workload]
    if rate is not None:
        cmd += ["--rate", f"{rate:g}"]
        if kind != "generator":
            cmd.append("--override-arrivals")
    cmd += ["--sessions", str(args.sessions or DEFAULT_SESSIONS), "--seed", str(args.seed)]
    if args.slo_ttft is not None:
        cmd += ["--slo-ttft", f"{args.slo_ttft:g}"]
    if args.slo_itl is not None:
        cmd += ["--slo-itl", f"{args.slo_itl:g}"]
    if args.policy != SimConfig.__dataclass_fields__["policy"].default:
        cmd += ["--policy", args.policy]
    cmd += ["--deploy", deploy]
    return shlex.join(cmd)


def _row(r, result, source: str) -> dict:
    m = r.m
    return {
        "rank": r.rank,
        "source": source,
        "prefill": {"tp": r.pair.n, "dp": r.pair.x},
        "decode": {"tp": r.pair.m, "dp": r.pair.y},
        "deploy": r.pair.deploy,
        "table2": r.pair.table2,
        "gpus": r.pair.gpus,
        "p95_s": (m.ttft_p95_s if m.bottleneck == "prefill" else m.itl_p95_s),
        "p95_ttft_s": m.ttft_p95_s,
        "p95_itl_s": m.itl_p95_s,
        "z": m.z,
        "bottleneck": m.bottleneck,
        "slo_attainment": m.slo_attainment,
        "round_slo_attainment": m.round_slo_attainment,
        "local_prefill_fraction": m.local_prefill_fraction,
        "sessions_failed": m.sessions_failed,
        "slice_z": r.slice_z,
        "method": result.method,
        "plan_wall_s": result.wall_s,
    }


def cmd_plan(args) -> int:
    """`tandem plan`: validate, plan (and optionally search exhaustively), print."""
    with _frozen_heap():
        return _plan_and_print(args)


@contextlib.contextmanager
def _frozen_heap():
    """The objects alive when the command starts (modules, tables) live until it ends: frozen out of the collector's
    passes meanwhile (gc.freeze), so its full passes do not walk them again and again; back in its care afterwards,
    for a caller that goes on in the same process."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _plan_and_print(args) -> int:
    """`cmd_plan` with the start-up objects frozen."""
    from tandem.perf.hardware import get_gpu       # not tandem.bench.experiment: its package imports the sweeps
    from tandem.perf.models import get_model
    from tandem.plan import PlanError, PlanInputs, default_cache_dir, exhaustive, plan

    fmt = "json" if args.json else args.format
    model, gpu = get_model(args.model).name, get_gpu(args.gpu).name   # catalogue names (aliases resolved)
    sessions, rate, kind = _sessions(args, model)
    if args.sessions is None and kind == "generator":
        args.sessions = DEFAULT_SESSIONS
    cache = None if args.no_cache else (Path(args.cache_dir) if args.cache_dir else default_cache_dir())
    inp = PlanInputs(model=model, gpu=gpu, budget=args.gpus, sessions=sessions, policy=args.policy, seed=args.seed,
                     top_k=args.top_k, jobs=args.jobs or DEFAULT_JOBS, cache_dir=cache,
                     sim=tuple(sorted(cost_fields(args).items())))
    cost_note(gpu, args)
    if args.exact:
        inp.exact_max_gpus = args.gpus
    with ray_executor(args) as executor:
        if executor is not None:
            inp.executor, inp.jobs = executor, args.jobs or executor.cpus
        flush_notes()
        bar = _Bar(not args.no_progress and sys.stderr.isatty())
        try:
            bar.stage("planning")
            result = plan(inp, progress=bar)
            full = None
            if args.exhaustive:
                bar.stage("exhaustive")
                full = exhaustive(inp, progress=bar)
        except PlanError as e:
            raise CLIError(str(e)) from None
        finally:
            bar.close()
    rows = [_row(r, result, "planner") for r in result.ranked]
    for row in rows:
        row["simulate"] = _reproduce(args, model, gpu, row["deploy"], rate, kind)
    ex_rows = [_row(r, full, "exhaustive") for r in full.ranked[: args.top_k]] if full else []
    if fmt == "deploy":
        print(rows[0]["deploy"])
    elif fmt == "json":
        print(json.dumps(_finite(rows + ex_rows), indent=2))
    else:
        print(_table(args, result, rows, full, ex_rows, model, gpu, rate, len(sessions)))
    if result.slo_problem and not args.best_effort:
        raise CLIError(result.slo_problem)
    return 0


def _finite(obj):
    """JSON-safe copy: infinite latencies (deployments that fail rounds) become null."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- table


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    if x == float("inf"):
        return "inf"
    return f"{x:.3f} s" if x >= 0.1 else f"{1000 * x:.1f} ms"


def _slo_text(result) -> str:
    slos = result.slos
    if len(slos) != 1:
        return " · per-session SLOs"
    t, i = next(iter(slos))
    return f" · SLO TTFT {t:g} s, ITL {1000 * i:g} ms"


def _table(args, result, rows, full, ex_rows, model, gpu, rate, nsessions) -> str:
    from tandem.sim.report import Column, format_table

    head = (f"{model} on {args.gpus} x {gpu} · {args.workload}"
            + (f" at {rate:g} sessions/s" if rate is not None else " (trace arrivals)")
            + f" · {nsessions} sessions, seed {args.seed} · policy {args.policy}" + _slo_text(result))
    cols = [Column("rk", "rank"), Column("table2", "deployment (AMPD Table 2)"),
            Column("p95_ttft_s", "P95 TTFT", _s), Column("p95_itl_s", "P95 ITL", _s),
            Column("zb", "worst P95/SLO"), Column("slo_attainment", "SLO attainment", percent),
            Column("deploy", "--deploy")]
    for r in rows + ex_rows:
        r["zb"] = "inf" if r["z"] == float("inf") else f"{r['z']:.3f} ({r['bottleneck']})"
        r["rk"] = f"#{r['rank']}"
    lines = [head, format_table(rows, cols, color=False).rstrip("\n")]
    st = result.stats
    if result.method == "slice":
        how = (f"slice search: {result.candidates} maximal deployments of a {result.slice_gpus}-GPU slice at "
               f"{result.slice_gpus}/{result.budget} of the traffic, the best scaled to {result.budget} GPUs and "
               f"simulated on the full cluster")
    else:
        how = f"exact search: {result.candidates} maximal deployments of {result.budget} GPUs"
    excluded = "".join(f"; tp{n} excluded" for n in sorted(result.excluded_degrees))
    lines.append(f"{how} (degrees {', '.join(f'tp{n}' for n in result.degrees)}{excluded}); "
                 f"{st.simulated} runs ({st.stopped_early} stopped early), {st.cached} from cache; "
                 f"planned in {result.wall_s:.2f} s")
    if full is not None:
        lines.append("")
        lines.append(f"exhaustive: {full.candidates} feasible deployments simulated in {full.wall_s:.2f} s")
        side = []
        for i in range(max(len(rows), len(ex_rows))):
            a = rows[i] if i < len(rows) else {}
            b = ex_rows[i] if i < len(ex_rows) else {}
            side.append({"rank": f"#{i + 1}", "planner": a.get("table2"), "pz": a.get("zb"),
                         "exhaustive": b.get("table2"), "ez": b.get("zb")})
        lines.append(format_table(side, [Column("rank", "rank"), Column("planner", "planner"),
                                         Column("pz", "worst P95/SLO"), Column("exhaustive", "exhaustive"),
                                         Column("ez", "worst P95/SLO")], color=False).rstrip("\n"))
        same = bool(rows and ex_rows and rows[0]["deploy"] == ex_rows[0]["deploy"])
        lines.append(f"first choice {'equals' if same else 'DIFFERS from'} the exhaustive best")
    lines.append(f"reproduce #1: {rows[0]['simulate']}")
    return "\n".join(lines)
