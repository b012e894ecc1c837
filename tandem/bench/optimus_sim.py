"""Optimus in the simulator: the runs (a system on a diffusion model and GPU, at a batch size or a Poisson rate), one
simulation each, the serving capacity under the TPOT SLO and TTFT bound, and elastic's ratios to the baselines."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.perf.costs import DEFAULT_COST_MODEL
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
    """Geometric mean of the positive values (None when there are none)."""
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


def plan_runs(models: Sequence[str], gpus: Sequence[str], batches: Sequence[int], rates: Sequence[float], *,
              per_client: int = CLIENT_REQUESTS, closed: int = MIN_CLOSED_REQUESTS, fewest: int = 300,
              span_s: float = ARRIVAL_SPAN_S, cost_model: str = DEFAULT_COST_MODEL) -> list[Run]:
    """Every system on every (model, GPU): closed loops of each batch size (per_client requests per client, at
    least `closed`) and Poisson rates (rate x span_s requests, at least `fewest`, at most MAX_OPEN_REQUESTS);
    the largest batches first."""
    runs = [Run(m, g, s, batch=b, sessions=max(per_client * b, closed)) for m in models for g in gpus
            for s in SYSTEMS for b in batches]
    runs += [Run(m, g, s, rate=r, sessions=max(fewest, min(math.ceil(r * span_s), MAX_OPEN_REQUESTS)))
             for m in models for g in gpus for s in SYSTEMS for r in rates]
    runs = [dataclasses.replace(r, cost_model=cost_model) for r in runs]
    runs.sort(key=lambda r: -(r.batch or 0))                 # the longest first
    return runs
