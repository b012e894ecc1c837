"""LAPS Fig. 6 and Fig. 7 in the simulator: prefill latency, throughput and TTFT-SLO violations under closed-loop
clients, LAPS and its ablations against SGLang-like PD baselines, Qwen2.5-7B/14B/32B on H200.

    python benchmarks/laps_repro.py                    # the default grid, 3 seeds (~9 min on 2 cores)
    python benchmarks/laps_repro.py --quick --out /tmp/laps   # a ~1 min smoke run

Every cell is one `tandem.sim.cluster.simulate()` run of the `chat-multiturn` workload (LAPS's length mix, TTFT SLO
0.4 s as Fig. 7) with `concurrency` closed-loop clients (SimConfig.concurrency): each client runs one conversation
at a time and sends its next turn as soon as the previous answer is complete (no think time: a concurrency-driven
load generator, as LAPS's "sustained client load"; the workload's ~20 s think times would leave 64 clients at a
few requests per second). Two client kinds:

- `chat`: every turn's full answer is decoded (ShareGPT output lengths); rounds/s are then set by the decode time
  of the answers, and prefill sees a light load;
- `prefill`: every turn asks for one output token, so a client waits only for the prefill stage (its TTFT) and the
  prefill instances are what limits rounds/s, as in LAPS's prefill throughput (Figs. 6 and 8).

Deployments are `P:tp1xN,D:tp1x8` (N = 1 or 8 prefill instances, one H200 each): eight tp1 decode workers hold
at most 8 of the 64 clients' sequences each, so decoding is never short of KV memory or preempted (the table
shows ITL and preemptions) and prefill latency is what differs between the policies.

Metrics per cell, from the per-round records of SimResult: rounds/s (rounds finished while every client was busy,
i.e. until the last conversation started, over that time), TTFT mean and P90 (= prefill latency including
queueing and the KV hand-off to the decode worker), initial and incremental TTFT, SLO violation rate (rounds whose
TTFT exceeds the SLO or that never produced a token, over all rounds). Writes table.md, results.json and PNG
plots (fig6_<client>.png, fig7_<client>.png) to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.bench.laps_report import headline_md, write_report
from tandem.bench.laps_repro import GPU, QUICK, Client, Grid, run_grid
from tandem.bench.provenance import cost_sources, report_meta
from tandem.cli.common import csv_list, positive_int, seed_arg
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL



def _csv(kind: Callable[[str], object]) -> Callable[[str], tuple]:
    """csv_list of `kind`, as a tuple (the Grid's fields are tuples)."""
    parse = csv_list(kind)
    return lambda text: tuple(parse(text))


def build_grid(args: argparse.Namespace) -> Grid:
    """The grid from --quick and the narrowing flags."""
    grid = QUICK if args.quick else Grid()
    over = {k: v for k, v in (("models", args.models), ("instances", args.instances), ("concurrency", args.concurrency),
                              ("policies", args.policies), ("clients", args.clients), ("seeds", args.seeds))
            if v is not None}
    if args.decode_workers is not None:
        over["decode_workers"] = args.decode_workers
    if args.sessions_per_client is not None:
        over["sessions_per_client"] = tuple((c, args.sessions_per_client) for c in Client)
        over["min_sessions"] = tuple((c, 1) for c in Client)
    return dataclasses.replace(grid, cost_model=args.cost_model, **over)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid and write the report; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/laps", help="report folder (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="a ~1 min smoke run: Qwen2.5-32B, concurrency 4 and 64, "
                                                          "fewer sessions")
    ap.add_argument("--models", type=_csv(str), default=None, metavar="A,B")
    ap.add_argument("--instances", type=_csv(positive_int), default=None, metavar="1,8", help="prefill instances")
    ap.add_argument("--concurrency", type=_csv(positive_int), default=None, metavar="1,4,...", help="clients")
    ap.add_argument("--policies", type=_csv(str), default=None, metavar="A,B")
    ap.add_argument("--clients", type=_csv(Client), default=None, metavar="chat,prefill")
    ap.add_argument("--seeds", type=_csv(seed_arg), default=None, metavar="0,1")
    ap.add_argument("--decode-workers", type=positive_int, default=None, help="tp1 decode workers (default: 8)")
    ap.add_argument("--sessions-per-client", type=positive_int, default=None, metavar="K",
                    help="conversations per client in every cell (default: 16 chat, 40 prefill, with a floor)")
    ap.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1), help="processes (default: %(default)s)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                    help="step costs (default: %(default)s: measured where tables exist; docs/cost-models.md)")
    args = ap.parse_args(argv)
    grid = build_grid(args)
    from tandem.policy.presets import POLICIES
    bad = [p for p in grid.policies if p not in POLICIES]
    if bad:
        ap.error(f"unknown policy {bad[0]!r} (valid: {', '.join(POLICIES)})")
    t0 = time.perf_counter()
    rows = run_grid(grid, args.jobs, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    meta = report_meta("benchmarks/laps_repro.py", argv, wall, jobs=args.jobs, cells=len(rows),
                       costs=cost_sources([GPU], grid.cost_model))
    out = Path(args.out)
    result = write_report(rows, grid, out, meta, plots=not args.no_plots)
    print(headline_md(result["headline"]))
    print(f"report: {out}/ ({', '.join(result['files'])}) — {len(rows)} simulations in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
