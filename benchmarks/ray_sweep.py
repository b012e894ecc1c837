"""`tandem experiment` in-process (--jobs 1), in two local processes (--jobs 2) and as Ray tasks on two Ray nodes
(--ray, one CPU per node): wall time of each and whether their results.json are byte-identical.

    python benchmarks/ray_sweep.py [--out docs/results/ray_sweep] [-- EXPERIMENT ARGS]

Default experiment: `--preset demo`, then a larger sweep (`--preset paper --workloads toolbench --policies
ampd,dynamo --rates 1,2 --sessions 1200`, ~40 s on one core). Each command runs as a separate `tandem experiment` process (its wall
time includes Python's start and, for --ray, joining the cluster and starting Ray's task workers).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWEEPS = {
    "demo": ["--preset", "demo"],
    "paper-toolbench": ["--preset", "paper", "--workloads", "toolbench", "--policies", "ampd,dynamo", "--rates", "1,2",
                        "--sessions", "1200"],
}


def run(sweeps: dict[str, list[str]], work: Path) -> list[dict]:
    """Each sweep three ways on one two-node Ray cluster; one row per (sweep, backend)."""
    from tandem.bench.ray_local import LocalRayCluster
    rows = []
    with LocalRayCluster(["sweep_a", "sweep_b"], cpus=1) as rc:
        for name, args in sweeps.items():
            outs = {}
            for backend, extra in (("--jobs 1", ["--jobs", "1"]), ("--jobs 2", ["--jobs", "2"]),
                                   ("--ray (2 nodes x 1 CPU)", ["--ray", "--ray-address", rc.address])):
                out = work / name / backend.split()[0].strip("-") / backend.split()[1].strip("(")
                t0 = time.perf_counter()
                r = subprocess.run([sys.executable, "-m", "tandem.cli", "experiment", *args, *extra, "--no-progress",
                                    "--out", str(out)], capture_output=True, text=True, env={**os.environ, **rc.env})
                wall = time.perf_counter() - t0
                if r.returncode != 0:
                    raise RuntimeError(f"{name} {backend}: exit {r.returncode}: {r.stderr[-2000:]}")
                outs[backend] = (out / "results.json").read_bytes()
                sweep_s = json.loads((out / "run.json").read_text())["wall_s"]
                rows.append({"sweep": name, "backend": backend, "wall_s": wall, "sweep_s": sweep_s,
                             "identical_to_jobs_1": outs[backend] == outs["--jobs 1"]})
                print(f"{name:>16} {backend:>24}: {wall:6.1f} s (sweep {sweep_s:6.1f} s), results.json "
                      f"{'identical' if rows[-1]['identical_to_jobs_1'] else 'DIFFERENT'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run, print, write results.json and table.md."""
    from tandem.bench.provenance import report_meta
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/ray_sweep")
    p.add_argument("experiment", nargs="*", help="one sweep's `tandem experiment` arguments instead of the default two")
    a = p.parse_args(argv)
    out = Path(a.out)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ray-sweep-") as work:          # the sweeps' own reports: not kept
        rows = run({"custom": a.experiment} if a.experiment else SWEEPS, Path(work))
    meta = report_meta("benchmarks/ray_sweep.py", argv if argv is not None else sys.argv[1:],
                       time.perf_counter() - t0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"`{meta['command']}` — {meta['machine']}, {meta['date']}, commit {meta['commit']}.", "",
             "| sweep | backend | wall (process) | sweep (run.json) | results.json vs --jobs 1 |", "|---|---|---|---|---|"]
    lines += [f"| {r['sweep']} | {r['backend']} | {r['wall_s']:.1f} s | {r['sweep_s']:.1f} s | "
              f"{'byte-identical' if r['identical_to_jobs_1'] else 'different'} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
