"""Planning time against the GPU budget, beside AMPD Figure 7 (0.54 s at 8 GPUs ... 61.67 s at 256).

For N = 8, 16, 32, 64, 128, 256 GPUs the planner runs from an empty cache on ToolBench at an arrival
rate proportional to N (`--base-rate` sessions/s per 8 GPUs), 200 sessions, seed 0, `--jobs`
processes; the wall time of `plan()` (from sessions in hand to the ranked top 3) is recorded with
the method (exact search up to 16 GPUs, slice search above), the runs it simulated and how many of
them stopped early. Writes plan_speed.json, plan_speed.md and plan_speed.png to --out.

    python benchmarks/plan_speed.py [--models llama-3.1-70b,qwen3-32b] [--jobs 2] [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.1-70b,qwen3-32b")
    ap.add_argument("--workload", default="toolbench")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs per point; the fastest is kept")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--out", default="reports/plan")
    ap.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                    help="step costs of the simulations (default: %(default)s)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args.models.split(","), args.workload, args.sessions, args.jobs, args.repeat,
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
