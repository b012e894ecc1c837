"""Independent check of tandem's measured GPU cost model against Microsoft Vidur's profiled A100 operators.

tandem's measured model (`tandem/perf/measured/`) prices a layer from aiconfigurator's vLLM 0.14 tables. Those
tables are the only input, so checking the model against the same tables would be circular. Vidur (MIT,
github.com/microsoft/vidur at 7d47513) profiled the same layer shapes on A100s on its own, with a different engine
and different kernels. It timed one TP rank of a Llama-3-70B block op by op (`mlp.csv`) and NCCL all-reduces inside
a DGX node (`all_reduce.csv`). Agreement between the two is evidence that the measured model is right. A gap points
at the op to look at.

For TP2 and TP4, Llama-3-70B (tandem's `llama-3.1-70b`, which has the same shapes) on `a100-80g` and a set of token
counts, each op is compared three ways: Vidur's median, tandem measured and tandem roofline. The ops are the QKV, O,
gate/up and down GEMMs, the elementwise kernels summed, and one all-reduce. The same comparison is made for the
per-layer sum (5 ops + 2 all-reduces) and for a decode step without attention, LM head or host time (80 layers).

- **Vidur**: the raw `time_stats.<op>.median` rows at that exact token count. Duplicate rows are averaged.
  Elementwise = input_layernorm + post_attention_layernorm + attn_rope + mlp_act + add. The all-reduce is read at
  tokens x 8192 x 2 bytes. When that size is a CSV row, the row is used as is. Otherwise the value is interpolated
  log-log between the two nearest sizes. Past the CSV's 64 MiB it is extrapolated at the last row's bandwidth.
  These are raw profiles, not Vidur's random-forest predictions. Vidur's predictor adds 0.02 ms of CPU launch per
  all-reduce, which is reported separately in results.json.
- **tandem measured**: the same pieces `tandem.perf.measured.step.token_tables` adds up. GEMMs come from
  `op_tables("a100_sxm", "vllm").gemm("bfloat16")`. The 4 elementwise kernels are priced at the `streaming_fit`
  floor + bytes / bandwidth. The all-reduce is `all_reduce(tp, graph=True)`: the CUDA-graph time, which matches
  Vidur's kernel-only timing.
- **tandem roofline** (`Roofline("llama-3.1-70b", "a100-80g", tp)`), taken op by op:
  - a GEMM costs max(2mnk / (peak x mfu), weight bytes / (HBM x mbu));
  - the elementwise kernels cost the roofline's per-layer activation traffic (`_m_act / layers`, which also covers
    the GEMMs' activations);
  - the all-reduce is `allreduce_time`.
  These per-op terms are summed for the layer. That sum bounds the roofline's own step from above, because the
  roofline takes max(total compute, total memory).

    python benchmarks/vidur_check.py [--out docs/results/vidur_check] [--tokens 1,8,32,128,512,2048,8192]
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from tandem.perf.hardware import get_gpu
from tandem.perf.measured.frameworks import framework_defaults
from tandem.perf.measured.ops import op_tables
from tandem.perf.measured.overhead import overheads, streaming_fit
from tandem.perf.measured.step import token_tables
from tandem.perf.models import get_model
from tandem.perf.roofline import Roofline, kv_heads_per_gpu

DATA = Path(__file__).resolve().parent / "data" / "vidur"
MLP_CSV = DATA / "a100_meta-llama-3-70b_mlp.csv"
ALL_REDUCE_CSV = DATA / "a100_dgx_all_reduce.csv"
VIDUR_COMMIT = "7d47513363ec447a741ac5e47241580b47724fbf"

MODEL, GPU, SYSTEM, FRAMEWORK = "llama-3.1-70b", "a100-80g", "a100_sxm", "vllm"
TPS = (2, 4)
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
VIDUR_LAUNCH_MS = 0.02            # Vidur's nccl_cpu_launch_overhead_ms, added per all-reduce by its predictor

# tandem op -> the Vidur mlp.csv ops summed for it
VIDUR_OPS: dict[str, tuple[str, ...]] = {
    "qkv": ("attn_pre_proj",),
    "o": ("attn_post_proj",),
    "gate_up": ("mlp_up_proj",),
    "down": ("mlp_down_proj",),
    "elementwise": ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add"),
}
OPS = (*VIDUR_OPS, "all_reduce")
ROWS = (*OPS, "layer", "step")

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


# --- Vidur's data ------------------------------------------------------------------------------------------------
def load_vidur_mlp(path: Path = MLP_CSV) -> dict[tuple[int, int], dict[str, float]]:
    """(tp, num_tokens) -> {Vidur op: median ms}, averaging the duplicate rows the CSV has at some token counts."""
    acc: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]))
            acc[key].append({k.split(".")[1]: float(v) for k, v in r.items() if k.endswith(".median")})
    return {k: {op: float(np.mean([row[op] for row in rows])) for op in rows[0]} for k, rows in acc.items()}


def load_vidur_all_reduce(path: Path = ALL_REDUCE_CSV) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """tp -> (sizes in bytes, ascending; median ms), for the rows with num_workers == devices_per_node == tp
    (one node). Duplicate sizes are averaged."""
    acc: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["num_workers"] == r["devices_per_node"]:
                acc[int(r["num_workers"])][int(r["size"])].append(float(r["time_stats.all_reduce.median"]))
    out = {}
    for tp, by_size in acc.items():
        sizes = np.array(sorted(by_size), dtype=float)
        out[tp] = (sizes, np.array([np.mean(by_size[int(s)]) for s in sizes]))
    return out


def vidur_all_reduce_ms(table: dict[int, tuple[np.ndarray, np.ndarray]], tp: int, nbytes: float
                        ) -> tuple[float, str]:
    """Vidur's all-reduce median over tp GPUs at nbytes, and how it was read: 'exact' (a CSV row), 'interpolated'
    (log-log between the two nearest sizes) or 'extrapolated' (past the largest size, at its bandwidth)."""
    sizes, ms = table[tp]
    i = int(np.searchsorted(sizes, nbytes))
    if i < len(sizes) and sizes[i] == nbytes:
        return float(ms[i]), "exact"
    if i >= len(sizes):
        return float(ms[-1] * nbytes / sizes[-1]), "extrapolated"
    if i == 0:
        return float(ms[0]), "extrapolated"
    x0, x1, y0, y1 = np.log(sizes[i - 1]), np.log(sizes[i]), np.log(ms[i - 1]), np.log(ms[i])
    return float(np.exp(y0 + (y1 - y0) * (np.log(nbytes) - x0) / (x1 - x0))), "interpolated"


def vidur_neighbourhood_ms(table: dict[int, tuple[np.ndarray, np.ndarray]], tp: int, nbytes: float
                           ) -> tuple[float, float, float] | None:
    """(min, median, max) of Vidur's all-reduce medians within 2^+-0.25 of nbytes, to show how noisy it is there."""
    sizes, ms = table[tp]
    sel = (sizes >= nbytes * 2 ** -0.25) & (sizes <= nbytes * 2 ** 0.25)
    if not sel.any():
        return None
    return float(ms[sel].min()), float(np.median(ms[sel])), float(ms[sel].max())


# --- the comparison ----------------------------------------------------------------------------------------------
def compare(tps: tuple[int, ...] = TPS, tokens: tuple[int, ...] = TOKENS, mlp_csv: Path = MLP_CSV,
            all_reduce_csv: Path = ALL_REDUCE_CSV) -> list[dict]:
    """One row per (tp, tokens, op in ROWS): Vidur, tandem measured and tandem roofline in ms, and the ratios to
    Vidur. Token counts Vidur did not profile at a tp are skipped."""
    mlp, ar = load_vidur_mlp(mlp_csv), load_vidur_all_reduce(all_reduce_csv)
    model, gpu = get_model(MODEL), get_gpu(GPU)
    ops = op_tables(SYSTEM, FRAMEWORK)
    gemm = ops.gemm("bfloat16")
    floor_s, ew_bps = streaming_fit(SYSTEM, FRAMEWORK)[:2]
    h, d, a, L = model.hidden, model.head_dim, model.dtype_bytes, model.layers
    rows: list[dict] = []
    for tp in tps:
        roof = Roofline(model, gpu, tp)
        graph_table = token_tables(model, tp, 1, ops, overheads(ops, framework_defaults(FRAMEWORK)))[0]
        q, kv = model.heads // tp * d, kv_heads_per_gpu(model, tp) * d
        inter = model.intermediate * model.experts_per_token // tp
        shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
        for t in tokens:
            if (tp, t) not in mlp:
                print(f"Vidur has no tp{tp} row at {t} tokens; skipped", file=sys.stderr)
                continue
            v = mlp[(tp, t)]
            m = float(t)
            vid, meas, rf, how = {}, {}, {}, {}
            for op, (n, k) in shapes.items():
                vid[op] = v[VIDUR_OPS[op][0]]
                meas[op] = float(gemm(m, n, k)) * 1e3
                rf[op] = max(2 * m * n * k / gpu.achievable_flops(model.weight_dtype),
                             n * k * model.weight_elem_bytes / gpu.mem_bw) * 1e3
            vid["elementwise"] = sum(v[o] for o in VIDUR_OPS["elementwise"])
            ew_bytes = m * a * (2 * 4 * h + (q + 2 * kv) + kv * 2 * model.kv_elem_bytes / a + 3 * inter)
            meas["elementwise"] = (4 * floor_s + ew_bytes / ew_bps) * 1e3
            rf["elementwise"] = roof._m_act / L * m * 1e3
            nbytes = m * h * a
            vid["all_reduce"], how["all_reduce"] = vidur_all_reduce_ms(ar, tp, nbytes)
            meas["all_reduce"] = float(ops.all_reduce(tp, True)(nbytes)) * 1e3
            rf["all_reduce"] = roof.allreduce_time(nbytes) * 1e3
            for src in (vid, meas, rf):
                src["layer"] = sum(src[o] for o in VIDUR_OPS) + 2 * src["all_reduce"]
                src["step"] = L * src["layer"]
            extra = {"all_reduce": {"nbytes": nbytes, "vidur_read": how["all_reduce"],
                                    "vidur_neighbourhood_ms": vidur_neighbourhood_ms(ar, tp, nbytes),
                                    "measured_eager_ms": float(ops.all_reduce(tp, False)(nbytes)) * 1e3},
                     "step": {"tandem_token_tables_ms": float(graph_table[t]) * 1e3 if t < len(graph_table) else None,
                              "vidur_with_launch_ms": vid["step"] + 2 * L * VIDUR_LAUNCH_MS}}
            for op in ROWS:
                rows.append({"tp": tp, "tokens": t, "op": op, "vidur_ms": vid[op], "measured_ms": meas[op],
                             "roofline_ms": rf[op], "measured_over_vidur": meas[op] / vid[op],
                             "roofline_over_vidur": rf[op] / vid[op], **extra.get(op, {})})
    return rows


# --- reporting ---------------------------------------------------------------------------------------------------
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/vidur_check"))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--tps", default=",".join(map(str, TPS)), help="comma-separated TP degrees (2 and/or 4)")
    a = ap.parse_args(argv)
    rows = compare(tuple(int(x) for x in a.tps.split(",")), tuple(int(x) for x in a.tokens.split(",")))
    if not rows:
        print("nothing to compare", file=sys.stderr)
        return 1
    tables = op_tables(SYSTEM, FRAMEWORK)
    table = markdown(rows, dict(tables.sources))
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "table.md").write_text(table)
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
    (a.out / "results.json").write_text(json.dumps({"meta": meta, "geomean_ratio_over_tokens": geo, "rows": rows},
                                                   indent=1))
    plot(rows, a.out / "per_op.png")
    print(f"wrote {a.out / 'table.md'}, {a.out / 'results.json'}, {a.out / 'per_op.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
