"""Planning time against the GPU budget, beside AMPD Figure 7 (0.54 s at 8 GPUs ... 61.67 s at 256).

For N = 8, 16, 32, 64, 128, 256 GPUs the planner runs from an empty cache on ToolBench at an arrival
rate proportional to N (`--base-rate` sessions/s per 8 GPUs), 200 sessions, seed 0, `--jobs`
processes; the wall time of `plan()` (from sessions in hand to the ranked top 3) is recorded with
the method (exact search up to 16 GPUs, slice search above), the runs it simulated and how many of
them stopped early. Writes plan_speed.json, plan_speed.md and plan_speed.png to --out.

    python benchmarks/plan_speed.py [--models llama-3.1-70b,qwen3-32b] [--jobs 2] [--repeat 1]

--cli instead times the whole `tandem plan` process (start-up, workload, planning, output) of CLI_ARGS against a
baseline revision checked out with `git worktree add` (default /tmp/plan-base at 5a0bb63), alternating old and new
runs, each from an empty run cache (a fresh XDG_CACHE_HOME) and again from the cache the cold run left (warm);
medians of --repeat pairs, the ratio new / old, and whether both print the same plan (`--json` output, all but
the wall-time field, compared once). Python's bytecode: `--bytecode source` (default) removes both trees'
__pycache__ and runs with PYTHONDONTWRITEBYTECODE=1, so every process compiles the modules it imports (as in an
environment that sets it); `--bytecode compiled` compiles both trees first (python -m compileall), as an installed
package or any second run has it. Writes plan_cli_speed.json, .md and .png to --out (`--tag` appends to the names).

    python benchmarks/plan_speed.py --cli [--base 5a0bb63] [--repeat 5] [--cpu 0] [--bytecode source|compiled]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.provenance import cost_sources
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL
from tandem.plan import PlanInputs, plan
from tandem.workload.generators import PAPER_SLOS, generate

BUDGETS = (8, 16, 32, 64, 128, 256)
PAPER_FIG7_S = {8: 0.54, 16: 1.93, 32: 5.06, 64: 14.50, 128: 28.88, 256: 61.67}
"""AMPD Figure 7: time of offline planning per number of GPUs (seconds)."""
BASE_RATE = {"llama-3.1-70b": 1.2, "qwen3-32b": 2.0}
"""ToolBench sessions/s per 8 GPUs: where the best 8-GPU deployment sits near the SLO (P95/SLO ~ 1)."""
GOAL_S = 6.0
CLI_ARGS = ("plan", "--gpus", "256", "--workload", "toolbench", "--rate", "16", "--slo-ttft", "1.0", "--slo-itl", "0.05")
"""The command `--cli` times: `tandem plan --gpus 256 --workload toolbench --rate 16 --slo-ttft 1.0 --slo-itl 0.05`."""
CLI_GOAL_S = 1.0
CLI_GOAL_RATIO = 0.25


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run(models: list[str], workload: str, sessions: int, jobs: int, repeat: int, budgets=BUDGETS,
        cost_model: str = DEFAULT_COST_MODEL) -> list[dict]:
    rows = []
    for model in models:
        slo = PAPER_SLOS[(model, workload)]
        for n in budgets:
            rate = BASE_RATE.get(model, 1.2) * n / 8
            ss = generate(workload, sessions, rate, 0, slo=slo)
            best = None
            for _ in range(repeat):
                t0 = time.perf_counter()
                r = plan(PlanInputs(model, "h20", n, ss, jobs=jobs, cache_dir=None, sim=(("cost_model", cost_model),)))
                wall = time.perf_counter() - t0
                if best is None or wall < best[0]:
                    best = (wall, r)
            wall, r = best
            rows.append({"model": model, "workload": workload, "gpus": n, "rate": rate, "sessions": sessions,
                         "cost_model": cost_model,
                         "jobs": jobs, "wall_s": wall, "paper_s": PAPER_FIG7_S.get(n), "method": r.method,
                         "candidates": r.candidates, "runs": r.stats.simulated, "stopped_early": r.stats.stopped_early,
                         "best": r.best.pair.deploy, "best_table2": r.best.pair.table2, "best_z": r.best.m.z,
                         "phases": r.phases})
            print(f"{model:14s} N={n:3d} rate={rate:6.2f}  {wall:6.2f} s  (paper {PAPER_FIG7_S.get(n)} s)  "
                  f"{r.method:5s} {r.stats.simulated:3d} runs ({r.stats.stopped_early} stopped)  "
                  f"best {r.best.pair.deploy} Z={r.best.m.z:.3f}", flush=True)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    head = "| GPUs | AMPD Fig. 7 (s) | " + " | ".join(f"{m} (s)" for m in models) + " | " + \
        " | ".join(f"{m}: method, runs (stopped early), first choice" for m in models) + " |"
    lines = [f"Planning time, {meta['workload']}, {meta['sessions']} sessions, rate {', '.join(f'{BASE_RATE.get(m, 1.2):g}' for m in models)} "
             f"sessions/s per 8 GPUs, --jobs {meta['jobs']}, empty cache, step costs {meta.get('costs', 'roofline')}; "
             f"{meta['machine']}, commit {meta['commit']}, "
             f"{meta['date']}.", "", head, "|" + "---|" * (2 + 2 * len(models))]
    for n in sorted({r["gpus"] for r in rows}):
        by = {r["model"]: r for r in rows if r["gpus"] == n}
        cells = [f"{by[m]['wall_s']:.2f}" if m in by else "-" for m in models]
        info = [f"{by[m]['method']}, {by[m]['runs']} ({by[m]['stopped_early']}), {by[m]['best']}" if m in by else "-"
                for m in models]
        lines.append(f"| {n} | {PAPER_FIG7_S.get(n, '-')} | " + " | ".join(cells) + " | " + " | ".join(info) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ns = sorted(PAPER_FIG7_S)
    ax.plot(ns, [PAPER_FIG7_S[n] for n in ns], "o--", color="tab:gray", label="AMPD Fig. 7 (paper)")
    for model, style in zip(dict.fromkeys(r["model"] for r in rows), ("o-", "s-", "^-")):
        pts = sorted((r["gpus"], r["wall_s"]) for r in rows if r["model"] == model)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"tandem, {model}")
        for x, y in pts:
            ax.annotate(f"{y:.1f}s", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(GOAL_S, color="tab:red", lw=0.8, ls=":", label=f"goal {GOAL_S:g} s at 256 GPUs")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("#GPUs")
    ax.set_ylabel("planning time (s)")
    ax.set_title("Offline planning time (2-core machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _base_tree(rev: str, path: Path) -> Path:
    """A checkout of `rev` at `path` (git worktree add --detach), reused when it already holds `rev`."""
    want = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True, check=True).stdout.strip()
    if path.exists():
        have = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        if have != want:
            raise SystemExit(f"{path} holds {have[:7] or 'no checkout'}, not {rev}; remove it or give --base-dir")
        return path
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True)
    return path


def _cli_run(tree: Path, cache: Path, cpu: int | None, extra: tuple[str, ...] = ()) -> tuple[float, float, str]:
    """Wall and CPU (user + system, its child processes included) seconds of one whole `python -m tandem.cli`
    process on the code of `tree`, and its stdout."""
    cmd = [sys.executable, "-m", "tandem.cli", *CLI_ARGS, *extra]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    env = dict(os.environ, PYTHONPATH=str(tree), XDG_CACHE_HOME=str(cache), PYTHONDONTWRITEBYTECODE="1")
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    # cwd = the tree: `python -m` puts the working directory first on sys.path
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: tandem plan exited {out.returncode}: {out.stderr.strip()[-400:]}")
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), out.stdout


def _plan_rows(stdout: str) -> list[dict]:
    """The --json plan without the wall-time field (what must be equal between old and new code)."""
    return [{k: v for k, v in row.items() if k != "plan_wall_s"} for row in json.loads(stdout)]


def _bytecode(tree: Path, mode: str) -> None:
    """`source`: no cached bytecode in the tree's package (every run compiles what it imports); `compiled`: all of it
    compiled beforehand."""
    import shutil
    for d in sorted((tree / "tandem").rglob("__pycache__")):
        shutil.rmtree(d, ignore_errors=True)
    if mode == "compiled":
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "tandem")], env=env, check=True,
                       capture_output=True)


def run_cli(new: Path, old: Path, repeat: int, cpu: int | None, bytecode: str = "source") -> dict:
    """Alternate old and new `tandem plan` processes, cold then warm, `repeat` times; medians and the ratio."""
    from rich.progress import Progress

    for tree in (old, new):
        _bytecode(tree, bytecode)

    times: dict[str, list[float]] = {f"{v}_{c}": [] for v in ("old", "new") for c in ("cold", "warm")}
    cpu_s: dict[str, list[float]] = {k: [] for k in times}
    with tempfile.TemporaryDirectory(prefix="plan-cli-") as tmp, Progress(transient=True) as bar:
        task = bar.add_task("tandem plan, old and new", total=2 * repeat + 2)
        plans = {}
        for version, tree in (("old", old), ("new", new)):     # the plans compared (not timed)
            plans[version] = _plan_rows(_cli_run(tree, Path(tmp) / f"json-{version}", cpu, ("--json",))[2])
            bar.advance(task)
        for i in range(repeat):
            order = (("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old))
            for version, tree in order:
                cache = Path(tmp) / f"{version}-{i}"            # empty: every simulation runs
                for kind in ("cold", "warm"):                   # warm: the cache the cold run left
                    wall, used, _ = _cli_run(tree, cache, cpu)
                    times[f"{version}_{kind}"].append(wall)
                    cpu_s[f"{version}_{kind}"].append(used)
                bar.advance(task)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_s.items()}
    return {"command": "tandem " + " ".join(CLI_ARGS), "repeat": repeat, "cpu": cpu, "bytecode": bytecode,
            "times": times, "median": med,
            "cpu_s": cpu_s, "median_cpu": med_cpu,
            "ratio_cold": med["new_cold"] / med["old_cold"], "ratio_warm": med["new_warm"] / med["old_warm"],
            "cpu_ratio_cold": med_cpu["new_cold"] / med_cpu["old_cold"],
            "cpu_ratio_warm": med_cpu["new_warm"] / med_cpu["old_warm"],
            "same_plan": plans["old"] == plans["new"], "plan": [r["deploy"] for r in plans["new"]],
            "z": [r["z"] for r in plans["new"]]}


def cli_markdown(res: dict, meta: dict) -> str:
    """The --cli table: median wall seconds of the whole process, old and new, cold and warm cache."""
    m, c = res["median"], res["median_cpu"]
    lines = [f"`{res['command']}`, whole process, median of {res['repeat']} alternating old/new runs"
             + (f" on CPU {res['cpu']} (taskset)" if res["cpu"] is not None else "")
             + ("; modules compiled beforehand (cached bytecode)" if res.get("bytecode") == "compiled"
                else "; no cached bytecode (every process compiles the modules it imports)")
             + f"; old = {meta['base']}, new = {meta['commit']}; {meta['machine']}, {meta['date']}.", "",
             "| run cache | old wall (s) | new wall (s) | new / old | old CPU (s) | new CPU (s) | new / old |",
             "|---|---|---|---|---|---|---|",
             f"| empty (every simulation runs) | {m['old_cold']:.2f} | {m['new_cold']:.2f} | {res['ratio_cold']:.3f} "
             f"| {c['old_cold']:.2f} | {c['new_cold']:.2f} | {res['cpu_ratio_cold']:.3f} |",
             f"| warm (the same command again) | {m['old_warm']:.2f} | {m['new_warm']:.2f} | {res['ratio_warm']:.3f} "
             f"| {c['old_warm']:.2f} | {c['new_warm']:.2f} | {res['cpu_ratio_warm']:.3f} |",
             "", f"Same plan (--json, all fields but the wall time): {'yes' if res['same_plan'] else 'NO'}; "
             f"first choices {', '.join(res['plan'])} (Z {', '.join(f'{z:.4f}' for z in res['z'])}). "
             f"Goal: at most {CLI_GOAL_S:g} s and {CLI_GOAL_RATIO:g}x the old time.", "",
             *(f"- {label}: new CPU {c[f'new_{cache}']:.2f} s ({'met' if c[f'new_{cache}'] <= CLI_GOAL_S else 'NOT met'}"
               f" against {CLI_GOAL_S:g} s), {res[f'cpu_ratio_{cache}']:.3f}x the old CPU time "
               f"({'met' if res[f'cpu_ratio_{cache}'] <= CLI_GOAL_RATIO else 'NOT met'} against {CLI_GOAL_RATIO:g}x)"
               for cache, label in (("cold", "empty run cache"), ("warm", "warm run cache")))]
    return "\n".join(lines) + "\n"


def cli_plot(res: dict, path: Path) -> None:
    """Median wall and CPU seconds, old against new, empty and warm run cache, with every run as a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8))
    for ax, (key, med, label) in zip(axes, (("times", "median", "wall time of the process (s)"),
                                            ("cpu_s", "median_cpu", "CPU time, user + system (s)"))):
        for j, cache in enumerate(("cold", "warm")):
            for k, (version, color) in enumerate((("old", "tab:gray"), ("new", "tab:blue"))):
                x, y = j * 3 + k, res[med][f"{version}_{cache}"]
                vals = res[key][f"{version}_{cache}"]
                ax.bar(x, y, color=color, label=version if j == 0 else None)
                ax.plot([x] * len(vals), vals, "k.", ms=3)
                ax.annotate(f"{y:.2f}s", (x, y), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
        ax.axhline(CLI_GOAL_S, color="tab:red", lw=0.8, ls=":", label=f"goal {CLI_GOAL_S:g} s")
        ax.set_xticks([0.5, 3.5], ["empty run cache", "warm run cache"])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("tandem plan --gpus 256 --workload toolbench --rate 16, whole process, "
                 + ("modules compiled beforehand" if res.get("bytecode") == "compiled" else "no cached bytecode"))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main_cli(args) -> None:
    """--cli: the whole `tandem plan` process against the baseline revision."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    new = Path(__file__).resolve().parent.parent
    old = _base_tree(args.base, Path(args.base_dir))
    res = run_cli(new, old, args.repeat or 5, args.cpu, args.bytecode)
    meta = {"base": args.base, "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                       f"load average {os.getloadavg()[0]:.1f} at the end"}
    stem = "plan_cli_speed" + (f"_{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, **res}, indent=2))
    md = cli_markdown(res, meta)
    (out / f"{stem}.md").write_text(md)
    cli_plot(res, out / f"{stem}.png")
    print(md)
    print(f"wrote {out}/{stem}.json, {stem}.md, {stem}.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.1-70b,qwen3-32b")
    ap.add_argument("--workload", default="toolbench")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs per point, the fastest kept (default 1); --cli: old/new pairs, medians (default 5)")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--out", default="reports/plan")
    ap.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                    help="step costs of the simulations (default: %(default)s)")
    ap.add_argument("--cli", action="store_true", help="time the whole `tandem plan` process against --base")
    ap.add_argument("--base", default="5a0bb63", help="--cli: the baseline revision (default: %(default)s)")
    ap.add_argument("--base-dir", default="/tmp/plan-base", help="--cli: where it is checked out")
    ap.add_argument("--cpu", type=int, default=None, help="--cli: pin every process to this CPU (taskset)")
    ap.add_argument("--bytecode", choices=("source", "compiled"), default="source",
                    help="--cli: no cached bytecode in either tree, or both compiled beforehand (default: %(default)s)")
    ap.add_argument("--tag", default="", help="--cli: suffix of the output file names")
    args = ap.parse_args()
    if args.cli:
        main_cli(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args.models.split(","), args.workload, args.sessions, args.jobs, args.repeat or 1,
               tuple(int(b) for b in args.budgets.split(",")), args.cost_model)
    meta = {"workload": args.workload, "sessions": args.sessions, "jobs": args.jobs, "commit": _commit(),
            "costs": cost_sources(["h20"], args.cost_model),
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                       f"load average {os.getloadavg()[0]:.1f} at the end"}
    (out / "plan_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = markdown(rows, meta)
    (out / "plan_speed.md").write_text(md)
    plot(rows, out / "plan_speed.png")
    print()
    print(md)
    print(f"wrote {out}/plan_speed.json, plan_speed.md, plan_speed.png")


if __name__ == "__main__":
    main()
