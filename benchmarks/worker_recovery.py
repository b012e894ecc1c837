"""Worker recovery under load: `tandem serve --prefill-workers 1 --decode-workers 1` on a tiny model with a few
streaming clients, its decode worker SIGKILLed once per run; per run the seconds from the kill until /health is 200
again, and where they went: detection (the kill until the coordinator noticed), then the replacement's phases as the
coordinator logs them (backoff, fork, imports, model load, setup, handshake, registration); what is left is the
/health prober's own granularity. Loopback only; bounded (a run gives up after 30 s).

    python benchmarks/worker_recovery.py [--runs 5] [--clients 4] [--limit 5]

Exit status 1 if any run's /health was not 200 again within --limit seconds."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.chaos.lifecycle import (RECOVERY_LIMIT_S, StreamLoad, decode_worker, make_model, recover_once,
                                          serve_tiny)
from tandem.bench.provenance import report_meta
from tandem.cli.common import positive_int
from tandem.runtime.cluster import QUICK_DEATH_S, STARTUP_PHASES

PHASES = ["detection", *(name for name, _ in STARTUP_PHASES)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=positive_int, default=5, help="decode worker kills, one per run (default 5)")
    ap.add_argument("--clients", type=positive_int, default=4, help="concurrent streaming clients (default 4)")
    ap.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per streamed request (default 128)")
    ap.add_argument("--limit", type=float, default=RECOVERY_LIMIT_S,
                    help=f"seconds /health may take to be 200 again (default {RECOVERY_LIMIT_S:g})")
    ap.add_argument("--settle", type=float, default=QUICK_DEATH_S + 1.0,
                    help="seconds of load between a replacement and the next kill (default: long enough that the "
                         f"supervisor sees no crash loop, {QUICK_DEATH_S:g} s + 1)")
    ap.add_argument("--out", default=None, help="write results.json and the server's log here")
    a = ap.parse_args(argv)
    t_start = time.time()
    runs, counts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.out) if a.out else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = make_model(Path(tmp) / "tiny")
        serve_args = ["--max-model-len", "1024", "--max-worker-restarts", str(a.runs + 1)]
        print(f"worker_recovery: tandem serve --prefill-workers 1 --decode-workers 1 {' '.join(serve_args)} "
              f"(tiny qwen3 1m), {a.clients} streaming clients x {a.max_tokens} tokens, {a.runs} decode-worker "
              "SIGKILLs", flush=True)
        with serve_tiny(model, work, serve_args, name="worker_recovery") as served:
            load = StreamLoad(served.url, a.clients, a.max_tokens)
            try:
                time.sleep(3.0)                                 # the load is running before the first kill
                for i in range(a.runs):
                    if i:
                        time.sleep(a.settle)
                    rec = recover_once(served, decode_worker(served))
                    runs.append(rec)
                    total = f"{rec.health_s:.2f} s" if rec.health_s is not None else "never"
                    print(f"run {i + 1}: killed pid {rec.pid}; /health 200 again after {total} (replacement pid "
                          f"{rec.new_pid})", flush=True)
            finally:
                counts = load.stop()
    print()
    print("| run | /health 200 after (s) | " + " | ".join(PHASES) + " | prober (s) |")
    print("|---:|---:|" + "---:|" * (len(PHASES) + 1))
    for i, r in enumerate(runs):
        parts = {"detection": r.detection_s, **r.phases}
        known = sum(v for v in parts.values() if v is not None)
        rest = r.health_s - known if r.health_s is not None else None
        cell = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {i + 1} | {cell(r.health_s)} | " + " | ".join(cell(parts.get(p)) for p in PHASES)
              + f" | {cell(rest)} |")
    worst = max((r.health_s if r.health_s is not None else float("inf")) for r in runs)
    failed = [i + 1 for i, r in enumerate(runs) if not r.passed(a.limit)]
    print(f"\nload: {counts.get('completed')} requests completed, {counts.get('failed')} failed (those in flight on "
          f"the killed worker, and those refused while no decode worker lived)")
    print(f"worst run {worst:.2f} s; limit {a.limit:g} s: " + ("PASS" if not failed else f"FAIL (runs {failed})"))
    if a.out:
        res = {"runs": [r.__dict__ for r in runs], "load": counts, "limit_s": a.limit,
               "meta": report_meta("benchmarks/worker_recovery.py", argv, time.time() - t_start)}
        (Path(a.out) / "results.json").write_text(json.dumps(res, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
