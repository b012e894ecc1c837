"""The Optimus simulation's report: the headline and per-(model, GPU) tables as markdown, Fig. 8 and Fig. 10, and
results.json."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.optimus_sim import BLOCK, PAPER, SYSTEMS, TPOT_SLO_S

def _x(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table_md(rows: list[dict], heads: list[dict], meta: dict, batches: Sequence[int], rates: Sequence[float]) -> str:
    """table.md: the settings, the headline against the paper, then throughput and P90 TPOT per (model, GPU)."""
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
    """fig8.png (throughput against batch size) and fig10.png (P90 TPOT against rate) in `out`; their names."""
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


def write_report(rows: list[dict], heads: list[dict], meta: dict, batches: Sequence[int], rates: Sequence[float],
                 out: Path) -> list[str]:
    """results.json, table.md and the plots in `out`; the plots' file names."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "headline": heads, "runs": rows}, indent=1))
    (out / "table.md").write_text(table_md(rows, heads, meta, batches, rates))
    return plots(rows, heads, out)
