"""Operator costs of a GPU without tables of its own, derived from the nearest measured GPU of its architecture.

Each measured latency is turned into a utilisation against the donor's datasheet roofline for that operator and
shape (FLOPs at the tensor-core peak of its dtype, bytes at the memory bandwidth, a collective's bytes at the link
rate after one hop's latency), and the same utilisation is applied to the target's own peaks:

    latency_target(shape) = latency_donor(shape) x roof_target(shape) / roof_donor(shape)

so a compute-bound GEMM scales with the FLOP peaks, a decode attention with the memory bandwidths, and a shape on
the ridge with whichever bounds it on each GPU. Reports label such costs "derived".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from tandem.perf.hardware import GPU, GPUS, get_gpu
from tandem.perf.measured.grid import LogGrid
from tandem.perf.measured.mla import MLAShape
from tandem.perf.measured.ops import HeadShape, OpTables, op_tables
from tandem.perf.measured.source import SYSTEMS, CostLabel, MissingCostData, data_root, system_of


def donor_of(gpu: GPU) -> GPU:
    """The measured GPU of the same architecture nearest to `gpu` in FLOP peak and memory bandwidth."""
    cands = [GPUS[n] for n in SYSTEMS if n in GPUS and GPUS[n].arch == gpu.arch and n != gpu.name]
    if not gpu.arch or not cands:
        raise MissingCostData(f"no measured GPU of {gpu.name}'s architecture ({gpu.arch or 'unknown'}) to derive "
                              f"its costs from")
    return min(cands, key=lambda g: (abs(math.log(g.bf16_tflops / gpu.bf16_tflops))
                                     + abs(math.log(g.hbm_bw_gbs / gpu.hbm_bw_gbs)), g.name))


def derived_ops(gpu: GPU | str, framework: str, donor: GPU | str | None = None):
    """(operator tables, CostLabel) for a GPU: its own tables when measured, else derived from `donor` (by default
    the nearest measured GPU of its architecture)."""
    gpu = get_gpu(gpu)
    data_root()                                       # MissingCostData naming the install when absent
    system = system_of(gpu.name)
    if donor is None and system is not None:
        ops = op_tables(system, framework)
        return ops, CostLabel("measured", framework, system)
    d = get_gpu(donor) if donor is not None else donor_of(gpu)
    ops = derived_tables(d.name, gpu.name, framework)
    return ops, CostLabel("derived", framework, gpu.name, donor=system_of(d.name) or d.name)


@lru_cache(maxsize=32)
def derived_tables(donor: str, target: str, framework: str) -> "DerivedTables":
    """The (cached) derived tables of `target` from `donor`'s measurements."""
    d = get_gpu(donor)
    system = system_of(d.name)
    if system is None:
        raise MissingCostData(f"{d.name} has no measured tables to derive from")
    return DerivedTables(op_tables(system, framework), d, get_gpu(target))


@dataclass(eq=False)
class DerivedTables:
    """OpTables' interface for a target GPU, each grid the donor's scaled by the ratio of the two rooflines."""

    donor_ops: OpTables
    donor: GPU
    target: GPU
    memo: dict = field(default_factory=dict)

    @property
    def system(self) -> str:
        return self.target.name

    @property
    def framework(self) -> str:
        return self.donor_ops.framework

    @property
    def sources(self) -> dict[str, str]:
        return self.donor_ops.sources

    def _scaled(self, key, grid: LogGrid, roof) -> LogGrid:
        if key not in self.memo:
            pts = np.meshgrid(*grid.axes, indexing="ij")
            ratio = roof(self.target, *pts) / roof(self.donor, *pts)
            self.memo[key] = LogGrid(grid.axes, grid.log_values + np.log(ratio), grid.exponents, grid.measured)
        return self.memo[key]

    def gemm(self, dtype: str) -> LogGrid:
        w = 1 if dtype.startswith("fp8") else 2
        kind = "fp8" if w == 1 else "bf16"

        def roof(g: GPU, m, n, k):
            return np.maximum(2 * m * n * k / g.peak_flops(kind), (m * k * w + k * n * w + m * n * 2) / _bw(g))
        return self._scaled(("gemm", dtype), self.donor_ops.gemm(dtype), roof)

    def context_attention(self, hs: HeadShape, kv_dtype: str) -> LogGrid:
        def roof(g: GPU, b, isl):
            flops = 2 * b * hs.heads * hs.head_dim * isl * isl
            nbytes = b * isl * hs.head_dim * (2 * hs.heads + 2 * hs.kv_heads) * 2
            return np.maximum(flops / g.peak_flops("bf16"), nbytes / _bw(g))
        return self._scaled(("ctx", hs, kv_dtype), self.donor_ops.context_attention(hs, kv_dtype), roof)

    def generation_attention(self, hs: HeadShape, kv_dtype: str) -> LogGrid:
        kvb = 1 if kv_dtype == "fp8" else 2

        def roof(g: GPU, b, kv):
            flops = 4 * b * hs.heads * hs.head_dim * kv
            nbytes = b * kv * 2 * hs.kv_heads * hs.head_dim * kvb
            return np.maximum(flops / g.peak_flops("bf16"), nbytes / _bw(g))
        return self._scaled(("gen", hs, kv_dtype), self.donor_ops.generation_attention(hs, kv_dtype), roof)

    def moe(self, shape, dtype: str) -> LogGrid:
        w = 1 if dtype.startswith("fp8") else 2
        kind = "fp8" if w == 1 else "bf16"

        def roof(g: GPU, t):
            # the experts t tokens touch under uniform routing (experts/moe_ep of them on this rank), streamed once;
            # 3 GEMMs of topk x hidden x inter, sharded moe_tp x moe_ep ways
            touched = shape.experts / shape.moe_ep * (1 - (1 - shape.topk / shape.experts) ** t)
            nbytes = touched * 3 * shape.hidden * shape.inter / shape.moe_tp * w
            flops = 6 * t * shape.topk * shape.hidden * shape.inter / (shape.moe_tp * shape.moe_ep)
            return np.maximum(flops / g.peak_flops(kind), nbytes / _bw(g))
        return self._scaled(("moe", shape, dtype), self.donor_ops.moe(shape, dtype), roof)

    def context_mla(self, shape: MLAShape, kv_dtype: str) -> LogGrid:
        dqk, dv = shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.v_head_dim

        def roof(g: GPU, b, isl):
            flops = b * shape.heads * isl * isl * (dqk + dv)          # causal: half of 2 x (QK^T + PV)
            nbytes = b * isl * shape.heads * (2 * dqk + 2 * dv) * 2   # q, k, v, output in bf16
            return np.maximum(flops / g.peak_flops("bf16"), nbytes / _bw(g))
        return self._scaled(("ctx_mla", shape, kv_dtype), self.donor_ops.context_mla(shape, kv_dtype), roof)

    def generation_mla(self, shape: MLAShape, kv_dtype: str) -> LogGrid:
        kvb = 1 if kv_dtype == "fp8" else 2
        latent = shape.kv_lora_rank + shape.qk_rope_head_dim

        def roof(g: GPU, b, kv):
            flops = 2 * b * shape.heads * kv * (latent + shape.kv_lora_rank)
            nbytes = b * kv * latent * kvb
            return np.maximum(flops / g.peak_flops("bf16"), nbytes / _bw(g))
        return self._scaled(("gen_mla", shape, kv_dtype), self.donor_ops.generation_mla(shape, kv_dtype), roof)

    def mla_bmm(self, shape: MLAShape, dtype: str) -> LogGrid:
        w = 1 if dtype.startswith("fp8") else 2
        per_head = shape.kv_lora_rank * (shape.qk_nope_head_dim + shape.v_head_dim)

        def roof(g: GPU, t):
            flops = 2 * t * shape.heads * per_head
            nbytes = shape.heads * per_head * w + t * shape.heads * (shape.qk_nope_head_dim + shape.v_head_dim
                                                                    + 2 * shape.kv_lora_rank) * 2
            return np.maximum(flops / g.peak_flops("fp8" if w == 1 else "bf16"), nbytes / _bw(g))
        return self._scaled(("mla_bmm", shape, dtype), self.donor_ops.mla_bmm(shape, dtype), roof)

    def all_reduce(self, num_gpus: int, graph: bool) -> LogGrid:
        return self._scaled(("ar", num_gpus, graph), self.donor_ops.all_reduce(num_gpus, graph), _link_roof)

    def all_gather(self, num_gpus: int) -> LogGrid:
        return self._scaled(("ag", num_gpus), self.donor_ops.all_gather(num_gpus), _link_roof)

    def fp8_quant(self) -> LogGrid:
        return self._scaled(("quant",), self.donor_ops.fp8_quant(), lambda g, m, k: 3 * m * k / _bw(g))

    def all_reduce_pair(self, framework: str, num_gpus: int):
        return self.donor_ops.all_reduce_pair(framework, num_gpus)    # host launch cost: the donor's host


def _bw(g: GPU) -> float:
    return g.hbm_bw_gbs * 1e9


def _link_roof(g: GPU, nbytes):
    return g.nvlink_latency_s + nbytes / (g.nvlink_gbs * 1e9)
