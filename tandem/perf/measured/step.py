"""The measured step-time model: a step of tandem's BatchShape priced operator by operator from measured tables.

Per layer, at the step's T query tokens on one GPU of a tp worker: the QKV, O, gate/up and down GEMMs (fp8 tables
under `--quantization fp8`, with the attention output's fp8 quantisation; the other GEMM inputs are written in fp8 by
the fused norm and activation kernels); the small elementwise kernels (two fused add+RMSNorm, rotary with the KV
write, SiLU-and-multiply) at a floor and bandwidth read from the tables (`overhead.py`); two all-reduces of the
hidden states at tp > 1; causal prefill attention per chunk and decode attention per sequence at their context
lengths (a diffusion window as a short non-causal chunk over its cached keys). Once per step: the LM head on the
sampled rows and the gather of vocab-sharded logits. A step that does not replay a CUDA graph takes at least its
kernel launches; a step takes at least the framework's per-step host work, which vLLM (async scheduling), SGLang
and TRT-LLM (overlap schedulers) run beside the previous step's GPU work.

Multi-head latent attention (DeepSeek-V3, `mla.py`): per token the fused down-projection (replicated on every
rank), q_b and o_proj from the GEMM table; prefill's kv_b up-projection of its new and history latents from the GEMM
table; decode's absorbed BMMs from the MLA BMM table; the attention kernels from the MLA tables. MoE layers read the
expert table at their expert sharding (tp = moe_tp x ep; with tensor-parallel attention every rank holds every
token, so the experts' outputs are summed by the same all-reduce as under TP); a model's first dense layers
(DeepSeek-V3: 3) price their own MLP.

Everything that depends on T alone is tabulated per token count at construction, so `step_time_args` is a few
array reads (the simulator's hot path); attention is read from small per-worker grids.
"""
from __future__ import annotations

import math
from functools import lru_cache
from math import log2 as _log2

import numpy as np

from tandem.perf.hardware import GPU, get_gpu
from tandem.perf.measured.derive import derived_ops
from tandem.perf.measured.frameworks import FrameworkDefaults, framework_defaults
from tandem.perf.measured.grid import Points
from tandem.perf.measured.mla import MLAShape
from tandem.perf.measured.ops import HeadShape, MoEShape, OpTables
from tandem.perf.measured.overhead import Overheads, overheads
from tandem.perf.models import ModelSpec, get_model
from tandem.perf.roofline import Roofline, check_ep, check_tp, kv_heads_per_gpu
from tandem.perf.step_timer import StepTimer

T_MAX = 32768             # token counts tabulated exactly (the GEMM tables' largest m); past it at constant utilisation
B_MAX = 2048              # decode sequences tabulated exactly
BINS_PER_OCTAVE = 16      # context lengths are read on a log grid this fine (4.4% apart) and interpolated between
CTX_OCTAVES = 18          # up to 2^18 = 262,144 tokens of context (past it at constant utilisation)
PREFILL_B_MAX = 256       # prefill chunks in one step tabulated exactly


class MeasuredStep(StepTimer):
    """Seconds of one step of `model` on a `tp`-GPU worker of `gpu` under `framework`, from measured operators
    (experts sharded over `ep` of the tp GPUs, each expert over tp/ep)."""

    __slots__ = ("model", "gpu", "tp", "ep", "label", "fw", "ovh", "roof", "_body_graph", "_body_eager", "_head",
                 "_dec", "_pre", "_launch", "_L", "_graph_tokens", "_graph_decode_only", "_overhead", "_mla",
                 "_kv_up", "_bmm")

    def __init__(self, model: ModelSpec | str, gpu: GPU | str, tp: int = 1, framework: str = "vllm",
                 donor: str | None = None, ep: int = 1) -> None:
        model, gpu = get_model(model), get_gpu(gpu)
        check_tp(model, gpu, tp)
        check_ep(model, tp, ep)
        self.model, self.gpu, self.tp, self.ep = model, gpu, tp, ep
        ops, self.label = derived_ops(gpu, framework, donor)
        self.fw: FrameworkDefaults = framework_defaults(framework)
        self.ovh: Overheads = overheads(ops, self.fw)
        self.roof = Roofline(model, gpu, tp, ep)
        self._L = model.layers
        # plain lists: the hot path reads one entry per step, and a list hands back a Python float as it is
        self._body_graph, self._body_eager, self._head = (a.tolist() for a in token_tables(model, tp, ep, ops, self.ovh))
        kv = "fp8" if model.kv_dtype == "fp8" else "bfloat16"
        self._mla = model.mla is not None
        if self._mla:
            shape = MLAShape.of(model, tp)
            self._dec = AttentionTable(ops.generation_mla(shape, kv), B_MAX)
            self._pre = AttentionTable(ops.context_mla(shape, kv), PREFILL_B_MAX)
            self._kv_up, self._bmm = (a.tolist() for a in _mla_count_tables(model, tp, ops))
        else:
            hs = HeadShape(model.heads // tp, kv_heads_per_gpu(model, tp), model.head_dim)
            self._dec = AttentionTable(ops.generation_attention(hs, kv), B_MAX)
            self._pre = AttentionTable(ops.context_attention(hs, kv), PREFILL_B_MAX)
            self._kv_up = self._bmm = None
        self._launch = self.ovh.launch_s * _kernels_per_layer(model, tp) * model.layers
        self._graph_tokens = self.fw.graph_tokens(tp)
        self._graph_decode_only = self.fw.graph_decode_only
        self._overhead = self.ovh.step_s

    # --- hot path ----------------------------------------------------------------------------------------------
    def step_time(self, shape) -> float:
        """Seconds of one iteration over a BatchShape; a plain decode step (the simulator's commonest) is read here
        with the very operations of `step_time_args`, the rest through it."""
        n = shape.num_decode
        if n > 0 and not shape.prefill_tokens and not shape.decode_kv_shared and not shape.graph and not self._mla \
                and not shape.num_prefill:
            graph = n <= self._graph_tokens
            table = self._body_graph if graph else self._body_eager
            i = int(n + 0.5)
            last = len(table) - 1
            t = table[i] if i <= last else table[last] * n / last
            head = self._head
            t += head[i] if i <= last else head[last] * n / last
            t += (0.0 + _lookup(self._dec, n, shape.decode_ctx_tokens / n)) * self._L
            if not graph and t < self._launch:
                t = self._launch
            return t if t > self._overhead else self._overhead
        return self.step_time_args(shape.prefill_tokens, shape.prefill_attn_pairs, shape.prefill_kv_read_tokens,
                                   shape.num_prefill, shape.num_decode, shape.decode_ctx_tokens, shape.graph,
                                   shape.decode_kv_shared)

    def step_time_args(self, prefill_tokens: float, prefill_attn_pairs: float, prefill_kv_read_tokens: float,
                       num_prefill: float, num_decode: float, decode_ctx_tokens: float, graph: bool = False,
                       decode_kv_shared: float = 0) -> float:
        """`step_time` without building a BatchShape (same fields, same order)."""
        tokens = prefill_tokens + num_decode
        if tokens <= 0:
            return 0.0
        if not graph:
            graph = tokens <= self._graph_tokens and not (self._graph_decode_only and prefill_tokens > 0)
        t = _at(self._body_graph if graph else self._body_eager, tokens)
        t += _at(self._head, num_prefill + num_decode)
        attn = 0.0
        if num_decode > 0:
            if decode_kv_shared > 0:      # diffusion windows: n sequences of rows/n queries over c keys each
                c = decode_ctx_tokens / num_decode
                n = max(1.0, num_decode - decode_kv_shared / c)
                attn += _lookup(self._pre, n, math.sqrt(2.0 * num_decode * c / n))
            else:
                attn += _lookup(self._dec, num_decode, decode_ctx_tokens / num_decode)
        if prefill_tokens > 0:
            n = max(1.0, num_prefill)
            attn += _lookup(self._pre, n, math.sqrt(2.0 * prefill_attn_pairs / n))
        t += attn * self._L
        if self._mla:                     # prefill's kv_b over its new and history latents; decode's absorbed BMMs
            t += _at(self._kv_up, prefill_tokens + prefill_kv_read_tokens) + _at(self._bmm, num_decode)
        if not graph and t < self._launch:
            t = self._launch              # an eager step waits for its kernel launches
        # the host prepares the next step while this one runs (vLLM's async scheduling, SGLang's and TRT-LLM's
        # overlap schedulers): its per-step work shows only when it is longer than the GPU's
        return t if t > self._overhead else self._overhead

    def swap_time(self, tokens: int) -> float:
        """Seconds to copy `tokens` positions of KV to or from host memory (the link, as on the roofline)."""
        return self.roof.swap_time(tokens)

    def prefill_boundary(self, l_hist: int = 0, max_tokens: int = 1 << 20) -> int:
        """LAPS's L_m: the roofline's compute/memory boundary of this model and GPU (docs/cost-models.md)."""
        return self.roof.prefill_boundary(l_hist, max_tokens)

    def __repr__(self) -> str:
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        return f"MeasuredStep({self.model.name}, {self.gpu.name}, tp{self.tp}{ep}, {self.label})"


def _at(table: list[float], x: float) -> float:
    """A per-count table at count x (0 below 1; linear, i.e. constant utilisation, past its end)."""
    i = int(x + 0.5)
    n = len(table) - 1
    if i <= n:
        return table[i]
    return table[n] * x / n


def _lookup(tab: "AttentionTable", b: float, ctx: float) -> float:
    """Attention of b sequences of ctx tokens each from a (batch, log2-context bin) table, interpolated in context."""
    bi = int(b + 0.5)
    scale = 1.0
    nb = tab.b_max
    if bi > nb:
        scale, bi = b / nb, nb
    elif bi < 1:
        bi = 1
    if ctx < 1.0:
        ctx = 1.0
    row = tab.rows[bi]
    if row is None:
        row = tab.fill(bi)
    x = _log2(ctx) * BINS_PER_OCTAVE
    j = int(x)
    last = len(row) - 1
    if j >= last:
        return row[last] * scale * ctx / 2.0 ** (last / BINS_PER_OCTAVE)
    f = x - j
    return (row[j] + (row[j + 1] - row[j]) * f) * scale          # rows are lists of Python floats


class AttentionTable:
    """An attention grid over (batch, context) read at every batch 1..b_max and every context bin; a batch's row is
    computed the first time a step has that batch (most runs see few batch sizes)."""

    __slots__ = ("grid", "b_max", "rows")

    def __init__(self, grid, b_max: int) -> None:
        self.grid, self.b_max = grid, b_max
        self.rows: list[list[float] | None] = [None] * (b_max + 1)

    def fill(self, b: int) -> list[float]:
        row = self.grid(float(b), _CTX).tolist()
        self.rows[b] = row
        return row


# the token counts 0..T_MAX (at least 1: an empty step's entry is zeroed) and the context bins every table is read at
_TOKENS = Points(np.maximum(np.arange(T_MAX + 1, dtype=float), 1.0))
_CTX = Points(2.0 ** (np.arange(CTX_OCTAVES * BINS_PER_OCTAVE + 1) / BINS_PER_OCTAVE))


@lru_cache(maxsize=16)
def scaled_tokens(*factors: float) -> Points:
    """The token counts times `factors`, multiplied in order (m * f0 * f1 ...): message sizes every tp degree's
    collectives are read at, interpolated once per grid axis."""
    v = _TOKENS.values
    for f in factors:
        v = v * f
    return Points(v)


def _kernels_per_layer(model: ModelSpec, tp: int) -> int:
    """Kernels one layer launches in an eager forward: 4 GEMMs, attention, 4 elementwise kernels, 2 all-reduces at
    tp > 1, and the attention output's quantisation under fp8; MLA adds q_b, kv_b (or the two absorbed BMMs) and the
    two latent norms."""
    return 4 + 1 + 4 + (2 if tp > 1 else 0) + (1 if model.weight_dtype != "bf16" else 0) \
        + (4 if model.mla is not None else 0)


@lru_cache(maxsize=256)
def token_tables(model: ModelSpec, tp: int, ep: int, ops: OpTables, ovh: Overheads
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token count T = 0..T_MAX: the layers' T-only cost under a CUDA graph and eager, and the LM head's."""
    mp = _TOKENS                      # every grid read at the token counts shares their log and interpolation
    m = mp.values
    L, h, d = model.layers, model.hidden, model.head_dim
    wdt = model.weight_dtype if model.weight_dtype.startswith("fp8") else "bfloat16"
    gemm = ops.gemm(wdt)
    a = model.dtype_bytes
    if model.mla is not None:
        # fused down-projection (replicated), q_b and o_proj; kv_b and the absorbed BMMs depend on the step's mix
        shape = MLAShape.of(model, tp)
        attn = shape.projections(gemm, mp)
        q = shape.heads * shape.v_head_dim                                  # o_proj's input
        mla = model.mla
        # rotary of the local queries' and the shared key's rope part, the two latent norms, the latent KV write
        attn_elems = ((shape.heads + 1) * mla.qk_rope_head_dim + 2 * (mla.q_lora_rank + mla.kv_lora_rank)
                      + mla.latent_dim * model.kv_elem_bytes / a)
        kernels = 6
    else:
        q, kv = model.heads // tp * d, kv_heads_per_gpu(model, tp) * d
        attn = gemm(mp, q + 2 * kv, h) + gemm(mp, h, q)
        attn_elems = (q + 2 * kv) + kv * 2 * model.kv_elem_bytes / a
        kernels = 4

    def layer_cost(experts: bool, inter: int) -> np.ndarray:
        layer = attn
        if experts:
            routed = model.experts - model.shared_experts
            shape = MoEShape(h, model.intermediate, model.experts_per_token - model.shared_experts, routed,
                             tp // ep, ep)
            layer = layer + ops.moe(shape, wdt)(mp) + gemm(mp, routed, h)        # + router
            inter = model.intermediate * model.shared_experts // tp             # shared experts: a dense MLP
        if inter > 0:
            layer = layer + gemm(mp, 2 * inter, h) + gemm(mp, h, inter)
        if wdt != "bfloat16":
            # the norms and SiLU-and-multiply write the QKV, gate/up and down inputs in fp8 (fused: vLLM's compile
            # passes, SGLang's and TRT-LLM's fused kernels); the attention output is quantised by a kernel of its own
            layer = layer + ops.fp8_quant()(mp, q)
        elementwise_bytes = m * a * (2 * 4 * h + attn_elems + 3 * inter)
        return layer + kernels * ovh.kernel_s + elementwise_bytes / ovh.elementwise_bps

    layer = layer_cost(model.is_moe, model.intermediate * model.experts_per_token // tp)
    graph = layer * model.moe_layers
    if model.dense_layers:                                     # DeepSeek-V3's first layers: a dense MLP
        graph = graph + layer_cost(False, model.dense_intermediate // tp) * model.dense_layers
    eager = graph.copy()
    if tp > 1:
        nbytes = scaled_tokens(h, a)                          # m * h * a
        graph = graph + 2 * L * ops.all_reduce(tp, True)(nbytes)
        eager = eager + 2 * L * ops.all_reduce(tp, False)(nbytes)
    head = ops.gemm("bfloat16")(mp, model.vocab // tp, h)
    if tp > 1:
        head = head + ops.all_gather(tp)(scaled_tokens(model.vocab, 4))   # m * vocab * 4: fp32 logits gathered
    for arr in (graph, eager, head):
        arr[0] = 0.0
    return graph, eager, head


@lru_cache(maxsize=64)
def _mla_count_tables(model: ModelSpec, tp: int, ops: OpTables) -> tuple[np.ndarray, np.ndarray]:
    """Per count 0..T_MAX, all layers: prefill's kv_b up-projection of that many latents (new and history), and
    decode's two absorbed BMMs for that many decode tokens."""
    m = _TOKENS
    shape = MLAShape.of(model, tp)
    kv_up = shape.kv_up(ops.gemm(shape.gemm_dtype), m) * model.layers
    bmm = ops.mla_bmm(shape, shape.gemm_dtype)(m) * model.layers
    kv_up[0] = bmm[0] = 0.0
    return kv_up, bmm
