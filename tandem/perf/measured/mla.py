"""Measured kernels of multi-head latent attention (DeepSeek-V3), as interpolating grids (seconds).

Each framework's tables (aiconfigurator-core, `mla/<framework>/<version>/` and `mla_bmm/...`) time:
- SGLang and TRT-LLM: `context_mla_perf` — the expanded prefill attention kernel alone, by (batch, isl) at the
  local head count; `generation_mla_perf` — the absorbed decode kernel alone (queries against the cached latent and
  rotary key), by (batch, step) where a query at `step` attends to step + 1 cached positions;
- vLLM has no kernel tables, only `mla_{context,generation}_module_perf`: the whole attention block of one GPU —
  the fused down-projection, q_b (and kv_b in prefill, the absorbed BMMs in decode), the attention kernel and
  o_proj — by (batch, isl) and (batch, kv length); its kernel is read as the module minus those projections as the
  GEMM and BMM tables price them (never below the GEMM table's fastest bf16 kernel), so a step that prices its
  projections from the GEMM table does not count them twice;
- every framework: `mla_bmm_perf` — decode's two absorbed per-head BMMs (`mla_gen_pre`: the no-position query into
  the latent, `mla_gen_post`: the latent output into v), by token count.
Where a framework measured several kernels for one shape the fastest is taken, as for the other families.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.perf.measured.grid import LogGrid
from tandem.perf.measured.memo import memoised
from tandem.perf.measured.source import MissingCostData
from tandem.perf.models import ModelSpec

_MS = 1e-3
_KERNEL_COLS = ("kv_cache_dtype", "num_heads", "batch_size", "isl", "step", "latency")
_MODULE_COLS = ("kv_cache_dtype", "gemm_type", "num_heads", "batch_size", "isl", "step", "latency")


@dataclass(frozen=True)
class MLAShape:
    """An MLA layer on one GPU of a tensor-parallel worker: its local heads, the model's widths, its weight dtype."""

    heads: int
    hidden: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    gemm_dtype: str             # the projections' GEMM table dtype: bfloat16, fp8 or fp8_block

    @classmethod
    def of(cls, model: ModelSpec, tp: int) -> "MLAShape":
        """The shape of `model`'s MLA on one of tp GPUs (heads sharded, latents whole)."""
        a = model.mla
        if a is None:
            raise ValueError(f"{model.name} has no multi-head latent attention")
        wdt = model.weight_dtype if model.weight_dtype.startswith("fp8") else "bfloat16"
        return cls(model.heads // tp, model.hidden, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim,
                   a.qk_rope_head_dim, a.v_head_dim, wdt)

    @property
    def down_width(self) -> int:
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim

    def projections(self, gemm, m):
        """Seconds of the projections every token runs (fused down-projection, q_b, o_proj) on m tokens."""
        h, n = self.hidden, self.heads
        return (gemm(m, self.down_width, h) + gemm(m, n * (self.qk_nope_head_dim + self.qk_rope_head_dim),
                                                   self.q_lora_rank) + gemm(m, h, n * self.v_head_dim))

    def kv_up(self, gemm, m):
        """Seconds of prefill's kv_b up-projection of m cached latents into per-head keys and values."""
        return gemm(m, self.heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)


def _heads_rows(heads: np.ndarray, want: int) -> tuple[int, float]:
    """The measured local head count to read for `want` heads, and the factor its latency is scaled by (the head
    ratio, at constant utilisation, when `want` itself was not measured)."""
    measured = np.unique(heads)
    if not len(measured):
        raise ValueError("no rows")
    if want in measured:
        return want, 1.0
    best = int(measured[np.argmin(np.abs(np.log(measured / want)))])
    return best, want / best


def _kernel_grid(t, phase: str, shape: MLAShape, kv_dtype: str) -> LogGrid | None:
    """The framework's MLA kernel table for `phase`, None when it has none (vLLM)."""
    try:
        _, c = t.table("mla", f"{phase}_mla_perf.parquet", _KERNEL_COLS)
    except MissingCostData:
        return None
    sel = c["kv_cache_dtype"] == kv_dtype
    if not sel.any():
        raise MissingCostData(f"no {kv_dtype}-KV {phase} MLA measurements for {t.system} under {t.framework}")
    heads, factor = _heads_rows(c["num_heads"][sel], shape.heads)
    pick = np.flatnonzero(sel)[c["num_heads"][sel] == heads]
    lat = c["latency"][pick] * _MS * factor
    if phase == "context":
        return LogGrid.from_points([c["batch_size"][pick], c["isl"][pick]], lat, (1.0, 2.0))
    return LogGrid.from_points([c["batch_size"][pick], c["step"][pick] + 1.0], lat, (1.0, 1.0))


def _module_kernel_grid(t, phase: str, shape: MLAShape, kv_dtype: str) -> LogGrid:
    """vLLM: the module table's attention block minus its projections as the GEMM (and BMM) tables price them."""
    _, c = t.table("mla", f"mla_{phase}_module_perf.parquet", _MODULE_COLS)
    gemm_type = "bfloat16" if shape.gemm_dtype == "bfloat16" else "fp8_block"
    sel = (c["kv_cache_dtype"] == kv_dtype) & (c["gemm_type"] == gemm_type)
    if not sel.any():
        raise MissingCostData(f"no {kv_dtype}-KV {gemm_type} {phase} MLA module measurements for {t.system} under "
                              f"{t.framework}")
    heads, factor = _heads_rows(c["num_heads"][sel], shape.heads)
    pick = np.flatnonzero(sel)[c["num_heads"][sel] == heads]
    b = c["batch_size"][pick].astype(float)
    length = (c["isl"] if phase == "context" else c["step"])[pick].astype(float)
    module = LogGrid.from_points([b, length], c["latency"][pick] * _MS * factor,
                                 (1.0, 2.0) if phase == "context" else (1.0, 1.0))
    gemm = t.gemm(shape.gemm_dtype)
    pts = np.meshgrid(*module.axes, indexing="ij")
    if phase == "context":
        m = pts[0] * pts[1]
        proj = shape.projections(gemm, m) + shape.kv_up(gemm, m)
    else:
        proj = shape.projections(gemm, pts[0]) + mla_bmm_grid(t, shape, shape.gemm_dtype)(pts[0])
    floor = float(np.exp(t.gemm("bfloat16").log_values.min()))     # the fastest kernel the GEMM table holds
    kernel = np.maximum(np.exp(module.log_values) - proj, floor)
    return LogGrid.from_points([pts[0].ravel(), pts[1].ravel()], kernel.ravel(), module.exponents)


@memoised
def context_mla_grid(t, shape: MLAShape, kv_dtype: str) -> LogGrid:
    """Expanded prefill attention kernel over (batch, isl)."""
    return _kernel_grid(t, "context", shape, kv_dtype) or _module_kernel_grid(t, "context", shape, kv_dtype)


@memoised
def generation_mla_grid(t, shape: MLAShape, kv_dtype: str) -> LogGrid:
    """Absorbed decode attention kernel over (batch, kv_len)."""
    return _kernel_grid(t, "generation", shape, kv_dtype) or _module_kernel_grid(t, "generation", shape, kv_dtype)


@memoised
def mla_bmm_grid(t, shape: MLAShape, dtype: str) -> LogGrid:
    """Decode's pre and post absorbed BMMs together over (tokens,): fp8 where the weights are fp8 and the table has
    fp8 rows, else bf16."""
    _, c = t.table("mla_bmm", "mla_bmm_perf.parquet", ("op_name", "bmm_dtype", "num_tokens", "num_heads", "latency"))
    want = "fp8" if dtype.startswith("fp8") and (c["bmm_dtype"] == "fp8").any() else "bfloat16"
    grids = []
    for op in ("mla_gen_pre", "mla_gen_post"):
        sel = (c["op_name"] == op) & (c["bmm_dtype"] == want)
        if not sel.any():
            raise MissingCostData(f"no {want} {op} measurements for {t.system} under {t.framework}")
        heads, factor = _heads_rows(c["num_heads"][sel], shape.heads)
        pick = np.flatnonzero(sel)[c["num_heads"][sel] == heads]
        grids.append(LogGrid.from_points([c["num_tokens"][pick]], c["latency"][pick] * _MS * factor, (1.0,)))
    tokens = np.union1d(grids[0].axes[0], grids[1].axes[0])
    return LogGrid.from_points([tokens], grids[0](tokens) + grids[1](tokens), (1.0,))
