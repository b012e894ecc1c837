"""Acceptance check of the planner: its first choice against exhaustive search (same objective).

For N = 8 and 16 H20 GPUs, the four synthetic workloads and Llama-3.1-70B and Qwen3-32B, the
planner (`tandem.plan.plan`, exact mode, empty cache) and the exhaustive baseline (every feasible
P/D deployment of <= N GPUs simulated in full, `tandem.plan.exhaustive`) rank deployments by the
same objective Z = max(P95 TTFT / TTFT SLO, P95 ITL / ITL SLO) over the same 200 sessions (seed 0,
AMPD's SLOs, arrival rate proportional to N). Reports both top-3s, whether the first choices agree,
the planner's time and runs, and (with --slice) where the slice approximation's first choice ranks
in the exhaustive order. Writes plan_optimality.json and plan_optimality.md to --out; exhaustive
runs are cached in --out/cache so a second invocation is fast.

    python benchmarks/plan_optimality.py [--models ...] [--workloads ...] [--budgets 8,16] [--jobs 2] [--slice]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from tandem.plan import PlanInputs, exhaustive, plan
from tandem.workload.generators import PAPER_SLOS, generate

RATE_PER_8_GPUS = {
    ("llama-3.1-70b", "toolbench"): 1.2, ("llama-3.1-70b", "hotpotqa"): 0.6,
    ("llama-3.1-70b", "dureader"): 0.3, ("llama-3.1-70b", "gaia"): 0.02,
    ("qwen3-32b", "toolbench"): 2.0, ("qwen3-32b", "hotpotqa"): 0.6,
    ("qwen3-32b", "dureader"): 0.3, ("qwen3-32b", "gaia"): 0.02,
}
"""Sessions/s per 8 GPUs: where the best 8-GPU deployment is near its SLO (P95/SLO ~ 1). GAIA's long
multi-round sessions (11 rounds of ~6K new tokens, contexts to 131K) miss AMPD's 1.5 s / 1.0 s TTFT
SLO on 8-16 H20s at any rate, so its rate is low and its problem is SLO-infeasible (Z > 1)."""


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _top(result, k=3) -> list[dict]:
    return [{"deploy": r.pair.deploy, "table2": r.pair.table2, "z": r.m.z, "ttft_p95_s": r.m.ttft_p95_s,
             "itl_p95_s": r.m.itl_p95_s, "slo_attainment": r.m.slo_attainment} for r in result.ranked[:k]]


def _monotonicity_violations(full) -> int:
    """Pairs where adding replicas (same degrees) made Z worse: the assumption behind maximal-only search."""
    z = {r.pair: r.m.z for r in full.ranked}
    bad = 0
    for p, zp in z.items():
        for q, zq in z.items():
            if q != p and q.n == p.n and q.m == p.m and q.x >= p.x and q.y >= p.y and zq > zp:
                bad += 1
    return bad


def run_case(model: str, workload: str, n: int, sessions: int, jobs: int, cache: Path, slice_check: bool) -> dict:
    rate = RATE_PER_8_GPUS[(model, workload)] * n / 8
    ss = generate(workload, sessions, rate, 0, slo=PAPER_SLOS[(model, workload)])
    t0 = time.perf_counter()
    p = plan(PlanInputs(model, "h20", n, ss, jobs=jobs, cache_dir=None))
    plan_s = time.perf_counter() - t0
    full = exhaustive(PlanInputs(model, "h20", n, ss, jobs=jobs, cache_dir=cache))
    order = [r.pair.deploy for r in full.ranked]
    row = {"model": model, "workload": workload, "gpus": n, "rate": rate, "sessions": sessions,
           "planner": _top(p), "exhaustive": _top(full), "match": p.best.pair.deploy == full.best.pair.deploy,
           "planner_rank_in_exhaustive": order.index(p.best.pair.deploy) + 1,
           "top3_match": [r["deploy"] for r in _top(p)] == order[:3],
           "plan_s": plan_s, "plan_runs": p.stats.simulated, "plan_stopped_early": p.stats.stopped_early,
           "plan_candidates": p.candidates, "exhaustive_candidates": full.candidates, "exhaustive_s": full.wall_s,
           "best_is_maximal": full.best.pair.maximal(n), "monotonicity_violations": _monotonicity_violations(full),
           "degrees": p.degrees, "slo_met": not p.slo_problem}
    if slice_check and n >= 16:
        sl = plan(PlanInputs(model, "h20", n, ss, jobs=jobs, cache_dir=cache, exact_max_gpus=n // 2,
                             slice_gpus=n // 2))
        rank = order.index(sl.best.pair.deploy) + 1
        row["slice"] = {"slice_gpus": n // 2, "first": sl.best.pair.deploy, "z": sl.best.m.z,
                        "rank_in_exhaustive": rank, "z_gap": sl.best.m.z / full.best.m.z - 1}
    mark = "==" if row["match"] else "!="
    print(f"{model:14s} {workload:9s} N={n:2d} rate={rate:5.2f}  planner {p.best.pair.deploy:16s} Z={p.best.m.z:.3f} "
          f"{mark} exhaustive {full.best.pair.deploy:16s} Z={full.best.m.z:.3f}  "
          f"plan {plan_s:.1f}s/{p.stats.simulated} runs, exhaustive {full.candidates} deployments"
          + (f"  slice#1 rank {row['slice']['rank_in_exhaustive']}" if "slice" in row else ""), flush=True)
    return row


def run_slice_case(model: str, workload: str, n: int, sessions: int, jobs: int, cache: Path) -> dict:
    """Slice mode at budget n (default slice of 16 GPUs) against every maximal deployment of n GPUs."""
    rate = RATE_PER_8_GPUS[(model, workload)] * n / 8
    ss = generate(workload, sessions, rate, 0, slo=PAPER_SLOS[(model, workload)])
    t0 = time.perf_counter()
    sl = plan(PlanInputs(model, "h20", n, ss, jobs=jobs, cache_dir=None))
    plan_s = time.perf_counter() - t0
    full = exhaustive(PlanInputs(model, "h20", n, ss, jobs=jobs, cache_dir=cache), maximal_only=True)
    order = [r.pair.deploy for r in full.ranked]
    rank = order.index(sl.best.pair.deploy) + 1
    row = {"model": model, "workload": workload, "gpus": n, "rate": rate, "sessions": sessions, "method": sl.method,
           "planner": _top(sl), "exhaustive_maximal": _top(full), "rank_in_exhaustive": rank,
           "z_gap": sl.best.m.z / full.best.m.z - 1, "plan_s": plan_s, "plan_runs": sl.stats.simulated,
           "exhaustive_candidates": full.candidates}
    print(f"{model:14s} {workload:9s} N={n:2d} rate={rate:5.2f}  slice planner {sl.best.pair.deploy:16s} "
          f"Z={sl.best.m.z:.3f} rank {rank} of {full.candidates} maximal; best {full.best.pair.deploy} "
          f"Z={full.best.m.z:.3f}; plan {plan_s:.1f}s", flush=True)
    return row


def _fmt(top: list[dict]) -> str:
    return "<br>".join(f"{t['table2']} ({t['z']:.3f})" for t in top)


def markdown(all_rows: list[dict], meta: dict) -> str:
    rows = [r for r in all_rows if "match" in r]
    big = [r for r in all_rows if "rank_in_exhaustive" in r]
    ok = sum(r["match"] for r in rows)
    lines = [f"{ok}/{len(rows)} first choices equal the exhaustive best; {sum(r['top3_match'] for r in rows)}/{len(rows)} "
             f"top-3s equal. {meta['sessions']} sessions, seed 0, H20, AMPD SLOs, --jobs {meta['jobs']}; "
             f"{meta['machine']}, commit {meta['commit']}, {meta['date']}. Z = max(P95 TTFT/SLO, P95 ITL/SLO) in "
             "parentheses.", "",
             "| model | workload | GPUs | rate | planner top-3 | exhaustive top-3 | #1 equal | plan s (runs, stopped) | "
             "exhaustive deployments | A1 violations |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['workload']} | {r['gpus']} | {r['rate']:g} | {_fmt(r['planner'])} | "
                     f"{_fmt(r['exhaustive'])} | {'yes' if r['match'] else 'NO (rank %d)' % r['planner_rank_in_exhaustive']} | "
                     f"{r['plan_s']:.1f} ({r['plan_runs']}, {r['plan_stopped_early']}) | {r['exhaustive_candidates']} | "
                     f"{r['monotonicity_violations']} |")
    sl = [r for r in rows if "slice" in r]
    if sl:
        lines += ["", "Slice approximation (a slice of N/2 GPUs at half the rate, half the sessions; the shortlist "
                  "re-simulated on N GPUs) against exhaustive:", "",
                  "| model | workload | GPUs | slice first choice | Z | rank in exhaustive | Z above the best |",
                  "|---|---|---|---|---|---|---|"]
        for r in sl:
            s = r["slice"]
            lines.append(f"| {r['model']} | {r['workload']} | {r['gpus']} | {s['first']} | {s['z']:.3f} | "
                         f"{s['rank_in_exhaustive']} | {100 * s['z_gap']:.1f}% |")
    if big:
        lines += ["", "Slice mode (the default above 16 GPUs: a 16-GPU slice, half the sessions, shortlist re-simulated "
                  "on the full cluster) against every maximal deployment simulated on the full cluster:", "",
                  "| model | workload | GPUs | slice top-3 | best maximal top-3 | rank of slice #1 | Z above the best | "
                  "plan s (runs) | maximal deployments |", "|---|---|---|---|---|---|---|---|---|"]
        for r in big:
            lines.append(f"| {r['model']} | {r['workload']} | {r['gpus']} | {_fmt(r['planner'])} | "
                         f"{_fmt(r['exhaustive_maximal'])} | {r['rank_in_exhaustive']} | {100 * r['z_gap']:.1f}% | "
                         f"{r['plan_s']:.1f} ({r['plan_runs']}) | {r['exhaustive_candidates']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.1-70b,qwen3-32b")
    ap.add_argument("--workloads", default="toolbench,hotpotqa,dureader,gaia")
    ap.add_argument("--budgets", default="8,16")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--slice", action="store_true", help="also measure the slice approximation at N >= 16")
    ap.add_argument("--slice-budgets", default="", help="budgets (> 16) at which to compare slice mode with every "
                    "maximal deployment, e.g. 32")
    ap.add_argument("--out", default="reports/plan")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        for workload in args.workloads.split(","):
            for n in (int(b) for b in args.budgets.split(",") if b):
                rows.append(run_case(model, workload, n, args.sessions, args.jobs, out / "cache", args.slice))
                (out / "plan_optimality.json").write_text(json.dumps(rows, indent=2, default=str))
            for n in (int(b) for b in args.slice_budgets.split(",") if b):
                rows.append(run_slice_case(model, workload, n, args.sessions, args.jobs, out / "cache"))
                (out / "plan_optimality.json").write_text(json.dumps(rows, indent=2, default=str))
    meta = {"sessions": args.sessions, "jobs": args.jobs, "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"}
    md = markdown(rows, meta)
    (out / "plan_optimality.md").write_text(md)
    print()
    print(md)


if __name__ == "__main__":
    main()
