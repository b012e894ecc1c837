"""tandem's measured and roofline A100 costs against Microsoft Vidur's own profiles of Llama-3-70B's ops (vendored in
benchmarks/data/vidur): Vidur's values read as its CSVs hold them, and one row per (TP, tokens, op)."""
from __future__ import annotations

import csv
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

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "vidur"
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
