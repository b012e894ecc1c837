"""Simulator speed: 10,000 ToolBench sessions on 8 H20 GPUs (Llama-3.1-70B), one core, under each cost model; and,
with --scale, rounds/s, events/s and peak memory from 10,000 to a million rounds.

Prints sessions/s and events/s per cost model (the roofline first: the same-run baseline of the measured and
derived costs, whose ratio to it is printed), the same figures for a bare heapq loop over the same number of events
(the floor any Python discrete-event loop pays), and checks that a second run with the same seed gives identical
results.

    python benchmarks/sim_speed.py [--sessions 10000] [--rate 1.0] [--policy ampd] [--cost-models roofline,measured]

--scale runs each ROUNDS@GPUS size (ToolBench, AMPD, measured costs; 8 GPUs: P:tp4x1,D:tp4x1 at 1 session/s,
64 GPUs: P:tp4x4,D:tp4x12 at 8 sessions/s, which they sustain; --workload agentic-long: 32 GPUs, P:tp4x2,D:tp4x6 at
0.1 sessions/s) in a child process pinned to one core, streaming its
records (simulate(stream=...)), and, up to --baseline-max-rounds, the same size on the --baseline tree (an older
commit checked out elsewhere, e.g. `git worktree add /tmp/sim-base <commit>`) keeping them in memory as it did,
alternating old and new; both must give the same events and metrics. CPU seconds are the process's own (the host is
shared); wall seconds are printed too.

    python benchmarks/sim_speed.py --scale [--sizes 10000@8,100000@64,1000000@64] [--workload toolbench]
        [--baseline /tmp/sim-base]
        [--baseline-max-rounds 100000] [--repeats 1] [--out sim_speed.json] [--plot sim_speed.png]
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

from tandem.sim.cluster import SimConfig, simulate
from tandem.workload.generators import PAPER_SLOS, generate
from tandem.workload.metrics import summarize


def bare_heap_loop(n: int) -> float:
    """Seconds to push and pop `n` events through heapq with the loop's tuple shape."""
    t0 = time.perf_counter()
    heap: list = []
    t = 0.0
    for i in range(n):
        heapq.heappush(heap, (t + (i % 97) * 1e-3, i, 2, None, None))
        if len(heap) > 64:
            heapq.heappop(heap)
    while heap:
        heapq.heappop(heap)
    return time.perf_counter() - t0


# workload -> GPUs -> (deployment, sessions/s); the workload's mean rounds per session
SCALE_DEPLOY = {"toolbench": {8: ("P:tp4x1,D:tp4x1", 1.0), 64: ("P:tp4x4,D:tp4x12", 8.0)},
                "agentic-long": {32: ("P:tp4x2,D:tp4x6", 0.1)}}
ROUNDS_PER_SESSION = {"toolbench": 3.96, "agentic-long": 250.0}


def child(workload: str, rounds: int, gpus: int, stream: bool) -> None:
    """One timed run in this process (whatever tree PYTHONPATH points at): print its figures as one JSON line."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    model = "llama-3.1-70b"
    deploy, rate = SCALE_DEPLOY[workload][gpus]
    n = max(1, math.ceil(rounds / ROUNDS_PER_SESSION[workload]))
    t0 = time.process_time()
    sessions = generate(workload, n, rate, 0, slo=PAPER_SLOS.get((model, workload)))
    gen_cpu = time.process_time() - t0
    total_rounds = sum(len(s.rounds) for s in sessions)
    cfg = SimConfig(model, "h20", gpus, deploy, "ampd", seed=0)
    kw = {}
    if stream:
        from tandem.workload.metrics import RecordStream
        kw["stream"] = RecordStream()
    tree = os.environ.get("PYTHONPATH", "?")
    every = max(1, n // 200)                      # the bar moves every 0.5% of the sessions
    with Progress(TextColumn(f"{total_rounds:,} rounds on {gpus} GPUs ({tree})"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, refresh_per_second=2) as bar:
        task = bar.add_task("sessions", total=n)
        c0, w0 = time.process_time(), time.perf_counter()
        res = simulate(sessions, cfg, progress=lambda done: done % every or bar.update(task, completed=done), **kw)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    metrics = res.metrics if stream else summarize(res.records, res.sim_time_s)
    print(json.dumps({
        "workload": workload, "rounds": total_rounds, "sessions": n, "gpus": gpus, "deploy": deploy, "rate": rate, "events": res.events,
        "cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "generate_cpu_s": round(gen_cpu, 2),
        "rounds_per_cpu_s": round(total_rounds / cpu), "events_per_cpu_s": round(res.events / cpu),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "sim_time_s": round(res.sim_time_s, 1), "slo_attainment": metrics["slo_attainment"],
        "metrics_sha": hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()[:16],
        "streamed": stream,
    }), flush=True)


def scale(args: argparse.Namespace) -> None:
    """Each size on the new tree (streaming) and, up to --baseline-max-rounds, on the baseline tree, alternating."""
    new_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for spec in args.sizes.split(","):
        rounds, gpus = (int(x) for x in spec.split("@"))
        if args.workload not in SCALE_DEPLOY or gpus not in SCALE_DEPLOY[args.workload]:
            sys.exit(f"--sizes: {args.workload} runs on {sorted(SCALE_DEPLOY.get(args.workload, {}))} GPUs, "
                     f"got {spec!r}")
        trees = [("new", new_tree)]
        if args.baseline and rounds <= args.baseline_max_rounds:
            trees = [("baseline", args.baseline), *trees]
        for rep in range(args.repeats):
            for label, tree in (trees if rep % 2 == 0 else trees[::-1]):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", args.workload, str(rounds), str(gpus)]
                if label == "new":
                    cmd.append("--stream")
                out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"},
                                     stdout=subprocess.PIPE, text=True, check=True).stdout
                row = {"tree": label, "path": tree, **json.loads(out.strip().splitlines()[-1])}
                rows.append(row)
                print(f"{label:8s} {row['rounds']:>9,} rounds {gpus:>2} GPUs: {row['cpu_s']:8.1f} cpu s "
                      f"{row['wall_s']:8.1f} wall s {row['rounds_per_cpu_s']:>6,} rounds/s "
                      f"{row['events_per_cpu_s']:>7,} events/s {row['peak_rss_mb']:>6,} MB", flush=True)
    for r in rows:                                  # the same run on both trees: same events and metrics
        base = [b for b in rows if b["tree"] == "baseline" and (b["rounds"], b["gpus"]) == (r["rounds"], r["gpus"])]
        if r["tree"] == "new" and base:
            b = min(base, key=lambda x: x["cpu_s"])
            r["speedup_cpu"] = round(b["cpu_s"] / r["cpu_s"], 2)
            r["identical_to_baseline"] = (b["events"], b["metrics_sha"]) == (r["events"], r["metrics_sha"])
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), one core pinned, "
                      f"python {platform.python_version()}", "runs": rows}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot_scale(rows, args.plot)


def plot_scale(rows: list[dict], path: str) -> None:
    """Rounds per CPU second and peak RSS by run size, baseline and new."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for tree, marker in (("baseline", "s"), ("new", "o")):
        pts = sorted((r["rounds"], r["gpus"], r["rounds_per_cpu_s"], r["peak_rss_mb"]) for r in rows
                     if r["tree"] == tree)
        for gpus in sorted({p[1] for p in pts}):
            sel = [p for p in pts if p[1] == gpus]
            a.plot([p[0] for p in sel], [p[2] for p in sel], marker=marker, label=f"{tree}, {gpus} GPUs")
            b.plot([p[0] for p in sel], [p[3] for p in sel], marker=marker, label=f"{tree}, {gpus} GPUs")
    for ax, ylab in ((a, "rounds per CPU second"), (b, "peak RSS (MB)")):
        ax.set_xscale("log")
        ax.set_xlabel(f"simulated rounds ({rows[0].get('workload', 'toolbench')})")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.axhline(1_000_000 / 300, color="grey", ls="--", lw=0.8)
    b.axhline(2048, color="grey", ls="--", lw=0.8)
    fig.suptitle("Simulator speed: Llama-3.1-70B on H20s, AMPD, one core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "--stream" in sys.argv[5:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", action="store_true", help="rounds/s, events/s and peak RSS by run size")
    ap.add_argument("--sizes", default="10000@8,100000@64,1000000@64",
                    help="ROUNDS@GPUS,... (toolbench: 8 or 64 GPUs; agentic-long: 32)")
    ap.add_argument("--workload", default="toolbench", choices=sorted(SCALE_DEPLOY))
    ap.add_argument("--baseline", help="a tree of an older commit to time beside this one")
    ap.add_argument("--baseline-max-rounds", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--policy", default="ampd")
    ap.add_argument("--deploy", default="P:tp4x1,D:tp4x1")
    ap.add_argument("--cost-models", default="roofline,measured", help="cost models to time, the first the baseline")
    args = ap.parse_args()
    if args.scale:
        scale(args)
        return
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})   # one core
    model = "llama-3.1-70b"
    sessions = generate("toolbench", args.sessions, args.rate, 0, slo=PAPER_SLOS[(model, "toolbench")])
    runs = {}
    for cm in args.cost_models.split(","):
        cfg = SimConfig(model, "h20", 8, args.deploy if args.policy not in ("vllm", "continuum") else "C:tp4x2",
                        args.policy, seed=0, cost_model=cm)
        t0 = time.perf_counter()
        res = simulate(sessions, cfg)
        wall = time.perf_counter() - t0
        m1 = summarize(res.records, res.sim_time_s)
        res2 = simulate(sessions, cfg)
        m2 = summarize(res2.records, res2.sim_time_s)
        bare = bare_heap_loop(res.events)
        runs[cm] = {
            "costs": str(cfg.cost_choice().label), "wall_s": round(wall, 2), "events": res.events,
            "sessions_per_s": round(args.sessions / wall, 1), "events_per_s": round(res.events / wall),
            "bare_heapq_events_per_s": round(res.events / bare), "overhead_vs_bare_heapq": round(wall / bare, 1),
            "sim_time_s": round(res.sim_time_s, 1), "slo_attainment": m1["slo_attainment"],
            "deterministic": json.dumps(m1, sort_keys=True) == json.dumps(m2, sort_keys=True),
        }
    base = next(iter(runs.values()))["wall_s"]
    for r in runs.values():
        r["wall_vs_first"] = round(r["wall_s"] / base, 3)
    out = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}",
        "sessions": args.sessions, "rate": args.rate, "policy": args.policy, "deploy": args.deploy,
        "runs": runs, "goal_wall_s": 60, "goal_measured_vs_roofline": 1.4,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
