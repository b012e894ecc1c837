"""The Vidur check's report: the ratio tables and every value as markdown, the per-op plot, results.json."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tandem.bench.vidur import ALL_REDUCE_CSV, FRAMEWORK, GPU, MLP_CSV, MODEL, OPS, ROWS, SYSTEM, VIDUR_COMMIT
from tandem.perf.measured.ops import op_tables
from tandem.perf.measured.overhead import streaming_fit

NOTES = (
    "Vidur profiled fp16 in sarathi-serve (its 2024 vLLM fork) on an A100; tandem's tables are vLLM 0.14 bf16 on "
    "A100 SXM (aiconfigurator-core). Same shapes, different engine, kernels and year.",
    "Times are one TP rank's GPU kernel time in ms. The step is 80 layers without attention, LM head, embedding or "
    "host time.",
    "Vidur's all-reduce is NCCL on an A100 DGX node. tandem's is vLLM's custom all-reduce table replayed from a CUDA "
    "graph. Vidur's predictor adds 0.02 ms of CPU launch per all-reduce on top of the raw median compared here.",
    "Elementwise: Vidur times separate RMSNorms, rotary, SiLU-and-mul and one residual add; tandem prices 4 fused "
    "kernels (2 add+RMSNorm, rotary with the KV-cache write, SiLU-and-mul), whose bytes include the KV write "
    "(Vidur puts that write in attention.csv, not compared).",
    "Roofline per op: GEMM max(FLOPs / (peak x mfu), weight bytes / (HBM x mbu)); elementwise = the roofline's "
    "per-layer activation traffic; all-reduce = Roofline.allreduce_time. The layer is the sum of these terms.",
)


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.1f}"


def markdown(rows: list[dict], sources: dict[str, str] | None = None) -> str:
    """Summary tables of the ratios (op x tokens, per tp), then every row in ms."""
    tps = sorted({r["tp"] for r in rows})
    out = ["# tandem measured and roofline vs Vidur's A100 profiles: Llama-3-70B, per TP rank", ""]
    out += [f"- {n}" for n in NOTES]
    out += [f"- Vidur: github.com/microsoft/vidur @ {VIDUR_COMMIT[:7]} (MIT), `{MLP_CSV.name}`, `{ALL_REDUCE_CSV.name}`."]
    if sources:
        out.append("- tandem tables read: " + ", ".join(f"`{v}`" for v in sorted(set(sources.values()))) + ".")
    out.append("")
    for key, title in (("measured_over_vidur", "tandem measured / Vidur"),
                       ("roofline_over_vidur", "tandem roofline / Vidur")):
        for tp in tps:
            sub = [r for r in rows if r["tp"] == tp]
            toks = sorted({r["tokens"] for r in sub})
            out += [f"**{title}, TP{tp}** (columns: tokens)", "",
                    "| op | " + " | ".join(str(t) for t in toks) + " |", "|---|" + "---:|" * len(toks)]
            for op in ROWS:
                cells = {r["tokens"]: r[key] for r in sub if r["op"] == op}
                out.append(f"| {op} | " + " | ".join(f"{cells[t]:.2f}" for t in toks) + " |")
            out.append("")
    out += ["**All values** (ms; all_reduce is one call, layer = 5 ops + 2 all-reduces, step = 80 layers)", "",
            "| TP | tokens | op | Vidur | measured | roofline | meas/Vidur | roof/Vidur |",
            "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = {"interpolated": " (i)", "extrapolated": " (x)"}.get(r.get("vidur_read", ""), "")
        out.append(f"| {r['tp']} | {r['tokens']} | {r['op']} | {_fmt(r['vidur_ms'])}{mark} | {_fmt(r['measured_ms'])} "
                   f"| {_fmt(r['roofline_ms'])} | {r['measured_over_vidur']:.2f} | {r['roofline_over_vidur']:.2f} |")
    out += ["", "(i): Vidur's all-reduce interpolated log-log between its two nearest profiled sizes; "
            "(x): extrapolated past its largest size (64 MiB) at that size's bandwidth.", ""]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Ratio to Vidur per op vs tokens: measured solid, roofline dashed; one panel per tp."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({r["tp"] for r in rows})
    fig, axes = plt.subplots(1, len(tps), figsize=(6.5 * len(tps), 4.8), sharey=True, squeeze=False)
    colours = {**dict(zip(OPS, plt.rcParams["axes.prop_cycle"].by_key()["color"])), "layer": "k"}
    for ax, tp in zip(axes[0], tps):
        for op in (*OPS, "layer"):
            sub = sorted((r for r in rows if r["tp"] == tp and r["op"] == op), key=lambda r: r["tokens"])
            x = [r["tokens"] for r in sub]
            lw = 2.5 if op == "layer" else 1.4
            ax.plot(x, [r["measured_over_vidur"] for r in sub], "-o", ms=3, lw=lw, color=colours[op], label=op)
            ax.plot(x, [r["roofline_over_vidur"] for r in sub], "--", lw=lw * 0.8, color=colours[op], alpha=0.7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the batch")
        ax.set_title(f"Llama-3-70B TP{tp}, A100: tandem / Vidur (solid measured, dashed roofline)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ratio to Vidur's median")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rows: list[dict], out: Path) -> str:
    """table.md, results.json (settings, notes, geometric-mean ratios over token counts, every row) and per_op.png
    in `out`; returns the table."""
    tables = op_tables(SYSTEM, FRAMEWORK)
    table = markdown(rows, dict(tables.sources))
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table)
    floor_s, bps = streaming_fit(SYSTEM, FRAMEWORK)[:2]
    meta = {"model": MODEL, "vidur_model": "meta-llama/Meta-Llama-3-70B", "gpu": GPU, "system": SYSTEM,
            "framework": FRAMEWORK, "vidur": {"repo": "github.com/microsoft/vidur", "commit": VIDUR_COMMIT,
                                              "licence": "MIT", "files": [MLP_CSV.name, ALL_REDUCE_CSV.name]},
            "tandem_tables": dict(tables.sources), "elementwise_floor_s": floor_s, "elementwise_bps": bps,
            "notes": list(NOTES)}
    geo = {f"tp{tp}": {op: {k: math.exp(float(np.mean([math.log(r[k]) for r in rows
                                                       if r["tp"] == tp and r["op"] == op])))
                            for k in ("measured_over_vidur", "roofline_over_vidur")} for op in ROWS}
           for tp in sorted({r["tp"] for r in rows})}
    (out / "results.json").write_text(json.dumps({"meta": meta, "geomean_ratio_over_tokens": geo, "rows": rows},
                                                 indent=1))
    plot(rows, out / "per_op.png")
    return table
