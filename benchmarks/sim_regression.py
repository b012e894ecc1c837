"""Simulator regression check: every policy on the four AMPD workloads, one JSON of metrics per cell.

Run it on two trees (e.g. before and after a refactor) and compare the outputs:

    PYTHONPATH=/path/to/old/tree python benchmarks/sim_regression.py --out old.json
    python benchmarks/sim_regression.py --out new.json
    python benchmarks/sim_regression.py --compare old.json new.json

Same seed, same sessions: a refactor that moves no decision must give identical JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

WORKLOADS = ("toolbench", "gaia", "hotpotqa", "dureader")
POLICIES = ("ampd", "ampd-window", "ampd-no-pr", "ampd-no-ar-pr", "dynamo", "vllm", "continuum")


def run(sessions: int, rate: float) -> dict:
    """Metrics of every (workload, policy) cell, with the per-session records' digest."""
    import hashlib

    from tandem.sim.cluster import SimConfig, simulate
    from tandem.workload.generators import PAPER_GPUS, PAPER_SLOS, generate
    from tandem.workload.metrics import summarize

    model = "llama-3.1-70b"
    out: dict = {}
    for wl in WORKLOADS:
        ss = generate(wl, sessions, rate, 0, slo=PAPER_SLOS[(model, wl)])
        gpus = PAPER_GPUS[wl]
        for pol in POLICIES:
            colo = pol in ("vllm", "continuum")
            half = gpus // 2
            deploy = f"C:tp4x{gpus // 4}" if colo else f"P:tp4x{half // 4},D:tp4x{half // 4}"
            res = simulate(ss, SimConfig(model, "h20", gpus, deploy, pol, seed=0))
            m = summarize(res.records, res.sim_time_s)
            rows = [(r.session_id, r.failed, [(x.first_token_s, x.finish_s, x.prefill_where) for x in r.rounds])
                    for r in sorted(res.records, key=lambda r: r.session_id)]
            digest = hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()[:16]
            out[f"{wl}/{pol}"] = {"metrics": json.loads(json.dumps(m, default=str)), "records_sha": digest,
                                  "events": res.events}
            print(f"{wl:10s} {pol:14s} {digest} events={res.events}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=120)
    ap.add_argument("--rate", type=float, default=1.6)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    a = ap.parse_args()
    if a.compare:
        old, new = (json.load(open(p)) for p in a.compare)
        same = 0
        for k in old:
            o, n = old[k], new.get(k, {})
            om, nm = o["metrics"], n.get("metrics", {})
            changed = [m for m in om if om[m] != nm.get(m)]
            added = sorted(set(nm) - set(om))
            if o["records_sha"] == n.get("records_sha") and not changed:
                same += 1
                print(f"same      {k}: records {o['records_sha']}, events {o['events']} -> {n['events']}"
                      + (f", new metrics {added}" if added else ""))
            else:
                print(f"DIFFERENT {k}: records {o['records_sha']} -> {n.get('records_sha')}; changed {changed}")
        print(f"{same}/{len(old)} cells give identical records and metrics")
        return
    res = run(a.sessions, a.rate)
    text = json.dumps(res, indent=1, sort_keys=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
