"""AMPD+LAPS against co-located Continuum on long agentic sessions.

    python benchmarks/ampd_laps_agentic.py [--out docs/results/ampd_laps_agentic] [--sessions 30] [--quick]

`agentic-long` sessions (100-400 rounds, contexts growing to ~200K tokens, tool gaps of 1 s to 3 h) on 32 H20s with
Llama-3.1-70B, each policy on its own best deployment: the experiment's deployment search scores every candidate
by its mean SLO attainment over the rates and keeps the best (tandem.bench.experiment). The workload has no paper
SLO; this benchmark fixes TTFT 2.5 s / ITL 50 ms (the loosest of AMPD's Llama-3.1-70B SLOs: HotpotQA's TTFT,
ToolBench's and DuReader's ITL), chosen before any run. Policies: continuum (co-located, KV pinned across tool
calls), vllm, ampd (local prefill pauses the decode worker's decodes), ampd+laps, ampd+laps-chunked (local prefill
in ITL-budget chunks beside the decodes). The report (table, JSON, PNG) is the experiment's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tandem.bench.experiment import ExperimentSpec, format_cells, run_experiment
from tandem.cli.common import csv_list, positive_float, positive_int, seed_arg
from tandem.workload.session import SLO

WORKLOAD = "agentic-long"
SLO_AGENTIC = SLO(2.5, 0.050)
POLICIES = ["continuum", "vllm", "ampd", "ampd+laps", "ampd+laps-chunked"]


def spec(sessions: int, rates: list[float], seeds: list[int], max_candidates: int, jobs: int) -> ExperimentSpec:
    """The experiment: one workload on 32 GPUs, the policies above, deployments searched per policy."""
    return ExperimentSpec(name="ampd-laps-agentic", model="llama-3.1-70b", gpu="h20", workloads=[WORKLOAD],
                          policies=list(POLICIES), rates=rates, sessions=sessions, seeds=seeds,
                          gpus={WORKLOAD: 32}, slos={WORKLOAD: SLO_AGENTIC}, max_candidates=max_candidates,
                          jobs=jobs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/ampd_laps_agentic", help="report directory")
    p.add_argument("--sessions", type=positive_int, default=30, help="sessions per cell and seed (default: 30)")
    p.add_argument("--rates", type=csv_list(positive_float), default=[0.05, 0.1],
                   help="session arrival rates per second (default: 0.05,0.1)")
    p.add_argument("--seeds", type=csv_list(seed_arg), default=[0], help="seeds (default: 0)")
    p.add_argument("--candidates", type=positive_int, default=6, help="deployments searched per policy (default: 6)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default: 1)")
    p.add_argument("--quick", action="store_true", help="8 sessions, one rate, 2 candidates: a smoke run")
    a = p.parse_args(argv)
    rates, seeds = a.rates, a.seeds
    if a.quick:
        a.sessions, rates, a.candidates = 8, rates[:1], 2
    t0 = time.perf_counter()
    result = run_experiment(spec(a.sessions, rates, seeds, a.candidates, a.jobs), Path(a.out),
                            progress=sys.stderr.isatty())
    print(format_cells(result["cells"]), end="")
    print(f"\nreport: {a.out}/ in {time.perf_counter() - t0:.0f} s; SLO TTFT {SLO_AGENTIC.ttft_s} s, "
          f"ITL {SLO_AGENTIC.itl_s} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
