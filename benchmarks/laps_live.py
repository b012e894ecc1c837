"""LAPS on the live server against FCFS prefill workers, same load, same run.

    python benchmarks/laps_live.py [--phase-s 40] [--rate 3] [--out docs/results/laps_live]

`tandem serve` with 2 prefill workers and 1 decode worker (a random ~30M-parameter Qwen3 made here, one torch
thread per worker) serves one-round requests through /v1/completions (token ids, 4 output tokens, streamed so the
client times the first token). The load has two phases of --phase-s seconds (Poisson arrivals): phase A at
--rate requests/s, an even mix of short prompts (32-200 tokens) and long ones (600-1400); phase B at --rate-b,
90% short. The server aims at a TTFT SLO of --slo-ttft (the controller's scale).
The same request list (same seed) is replayed on each policy in turn:

- `laps --laps-min-pool 0`: short/long pools over the 2 prefill workers (one each at the start), AWD batching of
  short prefills, long ones in chunks; the pressure controller may move a worker to the busier class, leaving the
  other class without a pool (its prefills then go to any prefill worker);
- `sglang-pd-router`: FCFS prefill workers with steps filled to the token budget, the least-loaded worker;
- `sglang-pd`: the same, round-robin.

Reported per policy and phase: P50/P90 TTFT of short and long requests (client-measured), and, scraped from
/metrics every second, the pool sizes, moves, AWD window and depth, and bucket hits. Writes results.json, table.md
and a PNG (TTFT by phase; the LAPS run's pools over time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tandem.bench.serve_client import BenchConfig, parse_prometheus, run_bench
from tandem.bench.serve_process import serve_subprocess
from tandem.engine.tiny_model import make_tiny_model
from tandem.engine.tokenizer import Tokenizer
from tandem.workload.session import Round, Session

POLICIES = [("laps", ["--laps-min-pool", "0"]), ("sglang-pd-router", []), ("sglang-pd", [])]
GAUGES = ("tandem:laps_pool_short_workers", "tandem:laps_pool_long_workers", "tandem:laps_pool_moves_total",
          "tandem:laps_awd_window_seconds", "tandem:laps_awd_depth", "tandem:laps_short_steps_total",
          "tandem:laps_graph_steps_total", "tandem:laps_short_waiting", "tandem:laps_long_waiting")
SHORT_MAX = 256


def workload(phase_s: float, rate: float, rate_b: float, seed: int) -> list[Session]:
    """Poisson requests: phase A at `rate`, half short, half long; phase B at `rate_b`, 90% short."""
    rng = np.random.default_rng(seed)
    out, t, i = [], 0.0, 0
    while True:
        t += rng.exponential(1.0 / (rate if t < phase_s else rate_b))
        if t >= 2 * phase_s:
            return out
        short_share = 0.5 if t < phase_s else 0.9
        n = int(rng.integers(32, 200)) if rng.random() < short_share else int(rng.integers(600, 1400))
        out.append(Session(f"q{i:04d}", t, [Round(n, 4)]))
        i += 1


async def _scrape_loop(url: str, t0: float, stop: asyncio.Event, samples: list[dict]) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            try:
                r = await c.get(url + "/metrics")
                samples.append({"t": time.monotonic() - t0, **parse_prometheus(r.text, GAUGES)})
            except Exception as e:                       # a missed scrape is reported in the samples, not fatal
                samples.append({"t": time.monotonic() - t0, "error": str(e)})
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


async def _drive(url: str, sessions: list[Session], cfg: BenchConfig) -> tuple:
    stop, samples = asyncio.Event(), []
    t0 = time.monotonic()
    scraper = asyncio.create_task(_scrape_loop(url, t0, stop, samples))
    try:
        res = await run_bench(sessions, cfg)
    finally:
        stop.set()
        await scraper
    return res, samples


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50_ms": None, "p90_ms": None}
    return {"n": len(xs), "p50_ms": 1e3 * float(np.percentile(xs, 50)), "p90_ms": 1e3 * float(np.percentile(xs, 90))}


def summarize(res, phase_s: float) -> dict:
    """TTFT percentiles of short and long requests in each phase, and the failures."""
    out = {}
    for phase, (lo, hi) in (("A", (0.0, phase_s)), ("B", (phase_s, 2 * phase_s))):
        for cls in ("short", "long"):
            xs = []
            for m in res.rounds:
                if not (lo <= m.sent_s < hi) or (m.new_input_tokens < SHORT_MAX) != (cls == "short"):
                    continue
                if m.ttft_s is None:
                    continue
                xs.append(m.ttft_s)
            out[f"{phase}_{cls}"] = _pcts(xs)
    failed = sum(1 for m in res.rounds if not m.ok)
    return {"ttft": out, "failed": failed, "requests": len(res.rounds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase (default: 40)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second in phase A (default: 2)")
    ap.add_argument("--rate-b", type=float, default=6.0, help="requests per second in phase B (default: 6)")
    ap.add_argument("--slo-ttft", type=float, default=0.5, help="the TTFT SLO the server aims at (default: 0.5 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(p for p, _ in POLICIES))
    ap.add_argument("--out", default="docs/results/laps_live")
    a = ap.parse_args(argv)
    if not (a.phase_s > 0 and a.rate > 0 and a.rate_b > 0 and a.slo_ttft > 0):
        print("laps_live: --phase-s, --rate, --rate-b and --slo-ttft must be > 0", file=sys.stderr)
        return 2
    chosen = [(p, extra) for p, extra in POLICIES if p in a.policies.split(",")]
    if not chosen:
        print(f"laps_live: no known policy in {a.policies!r}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sessions = workload(a.phase_s, a.rate, a.rate_b, a.seed)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model"
        make_tiny_model(model, arch="qwen3", size="30m", seed=0)
        tok = Tokenizer.from_pretrained(str(model))
        for policy, extra in chosen:
            args = ["--model", str(model), "--prefill-workers", "2", "--decode-workers", "1", "--policy", policy,
                    "--threads", "1", "--max-model-len", "2048", "--slo-ttft", str(a.slo_ttft), *extra]
            with serve_subprocess(args, out / f"serve_{policy}.log",
                                  log=lambda m: print(m, file=sys.stderr)) as (url, _pid):
                cfg = BenchConfig(url=url, endpoint="completions", tokenizer=tok, seed=a.seed)
                res, samples = asyncio.run(_drive(url, sessions, cfg))
            results[policy] = {**summarize(res, a.phase_s), "metrics": samples}
            t = results[policy]["ttft"]
            print(f"{policy}: short P90 A {t['A_short']['p90_ms']} B {t['B_short']['p90_ms']} ms; "
                  f"failed {results[policy]['failed']}", file=sys.stderr)
    summary = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
               "phase_s": a.phase_s, "rate": a.rate, "rate_b": a.rate_b, "slo_ttft_s": a.slo_ttft, "requests": len(sessions), "policies": results}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["| policy | phase | short P50 / P90 ms (n) | long P50 / P90 ms (n) | failed |", "|---|---|---|---|---|"]

    def f(x):
        return "-" if x is None else f"{x:.0f}"
    for policy, r in results.items():
        for ph in ("A", "B"):
            s, lg = r["ttft"][f"{ph}_short"], r["ttft"][f"{ph}_long"]
            lines.append(f"| {policy} | {ph} | {f(s['p50_ms'])} / {f(s['p90_ms'])} ({s['n']}) | "
                         f"{f(lg['p50_ms'])} / {f(lg['p90_ms'])} ({lg['n']}) | {r['failed']} |")
    laps = results.get("laps")
    if laps:
        moves = [s for s in laps["metrics"] if "error" not in s]
        if moves:
            last = moves[-1]
            lines.append(f"\nLAPS pools at the end: short {last.get('tandem:laps_pool_short_workers')}, long "
                         f"{last.get('tandem:laps_pool_long_workers')}; moves {last.get('tandem:laps_pool_moves_total')}; "
                         f"bucket hits {last.get('tandem:laps_graph_steps_total')} of "
                         f"{last.get('tandem:laps_short_steps_total')} short steps")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(results, a.phase_s, out / "laps_live.png")
    print("\n".join(lines))
    return 0


def _plot(results: dict, phase_s: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(results)
    x = np.arange(4)
    w = 0.8 / max(1, len(names))
    for i, p in enumerate(names):
        t = results[p]["ttft"]
        ys = [t[k]["p90_ms"] or 0 for k in ("A_short", "B_short", "A_long", "B_long")]
        ax.bar(x + i * w, ys, w, label=p)
    ax.set_xticks(x + w * (len(names) - 1) / 2, ["short A", "short B", "long A", "long B"])
    ax.set_ylabel("TTFT P90 (ms)")
    ax.legend(fontsize=8)
    laps = results.get("laps")
    if laps:
        ms = [s for s in laps["metrics"] if "error" not in s]
        ts = [s["t"] for s in ms]
        bx.step(ts, [s.get("tandem:laps_pool_short_workers") or 0 for s in ms], where="post", label="short pool")
        bx.step(ts, [s.get("tandem:laps_pool_long_workers") or 0 for s in ms], where="post", label="long pool")
        bx.axvline(phase_s, color="gray", ls=":", label="mix shift")
        bx.set_xlabel("s")
        bx.set_ylabel("prefill workers")
        bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
