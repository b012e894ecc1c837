"""Time to build simulated clusters on measured costs (the step timers, their tables and the routing-cost fits),
a tree against a baseline tree, alternating fresh processes on one core.

    python benchmarks/measured_build.py --baseline /path/to/old/tree --repeat 5 --cpu 0

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
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the old tree (its root, put on PYTHONPATH)")
    p.add_argument("--tree", type=Path, default=ROOT, help="the new tree (default: this one)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cpu", type=int, default=None, help="pin every process to this core")
    args = p.parse_args(argv)
    old, new = [], []
    for _ in range(args.repeat):
        old.append(one(args.baseline, args.cpu))
        new.append(one(args.tree, args.cpu))
    mo, mn = statistics.median(old), statistics.median(new)
    print(f"baseline {args.baseline}: " + " ".join(f"{x:.3f}" for x in old) + f"  median {mo:.3f} s")
    print(f"tree     {args.tree}: " + " ".join(f"{x:.3f}" for x in new) + f"  median {mn:.3f} s")
    print(f"new / old = {mn / mo:.3f} ({mo / mn:.2f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
