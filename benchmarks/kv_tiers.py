"""Host-memory KV tiers against co-located Continuum and the untiered policies, in the simulator.

    python benchmarks/kv_tiers.py [--out docs/results/kv_tiers] [--sessions 20] [--mooncake 2000] [--jobs 1]
                                  [--quick]

Llama-3.1-70B on 32 H20s (the host link each GPU copies over is the catalogue's PCIe Gen5 x16, 64 GB/s per
direction at the catalogue's link efficiency; a tp8 worker copies over its 8 links in parallel). Three setups:

- `agentic-long` (100-400 rounds, contexts to ~200K tokens, tool gaps 1 s to 3 h), SLO TTFT 2.5 s / ITL 50 ms
  (ampd_laps_agentic.py's), `--sessions` sessions at 0.05/s: the GPU pools hold every context, so what tiers change
  is the coordinator's idle-session expiry (session_ttl_s, 600 s), after which an untiered worker drops the KV;
- the same with the GPUs' memory share cut to 0.35 (`mem_util`; the KV pool shrinks from ~1.78M to ~0.39M tokens
  per worker, as on GPUs shared with other work): contexts outgrow the pools, KV is evicted for memory too; host
  tiers of 1024 and 64 GiB per worker (the smaller one fills, so the eviction rule matters);
- the Mooncake trace (its first `--mooncake` requests, one round each, prefixes shared through hash_ids) at half
  its rate (MOONCAKE_STRETCH), SLO TTFT 10 s / ITL 100 ms (chosen before any run): only prefix blocks written
  through to the host tier and cache-aware binding can act here;
- `chat-multiturn` (LAPS's multi-turn chat mix: about 2 rounds a session, think times of seconds to minutes),
  the generators' default 200 sessions at 1/s, its SLO (TTFT 0.4 s, ITL 0.1 s);
- the Azure LLM inference trace 2023, conversations (its first `--azure` requests at their own times, one round
  each, no prefix information), the Mooncake SLO: nothing is reused, so a tier can only cost.

Policies: continuum (C:tp8x4, the baseline), the untiered ampd+laps-chunked (P:tp8x2,D:tp8x2; the best untiered
policy of ampd_laps_agentic.py), continuum with no idle expiry (untiered, GPU retention unbounded: what the tiers
are measured against honestly), and the tiered continuum-tiered, continuum-tool (return-time eviction, and an LRU
variant), hicache, infercept (C:tp8x4) and ampd-tiered (P:tp8x2,D:tp8x2). Each cell's result is kept under
OUT/cells/ and reused by the next run of the same cell on the same simulator code. Report: table, JSON, PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tandem.cli.common import positive_int
from tandem.core.config import DEFAULT_SESSION_TTL_S
from tandem.perf.hardware import get_gpu
from tandem.policy.kv_tiers import EvictionKind
from tandem.policy.presets import get_policy
from tandem.sim.cluster import SimConfig, simulate
from tandem.workload.generators import CHAT_SLO, generate
from tandem.workload.options import DEFAULT_RATE, DEFAULT_SESSIONS
from tandem.workload.metrics import summarize
from tandem.workload.session import SLO
from tandem.workload.traces import load_azure, load_mooncake

MODEL, GPU, GPUS = "llama-3.1-70b", "h20", 32
SLO_AGENTIC = SLO(2.5, 0.050)
SLO_MOONCAKE = SLO(10.0, 0.100)
RATE = 0.05
COLO, DISAGG = "C:tp8x4", "P:tp8x2,D:tp8x2"
HOST_GIB = 1024.0
SMALL_HOST_GIB = 64.0
PRESSURE_MEM_UTIL = 0.35
MOONCAKE_STRETCH = 2.0   # the trace's gaps doubled (half its rate): at its own rate its ~22M unique prompt tokens in
                         # 1022 s exceed what 4 tp8 H20 workers prefill (~20K tokens/s) even with every prefix cached


@dataclass(frozen=True, slots=True)
class Cell:
    """One simulation: a setup, a policy (with knobs), a deployment, a host tier size."""

    setup: str
    label: str
    policy: str
    deploy: str
    host_gib: float = 0.0
    eviction: str | None = None       # override of the policy's eviction rule
    no_expiry: bool = False           # idle sessions never expire (session_ttl_s infinite)
    tiered: bool = False
    mem_util: float = 0.9             # share of GPU memory the engine takes (weights + KV pool)


def policies(setup: str, host_gib: float, mem_util: float = 0.9, untiered: bool = True,
             small: bool = False) -> list[Cell]:
    """The compared policies of one setup (`small`: the co-located tool-aware and HiCache-like ones only, for a
    second host size)."""
    m = mem_util
    out = []
    if untiered:
        out += [Cell(setup, "continuum", "continuum", COLO, mem_util=m),
                Cell(setup, "ampd+laps-chunked", "ampd+laps-chunked", DISAGG, mem_util=m),
                Cell(setup, "continuum, no idle expiry", "continuum", COLO, no_expiry=True, mem_util=m)]
    g = host_gib
    if not small:
        out += [Cell(setup, f"continuum-tiered ({g:g} GiB)", "continuum-tiered", COLO, g, tiered=True, mem_util=m)]
    out += [Cell(setup, f"continuum-tool ({g:g} GiB)", "continuum-tool", COLO, g, tiered=True, mem_util=m),
            Cell(setup, f"continuum-tool, LRU ({g:g} GiB)", "continuum-tool", COLO, g, EvictionKind.LRU.value,
                 tiered=True, mem_util=m),
            Cell(setup, f"hicache ({g:g} GiB)", "hicache", COLO, g, tiered=True, mem_util=m)]
    if not small:
        out += [Cell(setup, f"infercept ({g:g} GiB)", "infercept", COLO, g, tiered=True, mem_util=m),
                Cell(setup, f"ampd-tiered ({g:g} GiB)", "ampd-tiered", DISAGG, g, tiered=True, mem_util=m)]
    return out


def sessions_of(setup: str, n: int):
    """The sessions of a setup (deterministic)."""
    if setup == "chat-multiturn":
        return generate("chat-multiturn", n, DEFAULT_RATE, 0, slo=CHAT_SLO)
    if setup == "azure-conv":
        return [dataclasses.replace(s, slo=SLO_MOONCAKE) for s in load_azure("conv", limit=n)]
    if setup == "mooncake":
        return [dataclasses.replace(s, slo=SLO_MOONCAKE, arrival_s=s.arrival_s * MOONCAKE_STRETCH)
                for s in load_mooncake(limit=n)]
    return generate("agentic-long", n, RATE, 0, slo=SLO_AGENTIC)


def run_cell(cell: Cell, n: int) -> dict:
    """Simulate one cell; its metrics and tier counters."""
    spec = get_policy(cell.policy)
    if cell.eviction is not None:
        spec = spec.with_options(kv_eviction=cell.eviction)
    cfg = SimConfig(model=MODEL, gpu=GPU, gpus=GPUS, deploy=cell.deploy, policy=spec, kv_offloading_size=cell.host_gib,
                    session_ttl_s=math.inf if cell.no_expiry else DEFAULT_SESSION_TTL_S, mem_util=cell.mem_util)
    t0 = time.perf_counter()
    res = simulate(sessions_of(cell.setup, n), cfg)
    m = summarize(res.records, res.sim_time_s)
    tiers = [w["kv_tier"] for w in res.workers if "kv_tier" in w]
    tier = {k: sum(t[k] for t in tiers) for k in tiers[0]} if tiers else {}
    return {**dataclasses.asdict(cell), "sessions": n, "wall_s": time.perf_counter() - t0,
            "round_slo_attainment": m["round_slo_attainment"], "slo_attainment": m["slo_attainment"],
            "ttft_incremental_p95_s": m["ttft_incremental_p95_s"], "ttft_p95_s": m["ttft_p95_s"],
            "itl_mean_s": m["itl_mean_s"], "recomputed_tokens": m["recomputed_tokens"],
            "sessions_failed": m["sessions_failed"], "fail_reasons": m["fail_reasons"], "tier": tier,
            "rebinds": res.rebinds,
            "kv_capacity_tokens": res.workers[0]["kv_capacity_tokens"]}


def code_digest() -> str:
    """What a cell's result depends on besides the cell: the simulator's code (tandem/ minus the live shells)."""
    root = Path(__file__).resolve().parent.parent / "tandem"
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        if f.relative_to(root).parts[0] not in ("engine", "runtime", "server", "cli", "bench"):
            h.update(f.read_bytes())
    return h.hexdigest()


def cached_cell(cell: Cell, n: int, cache: Path, code: str = "") -> dict:
    """run_cell, or its result kept from an earlier run of the same cell on the same simulator code."""
    key = cache / (hashlib.sha256(repr((cell, n, code)).encode()).hexdigest()[:16] + ".json")
    if key.exists():
        return json.loads(key.read_text())
    row = run_cell(cell, n)
    key.write_text(json.dumps(row))
    return row


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(rows: list[dict]) -> str:
    """Markdown table per setup: attainment and its gap to continuum in points."""
    out = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        rs = [r for r in rows if r["setup"] == setup]
        base = next((r for r in rs if r["label"] == "continuum"), None)
        out.append(f"\n{setup} ({rs[0]['sessions']} sessions)\n")
        out.append("| policy | deployment | round SLO | vs continuum | session SLO | incr. TTFT p95 s | "
                   "recomputed Mtok | loads / prefetches (hits) | host evictions | rebinds |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            gap = "-" if base is None else f"{100 * (r['round_slo_attainment'] - base['round_slo_attainment']):+.1f}"
            t = r["tier"]
            moves = f"{t['loads']} / {t['prefetches']} ({t['prefetch_hits']})" if t else "-"
            p95 = r["ttft_incremental_p95_s"]
            out.append(f"| {r['label']} | {r['deploy']} | {_pct(r['round_slo_attainment'])} | {gap} | "
                       f"{_pct(r['slo_attainment'])} | {'-' if p95 is None else f'{p95:.2f}'} | "
                       f"{r['recomputed_tokens'] / 1e6:.1f} | {moves} | {t.get('host_evictions', '-') if t else '-'} | "
                       f"{r.get('rebinds', 0)} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Round SLO attainment per policy, one panel per setup."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 5), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        rs = [r for r in rows if r["setup"] == setup]
        ys = [100 * (r["round_slo_attainment"] or 0) for r in rs]
        colors = ["tab:orange" if r["tiered"] else "tab:gray" for r in rs]
        ax.barh([r["label"] for r in rs], ys, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("round SLO attainment (%)")
        ax.set_title(f"{setup} ({rs[0]['sessions']} sessions)")
        ax.set_xlim(0, 100)
    fig.suptitle(f"{MODEL} on {GPUS} {GPU.upper()}s; host link {get_gpu(GPU).host_gbs:g} GB/s per GPU per direction "
                 f"(orange: tiered)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/kv_tiers", help="report directory")
    p.add_argument("--sessions", type=positive_int, default=20, help="agentic-long sessions (default: 20)")
    p.add_argument("--mooncake", type=positive_int, default=2000, help="Mooncake requests (default: 2000)")
    p.add_argument("--azure", type=positive_int, default=2000, help="Azure conv requests (default: 2000)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default: 1)")
    p.add_argument("--quick", action="store_true", help="6 agentic sessions, no pressure setup, 100 Mooncake requests")
    a = p.parse_args(argv)
    if a.quick:
        a.sessions, a.mooncake = 6, 100
    jobs: list[tuple[Cell, int]] = [(c, a.sessions) for c in policies("agentic-long", HOST_GIB)]
    if not a.quick:
        pressure = f"agentic-long, mem_util {PRESSURE_MEM_UTIL:g}"
        jobs += [(c, a.sessions) for c in policies(pressure, HOST_GIB, PRESSURE_MEM_UTIL)]
        jobs += [(c, a.sessions) for c in policies(pressure, SMALL_HOST_GIB, PRESSURE_MEM_UTIL, untiered=False,
                                                   small=True)]
    traced = ("continuum", "ampd+laps-chunked", "continuum-tool", "hicache", "ampd-tiered")
    mooncake = [c for c in policies("mooncake", HOST_GIB) if c.label.split(" (")[0] in traced[:4]]
    jobs = [(c, a.mooncake) for c in mooncake] + jobs        # the longest cells first
    if not a.quick:
        jobs += [(c, DEFAULT_SESSIONS) for c in policies("chat-multiturn", HOST_GIB) if c.label.split(" (")[0] in traced]
        jobs += [(c, a.azure) for c in policies("azure-conv", HOST_GIB) if c.label.split(" (")[0] in traced]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from rich.progress import Progress
    rows: list[dict | None] = [None] * len(jobs)
    t0 = time.perf_counter()
    with Progress(disable=not sys.stderr.isatty()) as bar, ProcessPoolExecutor(a.jobs) as pool:
        task = bar.add_task("simulating", total=len(jobs))
        cache = out / "cells"
        cache.mkdir(exist_ok=True)
        code = code_digest()
        futs = {pool.submit(cached_cell, c, n, cache, code): i for i, (c, n) in enumerate(jobs)}
        from concurrent.futures import as_completed
        for f in as_completed(futs):
            rows[futs[f]] = f.result()
            bar.advance(task)
    done = [r for r in rows if r is not None]
    (out / "kv_tiers.json").write_text(json.dumps(done, indent=1))
    text = table(done)
    (out / "kv_tiers.md").write_text(text)
    plot(done, out / "kv_tiers.png")
    print(text, end="")
    print(f"\nreport: {out}/ in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
