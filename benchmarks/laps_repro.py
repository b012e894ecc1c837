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
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

from tandem.bench.parallel import ParallelMap
from tandem.bench.provenance import cost_sources, report_meta
from tandem.perf.costs import COST_MODELS, DEFAULT_COST_MODEL
from tandem.cli.common import csv_list, positive_int, seed_arg
from tandem.sim.cluster import SimConfig, SimResult, simulate
from tandem.workload.generators import default_slo, generate
from tandem.workload.session import Round, Session

WORKLOAD = "chat-multiturn"
GPU = "h200"
SHORT_TOKENS = 256          # LAPS's class boundary (its code's default): the short/long split of the report
PAPER = {"violations_vs_pd": -0.28, "violations_vs_router": -0.12, "prefill_latency": -0.30, "throughput": 0.35}
LAPS_POLICY, PD_POLICY, ROUTER_POLICY, VLLM_PD_POLICY = "laps", "sglang-pd", "sglang-pd-router", "vllm-pd"


class Client(StrEnum):
    """What a closed-loop client waits for before sending its next turn."""

    CHAT = "chat"           # the whole answer (ShareGPT output lengths)
    PREFILL = "prefill"     # the first token only (one output token per turn): the prefill stage


@dataclass(frozen=True, slots=True)
class Grid:
    """What the reproduction sweeps, and how many sessions each cell runs."""

    models: tuple[str, ...] = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")
    instances: tuple[int, ...] = (1, 8)
    concurrency: tuple[int, ...] = (1, 4, 16, 32, 64)
    policies: tuple[str, ...] = ("sglang-pd", "sglang-pd-router", "vllm-pd", "laps", "laps-no-graph", "laps-no-split",
                                 "ampd+laps")
    clients: tuple[Client, ...] = (Client.CHAT, Client.PREFILL)
    seeds: tuple[int, ...] = (0, 1, 2)
    decode_workers: int = 8
    cost_model: str = DEFAULT_COST_MODEL
    sessions_per_client: tuple[tuple[Client, int], ...] = ((Client.CHAT, 16), (Client.PREFILL, 40))
    min_sessions: tuple[tuple[Client, int], ...] = ((Client.CHAT, 64), (Client.PREFILL, 128))

    def sessions(self, client: Client, concurrency: int) -> int:
        """Conversations one cell runs: enough per client for a steady state (the pool controller's 5 s cool-down
        needs tens of simulated seconds under prefill-bound load)."""
        return max(dict(self.min_sessions)[client], dict(self.sessions_per_client)[client] * concurrency)

    def cells(self) -> list[Cell]:
        """Every (model, instances, client, concurrency, policy, seed), the most expensive first."""
        out = [Cell(m, n, c, k, p, s) for m in self.models for n in self.instances for c in self.clients
               for k in self.concurrency for p in self.policies for s in self.seeds]
        return sorted(out, key=lambda c: -self.sessions(c.client, c.concurrency))


QUICK = Grid(models=("qwen2.5-32b",), concurrency=(4, 64), seeds=(0,), sessions_per_client=((Client.CHAT, 6), (Client.PREFILL, 16)),
             min_sessions=((Client.CHAT, 24), (Client.PREFILL, 48)))


@dataclass(frozen=True, slots=True)
class Cell:
    """One simulation of the grid."""

    model: str
    instances: int
    client: Client
    concurrency: int
    policy: str
    seed: int

    def deploy(self, decode_workers: int) -> str:
        return f"P:tp1x{self.instances},D:tp1x{decode_workers}"

    @property
    def group(self) -> tuple[str, int, str, int, str]:
        """The cell without its seed (seeds are averaged)."""
        return (self.model, self.instances, str(self.client), self.concurrency, self.policy)


# --------------------------------------------------------------------------- one cell


@lru_cache(maxsize=32)
def _base_sessions(n: int, seed: int) -> tuple[Session, ...]:
    return tuple(generate(WORKLOAD, n, 1.0, seed, slo=default_slo("", WORKLOAD)))


def client_sessions(client: Client, n: int, seed: int) -> list[Session]:
    """The workload's conversations as closed-loop clients send them: no think time; `prefill` clients ask for one
    output token per turn. Arrival times are the loop's (SimConfig.concurrency)."""
    out = []
    for s in _base_sessions(n, seed):
        rounds = [Round(r.input_tokens, 1 if client is Client.PREFILL else r.output_tokens, 0.0, r.hash_ids)
                  for r in s.rounds]
        out.append(dataclasses.replace(s, rounds=rounds))
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def _p90(xs: Sequence[float]) -> float | None:
    return float(np.percentile(xs, 90)) if len(xs) else None


def cell_metrics(res: SimResult, slo_s: float) -> dict:
    """The cell's metrics from its per-round records (see the module docstring)."""
    recs = res.records
    busy_until = max((r.arrival_s for r in recs), default=0.0)   # the last conversation started: all clients busy
    window = busy_until if busy_until > 0 else res.sim_time_s
    rounds = [rr for r in recs for rr in r.rounds]
    total = sum(r.num_rounds for r in recs)
    ttft = [rr.ttft_s for rr in rounds if rr.ttft_s is not None]
    init = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.index == 0]
    incr = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.index > 0]
    short = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.input_tokens < SHORT_TOKENS]
    long = [rr.ttft_s for rr in rounds if rr.ttft_s is not None and rr.input_tokens >= SHORT_TOKENS]
    ok = sum(1 for rr in rounds if rr.ttft_s is not None and rr.ttft_s <= slo_s)
    done = sum(1 for rr in rounds if rr.finish_s is not None and rr.finish_s <= window)
    itl_n = sum(rr.itl_count for rr in rounds)
    prefill = [w for w in res.workers if str(w["role"]) == "prefill"]
    laps = [w["laps"] for w in prefill if "laps" in w]
    short_steps = sum(x["short_steps"] for x in laps)
    out = {
        "sessions": len(recs), "sessions_failed": sum(1 for r in recs if r.failed), "rounds": total,
        "window_s": window, "sim_time_s": res.sim_time_s, "wall_s": res.wall_s,
        "rounds_per_s": done / window if window > 0 else None,
        "ttft_mean_s": _mean(ttft), "ttft_p90_s": _p90(ttft),
        "ttft_initial_mean_s": _mean(init), "ttft_initial_p90_s": _p90(init),
        "ttft_incremental_mean_s": _mean(incr), "ttft_incremental_p90_s": _p90(incr),
        "ttft_short_mean_s": _mean(short), "ttft_long_mean_s": _mean(long),
        "slo_violation_rate": 1.0 - ok / total if total else None,
        "itl_mean_s": sum(rr.itl_sum_s for rr in rounds) / itl_n if itl_n else None,
        "preemptions": sum(rr.preemptions for rr in rounds),
        "prefill_busy": _mean([w["busy_s"] / res.sim_time_s for w in prefill]) if res.sim_time_s > 0 else None,
        "pool_moves": len(res.pool_moves),
        "graph_step_share": sum(x["graph_steps"] for x in laps) / short_steps if short_steps else None,
        "padded_tokens": sum(x["padded_tokens"] for x in laps) if laps else None,
    }
    return out


def run_cell(cell: Cell, grid: Grid) -> dict:
    """Simulate one cell; its metrics with the cell's coordinates."""
    n = grid.sessions(cell.client, cell.concurrency)
    sessions = client_sessions(cell.client, n, cell.seed)
    slo = sessions[0].slo.ttft_s if sessions and sessions[0].slo is not None else 0.4
    cfg = SimConfig(model=cell.model, gpu=GPU, gpus=cell.instances + grid.decode_workers,
                    deploy=cell.deploy(grid.decode_workers), policy=cell.policy, seed=cell.seed,
                    concurrency=cell.concurrency, cost_model=grid.cost_model)
    res = simulate(sessions, cfg)
    row = {"model": cell.model, "instances": cell.instances, "client": str(cell.client),
           "concurrency": cell.concurrency, "policy": cell.policy, "seed": cell.seed, "deploy": res.deployment,
           "slo_ttft_s": slo}
    row.update(cell_metrics(res, slo))
    return row


# --------------------------------------------------------------------------- the grid


def run_grid(grid: Grid, jobs: int, progress: bool) -> list[dict]:
    """Every cell of the grid (in a process pool when jobs > 1), with a rich progress bar when `progress`."""
    cells = grid.cells()
    with ParallelMap(jobs, progress, len(cells), width=52) as runner:
        rows = runner.map(partial(run_cell, grid=grid), cells,
                          lambda c: f"{c.model} P{c.instances} {c.client} c={c.concurrency} {c.policy}")
    return sorted(rows, key=lambda r: (r["model"], r["instances"], r["client"], r["concurrency"],
                                       grid.policies.index(r["policy"]), r["seed"]))


AVERAGED = ("rounds_per_s", "ttft_mean_s", "ttft_p90_s", "ttft_initial_mean_s", "ttft_initial_p90_s",
            "ttft_incremental_mean_s", "ttft_incremental_p90_s", "ttft_short_mean_s", "ttft_long_mean_s",
            "slo_violation_rate", "itl_mean_s", "prefill_busy", "graph_step_share", "pool_moves")
SUMMED = ("sessions", "sessions_failed", "rounds", "preemptions", "wall_s")


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per cell without its seed: the seeds' mean of each metric (sums of the counts)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["instances"], r["client"], r["concurrency"], r["policy"]), []).append(r)
    out = []
    for key, rs in groups.items():
        a = {k: v for k, v in zip(("model", "instances", "client", "concurrency", "policy"), key)}
        a["seeds"] = [r["seed"] for r in rs]
        a["deploy"] = rs[0]["deploy"]
        a["slo_ttft_s"] = rs[0]["slo_ttft_s"]
        for k in AVERAGED:
            vals = [r[k] for r in rs if r.get(k) is not None]
            a[k] = float(np.mean(vals)) if vals else None
        for k in SUMMED:
            a[k] = sum(r[k] for r in rs)
        out.append(a)
    return out


def _find(agg: list[dict], **kw) -> dict | None:
    return next((a for a in agg if all(a[k] == v for k, v in kw.items())), None)


def _rel(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return new / old - 1.0


def headline(agg: list[dict], grid: Grid) -> list[dict]:
    """The graph check: at the largest model, instance count and concurrency of the grid (Qwen2.5-32B, 8 prefill
    instances, 64 clients by default), LAPS against SGLang-PD, its router and vLLM-PD, per client kind."""
    model = "qwen2.5-32b" if "qwen2.5-32b" in grid.models else grid.models[-1]
    inst, conc = max(grid.instances), max(grid.concurrency)
    out = []
    for client in grid.clients:
        at = dict(model=model, instances=inst, client=str(client), concurrency=conc)
        laps = _find(agg, policy=LAPS_POLICY, **at)
        if laps is None:
            continue
        h = {**at, "laps": _pick(laps)}
        for name, pol in (("vs_pd", PD_POLICY), ("vs_router", ROUTER_POLICY), ("vs_vllm_pd", VLLM_PD_POLICY)):
            base = _find(agg, policy=pol, **at)
            if base is None:
                continue
            h[pol] = _pick(base)
            h[name] = {"slo_violation_points": laps["slo_violation_rate"] - base["slo_violation_rate"],
                       "slo_violation_rel": _rel(laps["slo_violation_rate"], base["slo_violation_rate"]),
                       "ttft_mean_rel": _rel(laps["ttft_mean_s"], base["ttft_mean_s"]),
                       "ttft_p90_rel": _rel(laps["ttft_p90_s"], base["ttft_p90_s"]),
                       "rounds_per_s_rel": _rel(laps["rounds_per_s"], base["rounds_per_s"])}
        out.append(h)
    return out


def _pick(a: dict) -> dict:
    return {k: a[k] for k in ("slo_violation_rate", "ttft_mean_s", "ttft_p90_s", "rounds_per_s",
                              "ttft_short_mean_s", "ttft_long_mean_s", "prefill_busy", "pool_moves")}


# --------------------------------------------------------------------------- report


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def headline_md(heads: list[dict]) -> str:
    """The headline comparison as markdown."""
    lines = []
    for h in heads:
        lines += [f"**{h['model']}, {h['instances']} prefill instance(s), concurrency {h['concurrency']}, "
                  f"`{h['client']}` clients**", "",
                  "| policy | SLO violations | TTFT mean (ms) | TTFT P90 (ms) | rounds/s | short / long TTFT mean (ms) "
                  "| prefill busy | pool moves |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for pol in (LAPS_POLICY, PD_POLICY, ROUTER_POLICY, VLLM_PD_POLICY):
            v = h.get(pol) if pol != LAPS_POLICY else h["laps"]
            if v is None:
                continue
            lines.append(f"| {pol} | {_pct(v['slo_violation_rate'])} | {_ms(v['ttft_mean_s'])} | "
                         f"{_ms(v['ttft_p90_s'])} | {_num(v['rounds_per_s'])} | {_ms(v['ttft_short_mean_s'])} / "
                         f"{_ms(v['ttft_long_mean_s'])} | {_pct(v['prefill_busy'], 0)} | {v['pool_moves']:.0f} |")
        lines += ["", "| LAPS against | violations (points) | violations (relative) | TTFT mean | TTFT P90 | rounds/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, label in (("vs_pd", "SGLang PD (round robin)"), ("vs_router", "SGLang PD + router (least load)"),
                            ("vs_vllm_pd", "vLLM PD (round robin, history recomputed)")):
            d = h.get(name)
            if d is not None:
                lines.append(f"| {label} | {100 * d['slo_violation_points']:+.1f} | {_signed(d['slo_violation_rel'])} | "
                             f"{_signed(d['ttft_mean_rel'])} | {_signed(d['ttft_p90_rel'])} | "
                             f"{_signed(d['rounds_per_s_rel'])} |")
        lines += [f"| paper (LAPS §4, H200) | | {_signed(PAPER['violations_vs_pd'])} vs PD, "
                  f"{_signed(PAPER['violations_vs_router'])} vs router | {_signed(PAPER['prefill_latency'])} | | "
                  f"{_signed(PAPER['throughput'])} |", ""]
    return "\n".join(lines)


def table_md(agg: list[dict], grid: Grid, heads: list[dict], meta: dict) -> str:
    """table.md: the settings, the headline, then every cell."""
    lines = ["# LAPS Fig. 6 / Fig. 7 in the simulator", "",
             f"`{meta['command']}` — {meta['machine']}, {meta['date']}, {meta['wall_s']:.0f} s, "
             f"commit {meta.get('commit')}. Step costs: {meta.get('costs', 'roofline')}.", "",
             f"Workload `{WORKLOAD}` (LAPS's length mix), TTFT SLO {agg[0]['slo_ttft_s'] if agg else 0.4:g} s, closed-loop "
             f"clients without think time; `chat` clients wait for the whole answer, `prefill` clients for one token. "
             f"{GPU.upper()}, deployments `P:tp1xN,D:tp1x{grid.decode_workers}`, seeds {list(grid.seeds)}, "
             f"sessions per cell: chat max({dict(grid.min_sessions)[Client.CHAT]}, "
             f"{dict(grid.sessions_per_client)[Client.CHAT]} x clients), prefill "
             f"max({dict(grid.min_sessions)[Client.PREFILL]}, {dict(grid.sessions_per_client)[Client.PREFILL]} x clients). "
             "TTFT includes queueing and the KV hand-off; violations are over all rounds; rounds/s over the time all "
             "clients were busy. Short/long: new tokens below/above 256.", "", "## Headline", "",
             headline_md(heads), "## Every cell", ""]
    cols = ("| policy | rounds/s | TTFT mean | TTFT P90 | initial mean | incremental mean | short mean | long mean "
            "| violations | ITL mean | preempt. | prefill busy | graph steps | pool moves |")
    sep = "|---|" + "---:|" * 13
    for client in grid.clients:
        for model in grid.models:
            for inst in grid.instances:
                lines += [f"### {model}, {inst} prefill instance(s), `{client}` clients (times in ms)", ""]
                for conc in grid.concurrency:
                    lines += [f"concurrency {conc}", "", cols, sep]
                    for pol in grid.policies:
                        a = _find(agg, model=model, instances=inst, client=str(client), concurrency=conc, policy=pol)
                        if a is None:
                            continue
                        lines.append(
                            f"| {pol} | {_num(a['rounds_per_s'])} | {_ms(a['ttft_mean_s'])} | {_ms(a['ttft_p90_s'])} | "
                            f"{_ms(a['ttft_initial_mean_s'])} | {_ms(a['ttft_incremental_mean_s'])} | "
                            f"{_ms(a['ttft_short_mean_s'])} | {_ms(a['ttft_long_mean_s'])} | "
                            f"{_pct(a['slo_violation_rate'])} | {_num(None if a['itl_mean_s'] is None else 1e3 * a['itl_mean_s'], '.1f')} | "
                            f"{a['preemptions']} | {_pct(a['prefill_busy'], 0)} | {_pct(a['graph_step_share'], 0)} | "
                            f"{_num(a['pool_moves'], '.0f')} |")
                    lines.append("")
    return "\n".join(lines) + "\n"


def _save(fig, axes, title: str, path: Path) -> str:
    """Legend on the first panel, the title, and the figure written to `path` (closed); returns its file name."""
    import matplotlib.pyplot as plt
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def plot(agg: list[dict], grid: Grid, out: Path) -> list[str]:
    """fig6_<client>.png (rounds/s, mean and P90 TTFT against concurrency) and fig7_<client>.png (SLO violations)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    panels = [("rounds_per_s", "rounds/s", 1.0), ("ttft_mean_s", "mean TTFT (ms)", 1e3),
              ("ttft_p90_s", "P90 TTFT (ms)", 1e3)]
    combos = [(m, n) for m in grid.models for n in grid.instances]

    def lines(ax, model: str, inst: int, client: str, key: str, scale: float) -> None:
        for pol in grid.policies:
            pts = [(c, a[key] * scale) for c in grid.concurrency
                   if (a := _find(agg, model=model, instances=inst, client=client, concurrency=c, policy=pol))
                   and a[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=pol)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(grid.concurrency), [str(c) for c in grid.concurrency])
        ax.grid(alpha=0.3)

    for client in map(str, grid.clients):
        fig, axes = plt.subplots(len(combos), 3, figsize=(13, 2.6 * len(combos)), squeeze=False)
        for i, (m, n) in enumerate(combos):
            for j, (key, label, scale) in enumerate(panels):
                ax = axes[i][j]
                lines(ax, m, n, client, key, scale)
                ax.set_title(f"{m}, {n} prefill inst.: {label}", fontsize=9)
                if i == len(combos) - 1:
                    ax.set_xlabel("concurrency (clients)")
        files.append(_save(fig, axes, f"LAPS Fig. 6 in the simulator ({client} clients, H200)",
                           out / f"fig6_{client}.png"))

        fig, axes = plt.subplots(len(grid.instances), len(grid.models), figsize=(4.2 * len(grid.models),
                                 2.9 * len(grid.instances)), squeeze=False)
        for i, n in enumerate(grid.instances):
            for j, m in enumerate(grid.models):
                ax = axes[i][j]
                lines(ax, m, n, client, "slo_violation_rate", 100.0)
                ax.set_title(f"{m}, {n} prefill inst.", fontsize=9)
                ax.set_ylabel("SLO violations (%)")
                if i == len(grid.instances) - 1:
                    ax.set_xlabel("concurrency (clients)")
        files.append(_save(fig, axes, f"LAPS Fig. 7 in the simulator: TTFT > SLO ({client} clients)",
                           out / f"fig7_{client}.png"))
    return files


def write_report(rows: list[dict], grid: Grid, out: Path, meta: dict, plots: bool = True) -> dict:
    """Aggregate, then write results.json, table.md and the plots to `out`; returns results.json's content."""
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(rows)
    heads = headline(agg, grid)
    files = ["results.json", "table.md"]
    if plots and agg:
        files += plot(agg, grid, out)
    grid_json = {f.name: getattr(grid, f.name) for f in dataclasses.fields(grid)}
    result = {"meta": meta, "grid": grid_json, "paper": PAPER, "headline": heads, "cells": agg, "runs": rows,
              "files": files}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "table.md").write_text(table_md(agg, grid, heads, meta))
    return result


# --------------------------------------------------------------------------- command line


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
