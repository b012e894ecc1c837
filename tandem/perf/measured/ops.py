"""Measured operator latencies of one GPU under one framework, as interpolating grids (seconds).

Each family is read from the newest version of the framework's table in `aiconfigurator-core`:
- GEMM by (m, n, k) per weight dtype (bf16, fp8 per-tensor, fp8 block-scaled);
- context (prefill) attention by (batch, isl) and generation (decode) attention by (batch, KV length), per
  (query heads, KV heads, head dim) on one GPU and KV-cache dtype;
- all-reduce by message size per GPU count: the faster of NCCL and the framework's custom all-reduce (captured in a
  CUDA graph or eager), NCCL all-gather;
- fp8 activation quantisation by (m, k);
- multi-head latent attention's kernels (`mla.py`), MoE layers by token count at their expert sharding.
Where a framework measured several kernels for one shape, the fastest is taken: each framework picks among them by
shape. Latencies in the tables are milliseconds; everything returned here is seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from tandem.perf.measured.grid import LogGrid
from tandem.perf.measured.memo import clear_memos, memoised
from tandem.perf.measured.mla import MLAShape, context_mla_grid, generation_mla_grid, mla_bmm_grid
from tandem.perf.measured.source import (MissingCostData, TableRef, clear_read_cache, find_table, find_tables,
                                         read_columns)

GEMM_DTYPES = ("bfloat16", "fp8", "fp8_block")
KV_DTYPES = ("bfloat16", "fp8")
_MS = 1e-3


@dataclass(frozen=True)
class HeadShape:
    """Attention heads on one GPU."""

    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts layer as the MoE table keys it: routed experts only, sharded moe_tp ways."""

    hidden: int
    inter: int
    topk: int
    experts: int
    moe_tp: int = 1
    moe_ep: int = 1


@dataclass(eq=False)
class OpTables:
    """Lazily built grids of one (system, framework); `sources` lists the tables read (for reports)."""

    system: str
    framework: str
    sources: dict[str, str] = field(default_factory=dict)

    def table(self, op: str, filename: str, columns: tuple[str, ...]) -> tuple[TableRef, dict[str, np.ndarray]]:
        """The newest version of one of this framework's tables (recorded in `sources`), as columns."""
        ref = find_table(self.system, op, self.framework, filename)
        self.sources[filename] = ref.label
        return ref, read_columns(ref.path, columns)

    # --- GEMM --------------------------------------------------------------------------------------------------
    def gemm(self, dtype: str) -> LogGrid:
        """Latency of one (m x k) @ (k x n) GEMM with weights of `dtype`, over (m, n, k)."""
        return _gemm_grid(self, dtype)

    # --- attention ---------------------------------------------------------------------------------------------
    def context_attention(self, hs: HeadShape, kv_dtype: str) -> LogGrid:
        """Causal prefill attention of `batch` sequences of `isl` tokens each, over (batch, isl)."""
        return _attention_grid(self, "context", hs, kv_dtype)

    def generation_attention(self, hs: HeadShape, kv_dtype: str) -> LogGrid:
        """One decode query per sequence for `batch` sequences over `kv_len` cached tokens, over (batch, kv_len)."""
        return _attention_grid(self, "generation", hs, kv_dtype)

    # --- multi-head latent attention -----------------------------------------------------------------------------
    def context_mla(self, shape: MLAShape, kv_dtype: str) -> LogGrid:
        """MLA's expanded prefill attention kernel of `batch` sequences of `isl` tokens each, over (batch, isl)."""
        return context_mla_grid(self, shape, kv_dtype)

    def generation_mla(self, shape: MLAShape, kv_dtype: str) -> LogGrid:
        """MLA's absorbed decode attention kernel, one query per sequence over `kv_len` cached latents, over
        (batch, kv_len)."""
        return generation_mla_grid(self, shape, kv_dtype)

    def mla_bmm(self, shape: MLAShape, dtype: str) -> LogGrid:
        """MLA decode's two absorbed per-head BMMs (query into the latent, latent output into v), over (tokens,)."""
        return mla_bmm_grid(self, shape, dtype)

    # --- communication -----------------------------------------------------------------------------------------
    def all_reduce(self, num_gpus: int, graph: bool) -> LogGrid:
        """One all-reduce of `bytes` (bf16) over num_gpus GPUs, over (bytes,)."""
        return _comm_grid(self, "all_reduce", num_gpus, graph)

    def all_gather(self, num_gpus: int) -> LogGrid:
        """One NCCL all-gather of `bytes` in all over num_gpus GPUs, over (bytes,)."""
        return _comm_grid(self, "all_gather", num_gpus, False)

    def all_reduce_pair(self, framework: str, num_gpus: int):
        """(eager, graph) grids of `framework`'s custom all-reduce on this system (for the launch-cost fit)."""
        return custom_allreduce_pair(self.system, framework, num_gpus)

    # --- mixture of experts -------------------------------------------------------------------------------------
    def moe(self, shape: "MoEShape", dtype: str) -> LogGrid:
        """The routed experts of one MoE layer (grouped GEMMs, routing and combine) for `num_tokens` tokens."""
        return _moe_grid(self, shape, dtype)

    # --- quantisation ------------------------------------------------------------------------------------------
    def fp8_quant(self) -> LogGrid:
        """Dynamic fp8 quantisation of an (m x k) activation, over (m, k)."""
        return _quant_grid(self)


@lru_cache(maxsize=32)
def op_tables(system: str, framework: str) -> OpTables:
    """The (cached) tables of a system and framework."""
    return OpTables(system, framework)


def clear_caches() -> None:
    """Forget every table and grid read in this process (after the package's data changed on disk)."""
    clear_memos()
    op_tables.cache_clear()
    clear_read_cache()


# every column any reader takes from these tables (one read per table: streaming_fit reads them first)
GEMM_COLUMNS = ("gemm_dtype", "m", "n", "k", "latency")
ATTENTION_COLUMNS = ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype", "step",
                     "window_size", "latency")


@memoised
def _gemm_grid(t: OpTables, dtype: str) -> LogGrid:
    if dtype not in GEMM_DTYPES:
        raise ValueError(f"GEMM dtype must be one of {GEMM_DTYPES}, got {dtype!r}")
    _, c = t.table("gemm", "gemm_perf.parquet", GEMM_COLUMNS)
    sel = c["gemm_dtype"] == dtype
    if not sel.any():
        raise MissingCostData(f"no {dtype} GEMM measurements for {t.system} under {t.framework}")
    return LogGrid.from_points([c["m"][sel], c["n"][sel], c["k"][sel]], c["latency"][sel] * _MS, (1.0, 1.0, 1.0))


@memoised
def _attention_grid(t: OpTables, phase: str, hs: HeadShape, kv_dtype: str) -> LogGrid:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV-cache dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    c, rows, (h, kvh, d), shapes = _attention_rows(t, phase, kv_dtype)
    donor, factor = _nearest_heads(hs, shapes, phase)
    pick = rows[(h == donor.heads) & (kvh == donor.kv_heads) & (d == donor.head_dim)]
    lat = c["latency"][pick] * _MS * factor
    if phase == "context":
        # (batch, isl): compute-bound past the table, attention work grows with isl^2
        return LogGrid.from_points([c["batch_size"][pick], c["isl"][pick]], lat, (1.0, 2.0))
    # the decode query at `step` attends to step + 1 cached tokens (its own included)
    return LogGrid.from_points([c["batch_size"][pick], c["step"][pick] + 1.0], lat, (1.0, 1.0))


@memoised
def _attention_rows(t: OpTables, phase: str, kv_dtype: str):
    """The attention table's rows without a sliding window at a KV-cache dtype, their (heads, KV heads, head dim)
    columns and the set of those shapes (shared by every head shape looked up: one per tp degree)."""
    c = t.table("attention", f"{phase}_attention_perf.parquet", ATTENTION_COLUMNS)[1]
    sel = (c["window_size"] == 0) & (c["kv_cache_dtype"] == kv_dtype)
    if not sel.any():
        raise MissingCostData(f"no {kv_dtype}-KV {phase} attention measurements for {t.system} under {t.framework}")
    rows = np.flatnonzero(sel)
    heads = (c["num_heads"][rows], c["num_key_value_heads"][rows], c["head_dim"][rows])
    h, kvh, d = (x.astype(np.int64) for x in heads)
    if 0 <= min(h.min(), kvh.min(), d.min()) and max(h.max(), kvh.max(), d.max()) < 1 << 20:
        key = (h << 40) | (kvh << 20) | d                 # one integer per shape, distinct for distinct shapes
        first = np.unique(key, return_index=True)[1]
    else:
        first = np.unique(np.stack((h, kvh, d), axis=1), axis=0, return_index=True)[1]
    # the distinct shapes inserted in the order the rows first hold them: the very set (iteration order included)
    # that inserting every row's shape builds
    at = np.sort(first)
    shapes = {(a, b, e) for a, b, e in zip(h[at].tolist(), kvh[at].tolist(), d[at].tolist())}
    return c, rows, heads, shapes


def _nearest_heads(hs: HeadShape, shapes: set[tuple[int, int, int]], phase: str) -> tuple[HeadShape, float]:
    """The measured head shape to read for `hs`, and the factor its latency is scaled by: the shape itself (1.0),
    else the measured one of the same head dim and GQA ratio closest in heads, scaled by the work ratio (query
    heads for prefill, which is compute-bound; KV heads for decode, which reads the cache)."""
    if (hs.heads, hs.kv_heads, hs.head_dim) in shapes:
        return hs, 1.0
    ratio = hs.heads / hs.kv_heads
    same = [s for s in shapes if s[2] == hs.head_dim and s[0] / s[1] == ratio] or \
           [s for s in shapes if s[2] == hs.head_dim]
    if not same:
        raise MissingCostData(f"no attention measurements with head dim {hs.head_dim}")
    best = min(same, key=lambda s: (abs(np.log(s[0] / hs.heads)), abs(np.log(s[1] / hs.kv_heads))))
    donor = HeadShape(*best)
    factor = hs.heads / donor.heads if phase == "context" else hs.kv_heads / donor.kv_heads
    return donor, factor


@memoised
def _comm_grid(t: OpTables, op: str, num_gpus: int, graph: bool) -> LogGrid:
    """NCCL's measured collective; for an all-reduce, the faster of NCCL and the framework's custom all-reduce at
    each message size (frameworks use their custom kernel for the small messages it wins, NCCL past its buffer)."""
    ref = find_table(t.system, "comm", "nccl", "nccl_perf.parquet")
    t.sources[f"nccl_{op}"] = ref.label
    c = read_columns(ref.path, ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency"))
    sel = (c["op_name"] == op) & (c["num_gpus"] == num_gpus) & (c["nccl_dtype"] == "half")
    if not sel.any():
        raise MissingCostData(f"no NCCL {op} measurements over {num_gpus} GPUs for {t.system}")
    nccl = LogGrid.from_points([c["message_size"][sel]], c["latency"][sel] * _MS, (1.0,))
    if op != "all_reduce":
        return nccl
    try:
        eager, captured = custom_allreduce_pair(t.system, t.framework, num_gpus)
        t.sources["custom_allreduce_perf.parquet"] = find_table(t.system, "comm", t.framework,
                                                                "custom_allreduce_perf.parquet").label
    except MissingCostData:
        return nccl
    custom = captured if graph else eager
    if custom is None:                               # one kernel for both (TRT-LLM's table)
        custom = _single_custom(t.system, t.framework, num_gpus)
    if custom is None:
        return nccl
    sizes = np.union1d(nccl.axes[0], custom.axes[0])
    return LogGrid.from_points([sizes], np.minimum(nccl(sizes), custom(sizes)), (1.0,))


def _single_custom(system: str, framework: str, num_gpus: int) -> LogGrid | None:
    """A framework's custom all-reduce table without an eager/graph split, None when it has no rows for num_gpus."""
    ref = find_table(system, "comm", framework, "custom_allreduce_perf.parquet")
    c = read_columns(ref.path, ("num_gpus", "message_size", "latency"))
    sel = c["num_gpus"] == num_gpus
    return LogGrid.from_points([c["message_size"][sel]], c["latency"][sel] * _MS, (1.0,)) if sel.any() else None


@memoised
def _quant_grid(t: OpTables) -> LogGrid:
    _, c = t.table("quantize", "computescale_perf.parquet", ("m", "k", "quant_dtype", "latency"))
    sel = c["quant_dtype"] == "fp8"
    return LogGrid.from_points([c["m"][sel], c["k"][sel]], c["latency"][sel] * _MS, (1.0, 1.0))


_MOE_COLS = ("moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
             "moe_ep_size", "distribution", "latency")


@memoised
def _moe_grid(t: OpTables, shape: MoEShape, dtype: str) -> LogGrid:
    """The MoE table at `shape` under uniform routing ('balanced'; else the mildest skew measured), over num_tokens,
    from the newest version that measured the shape (a framework's newest table may hold only one model's shapes).
    A shape no version measured is read from the newest table's measured shape of the same expert parallelism and
    top-k nearest in its per-rank work per token (topk x hidden x inter / (moe_tp x moe_ep)) and scaled by the work
    ratio (constant utilisation)."""
    want = np.array([shape.hidden, shape.inter, shape.topk, shape.experts, shape.moe_tp, shape.moe_ep])
    tables = []
    for ref in find_tables(t.system, "moe", t.framework, "moe_perf.parquet"):
        c = read_columns(ref.path, _MOE_COLS)
        sel = c["moe_dtype"] == dtype
        if not sel.any():
            continue
        keys = np.stack([c[k][sel] for k in ("hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
                                             "moe_ep_size")], axis=1)
        exact = (keys == want).all(axis=1)
        tables.append((ref, c, sel, keys, exact))
        if exact.any():
            break
    if not tables:
        raise MissingCostData(f"no {dtype} MoE measurements for {t.system} under {t.framework}")
    ref, c, sel, keys, exact = tables[-1] if tables[-1][4].any() else tables[0]
    t.sources["moe_perf.parquet"] = ref.label
    factor = 1.0
    if not exact.any():
        def work(k):
            return k[:, 2].astype(float) * k[:, 0] * k[:, 1] / (k[:, 4] * k[:, 5])
        w = work(want[None, :])[0]
        cand = (keys[:, 5] == shape.moe_ep) & (keys[:, 2] == shape.topk)
        if not cand.any():
            cand = keys[:, 5] == shape.moe_ep
        if not cand.any():
            raise MissingCostData(f"no MoE measurements at expert parallelism {shape.moe_ep} for {t.system}")
        idx = np.flatnonzero(cand)
        best = idx[np.argmin(np.abs(np.log(work(keys[idx]) / w)))]
        exact = (keys == keys[best]).all(axis=1)
        factor = w / work(keys[best:best + 1])[0]
    dist = c["distribution"][sel][exact]
    pick = next((d for d in ("balanced", "power_law_1.01", "power_law_1.2") if (dist == d).any()), None)
    rows = np.flatnonzero(sel)[exact][dist == pick]
    return LogGrid.from_points([c["num_tokens"][rows]], c["latency"][rows] * _MS * factor, (1.0,))


def custom_allreduce_pair(system: str, framework: str, num_gpus: int):
    """(eager, graph) all-reduce grids of a framework's custom all-reduce table, (None, None) without the split."""
    ref = find_table(system, "comm", framework, "custom_allreduce_perf.parquet")
    c = read_columns(ref.path, ("kernel_source", "num_gpus", "message_size", "latency"))
    src = c["kernel_source"].astype(str)
    eager = np.char.find(src, "eager") >= 0
    graph = np.char.find(src, "graph") >= 0
    n = c["num_gpus"] == num_gpus
    if not (eager & n).any() or not (graph & n).any():
        return None, None
    mk = [LogGrid.from_points([c["message_size"][s & n]], c["latency"][s & n] * 1e-3, (1.0,)) for s in (eager, graph)]
    return mk[0], mk[1]
