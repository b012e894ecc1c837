"""Roofline estimate of one iteration of a serving engine, plus KV capacity and KV transfer time.

One iteration runs a mixed batch (prefill chunks and decode sequences) through the model under
tensor parallelism `tp` inside one node. Per GPU:

    compute = (body FLOPs x query tokens + LM-head FLOPs x sampled rows + attention FLOPs x pairs)
              / tp / (peak x mfu)
    memory  = (streamed weights / tp + KV read and written on this GPU + activation traffic)
              / (hbm_bw x mbu)
    comm    = 2 all-reduces per layer of (query tokens x hidden x dtype) bytes + a logits gather
    time    = max(compute, memory[, launches]) + comm + step_overhead

`launches` (layers x the GPU's eager launch time per layer) bounds steps that carry prefill tokens and do not
replay a CUDA graph (`BatchShape.graph`): an eager forward cannot finish before its kernels are launched.
Decode-only steps are taken as captured graphs, as vLLM and SGLang run them.

`max` is the roofline assumption that compute and memory traffic overlap perfectly within a
step; communication is added because tensor-parallel engines (vLLM, SGLang) run the all-reduces
between the GEMMs rather than overlapping them. See docs/cost-models.md.

Multi-head latent attention (DeepSeek-V3): prefill runs expanded (per head at qk_nope+qk_rope and v_head_dim, the
cached latent of the history up-projected by kv_b for every chunk), decode runs absorbed (every head against the
cached latent); the fused down-projection is replicated on every rank, the latent KV cache too.

Expert parallelism `ep` (tp = moe_tp x ep): each rank holds experts/ep experts, each sharded tp/ep ways. Attention
stays tensor-parallel, so every rank sees every token and the experts' outputs are summed by the same all-reduce
as under TP (what vLLM, SGLang and TRT-LLM run without attention data parallelism); no all-to-all is needed.

What is left out (all small next to the terms kept): norms/rotary/softmax FLOPs, flash-attention
re-reads of K/V tiles from L2, embedding-table gathers beyond one row per token, expert load imbalance
(routing is taken as uniform).
"""
from __future__ import annotations

import math

from tandem.perf.batch_shape import BatchShape
from tandem.perf.errors import DoesNotFitError, ParallelismError
from tandem.perf.hardware import GIB, GPU, get_gpu
from tandem.perf.models import ModelSpec, get_model
from tandem.perf.step_timer import StepTimer

# Memory reserved per GPU besides weights and KV: CUDA context, NCCL buffers, CUDA-graph pools and
# the peak activations of a max_num_batched_tokens forward. vLLM's profiling run typically finds
# 1-3 GiB on 70B-class models; 2 GiB is used unless the caller knows better.
ACTIVATION_RESERVE_GIB = 2.0
# Fraction of device memory the engine may use (vLLM's gpu_memory_utilization default).
MEM_UTIL = 0.9


def check_tp(model: ModelSpec, gpu: GPU, tp: int) -> None:
    """Raise ParallelismError if `tp` cannot run `model` inside one node of `gpu`s."""
    if not isinstance(tp, int) or tp < 1:
        raise ParallelismError(f"tensor-parallel degree must be a positive integer, got {tp!r}")
    if tp > gpu.gpus_per_node:
        raise ParallelismError(
            f"tp{tp} exceeds the {gpu.gpus_per_node} GPUs of one {gpu.name} node; "
            f"tensor parallelism is modelled inside a node only")
    if model.heads % tp:
        raise ParallelismError(f"{model.name} has {model.heads} attention heads, not divisible by tp{tp}")
    if model.kv_heads % tp and tp % model.kv_heads:
        raise ParallelismError(f"{model.name} has {model.kv_heads} KV heads; tp{tp} neither divides nor is a multiple of it")


def check_ep(model: ModelSpec, tp: int, ep: int) -> None:
    """Raise ParallelismError unless `ep` can shard `model`'s routed experts inside a tp-GPU worker (tp = moe_tp x
    ep)."""
    if not isinstance(ep, int) or ep < 1:
        raise ParallelismError(f"expert-parallel degree must be a positive integer, got {ep!r}")
    if ep == 1:
        return
    if not model.is_moe:
        raise ParallelismError(f"{model.name} has no experts to shard over ep{ep}")
    if tp % ep:
        raise ParallelismError(f"ep{ep} does not divide tp{tp} (experts are sharded over the worker's own GPUs)")
    routed = model.experts - model.shared_experts
    if routed % ep:
        raise ParallelismError(f"{model.name} has {routed} routed experts, not divisible by ep{ep}")


def supported_tps(model: ModelSpec | str, gpu: GPU | str) -> tuple[int, ...]:
    """Power-of-two tensor-parallel degrees up to one node that `model` can be sharded over."""
    model, gpu = get_model(model), get_gpu(gpu)
    out, tp = [], 1
    while tp <= gpu.gpus_per_node:
        try:
            check_tp(model, gpu, tp)
            out.append(tp)
        except ParallelismError:
            pass
        tp *= 2
    return tuple(out)


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads each GPU stores: sharded when tp <= kv_heads, else replicated (one per GPU)."""
    return max(1, model.kv_heads // tp)


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV bytes of one token on one GPU: the GPU's KV heads, or MLA's whole latent (replicated: TP does not shard
    it)."""
    if model.mla is not None:
        return model.kv_bytes_per_token
    return 2 * model.layers * kv_heads_per_gpu(model, tp) * model.head_dim * model.kv_elem_bytes


class Roofline(StepTimer):
    """Iteration-time estimator for one worker: `model` on `tp` GPUs of kind `gpu`.

    All per-step coefficients are precomputed in seconds; `step_time` is a handful of float
    multiply-adds.
    """

    __slots__ = ("model", "gpu", "tp", "ep", "_c_tok", "_c_row", "_c_pair", "_c_pair_dec", "_c_hist", "_m_w",
                 "_m_kv", "_m_act", "_moe", "_n_exp", "_p_miss", "_m_expert", "_ar_fixed", "_ar_tok", "_g_fixed",
                 "_g_row", "_overhead", "_launch")

    def __init__(self, model: ModelSpec | str, gpu: GPU | str, tp: int = 1, ep: int = 1):
        model, gpu = get_model(model), get_gpu(gpu)
        check_tp(model, gpu, tp)
        check_ep(model, tp, ep)
        self.model, self.gpu, self.tp, self.ep = model, gpu, tp, ep
        flops, bw, d = gpu.flops, gpu.mem_bw, model.dtype_bytes
        we = model.weight_elem_bytes   # linear layers' weights (1 byte under fp8 w8a8, run at the fp8 peak)
        h, L = model.hidden, model.layers
        wflops = gpu.achievable_flops(model.weight_dtype)

        # Compute (s per unit): heads, MLP columns and vocab are all sharded tp ways; MLA's down-projection is not.
        repl = L * model.replicated_params_per_layer
        self._c_tok = (model.body_flops_per_token - 2 * repl + 2 * repl * tp) / tp / wflops
        self._c_row = model.lm_head_flops_per_token / tp / flops
        self._c_pair = model.attn_flops_per_pair / tp / flops
        # decode pairs beyond the prefill rate (MLA's absorbed decode; 0 for GQA, where both are the same)
        self._c_pair_dec = (model.attn_flops_per_pair_decode - model.attn_flops_per_pair) / tp / flops
        # MLA's expanded prefill up-projects the cached latent of every history token a chunk attends to
        self._c_hist = 2 * L * model.kv_up_params_per_layer / tp / wflops

        # Weights streamed every step: the layers' dense part, the final norm and the LM-head
        # matrix (the input embedding is only gathered row by row). Experts handled below.
        linear = L * (model.attn_params_per_layer + model.router_params_per_layer) + repl * (tp - 1)
        self._m_w = (linear * we + (L * 2 * h + h + model.vocab * h) * d) / tp / bw
        self._moe = model.is_moe
        # Each rank holds experts/ep experts, each sharded tp/ep ways (ep = 1: every expert sharded tp ways).
        self._n_exp = model.experts / ep
        # A token misses a given expert with prob 1 - k/E (uniform routing); T tokens touch
        # E*(1 - (1-k/E)^T) distinct experts per layer in expectation (k for T=1, -> E), E/ep of them on a rank.
        self._p_miss = 1.0 - model.experts_per_token / model.experts
        if not self._moe:
            dense_streamed_mlp = L * model.expert_params
            self._m_w += dense_streamed_mlp * we / tp / bw
            self._m_expert = 0.0
        else:
            self._m_w += model.dense_layers * model.dense_mlp_params * we / tp / bw   # DeepSeek's first layers
            # per distinct expert touched on this rank, all MoE layers
            self._m_expert = model.moe_layers * model.expert_params * we / (tp // ep) / bw

        # KV bytes on this GPU per token read or written.
        self._m_kv = kv_bytes_per_token_per_gpu(model, tp) / bw
        # Activation traffic per query token (fused add+norm kernels): ~10 hidden-sized
        # reads/writes per layer on every GPU (the residual stream is replicated), plus the
        # sharded q/k/v/attention-output tensors and the MLP's gate/up/act/down tensors.
        ffn = model.experts_per_token * model.intermediate
        if model.mla is not None:      # expanded q, k and v of every head, and the attention output
            a = model.mla
            sharded = 2 * model.heads * (a.qk_head_dim + a.qk_head_dim + a.v_head_dim) + 2 * model.heads * a.v_head_dim \
                + 6 * ffn
        else:
            sharded = (2 * (model.heads + 2 * model.kv_heads) + 2 * model.heads) * model.head_dim + 6 * ffn
        self._m_act = L * d * (10 * h + sharded / tp) / bw

        # Communication: 2 all-reduces per layer (after attention and after the MLP) over the
        # query tokens' hidden states, and one gather of the vocab-sharded logits rows.
        if tp > 1:
            link = gpu.nvlink_gbs * 1e9 * gpu.link_eff
            hops = math.ceil(math.log2(tp))
            ring = 2 * (tp - 1) / tp  # ring all-reduce moves 2(n-1)/n of the buffer per GPU
            self._ar_fixed = 2 * L * hops * gpu.nvlink_latency_s
            self._ar_tok = 2 * L * ring * h * d / link
            self._g_fixed = hops * gpu.nvlink_latency_s
            self._g_row = (tp - 1) / tp * model.vocab * d / link
        else:
            self._ar_fixed = self._ar_tok = self._g_fixed = self._g_row = 0.0
        self._overhead = gpu.step_overhead_s
        self._launch = L * gpu.eager_launch_s_per_layer

    # ------------------------------------------------------------------------------------
    def step_time_args(self, prefill_tokens: float, prefill_attn_pairs: float, prefill_kv_read_tokens: float,
                       num_prefill: float, num_decode: float, decode_ctx_tokens: float, graph: bool = False,
                       decode_kv_shared: float = 0) -> float:
        """`step_time` without building a BatchShape (same fields, same order)."""
        tokens = prefill_tokens + num_decode
        if tokens <= 0:
            return 0.0
        rows = num_prefill + num_decode
        compute = (self._c_tok * tokens + self._c_row * rows + self._c_pair * (prefill_attn_pairs + decode_ctx_tokens)
                   + self._c_pair_dec * decode_ctx_tokens + self._c_hist * prefill_kv_read_tokens)
        memory = (self._m_w
                  + self._m_kv * (prefill_kv_read_tokens + 2 * prefill_tokens + decode_ctx_tokens - decode_kv_shared
                                  + num_decode)
                  + self._m_act * tokens)
        if self._moe:
            memory += self._m_expert * self._n_exp * (1.0 - self._p_miss ** tokens)
        comm = self._ar_fixed + self._ar_tok * tokens + self._g_fixed + self._g_row * rows  # all 0 at tp1
        busy = compute if compute > memory else memory
        if prefill_tokens > 0 and not graph and self._launch > busy:
            busy = self._launch                     # an eager prefill step waits for its kernel launches
        return busy + comm + self._overhead

    def swap_time(self, tokens: int) -> float:
        """Seconds to copy `tokens` positions of this GPU's KV to or from host memory (a swap preemption)."""
        if tokens <= 0:
            return 0.0
        g = self.gpu
        return tokens * kv_bytes_per_token_per_gpu(self.model, self.tp) / (g.host_gbs * 1e9 * g.link_eff)

    # ------------------------------------------------------------------------------------
    def prefill_boundary(self, l_hist: int = 0, max_tokens: int = 1 << 20) -> int:
        """LAPS's L_m on this roofline: the fewest new tokens from which one (re-)prefill step over `l_hist`
        history tokens is compute-bound (compute >= memory traffic); shorter ones are memory-bound. Unlike LAPS's
        T(L, H), memory here includes the weights streamed every step, which is what puts L_m in the hundreds of
        tokens (LAPS measures 150-512). max_tokens when no length up to it is compute-bound."""
        def compute_bound(n: int) -> bool:
            b = self.breakdown(BatchShape(n, n * (l_hist + (n + 1) / 2), l_hist, 1))
            return b["compute"] >= b["memory"]
        if compute_bound(1):
            return 1
        if not compute_bound(max_tokens):
            return max_tokens
        lo, hi = 1, max_tokens                      # memory-bound at lo, compute-bound at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if compute_bound(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def allreduce_time(self, nbytes: float) -> float:
        """One all-reduce of nbytes over this worker's tp GPUs (0 at tp1)."""
        if self.tp == 1:
            return 0.0
        g = self.gpu
        hops = math.ceil(math.log2(self.tp))
        return hops * g.nvlink_latency_s + 2 * (self.tp - 1) / self.tp * nbytes / (g.nvlink_gbs * 1e9 * g.link_eff)

    def breakdown(self, shape: BatchShape) -> dict[str, float]:
        """The terms of `step_time` (compute, memory, comm, overhead, total) for inspection."""
        s = shape
        tokens = s.prefill_tokens + s.num_decode
        rows = s.num_prefill + s.num_decode
        compute = (self._c_tok * tokens + self._c_row * rows + self._c_pair * (s.prefill_attn_pairs + s.decode_ctx_tokens)
                   + self._c_pair_dec * s.decode_ctx_tokens + self._c_hist * s.prefill_kv_read_tokens)
        memory = (self._m_w + self._m_kv * (s.prefill_kv_read_tokens + 2 * s.prefill_tokens + s.decode_ctx_tokens
                                            - s.decode_kv_shared + s.num_decode)
                  + self._m_act * tokens)
        if self._moe:
            memory += self._m_expert * self._n_exp * (1.0 - self._p_miss ** tokens)
        comm = self._ar_fixed + self._ar_tok * tokens + self._g_fixed + self._g_row * rows
        launch = self._launch if s.prefill_tokens > 0 and not s.graph else 0.0
        bound = "compute" if compute > memory else "memory"
        if launch > max(compute, memory):
            bound = "launch"
        return {"compute": compute, "memory": memory, "launch": launch, "comm": comm, "overhead": self._overhead,
                "total": self.step_time(s), "bound": bound}

    def __repr__(self) -> str:
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        return f"Roofline({self.model.name}, {self.gpu.name}, tp{self.tp}{ep})"


def kv_capacity_tokens(model: ModelSpec | str, gpu: GPU | str, tp: int, mem_util: float = MEM_UTIL,
                       activation_reserve_gb: float = ACTIVATION_RESERVE_GIB) -> int:
    """KV-cache tokens one worker (tp GPUs) holds after weights and the reserve.

    Per GPU: hbm x mem_util - weights/tp - reserve (GiB, like hbm_gb), divided by the KV bytes
    per token stored on one GPU (KV heads sharded, or replicated when tp > kv_heads; MLA's latent replicated).
    Expert parallelism leaves this unchanged: experts/ep experts sharded tp/ep ways are weights/tp all the same.
    Raises DoesNotFitError when nothing is left.
    """
    model, gpu = get_model(model), get_gpu(gpu)
    check_tp(model, gpu, tp)
    usable = gpu.hbm_bytes * mem_util - activation_reserve_gb * GIB
    weights = (model.weight_bytes + model.layers * model.replicated_params_per_layer * model.weight_elem_bytes
               * (tp - 1)) / tp
    free = usable - weights
    tokens = int(free // kv_bytes_per_token_per_gpu(model, tp)) if free > 0 else 0
    if tokens <= 0:
        raise DoesNotFitError(
            f"{model.name} does not fit tp{tp} x {gpu.name}: weights {model.weight_bytes / 1e9:.1f} GB "
            f"({weights / 1e9:.1f} GB per GPU) vs memory {usable / 1e9:.1f} GB usable per GPU "
            f"({gpu.hbm_gb:g} GB x {mem_util:g} - {activation_reserve_gb:g} GiB reserve) at tp{tp}")
    return tokens


def kv_transfer_time(model: ModelSpec | str, gpu: GPU | str, tokens: int, src_tp: int, dst_tp: int,
                     same_node: bool) -> float:
    """Alpha-beta (Hockney) time to move the KV of `tokens` tokens between two workers.

    alpha: one link latency (NVLink hop inside a node, NIC latency across nodes).
    beta: each GPU moves its own KV-head shard over its own link, so min(src_tp, dst_tp) links
    run in parallel, each at nvlink_gbs (same node) or net_gbs (its NIC share) x link_eff.
    Only unique KV is moved (kv_bytes_per_token x tokens), whatever the replication.
    """
    if tokens <= 0:
        return 0.0
    model, gpu = get_model(model), get_gpu(gpu)
    links = min(src_tp, dst_tp)
    per_link = (gpu.nvlink_gbs if same_node else gpu.net_gbs) * 1e9 * gpu.link_eff
    alpha = gpu.nvlink_latency_s if same_node else gpu.net_latency_s
    return alpha + tokens * model.kv_bytes_per_token / (links * per_link)
