"""dLLM-Serve in the simulator: LLaDA-8B on an RTX 4090 and an L40S, phase-multiplexed
admission with logit decomposition and sparse KV against request-level batching that reserves each request's
Refresh peak, under Poisson load: the shape of dLLM-Serve's Fig. 3 (throughput against request rate, the baseline's
throughput wall), Fig. 4/5 and Table 4 (latency, its tail and spread), Fig. 7a (the gain against prompt length).

    python benchmarks/dllm_serve_sim.py                     # both GPUs, both workloads (~3 min on 2 cores)
    python benchmarks/dllm_serve_sim.py --quick --out /tmp/dllm   # the RTX 4090, one workload, a few rates

One tp1 co-located worker (`C:tp1x1`, policy `vllm`), LLaDA-8B (tandem.perf.models), blocks of 32, every request
generating 256 tokens (dLLM-Serve Table 3), one token committed a step (Table 3's 256 steps for 256 tokens, the
baselines without parallel decoding: tandem.perf.dllm.FIXED_SCHEDULE_COMMITS), step times from `--cost-model`
(measured operator tables by default, derived for the RTX 4090; docs/cost-models.md), the KV pool and the token
budget from tandem.perf.dllm_memory. Systems:

- `fast-dllm`: static batches (`--dllm-admission static`), each request reserving its Refresh peak (prompt + 256
  query tokens) and its dense KV (ρ = 1) for its whole life, a Refresh at each block start (delay_step 0: Fast-dLLM's
  dual cache), monolithic logits; the token budget the largest whose peak and KV fit (`auto`): the batch is the
  largest that fits, as the paper sizes its baselines;
- `sparse-dllm`: static batches of Sparse-dLLM's algorithm, dLLM-Serve's (ρ = 0.5, delay_step 1: two full-length
  steps at each block start), monolithic logits, the budget the largest that fits: the baseline of dLLM-Serve's
  ablation (Fig. 8) and of its sensitivity study, the same algorithm without the serving system;
- `reserve`: fast-dllm's provisioning, admitted continuously (dInfer-like dynamic batching);
- `phase-mono`: phase-multiplexed admission with the baseline's memory (monolithic logits, ρ = 1, delay 0, the same
  budget): the scheduler alone;
- `reserve-serve`: dLLM-Serve's memory and phases (max_num_logits 2048, ρ = 0.5, max_num_batched_tokens 4,000 on
  the 4090 / 16,384 on the L40S as its Table 3, delay_step 1) admitted request by request, each reserving its
  Refresh peak: phase multiplexing alone, at dLLM-Serve's memory;
- `dllm-serve-d0`: phase-multiplexed admission with that memory, delay_step 0;
- `dllm-serve`: the same with delay_step 1 (dLLM-Serve's default, SparseConfig.delay_step): two full-length steps at
  each block start.

Workloads (the paper's LiveBench, BurstGPT and OSC are not in ../shared/data): `burst`, the input lengths of the Azure
LLM inference conversation trace (Azure OpenAI traffic, like BurstGPT) with prompt + 256 within 4,000 tokens; `code`,
HumanEval-like coding prompts (Optimus Table 2's lengths, 172 ± 65, lognormal), a stand-in for LiveBench coding.
Writes table.md, results.json and PNGs to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.bench.parallel import ParallelMap
from tandem.bench.provenance import cost_sources, report_meta
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL
from tandem.cli.common import csv_list, positive_int
from tandem.perf.dllm import OPTIMUS_LENGTHS
from tandem.perf.dllm_memory import DllmMemory
from tandem.sim.cluster import SimConfig, dllm_serve_summary, simulate
from tandem.workload.session import Round, Session
from tandem.workload.traces import load_trace

MODEL = "llada-8b"
GPUS = ("rtx4090", "l40s")
GEN = 256                                   # dLLM-Serve Table 3: generation length
BLOCK = 32                                  # Table 3: block size
MAX_LOGITS = 2048                           # Table 3: max materialised logits
BUDGET = {"rtx4090": 4000, "l40s": 16384}   # Table 3: max batched tokens of dLLM-Serve
MAX_LEN = 4000                              # the longest request (prompt + 256) any system here can take on a 4090
SYSTEMS = ("fast-dllm", "sparse-dllm", "reserve", "phase-mono", "reserve-serve", "dllm-serve-d0", "dllm-serve")
WORKLOADS = ("burst", "code")
RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0)
SWEEP_INPUTS = (64, 256, 512, 1024, 2048)   # Fig. 7a's shape: the gain against prompt length, at saturation
SWEEP_RATE = 2.0
PARALLEL_COMMITS = (2.51, 4.19)             # sensitivity: a parallel decoder's commits (Optimus Table 2, LLaDA2.0 row)
PAPER = {"rtx4090": {"speedup": (1.61, 1.81), "burst_tok_s": {"fast-dllm": 42.4, "dllm-serve": 76.6},
                     "wall_rps": 0.25, "left_gb": 7.0},
         "l40s": {"speedup": (1.60, 1.74),
                  "table4": {"LiveBench": {"sparse-dllm": (435.18, 32.26), "fast-dllm": (241.19, 56.46),
                                           "dllm-serve": (218.50, 90.17)},
                             "Burst": {"sparse-dllm": (6466.96, 34.23), "fast-dllm": (3158.38, 61.26),
                                       "dllm-serve": (1551.40, 106.95)},
                             "OSC": {"sparse-dllm": (6791.42, 32.87), "fast-dllm": (3408.36, 58.23),
                                     "dllm-serve": (1849.79, 94.32)}},
                  "left_gb": 31.0}}


@dataclass(frozen=True, slots=True)
class Run:
    """One simulation: a system on a GPU, a workload at a Poisson rate."""

    gpu: str
    system: str
    workload: str
    rate: float
    sessions: int = 400
    commits: tuple[float, float] | None = None     # None: LLaDA-8B's one token a step
    tag: str = "main"
    cost_model: str = DEFAULT_COST_MODEL

    def label(self) -> str:
        return f"{self.gpu} {self.system} {self.workload} {self.rate:g}/s" + ("" if self.tag == "main" else
                                                                               f" {self.tag}")


def system_config(gpu: str, system: str, commits=None, cost_model: str = DEFAULT_COST_MODEL) -> SimConfig:
    """The simulator's configuration of a system on a GPU."""
    base = dict(dllm_block_length=BLOCK, dllm_commits=commits)
    if system == "sparse-dllm":
        kw = dict(dllm_admission="static", colocated_max_num_batched_tokens=0, max_num_logits=None,
                  dllm_kv_retention=0.5, dllm_delay_step=1)
    elif system in ("fast-dllm", "reserve", "phase-mono"):
        mode = {"fast-dllm": "static", "reserve": "reserve", "phase-mono": "phase"}[system]
        kw = dict(dllm_admission=mode, colocated_max_num_batched_tokens=0, max_num_logits=None,
                  dllm_kv_retention=1.0, dllm_delay_step=0)
    else:
        kw = dict(dllm_admission="reserve" if system == "reserve-serve" else "phase",
                  colocated_max_num_batched_tokens=BUDGET[gpu], max_num_logits=MAX_LOGITS,
                  dllm_kv_retention=0.5, dllm_delay_step=0 if system == "dllm-serve-d0" else 1)
    return SimConfig(MODEL, gpu, 1, "C:tp1x1", "vllm", cost_model=cost_model, **base, **kw)


def prompts(workload: str, n: int, seed: int) -> list[int]:
    """n prompt lengths of a workload (each within MAX_LEN with its 256 generated tokens)."""
    rng = random.Random(seed)
    limit = MAX_LEN - GEN
    if workload == "burst":
        pool = [s.rounds[0].input_tokens for s in load_trace("azure-conv")]
        pool = [p for p in pool if 1 <= p <= limit]
        return [rng.choice(pool) for _ in range(n)]
    if workload == "code":
        (mean, sd), _ = OPTIMUS_LENGTHS["humaneval"]
        s2 = math.log(1 + (sd / mean) ** 2)
        return [min(limit, max(8, round(rng.lognormvariate(math.log(mean) - s2 / 2, math.sqrt(s2))))) for _ in range(n)]
    if workload.startswith("fixed"):
        return [int(workload[len("fixed"):])] * n
    raise ValueError(f"unknown workload {workload!r}")


def sessions(workload: str, n: int, rate: float, seed: int = 0) -> list[Session]:
    """Poisson arrivals at `rate`, one request each (its prompt, 256 tokens)."""
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for i, p in enumerate(prompts(workload, n, seed)):
        t += rng.expovariate(rate)
        out.append(Session(f"{workload}-{i}", t, [Round(p, GEN)]))
    return out


def simulate_run(run: Run) -> dict:
    """One simulation: throughput, latency and the worker's phase and admission figures."""
    res = simulate(sessions(run.workload, run.sessions, run.rate), system_config(run.gpu, run.system, run.commits,
                                                                                  run.cost_model))
    rounds = [r for rec in res.records for r in rec.rounds if r.finish_s is not None]
    lat = np.array([r.finish_s - r.arrival_s for r in rounds]) if rounds else np.array([0.0])
    ttft = [r.first_token_s - r.arrival_s for r in rounds if r.first_token_s is not None]
    out_tokens = sum(r.output_tokens for r in rounds)
    s = dllm_serve_summary(res.workers)
    return {"gpu": run.gpu, "system": run.system, "workload": run.workload, "rate": run.rate, "tag": run.tag,
            "sessions": len(res.records), "failed": sum(1 for r in res.records if not r.completed),
            "output_tokens_per_s": out_tokens / res.sim_time_s if res.sim_time_s > 0 else None,
            "latency_mean_s": float(lat.mean()), "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p99_s": float(np.percentile(lat, 99)), "latency_std_s": float(lat.std()),
            "latency_span_s": float(np.percentile(lat, 99) - np.percentile(lat, 1)),
            "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
            "budget": s.get("dllm_max_num_batched_tokens"), "kv_pool": s.get("dllm_kv_pool_tokens"),
            "max_running": s.get("dllm_max_running"), "batch_tokens_mean": s.get("dllm_batch_tokens_mean"),
            "refresh_share": s.get("dllm_refresh_share"), "deferrals": s.get("dllm_deferrals"),
            "max_deferred": s.get("dllm_max_deferred_steps"), "wall_s": res.wall_s}


# ------------------------------------------------------------------------------------------------ report

def memory_rows(mean_prompt: dict[str, float]) -> list[dict]:
    """The memory model of each GPU: what the baseline and dLLM-Serve reserve, and the requests that fit."""
    rows = []
    for gpu in GPUS:
        mem = DllmMemory(MODEL, gpu)
        static_t = mem.feasible_batched_tokens(None, 1.0)
        t = BUDGET[gpu]
        rep = mem.report(t, MAX_LOGITS, 0.5)
        row = {"gpu": gpu, "budget_gib": rep["budget"] / 2**30, "weights_gib": rep["weights"] / 2**30,
               "left_gib": rep["left_after_weights"] / 2**30, "left_gb": rep["left_after_weights"] / 1e9,
               "raw_left_gib": (mem.gpu.hbm_bytes - mem.weights_bytes) / 2**30,
               "static_budget": static_t, "static_peak_gib": mem.activation_peak(static_t) / 2**30,
               "static_pool_tokens": mem.kv_pool_tokens(static_t),
               "serve_budget": t, "serve_peak_mono_gib": rep["peak_monolithic"] / 2**30,
               "serve_peak_capped_gib": rep["peak_capped"] / 2**30,
               "serve_pool_mono_gib": rep["pool_monolithic"] / 2**30,
               "serve_pool_capped_gib": rep["pool_capped"] / 2**30,
               "serve_pool_tokens": mem.kv_pool_tokens(t, MAX_LOGITS)}
        for w, p in mean_prompt.items():
            L = round(p) + GEN
            row[f"static_requests_{w}"] = min(static_t // L, row["static_pool_tokens"] // L)
            row[f"serve_requests_{w}"] = row["serve_pool_tokens"] // mem.request_kv_positions(round(L), 0.5)
        rows.append(row)
    return rows


def saturation(rows: list[dict], gpu: str, workload: str, system: str, tag: str = "main") -> float | None:
    """A system's highest measured throughput over the rates (its saturation throughput)."""
    vals = [r["output_tokens_per_s"] for r in rows if r["gpu"] == gpu and r["workload"] == workload
            and r["system"] == system and r["tag"] == tag and r["output_tokens_per_s"]]
    return max(vals) if vals else None


def wall(rows: list[dict], gpu: str, workload: str, system: str) -> float | None:
    """The throughput wall: the lowest rate at which the system delivers under 90% of the offered tokens."""
    for r in sorted((r for r in rows if r["gpu"] == gpu and r["workload"] == workload and r["system"] == system
                     and r["tag"] == "main"), key=lambda r: r["rate"]):
        if r["output_tokens_per_s"] < 0.9 * r["rate"] * GEN:
            return r["rate"]
    return None


def _x(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table_md(rows: list[dict], mem: list[dict], meta: dict, gpus, workloads, rates) -> str:
    L = ["# dLLM-Serve in the simulator (LLaDA-8B)", "",
         f"`{meta['command']}` — {meta['machine']}, {meta['date']}, {meta['wall_s']:.0f} s, commit {meta['commit']}. "
         f"Step costs: {meta.get('costs', 'roofline')}.",
         "", "One tp1 co-located worker, blocks of 32, 256 tokens a request, one token committed a step (dLLM-Serve "
         "Table 3), step times as named above, KV pool and token budget from tandem.perf.dllm_memory (bf16 logits + a "
         "float32 softmax: 6 bytes a logit, guard 10%, gpu_memory_utilization 0.9). Systems and workloads: the "
         "benchmark's docstring and docs/dllm-serve.md.", "",
         "## Memory (tandem.perf.dllm_memory)", "",
         "| GPU | budget (GiB) | weights | left for KV + activations | fast-dllm budget (tokens, auto) | its peak "
         "| its KV pool (positions) | dLLM-Serve budget | peak monolithic / with 2048 logits | KV pool monolithic / "
         "capped (GiB) | capped pool (positions) | requests that fit, fast-dllm / dLLM-Serve (burst, code) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for m in mem:
        L.append(f"| {m['gpu']} | {m['budget_gib']:.2f} | {m['weights_gib']:.2f} | {m['left_gib']:.2f} GiB "
                 f"({m['left_gb']:.2f} GB; {m['raw_left_gib']:.2f} GiB at 100%) | {m['static_budget']:,} | "
                 f"{m['static_peak_gib']:.2f} | {m['static_pool_tokens']:,} | {m['serve_budget']:,} | "
                 f"{m['serve_peak_mono_gib']:.2f} / {m['serve_peak_capped_gib']:.2f} | "
                 f"{m['serve_pool_mono_gib']:.2f} / {m['serve_pool_capped_gib']:.2f} | {m['serve_pool_tokens']:,} | "
                 + ", ".join(f"{m.get('static_requests_' + w, '-')} / {m.get('serve_requests_' + w, '-')}"
                             for w in workloads) + " |")
    L += ["", "Paper: \"less than 7GB remains for the KV cache and activations\" on the RTX 4090 after the weights "
          "(~17 GB); \"nearly 31GB of available headroom\" on the L40S.", "",
          "## Headline: saturation throughput (the highest over the rates) against fast-dllm", "",
          "| GPU | workload | " + " | ".join(SYSTEMS) + " | dllm-serve / fast-dllm | dllm-serve-d0 / fast-dllm "
          "| dllm-serve / sparse-dllm | paper dLLM-Serve / Fast-dLLM |", "|---|---|" + "---:|" * (len(SYSTEMS) + 4)]
    for g in gpus:
        for w in workloads:
            sat = {s: saturation(rows, g, w, s) for s in SYSTEMS}
            base = sat["fast-dllm"]
            lo, hi = PAPER[g]["speedup"]
            L.append(f"| {g} | {w} | " + " | ".join(_x(sat[s], ".1f") for s in SYSTEMS) + " | "
                     + f"{_x(sat['dllm-serve'] / base if base and sat['dllm-serve'] else None)}x | "
                     + f"{_x(sat['dllm-serve-d0'] / base if base and sat['dllm-serve-d0'] else None)}x | "
                     + f"{_x(sat['dllm-serve'] / sat['sparse-dllm'] if sat['sparse-dllm'] else None)}x | "
                     + f"{lo}-{hi}x |")
    L += ["", "Throughput wall (the lowest rate, req/s, at which a system delivers under 90% of the offered 256 "
          "tokens x rate; `-`: none up to the highest rate):", "",
          "| GPU | workload | " + " | ".join(SYSTEMS) + " | paper |", "|---|---|" + "---:|" * (len(SYSTEMS) + 1)]
    for g in gpus:
        for w in workloads:
            paper = (f"baselines ~{PAPER['rtx4090']['wall_rps']}, dLLM-Serve linear to 0.4-0.5" if g == "rtx4090"
                     else "beyond the 4090's")
            L.append(f"| {g} | {w} | " + " | ".join(_x(wall(rows, g, w, s), "g") for s in SYSTEMS) + f" | {paper} |")
    if "l40s" in gpus:
        L += ["", "## Table 4's shape: L40S at 1.0 req/s", "",
              "| workload | system | avg latency (s) | P99 (s) | throughput (tok/s) | speedup vs fast-dllm |",
              "|---|---|---:|---:|---:|---:|"]
        for w in workloads:
            at = {r["system"]: r for r in rows if r["gpu"] == "l40s" and r["workload"] == w and r["rate"] == 1.0
                  and r["tag"] == "main"}
            base = at.get("fast-dllm", {}).get("output_tokens_per_s")
            for s in SYSTEMS:
                if s in at:
                    r = at[s]
                    L.append(f"| {w} | {s} | {r['latency_mean_s']:.1f} | {r['latency_p99_s']:.1f} | "
                             f"{r['output_tokens_per_s']:.1f} | {_x(r['output_tokens_per_s'] / base if base else None)}x |")
        L += ["", "Paper, Table 4 (L40S, 1.0 req/s, avg latency s / tok/s): " + "; ".join(
            f"{d}: Sparse-dLLM {v['sparse-dllm'][0]} / {v['sparse-dllm'][1]}, Fast-dLLM {v['fast-dllm'][0]} / "
            f"{v['fast-dllm'][1]}, dLLM-Serve {v['dllm-serve'][0]} / {v['dllm-serve'][1]}"
            for d, v in PAPER["l40s"]["table4"].items()) + "."]
    for g in gpus:
        for w in workloads:
            L += ["", f"## {g}, {w}", "", "Output tokens/s against request rate (Fig. 3's shape):", "",
                  "| system | " + " | ".join(f"{r:g}" for r in rates) + " |", "|---|" + "---:|" * len(rates)]
            for s in SYSTEMS:
                v = {r["rate"]: r for r in rows if r["gpu"] == g and r["workload"] == w and r["system"] == s
                     and r["tag"] == "main"}
                L.append(f"| {s} | " + " | ".join(_x(v[r]["output_tokens_per_s"], ".1f") if r in v else "-"
                                                 for r in rates) + " |")
            L += ["", "Mean / P99 latency (s) against request rate (Fig. 4's shape):", "",
                  "| system | " + " | ".join(f"{r:g}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
            for s in SYSTEMS:
                v = {r["rate"]: r for r in rows if r["gpu"] == g and r["workload"] == w and r["system"] == s
                     and r["tag"] == "main"}
                L.append(f"| {s} | " + " | ".join(
                    f"{v[r]['latency_mean_s']:.0f} / {v[r]['latency_p99_s']:.0f}" if r in v else "-"
                    for r in rates) + " |")
            hi = max(rates)
            L += ["", f"At {hi:g} req/s: largest running set, mean packed tokens a step, Refresh share of the "
                  "sequence-steps, deferred sequence-steps and the longest wait (steps), latency std and P99-P1 span "
                  "(s) (Fig. 5's shape):", "",
                  "| system | max running | tokens/step | Refresh share | deferrals | longest wait | std | span |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for s in SYSTEMS:
                r = next((r for r in rows if r["gpu"] == g and r["workload"] == w and r["system"] == s
                          and r["rate"] == hi and r["tag"] == "main"), None)
                if r:
                    L.append(f"| {s} | {r['max_running']} | {_x(r['batch_tokens_mean'], '.0f')} | "
                             f"{_x(r['refresh_share'], '.3f')} | {r['deferrals']} | {r['max_deferred']} | "
                             f"{r['latency_std_s']:.0f} | {r['latency_span_s']:.0f} |")
    sweep = [r for r in rows if r["tag"] == "sweep"]
    if sweep:
        L += ["", f"## Fig. 7a's shape: throughput at {SWEEP_RATE:g} req/s (saturated) against prompt length", "",
              "| GPU | prompt | fast-dllm | dllm-serve | dllm-serve-d0 | dllm-serve / fast-dllm | d0 / fast-dllm |",
              "|---|---:|---:|---:|---:|---:|---:|"]
        for g in gpus:
            for p in SWEEP_INPUTS:
                v = {r["system"]: r["output_tokens_per_s"] for r in sweep if r["gpu"] == g
                     and r["workload"] == f"fixed{p}"}
                b = v.get("fast-dllm")
                L.append(f"| {g} | {p} | {_x(b, '.1f')} | {_x(v.get('dllm-serve'), '.1f')} | "
                         f"{_x(v.get('dllm-serve-d0'), '.1f')} | "
                         f"{_x(v['dllm-serve'] / b if b and v.get('dllm-serve') else None)}x | "
                         f"{_x(v['dllm-serve-d0'] / b if b and v.get('dllm-serve-d0') else None)}x |")
    par = [r for r in rows if r["tag"] == "parallel"]
    if par:
        L += ["", f"## Sensitivity: parallel decoding (commits {PARALLEL_COMMITS[0]} ± {PARALLEL_COMMITS[1]} a step "
              f"at block 32), burst at {SWEEP_RATE:g} req/s", "",
              "| GPU | " + " | ".join(SYSTEMS) + " | dllm-serve / fast-dllm |", "|---|" + "---:|" * (len(SYSTEMS) + 1)]
        for g in gpus:
            v = {r["system"]: r["output_tokens_per_s"] for r in par if r["gpu"] == g}
            b = v.get("fast-dllm")
            L.append(f"| {g} | " + " | ".join(_x(v.get(s), ".1f") for s in SYSTEMS) + " | "
                     f"{_x(v['dllm-serve'] / b if b and v.get('dllm-serve') else None)}x |")
    return "\n".join(L) + "\n"


def plots(rows: list[dict], mem: list[dict], out: Path, gpus, workloads) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for name, key, ylabel, logy in (("fig3_throughput.png", "output_tokens_per_s", "output tokens/s", False),
                                    ("fig4_latency.png", "latency_mean_s", "mean latency (s)", True),
                                    ("fig4_latency_p99.png", "latency_p99_s", "P99 latency (s)", True)):
        fig, axes = plt.subplots(len(workloads), len(gpus), figsize=(4.6 * len(gpus), 3.3 * len(workloads)),
                                 squeeze=False)
        for i, w in enumerate(workloads):
            for j, g in enumerate(gpus):
                ax = axes[i][j]
                for s in SYSTEMS:
                    pts = sorted((r["rate"], r[key]) for r in rows if r["gpu"] == g and r["workload"] == w
                                 and r["system"] == s and r["tag"] == "main" and r[key] is not None)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", ms=3, label=s)
                if key == "output_tokens_per_s":
                    xs = sorted({r["rate"] for r in rows if r["tag"] == "main"})
                    ax.plot(xs, [x * GEN for x in xs], color="k", lw=0.7, ls=":", label="offered")
                    ax.set_ylim(0, 1.15 * max(r[key] for r in rows if r["gpu"] == g and r["tag"] == "main"))
                if logy:
                    ax.set_yscale("log")
                ax.set_title(f"LLaDA-8B on {g}, {w}", fontsize=9)
                ax.set_xlabel("request rate (req/s)", fontsize=8)
                ax.set_ylabel(ylabel, fontsize=8)
                ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"{ylabel} against request rate (dLLM-Serve Fig. {3 if 'throughput' in name else 4}, "
                     "simulated)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)
    sweep = [r for r in rows if r["tag"] == "sweep"]
    if sweep:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for g in gpus:
            for s, ls in (("dllm-serve", "-"), ("dllm-serve-d0", "--")):
                pts = []
                for p in SWEEP_INPUTS:
                    v = {r["system"]: r["output_tokens_per_s"] for r in sweep if r["gpu"] == g
                         and r["workload"] == f"fixed{p}"}
                    if v.get("fast-dllm") and v.get(s):
                        pts.append((p, v[s] / v["fast-dllm"]))
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, ls=ls, label=f"{s}, {g}")
        ax.axhline(1.0, color="k", lw=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (256 generated)", fontsize=8)
        ax.set_ylabel("throughput / fast-dllm", fontsize=8)
        ax.set_title("Gain against prompt length at saturation (Fig. 7a's shape)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "fig7a_prompt_length.png", dpi=90)
        plt.close(fig)
        files.append("fig7a_prompt_length.png")
    fig, ax = plt.subplots(figsize=(5.4, 3.4))
    labels, parts = [], []
    for m in mem:
        for kind in ("fast-dllm", "dLLM-Serve"):
            labels.append(f"{m['gpu']}\n{kind}")
            if kind == "fast-dllm":
                peak = m["static_peak_gib"]
                kv = m["left_gib"] - peak * 1.1
            else:
                peak = m["serve_peak_capped_gib"]
                kv = m["serve_pool_capped_gib"]
            parts.append((m["weights_gib"], peak * 1.1, kv))
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for k, (lab, color) in enumerate((("weights", "#999999"), ("activation peak + guard", "#d95f02"),
                                      ("KV pool", "#1b9e77"))):
        vals = np.array([p[k] for p in parts])
        ax.bar(x, vals, bottom=bottom, color=color, label=lab)
        bottom += vals
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("GiB (budget: 0.9 x HBM)", fontsize=8)
    ax.set_title("LLaDA-8B memory: reserved peak against the KV pool", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=90)
    plt.close(fig)
    files.append("memory.png")
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/dllm_serve_sim", help="report folder (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the RTX 4090, the code workload, a few rates")
    ap.add_argument("--gpus", type=csv_list(str), default=None, metavar="A,B")
    ap.add_argument("--workloads", type=csv_list(str), default=None, metavar="A,B")
    ap.add_argument("--sessions", type=positive_int, default=None, help="requests per point (default: 400)")
    ap.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1), help="processes")
    ap.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                    help="step costs (default: %(default)s: measured where tables exist; docs/cost-models.md)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    gpus = args.gpus or (["rtx4090"] if args.quick else list(GPUS))
    workloads = args.workloads or (["code"] if args.quick else list(WORKLOADS))
    bad = [g for g in gpus if g not in GPUS] + [w for w in workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown GPU or workload {bad[0]!r} (GPUs: {', '.join(GPUS)}; workloads: {', '.join(WORKLOADS)})")
    rates = (0.2, 0.5, 1.0, 2.0) if args.quick else RATES
    n = args.sessions or (80 if args.quick else 400)
    runs = [Run(g, s, w, r, n) for g in gpus for s in SYSTEMS for w in workloads for r in rates]
    if not args.quick:
        runs += [Run(g, s, f"fixed{p}", SWEEP_RATE, n, tag="sweep") for g in gpus
                 for s in ("fast-dllm", "dllm-serve", "dllm-serve-d0") for p in SWEEP_INPUTS]
        runs += [Run(g, s, "burst", SWEEP_RATE, n, commits=PARALLEL_COMMITS, tag="parallel") for g in gpus
                 for s in SYSTEMS]
    runs = [dataclasses.replace(r, cost_model=args.cost_model) for r in runs]
    runs.sort(key=lambda r: (r.system != "fast-dllm", r.rate))    # the slow static runs first
    t0 = time.time()
    try:
        with ParallelMap(args.jobs, not args.no_progress, len(runs), width=44) as pool:
            rows = pool.map(simulate_run, runs, Run.label)
    except ValueError as e:
        print(f"dllm_serve_sim: {e}", file=sys.stderr)
        return 2
    mean_prompt = {w: float(np.mean(prompts(w, 2000, 0))) for w in workloads}
    mem = memory_rows(mean_prompt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = report_meta("benchmarks/dllm_serve_sim.py", argv, time.time() - t0, mean_prompt=mean_prompt,
                       costs=cost_sources(gpus, args.cost_model))
    (out / "results.json").write_text(json.dumps({"meta": meta, "memory": mem, "paper": PAPER, "runs": rows},
                                                 indent=1))
    (out / "table.md").write_text(table_md(rows, mem, meta, gpus, workloads, rates))
    files = plots(rows, mem, out, gpus, workloads)
    failed = sum(r["failed"] for r in rows)
    print(f"report: {out}/ (table.md, results.json, {', '.join(files)}) — {len(runs)} simulations in "
          f"{meta['wall_s']:.0f} s" + (f"; {failed} requests failed" if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
