"""Optimus in the simulator: block-diffusion decoding with an elastic chunk size against
autoregressive decoding of the base model, plain block diffusion (BD32) and fixed chunks, on ShareGPT lengths.

    python benchmarks/optimus_sim.py                  # SDAR-8B and LLaDA2.0-16B on A100-80G and H100 (~15 min)
    python benchmarks/optimus_sim.py --quick --out /tmp/optimus   # SDAR-8B on an A100, a few points (~1 min)

Two experiments per (model, GPU), one co-located tp1 worker (`C:tp1x1`, the `vllm` policy: continuous batching, the
batch rebuilt every step):

- **throughput against batch size** (Optimus Fig. 8/9): b closed-loop clients, each sending its next ShareGPT
  request (trace lengths, ../shared/data/traces) when the previous one ends, 16 requests per client (at least 256
  in all), so that the ramp-up and the drain (clients out of requests) are a small share of the run; output
  tokens/s over the run;
- **P90 TPOT against request rate** (Fig. 10/13): Poisson arrivals spanning at least 100 s at every rate (rate ×
  100 requests, at least 300, at most 3,000), so that a rate past capacity shows its queue growing rather than a
  burst drained; a request's TPOT is (finish − first token) / (output tokens − 1); the serving capacity is the
  highest rate whose P90 TPOT stays within the 50 ms SLO and whose P90 TTFT stays within 5 s (linear interpolation
  between the rates measured on both sides). The TTFT bound is there because TPOT alone plateaus once
  max_num_seqs caps the batch: past that rate requests queue instead.

Systems: `ar` (the AR base model: Qwen3-8B for SDAR-8B, Ling-2.0-16B for LLaDA2.0-16B), `bd32` (the whole block
every step), `c4`..`c32` (streaming chunked decoding with a fixed window), `elastic` (Optimus's c* per step, the
windows leaving waiting prefills up to half the step's token budget: tandem's default) and `elastic-paper` (the
windows may take the whole token budget, as the paper's c* does under decode-first batching; where ready prompts
overflow the step, its windows are priced at the prompt rows they displace, as elastic's are).
Diffusion commits follow tandem.perf.dllm's distribution for the model's ShareGPT row of Optimus Table 2; step
times come from `--cost-model` (measured operator tables by default; docs/cost-models.md). Writes table.md,
results.json, fig8.png and fig10.png to --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from tandem.bench.optimus_report import write_report
from tandem.bench.optimus_sim import (ARRIVAL_SPAN_S, BATCHES, CLIENT_REQUESTS, MIN_CLOSED_REQUESTS, MODELS, RATES, Run,
                                      plan_runs, simulate_run, summarize)
from tandem.bench.parallel import ParallelMap
from tandem.bench.provenance import cost_sources, report_meta
from tandem.cli.common import csv_list, positive_float, positive_int
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL


def main(argv: list[str] | None = None) -> int:
    """Simulate every run, summarise, write the report; 2 when a run cannot be simulated."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/optimus_sim", help="report folder (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="SDAR-8B on an A100, a few batch sizes and rates")
    ap.add_argument("--models", type=csv_list(str), default=None, metavar="A,B")
    ap.add_argument("--gpus", type=csv_list(str), default=None, metavar="A,B")
    ap.add_argument("--sessions", type=positive_int, default=None,
                    help="fewest requests per rate point (default: 300; rate x the arrival span when more)")
    ap.add_argument("--arrival-span", type=positive_float, default=None, metavar="S",
                    help="seconds the arrivals of a rate point span at least (default: 100; --quick: 10)")
    ap.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1), help="processes")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                    help="step costs (default: %(default)s: measured where tables exist; docs/cost-models.md)")
    args = ap.parse_args(argv)
    models = args.models or (["sdar-8b"] if args.quick else list(MODELS))
    gpus = args.gpus or (["a100-80g"] if args.quick else ["a100-80g", "h100"])
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown diffusion model {bad[0]!r} (valid: {', '.join(MODELS)})")
    batches = (1, 8, 64) if args.quick else BATCHES
    rates = (1, 4, 8, 16) if args.quick else RATES
    n = args.sessions or (100 if args.quick else 300)
    span = args.arrival_span or (10.0 if args.quick else ARRIVAL_SPAN_S)
    per_client, closed = (4, 32) if args.quick else (CLIENT_REQUESTS, MIN_CLOSED_REQUESTS)
    runs = plan_runs(models, gpus, batches, rates, per_client=per_client, closed=closed, fewest=n, span_s=span,
                     cost_model=args.cost_model)
    t0 = time.time()
    try:
        with ParallelMap(args.jobs, not args.no_progress, len(runs), width=40) as pool:
            rows = pool.map(simulate_run, runs, Run.label)
    except ValueError as e:
        print(f"optimus_sim: {e}", file=sys.stderr)
        return 2
    heads = summarize(rows, models, gpus)
    out = Path(args.out)
    meta = report_meta("benchmarks/optimus_sim.py", argv, time.time() - t0, costs=cost_sources(gpus, args.cost_model))
    files = write_report(rows, heads, meta, batches, rates, out)
    print(f"report: {out}/ (table.md, results.json, {', '.join(files)}) — {len(runs)} simulations in "
          f"{meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
