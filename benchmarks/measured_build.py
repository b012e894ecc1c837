"""Time to build simulated clusters on measured costs (the step timers, their tables and the routing-cost fits),
a tree against a baseline tree, alternating fresh processes on one core; with --plan also the whole `tandem plan`
command that builds them (its --json plan must be the same from both trees, apart from its wall time).

    python benchmarks/measured_build.py --baseline /path/to/old/tree --repeat 5 --cpu 0 [--plan] [--plot FILE.png]

The workload is what `tandem plan --gpus 256 --workload toolbench` builds: Llama-3.1-70B on H20s (costs derived
from the H100's tables) under AMPD, 7 deployments of 16 GPUs and 3 of 256, all degrees tp2, tp4 and tp8. Imports
(scipy.optimize, pyarrow.parquet, the simulator) happen before the clock starts; each process builds once, cold.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SLICES = ("P:tp8x1,D:tp8x1", "P:tp4x2,D:tp8x1", "P:tp8x1,D:tp4x2", "P:tp4x2,D:tp4x2", "P:tp4x3,D:tp4x1",
          "P:tp2x5,D:tp2x3", "P:tp2x4,D:tp8x1")
FULL = ("P:tp8x16,D:tp8x16", "P:tp8x16,D:tp2x64", "P:tp4x48,D:tp4x16")

CHILD = """
import json, time
import scipy.optimize, pyarrow.parquet
from tandem.sim.cluster import SimConfig, build
slices, full = json.loads(__import__("sys").argv[1])
t = time.perf_counter()
for d in slices:
    build(SimConfig(model="llama-3.1-70b", gpu="h20", gpus=16, deploy=d, policy="ampd", seed=0))
for d in full:
    build(SimConfig(model="llama-3.1-70b", gpu="h20", gpus=256, deploy=d, policy="ampd", seed=0))
print(time.perf_counter() - t)
"""


def one(tree: Path, cpu: int | None) -> float:
    """Seconds one fresh process on `tree` takes to build the clusters."""
    cmd = [sys.executable, "-c", CHILD + f"\nassert __import__('tandem').__file__.startswith({str(tree)!r})",
           json.dumps([SLICES, FULL])]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    # run in the tree's root: `python -c` puts the working directory first on sys.path
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


PLAN = ("plan", "--gpus", "256", "--workload", "toolbench", "--rate", "16", "--slo-ttft", "1.0", "--slo-itl", "0.05",
        "--no-cache", "--jobs", "1", "--json")


def one_plan(tree: Path, cpu: int | None) -> tuple[float, list]:
    """Wall seconds of the whole `tandem plan` process on `tree`, and its plan without the wall-time fields."""
    cmd = [sys.executable, "-m", "tandem.cli", *PLAN]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    plan = [{k: v for k, v in row.items() if k != "plan_wall_s"} for row in json.loads(out.stdout)]
    return wall, plan


def plot(path: Path, panels: list[tuple[str, list[float], list[float]]]) -> None:
    """Old and new medians (bars) and every run (dots), one panel per measurement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (title, old, new) in zip(np.atleast_1d(axes), panels):
        for x, (runs, colour) in enumerate(((old, "tab:grey"), (new, "tab:blue"))):
            ax.bar(x, statistics.median(runs), color=colour, alpha=0.6, width=0.6)
            ax.plot([x] * len(runs), runs, "o", color="black", markersize=3)
            ax.text(x, statistics.median(runs), f"{statistics.median(runs):.3f} s", ha="center", va="bottom")
        ax.set_xticks([0, 1], ["baseline", "this tree"])
        ax.set_ylabel("seconds (one core)")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def report(name: str, old: list[float], new: list[float]) -> None:
    mo, mn = statistics.median(old), statistics.median(new)
    print(f"{name}: baseline " + " ".join(f"{x:.3f}" for x in old) + f"  median {mo:.3f} s")
    print(f"{name}: tree     " + " ".join(f"{x:.3f}" for x in new) + f"  median {mn:.3f} s")
    print(f"{name}: new / old = {mn / mo:.3f} ({mo / mn:.2f}x faster)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the old tree (its root, put on PYTHONPATH)")
    p.add_argument("--tree", type=Path, default=ROOT, help="the new tree (default: this one)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cpu", type=int, default=None, help="pin every process to this core")
    p.add_argument("--plan", action="store_true", help="also time the whole `tandem plan` command")
    p.add_argument("--plot", type=Path, help="write a PNG of the runs here")
    args = p.parse_args(argv)
    old, new, old_plan, new_plan = [], [], [], []
    for _ in range(args.repeat):
        old.append(one(args.baseline, args.cpu))
        new.append(one(args.tree, args.cpu))
    panels = [("building 10 clusters (timers, fits)", old, new)]
    report("build", old, new)
    if args.plan:
        for _ in range(args.repeat):
            (wo, po), (wn, pn) = one_plan(args.baseline, args.cpu), one_plan(args.tree, args.cpu)
            old_plan.append(wo)
            new_plan.append(wn)
            if po != pn:
                print("plan: the two trees' plans differ")
                return 1
        report("plan", old_plan, new_plan)
        print("plan: the same plan from both trees")
        panels.append(("tandem plan --gpus 256 (whole process)", old_plan, new_plan))
    if args.plot:
        plot(args.plot, panels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
