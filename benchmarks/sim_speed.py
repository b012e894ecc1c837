"""Simulator speed: 10,000 ToolBench sessions on 8 H20 GPUs (Llama-3.1-70B), one core, under each cost model.

Prints sessions/s and events/s per cost model (the roofline first: the same-run baseline of the measured and
derived costs, whose ratio to it is printed), the same figures for a bare heapq loop over the same number of events
(the floor any Python discrete-event loop pays), and checks that a second run with the same seed gives identical
results.

    python benchmarks/sim_speed.py [--sessions 10000] [--rate 1.0] [--policy ampd] [--cost-models roofline,measured]
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--policy", default="ampd")
    ap.add_argument("--deploy", default="P:tp4x1,D:tp4x1")
    ap.add_argument("--cost-models", default="roofline,measured", help="cost models to time, the first the baseline")
    args = ap.parse_args()
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
