"""The costs around the measured kernels, each fitted to named data and written down with its residuals.

- Elementwise kernels (fused add+RMSNorm, rotary and KV write, SiLU-and-multiply) are not in the tables; they are
  memory-bound, so each is priced `kernel_s + bytes / elementwise_bps`: the floor is the fastest kernel of the GEMM
  table, the bandwidth is fitted to the tables' own memory-streaming kernel, decode attention over a bf16 KV cache.
- An eager step's launch cost per kernel: the framework's eager all-reduce minus the same all-reduce replayed from a
  CUDA graph, at the smallest message (where both are pure latency), two GPUs.
- The per-step host overhead (scheduling, input preparation, sampling, output processing), which no operator table
  holds: `STEP_OVERHEAD_S` below, with its source.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tandem.perf.measured.frameworks import FrameworkDefaults
from tandem.perf.measured.ops import ATTENTION_COLUMNS, GEMM_COLUMNS
from tandem.perf.measured.source import MissingCostData, find_table, read_columns

# Host seconds a step spends outside the GPU's kernels (see docs/cost-models.md, "Measured costs: overheads").
STEP_OVERHEAD_S = {"vllm": 2e-3, "sglang": 2e-3, "trtllm": 2e-3}
# When a system has no eager/graph all-reduce pair, a kernel launch costs this (PyTorch dispatch + cudaLaunchKernel).
DEFAULT_LAUNCH_S = 6e-6


@dataclass(frozen=True)
class Overheads:
    """Fitted costs around the kernels of one (system, framework), with the fit's residuals."""

    kernel_s: float            # floor of one small elementwise kernel
    elementwise_bps: float     # bytes/s an elementwise kernel moves
    launch_s: float            # host time to launch one kernel eagerly
    step_s: float              # host time per step
    fit_median_rel: float      # elementwise fit: median |relative residual| over the table
    fit_p90_rel: float
    fit_points: int
    source: str


@lru_cache(maxsize=64)
def overheads(ops, fw: FrameworkDefaults) -> Overheads:
    """The overheads of an OpTables (measured or derived) under a framework's defaults."""
    donor = getattr(ops, "donor_ops", ops)
    floor, bps, med, p90, n = streaming_fit(donor.system, donor.framework)
    if donor is not ops:                              # derived: the same kernels at the target's bandwidth
        bps *= ops.target.hbm_bw_gbs / ops.donor.hbm_bw_gbs
    return Overheads(kernel_s=floor, elementwise_bps=bps, launch_s=_launch_s(ops), step_s=STEP_OVERHEAD_S[fw.name],
                     fit_median_rel=med, fit_p90_rel=p90, fit_points=n, source=f"{donor.system} {donor.framework}")


@lru_cache(maxsize=32)
def streaming_fit(system: str, framework: str) -> tuple[float, float, float, float, int]:
    """(floor s, bytes/s, median and p90 |relative residual|, points): the floor is the GEMM table's fastest kernel
    (the least a launched kernel takes on this GPU); the bandwidth is fitted (relative least squares) to the decode
    attention table's streaming part (bf16 KV, no sliding window, at least 64 MiB read), a kernel that streams
    memory as the elementwise kernels do."""
    # (all the columns the grids will take: each table is read in one pass)
    g = read_columns(find_table(system, "gemm", framework, "gemm_perf.parquet").path, GEMM_COLUMNS)
    floor = float(np.min(g["latency"])) * 1e-3
    ref = find_table(system, "attention", framework, "generation_attention_perf.parquet")
    c = read_columns(ref.path, ATTENTION_COLUMNS)
    nbytes = (c["batch_size"] * (c["step"] + 1.0) * 2 * c["num_key_value_heads"] * c["head_dim"] * 2).astype(float)
    sel = (c["kv_cache_dtype"] == "bfloat16") & (c["window_size"] == 0) & (nbytes >= 1 << 26)
    y, x = c["latency"][sel] * 1e-3 - floor, nbytes[sel]
    per_byte = float(np.sum(x / y) / np.sum((x / y) ** 2))        # min sum ((x * p - y) / y)^2
    rel = np.abs((floor + per_byte * x) / (y + floor) - 1.0)
    return floor, 1.0 / per_byte, float(np.median(rel)), float(np.quantile(rel, 0.9)), int(len(y))


def _launch_s(ops) -> float:
    """Eager minus graph all-reduce at the smallest message over 2 GPUs (the framework's table, else vLLM's)."""
    for fw in (ops.framework, "vllm", "sglang"):
        try:
            eager, graph = ops.all_reduce_pair(fw, 2)
        except MissingCostData:
            continue
        if eager is not None:
            size = min(eager.axes[0][0], graph.axes[0][0])
            return max(float(eager(size)[()] - graph(size)[()]), 0.0)
    return DEFAULT_LAUNCH_S

