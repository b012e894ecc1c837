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
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.bench.parallel import ParallelMap
from tandem.bench.provenance import cost_sources, report_meta
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL
from tandem.cli.common import csv_list, positive_float, positive_int
from tandem.sim.cluster import SimConfig, dllm_summary, simulate
from tandem.workload.session import SLO, Session
from tandem.workload.traces import load_sharegpt

MODELS = {"sdar-8b": "qwen3-8b", "llada2.0-16b": "ling-2.0-16b"}   # diffusion model -> its AR base
SYSTEMS = ("ar", "bd32", "c4", "c8", "c16", "c32", "elastic", "elastic-paper")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATES = (0.25, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
TPOT_SLO_S = 0.050
CLIENT_REQUESTS = 16        # closed loop: requests each client sends (at least MIN_CLOSED_REQUESTS in all)
MIN_CLOSED_REQUESTS = 256
ARRIVAL_SPAN_S = 100.0      # open loop: the arrivals of a rate point span at least this long ...
MAX_OPEN_REQUESTS = 3000    # ... within this many requests (past capacity at the highest rates anyway)
TTFT_BOUND_S = 5.0          # a rate whose P90 TTFT exceeds this is past capacity (its queue grows without bound)
BLOCK = 32
PAPER = {"throughput_vs_ar": 2.07, "throughput_vs_bd32": 1.31, "capacity_vs_ar": 1.96, "capacity_vs_bd32": 1.95,
         "elastic_vs_best_fixed": -0.095}


@dataclass(frozen=True, slots=True)
class Run:
    """One simulation: a system on (model, GPU) at a batch size (closed loop) or a rate (Poisson)."""

    model: str
    gpu: str
    system: str
    batch: int | None = None
    rate: float | None = None
    sessions: int = 300
    cost_model: str = DEFAULT_COST_MODEL

    def label(self) -> str:
        at = f"b={self.batch}" if self.batch is not None else f"{self.rate:g}/s"
        return f"{self.model} {self.gpu} {self.system} {at}"


def sim_config(run: Run) -> SimConfig:
    """The simulator's config of a run (the AR base model for `ar`)."""
    if run.system == "ar":
        return SimConfig(MODELS[run.model], run.gpu, 1, "C:tp1x1", "vllm", concurrency=run.batch,
                         cost_model=run.cost_model)
    chunk = {"bd32": "block", "elastic": "elastic", "elastic-paper": "elastic"}.get(run.system,
                                                                                     run.system.removeprefix("c"))
    return SimConfig(run.model, run.gpu, 1, "C:tp1x1", "vllm", concurrency=run.batch, dllm_block_length=BLOCK,
                     dllm_chunk=chunk, dllm_dataset="sharegpt",
                     dllm_prefill_share=0.0 if run.system == "elastic-paper" else 0.5, cost_model=run.cost_model)


def simulate_run(run: Run) -> dict:
    """Simulate one run; its throughput, TPOT percentiles and diffusion figures."""
    sessions = load_sharegpt(limit=run.sessions, rate=run.rate or 1.0, seed=0)
    sessions = [Session(s.session_id, s.arrival_s, s.rounds, SLO(math.inf, TPOT_SLO_S)) for s in sessions]
    res = simulate(sessions, sim_config(run))
    rounds = [r for rec in res.records for r in rec.rounds if r.first_token_s is not None and r.finish_s is not None]
    out_tokens = sum(r.output_tokens for r in rounds)
    tpot = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in rounds if r.output_tokens > 1]
    ttft = [r.first_token_s - r.arrival_s for r in rounds]
    d = dllm_summary(res.workers)
    return {"model": run.model, "gpu": run.gpu, "system": run.system, "batch": run.batch, "rate": run.rate,
            "sessions": len(res.records), "failed": sum(1 for r in res.records if not r.completed),
            "output_tokens_per_s": out_tokens / res.sim_time_s if res.sim_time_s > 0 else None,
            "tpot_p50_s": float(np.percentile(tpot, 50)) if tpot else None,
            "tpot_p90_s": float(np.percentile(tpot, 90)) if tpot else None,
            "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
            "tokens_per_step": d.get("dllm_tokens_per_step"), "chunk_mean": d.get("dllm_chunk_mean"),
            "wall_s": res.wall_s}


def capacity(rows: list[dict]) -> float | None:
    """The highest rate within the TPOT SLO and the TTFT bound, interpolated to where the first of the two is crossed
    (None: never within; the largest rate measured when always within, a lower bound)."""
    pts = sorted((r["rate"], max(r["tpot_p90_s"] / TPOT_SLO_S, r["ttft_p90_s"] / TTFT_BOUND_S)) for r in rows
                 if r["tpot_p90_s"] is not None and r["ttft_p90_s"] is not None)
    if not pts or pts[0][1] > 1.0:
        return None
    for (r0, x0), (r1, x1) in zip(pts, pts[1:]):
        if x0 <= 1.0 < x1:                       # the worse of the two ratios crosses 1 between r0 and r1
            return r0 + (r1 - r0) * (1.0 - x0) / (x1 - x0)
    return pts[-1][0]


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else None


def summarize(rows: list[dict], models: list[str], gpus: list[str]) -> list[dict]:
    """Per (model, GPU): throughput ratios of elastic over AR and BD32 (geometric mean over batch sizes), the
    capacity of every system and elastic's ratios."""
    out = []
    for m in models:
        for g in gpus:
            at = [r for r in rows if r["model"] == m and r["gpu"] == g]
            thr = {s: {r["batch"]: r["output_tokens_per_s"] for r in at if r["system"] == s and r["batch"]}
                   for s in SYSTEMS}
            ratio = {base: geomean([thr["elastic"].get(b, 0) / thr[base][b] for b in thr[base] if thr[base][b]])
                     for base in ("ar", "bd32")}
            cap = {s: capacity([r for r in at if r["system"] == s and r["rate"] is not None]) for s in SYSTEMS}
            fixed = {s: c for s, c in cap.items() if s.startswith("c") and c}
            best = max(fixed, key=fixed.get) if fixed else None
            e = cap["elastic"]
            out.append({"model": m, "gpu": g, "throughput_vs_ar": ratio["ar"], "throughput_vs_bd32": ratio["bd32"],
                        "capacity": cap, "best_fixed": best,
                        "capacity_vs_ar": e / cap["ar"] if e and cap["ar"] else None,
                        "capacity_vs_bd32": e / cap["bd32"] if e and cap["bd32"] else None,
                        "elastic_vs_best_fixed": e / fixed[best] - 1 if e and best else None})
    return out


def _x(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table_md(rows: list[dict], heads: list[dict], meta: dict, batches, rates) -> str:
    lines = ["# Optimus in the simulator", "",
             f"`{meta['command']}` — {meta['machine']}, {meta['date']}, {meta['wall_s']:.0f} s, commit "
             f"{meta['commit']}. Step costs: {meta.get('costs', 'roofline')}.", "",
             "One tp1 co-located worker, ShareGPT trace lengths, diffusion commits per step from Optimus Table 2's "
             f"ShareGPT row (tandem.perf.dllm), block {BLOCK}, TPOT SLO {TPOT_SLO_S * 1e3:.0f} ms, step times as "
             "named above. `ar` is the base model decoded autoregressively.", "",
             "## Headline", "",
             "| model | GPU | throughput elastic/AR | elastic/BD32 | capacity (req/s) AR / BD32 / best fixed / elastic "
             "| capacity elastic/AR | elastic/BD32 | elastic vs best fixed |", "|---|---|---:|---:|---|---:|---:|---:|"]
    for h in heads:
        c = h["capacity"]
        best = h["best_fixed"]
        vs_best = h["elastic_vs_best_fixed"]
        vs_best = "-" if vs_best is None else f"{100 * vs_best:+.1f}%"
        lines.append(f"| {h['model']} | {h['gpu']} | {_x(h['throughput_vs_ar'])}x | {_x(h['throughput_vs_bd32'])}x | "
                     f"{_x(c['ar'])} / {_x(c['bd32'])} / {_x(c.get(best) if best else None)} ({best or '-'}) / "
                     f"{_x(c['elastic'])} | {_x(h['capacity_vs_ar'])}x | {_x(h['capacity_vs_bd32'])}x | "
                     f"{vs_best} |")
    lines += [f"| paper (SDAR-8B, A100, ShareGPT) | | {PAPER['throughput_vs_ar']}x (geomean, all settings) | "
              f"{PAPER['throughput_vs_bd32']}x | | {PAPER['capacity_vs_ar']}x | {PAPER['capacity_vs_bd32']}x | "
              f"{100 * PAPER['elastic_vs_best_fixed']:+.1f}% (chunk 8) |", ""]
    for h in heads:
        m, g = h["model"], h["gpu"]
        lines += [f"## {m} on {g}", "", "Output tokens/s against batch size (closed loop):", "",
                  "| system | " + " | ".join(f"b={b}" for b in batches) + " |",
                  "|---|" + "---:|" * len(batches)]
        for s in SYSTEMS:
            vals = {r["batch"]: r for r in rows if r["model"] == m and r["gpu"] == g and r["system"] == s
                    and r["batch"]}
            lines.append(f"| {s} | " + " | ".join(_x(vals[b]["output_tokens_per_s"], ".0f") if b in vals else "-"
                                                 for b in batches) + " |")
        lines += ["", "P90 TPOT (ms) against request rate (req/s):", "",
                  "| system | " + " | ".join(f"{r:g}" for r in rates) + " | capacity |",
                  "|---|" + "---:|" * (len(rates) + 1)]
        for s in SYSTEMS:
            vals = {r["rate"]: r for r in rows if r["model"] == m and r["gpu"] == g and r["system"] == s
                    and r["rate"] is not None}
            lines.append(f"| {s} | " + " | ".join(
                _x(1e3 * vals[r]["tpot_p90_s"], ".0f") if r in vals and vals[r]["tpot_p90_s"] else "-"
                for r in rates) + f" | {_x(h['capacity'][s])} |")
        el = [r for r in rows if r["model"] == m and r["gpu"] == g and r["system"] == "elastic" and r["batch"]]
        lines += ["", "Elastic's mean window and tokens committed per step against batch size: " + ", ".join(
            f"b={r['batch']}: {_x(r['chunk_mean'], '.1f')} / {_x(r['tokens_per_step'])}"
            for r in sorted(el, key=lambda r: r["batch"])), ""]
    return "\n".join(lines)


def plots(rows: list[dict], heads: list[dict], out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = [(h["model"], h["gpu"]) for h in heads]
    files = []
    for kind, key, xlabel, ylabel in (("fig8", "batch", "batch size (closed-loop clients)", "output tokens/s"),
                                      ("fig10", "rate", "request rate (req/s)", "P90 TPOT (ms)")):
        fig, axes = plt.subplots(1, len(combos), figsize=(4.6 * len(combos), 3.4), squeeze=False)
        for ax, (m, g) in zip(axes[0], combos):
            for s in SYSTEMS:
                pts = sorted((r[key], r["output_tokens_per_s"] if kind == "fig8" else 1e3 * (r["tpot_p90_s"] or 0))
                             for r in rows if r["model"] == m and r["gpu"] == g and r["system"] == s
                             and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=s)
            ax.set_xscale("log", base=2)
            if kind == "fig10":
                ax.axhline(1e3 * TPOT_SLO_S, color="k", lw=0.8, ls="--")
                ax.set_yscale("log")
            ax.set_title(f"{m} on {g}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        title = "Throughput against batch size" if kind == "fig8" else "P90 TPOT against request rate"
        fig.suptitle(f"{title} (Optimus Fig. {8 if kind == 'fig8' else 10}, simulated)", fontsize=10)
        fig.tight_layout()
        path = out / f"{kind}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path.name)
    return files


def main(argv: list[str] | None = None) -> int:
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
    runs = [Run(m, g, s, batch=b, sessions=max(per_client * b, closed)) for m in models for g in gpus
            for s in SYSTEMS for b in batches]
    runs += [Run(m, g, s, rate=r, sessions=max(n, min(math.ceil(r * span), MAX_OPEN_REQUESTS))) for m in models
             for g in gpus for s in SYSTEMS for r in rates]
    runs = [dataclasses.replace(r, cost_model=args.cost_model) for r in runs]
    runs.sort(key=lambda r: -(r.batch or 0))                 # the longest first
    t0 = time.time()
    try:
        with ParallelMap(args.jobs, not args.no_progress, len(runs), width=40) as pool:
            rows = pool.map(simulate_run, runs, Run.label)
    except ValueError as e:
        print(f"optimus_sim: {e}", file=sys.stderr)
        return 2
    heads = summarize(rows, models, gpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = report_meta("benchmarks/optimus_sim.py", argv, time.time() - t0, costs=cost_sources(gpus, args.cost_model))
    (out / "results.json").write_text(json.dumps({"meta": meta, "headline": heads, "runs": rows}, indent=1))
    (out / "table.md").write_text(table_md(rows, heads, meta, batches, rates))
    files = plots(rows, heads, out)
    print(f"report: {out}/ (table.md, results.json, {', '.join(files)}) — {len(runs)} simulations in "
          f"{meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
