"""The memory of a diffusion-LLM worker (dLLM-Serve §3.2, §4.2-4.3, §4.5), analytic: weights, the activation peak of
a step at `max_num_batched_tokens` with and without the logit cap, and the KV pool that is left, in requests' fixed
sparse buffers.

Per GPU (tensor parallelism shards weights, heads and the MLP; the logits are gathered whole):

    budget      = hbm x mem_util                                   (vLLM's gpu_memory_utilization, 0.9)
    weights     = params x dtype / tp
    body(T)     = T x dtype x (2 hidden + 3 MLP width / tp)        the MLP's working set dominates a layer: the residual
                                                                   stream and its normed copy, gate, up, and their
                                                                   product, for every query token
    logits(T,R) = T x hidden x dtype + R x vocab x LOGIT_BYTES     the last hidden states stay live while R rows of
                                                                   logits are projected and reduced
    peak(T, R)  = max(body(T), logits(T, R))
    pool        = budget - weights - peak - guard                  guard: 10% of the peak, at least 4 MiB (the
                                                                   engine's, tandem/engine/memory_profile.py)

The step the profile measures is the worst one: T = max_num_batched_tokens query tokens, every one with logits
(R = T, "monolithic": what an engine that materialises the logits of the whole packed batch, as Fast-dLLM and
LLaDA's reference generate, must reserve) or at most `max_num_logits` rows at a time (R = min(T, max_num_logits):
dLLM-Serve's logit decomposition, each chunk reduced to (token, confidence) and freed before the next;
tandem/engine/logits.py does the same).

LOGIT_BYTES = 6: a logit row lives as the LM head's output in the model dtype (2 bytes an entry) and its float32
softmax (4 bytes) at once, which is what a diffusion step's (token, confidence) reduction needs (argmax and the
probability of the argmax). It is an assumption, not a measurement: LLaDA's reference decoder upcasts to float64 for
Gumbel noise when sampling (more), a fused kernel needs less; the figure is a parameter.

KV (head-centric sparse KV, §4.5): a request of L = P + G positions keeps ⌈ρ·L⌉ positions per KV head in a dense
buffer fixed for its life, ρ the retention ratio (1: the dense cache); `request_kv_bytes` is its size. The KV pool in
positions is pool / kv_bytes_per_token (per GPU).

The request-level baselines reserve every request's Refresh peak (its L query tokens) and its KV together, so their
largest feasible token budget is the T at which the monolithic peak plus ρ·T positions of KV fill the budget:
`feasible_batched_tokens`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.perf.errors import DoesNotFitError
from tandem.perf.hardware import GIB, GPU, get_gpu
from tandem.perf.models import ModelSpec, get_model
from tandem.perf.roofline import MEM_UTIL, check_tp, kv_bytes_per_token_per_gpu

LOGIT_BYTES = 6.0               # bytes per (row, vocabulary id) at the logit phase's peak: bf16 logits + fp32 softmax
GUARD_SHARE = 0.10              # guard band over the measured peak (the engine's memory profile)
GUARD_MIN_BYTES = 4 << 20
MIB = 1 << 20


@dataclass(frozen=True)
class DllmMemory:
    """The memory model of one diffusion worker: `model` on `tp` GPUs of kind `gpu`."""

    model: ModelSpec
    gpu: GPU
    tp: int = 1
    mem_util: float = MEM_UTIL
    logit_bytes: float = LOGIT_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", get_model(self.model))
        object.__setattr__(self, "gpu", get_gpu(self.gpu))
        check_tp(self.model, self.gpu, self.tp)
        if not (isinstance(self.mem_util, (int, float)) and 0 < self.mem_util <= 1):
            raise ValueError(f"mem_util must be in (0, 1], got {self.mem_util!r}")
        if not (isinstance(self.logit_bytes, (int, float)) and self.logit_bytes > 0):
            raise ValueError(f"logit_bytes must be > 0, got {self.logit_bytes!r}")

    # ---------------------------------------------------------------- fixed terms
    @property
    def budget_bytes(self) -> float:
        """What the engine may use of one GPU: hbm x mem_util."""
        return self.gpu.hbm_bytes * self.mem_util

    @property
    def weights_bytes(self) -> float:
        return self.model.weight_bytes / self.tp

    @property
    def left_after_weights_bytes(self) -> float:
        """What the budget leaves for KV and activations (dLLM-Serve §6.1's "< 7 GB" on an RTX 4090)."""
        return self.budget_bytes - self.weights_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one position on one GPU (every layer, its KV heads)."""
        return kv_bytes_per_token_per_gpu(self.model, self.tp)

    # ---------------------------------------------------------------- activations
    def body_bytes(self, tokens: int) -> float:
        """The forward's peak over `tokens` query tokens: the MLP's working set of a layer."""
        m = self.model
        return tokens * m.dtype_bytes * (2 * m.hidden + 3 * m.intermediate * m.experts_per_token / self.tp)

    def logit_bytes_at(self, tokens: int, rows: int) -> float:
        """The logit phase's peak: the final hidden states of `tokens` plus `rows` rows of logits at once."""
        m = self.model
        return tokens * m.hidden * m.dtype_bytes + rows * m.vocab * self.logit_bytes

    def activation_peak(self, tokens: int, max_num_logits: int | None = None) -> float:
        """Peak activation bytes of a step of `tokens` query tokens, every one with logits, monolithic (None) or at
        most `max_num_logits` rows at a time."""
        rows = tokens if max_num_logits is None else min(tokens, max_num_logits)
        return max(self.body_bytes(tokens), self.logit_bytes_at(tokens, rows))

    @staticmethod
    def guard(peak: float) -> float:
        return max(GUARD_SHARE * peak, GUARD_MIN_BYTES)

    # ---------------------------------------------------------------- KV
    def kv_pool_bytes(self, max_num_batched_tokens: int, max_num_logits: int | None = None) -> float:
        """KV pool bytes after the weights and the profiled peak (with its guard); may be negative."""
        peak = self.activation_peak(max_num_batched_tokens, max_num_logits)
        return self.left_after_weights_bytes - peak - self.guard(peak)

    def kv_pool_tokens(self, max_num_batched_tokens: int, max_num_logits: int | None = None) -> int:
        """KV pool in positions; DoesNotFitError when nothing is left."""
        pool = self.kv_pool_bytes(max_num_batched_tokens, max_num_logits)
        tokens = int(pool // self.kv_bytes_per_token) if pool > 0 else 0
        if tokens <= 0:
            peak = self.activation_peak(max_num_batched_tokens, max_num_logits)
            raise DoesNotFitError(
                f"{self.model.name} on {self.gpu.name} (tp{self.tp}): nothing left for KV at max_num_batched_tokens "
                f"{max_num_batched_tokens} (max_num_logits {max_num_logits}): budget {self.budget_bytes / GIB:.2f} "
                f"GiB - weights {self.weights_bytes / GIB:.2f} GiB - activation peak {peak / GIB:.2f} GiB (+ guard)")
        return tokens

    def request_kv_positions(self, length: int, retention: float = 1.0) -> int:
        """Positions of a request's fixed buffer: ⌈ρ·L⌉ (at least 1)."""
        return max(1, math.ceil(retention * length - 1e-9))

    def request_kv_bytes(self, length: int, retention: float = 1.0) -> int:
        """Bytes of a request's fixed KV buffer on one GPU."""
        return self.request_kv_positions(length, retention) * self.kv_bytes_per_token

    def feasible_batched_tokens(self, max_num_logits: int | None = None, retention: float = 1.0,
                                limit: int = 1 << 22) -> int:
        """The largest token budget T whose peak leaves KV for ρ·T positions: what request-level batching that
        reserves each request's Refresh peak (L query tokens, ⌈ρ·L⌉ KV positions) can run; 0 when none can."""
        def fits(t: int) -> bool:
            return self.kv_pool_bytes(t, max_num_logits) >= retention * t * self.kv_bytes_per_token
        if not fits(1):
            return 0
        lo, hi = 1, 2
        while hi < limit and fits(hi):
            lo, hi = hi, hi * 2
        if hi >= limit and fits(limit):
            return limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def report(self, max_num_batched_tokens: int, max_num_logits: int | None, retention: float = 1.0) -> dict:
        """The figures of the model at one setting (bytes), monolithic and with the cap, for tables."""
        mono = self.activation_peak(max_num_batched_tokens, None)
        capped = self.activation_peak(max_num_batched_tokens, max_num_logits)
        return {"model": self.model.name, "gpu": self.gpu.name, "tp": self.tp, "mem_util": self.mem_util,
                "budget": self.budget_bytes, "weights": self.weights_bytes,
                "left_after_weights": self.left_after_weights_bytes,
                "max_num_batched_tokens": max_num_batched_tokens, "max_num_logits": max_num_logits,
                "peak_monolithic": mono, "peak_capped": capped,
                "pool_monolithic": self.kv_pool_bytes(max_num_batched_tokens, None),
                "pool_capped": self.kv_pool_bytes(max_num_batched_tokens, max_num_logits),
                "kv_bytes_per_token": self.kv_bytes_per_token, "retention": retention}


__all__ = ["DllmMemory", "GUARD_MIN_BYTES", "GUARD_SHARE", "LOGIT_BYTES"]
