"""The LAPS reproduction's report: the headline and every cell as markdown, the Fig. 6 / Fig. 7 plots, results.json."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tandem.bench.laps_repro import (GPU, LAPS_POLICY, PAPER, PD_POLICY, ROUTER_POLICY, VLLM_PD_POLICY, WORKLOAD, Client,
                                     Grid, aggregate, find_cell, headline)



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
                        a = find_cell(agg, model=model, instances=inst, client=str(client), concurrency=conc, policy=pol)
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
                   if (a := find_cell(agg, model=model, instances=inst, client=client, concurrency=c, policy=pol))
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
