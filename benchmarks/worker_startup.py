"""Worker start time: a 1P+1D ServingCluster of the tiny model started `--starts` times in a row, workers forked by
the fork server (the default) against spawned (TANDEM_WORKER_MULTIPROC_METHOD=spawn, the same-run baseline), each
method in a process of its own. The first forked start also starts the fork server.

    python benchmarks/worker_startup.py [--starts 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from tandem.bench.provenance import report_meta
from tandem.cli.common import positive_int


def _child(model: str, starts: int) -> None:
    """Start and stop the cluster `starts` times; print the seconds of each start as JSON."""
    from tandem.runtime.cluster import ClusterConfig, ServingCluster

    async def run() -> list[float]:
        out = []
        for _ in range(starts):
            t0 = time.monotonic()
            c = await ServingCluster.start(ClusterConfig(model, 1, 1, 0, "ampd",
                                                         engine_args=dict(max_model_len=1024, num_kv_blocks=256)))
            out.append(time.monotonic() - t0)
            await c.shutdown()
        return out
    print(json.dumps(asyncio.run(run())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=positive_int, default=3, help="cluster starts per method (default 3)")
    ap.add_argument("--out", default=None, help="write results.json here")
    a = ap.parse_args(argv)
    from tandem.engine.tiny_model import make_tiny_model
    t0 = time.time()
    res: dict = {"starts": a.starts}
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, arch="qwen3", size="1m", seed=5)
        for method in ("forkserver", "spawn"):
            env = {**os.environ, "TANDEM_WORKER_MULTIPROC_METHOD": method, "OMP_NUM_THREADS": "1"}
            r = subprocess.run([sys.executable, __file__, "--child", tmp, str(a.starts)], env=env,
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                print(f"worker_startup: the {method} run failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                return 1
            res[method] = json.loads(r.stdout.strip().splitlines()[-1])
    res["meta"] = report_meta("benchmarks/worker_startup.py", argv, time.time() - t0)
    print("| method | " + " | ".join(f"start {i + 1} (s)" for i in range(a.starts)) + " |")
    print("|---|" + "---:|" * a.starts)
    for method in ("forkserver", "spawn"):
        print(f"| {method} | " + " | ".join(f"{t:.2f}" for t in res[method]) + " |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
