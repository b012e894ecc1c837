"""The scheduler configuration every shell shares: one set of defaults (vLLM's names) for the simulator,
the engine and the runtime's workers and coordinator; and the knobs of one worker core drawn from it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tandem.policy.dllm_serve import PhaseSpec, parse_admission
from tandem.policy.optimus.chunk import DEFAULT_CHUNK, parse_chunk

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048     # vLLM's chunked-prefill token budget per step
DEFAULT_MAX_NUM_SEQS = 256                # vLLM's cap on sequences scheduled at once
DEFAULT_WATERMARK = 0.01                  # vLLM's share of blocks an admitted prefill leaves free
DEFAULT_WINDOW_S = 10.0                   # AMPD's window of the published TTFT/ITL means
DEFAULT_KV_TIMEOUT_S = 10.0               # a KV transfer not landed after this is abandoned (local recompute)
DEFAULT_SESSION_TTL_S = 600.0             # an idle session's KV is released after this
DEFAULT_SWAP_SPACE_GIB = 4.0              # vLLM's swap_space: host memory per worker for swapped-out KV
DEFAULT_KV_OFFLOADING_SIZE_GIB = 0.0      # vLLM's kv_offloading_size: host KV tier per worker, all TP ranks (0: none)
GIB = 1 << 30


class PreemptionMode(Enum):
    """How a worker frees a running sequence's KV when its pool runs short (vLLM's preemption_mode)."""

    RECOMPUTE = "recompute"     # drop the KV; the context is prefilled again when the sequence resumes
    SWAP = "swap"               # copy the KV to host memory (swap_space); it is copied back when the sequence resumes


def _int(name: str, v, lo: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def _seconds(name: str, v, allow_inf: bool = True) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or (not allow_inf and math.isinf(v)):
        raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How every worker core schedules and how the coordinator times out (validated on construction)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    watermark: float = DEFAULT_WATERMARK
    window_s: float = DEFAULT_WINDOW_S
    decode_query_tokens: int = 1              # query tokens a decoding sequence computes per step (1: AR; the
                                              # diffusion chunk or 1 + draft tokens for multi-token steps)
    kv_timeout_s: float = DEFAULT_KV_TIMEOUT_S
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    dllm_block_length: int = 0                # block-diffusion models: positions per block (0: autoregressive)
    dllm_chunk: str = DEFAULT_CHUNK           # diffusion steps' window: auto (block for a greedy or seeded request,
                                              # elastic for the others), elastic (Optimus), block (BD-B), or N
    dllm_prefill_share: float = 0.5           # elastic windows leave waiting prefills up to this share of the budget
    dllm_admission: str | None = None         # dLLM-Serve mode (LLaDA-style Refresh/Reuse phases, co-located
                                              # workers): "phase" (phase-multiplexed), "static" (Fast-dLLM-like
                                              # static batches) or "reserve" (request-level continuous); None: off
    dllm_delay_step: int = 1                  # dLLM-Serve: full-length steps of a block before its cache is written
    dllm_refresh_interval: int = 0            # dLLM-Serve: also refresh every this many steps (0: block starts only)
    dllm_refresh_span: str = "full"           # dLLM-Serve: a Refresh recomputes prompt + the whole generation length
                                              # ("full", LLaDA) or prompt + generated + the active block ("prefix";
                                              # "aligned": SDAR's blocks at absolute positions, the engine's)
    dllm_kv_retention: float = 1.0            # dLLM-Serve: share ρ of a request's positions whose KV it keeps
    preemption_mode: str | None = None        # recompute or swap; None: swap where a recompute would change the
                                              # output (streaming diffusion windows: a decoded position's K/V depend on
                                              # the window that wrote it) and swap_space allows, recompute elsewhere
    swap_space: float = DEFAULT_SWAP_SPACE_GIB   # GiB of host memory per worker for KV preempted by swap
    kv_offloading_size: float = DEFAULT_KV_OFFLOADING_SIZE_GIB   # GiB of host KV tier per worker (summed over its
                                              # TP ranks, as vLLM's --kv-offloading-size); a tiered policy needs it

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "decode_query_tokens"):
            _int(name, getattr(self, name))
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        _seconds("window_s", self.window_s, allow_inf=False)
        _seconds("kv_timeout_s", self.kv_timeout_s)
        _seconds("session_ttl_s", self.session_ttl_s)
        if self.dllm_block_length != 0:
            _int("dllm_block_length", self.dllm_block_length, lo=2)
        object.__setattr__(self, "dllm_chunk", str(parse_chunk(self.dllm_chunk)))
        if not (isinstance(self.dllm_prefill_share, (int, float)) and not isinstance(self.dllm_prefill_share, bool)
                and 0 <= self.dllm_prefill_share < 1):
            raise ValueError(f"dllm_prefill_share must be in [0, 1), got {self.dllm_prefill_share!r}")
        if self.dllm_admission is not None:
            object.__setattr__(self, "dllm_admission", parse_admission(self.dllm_admission).value)
            if not self.dllm_block_length:
                raise ValueError("dllm_admission needs a block-diffusion model (dllm_block_length > 0)")
        self.phase_spec()                         # validates the Refresh/Reuse knobs
        for knob in ("swap_space", "kv_offloading_size"):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{knob} must be a finite number of GiB >= 0, got {v!r}")
        sw = self.swap_space
        if self.preemption_mode is not None:
            try:
                mode = PreemptionMode(self.preemption_mode)
            except ValueError:
                raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}") from None
            if mode is PreemptionMode.SWAP and sw == 0:
                raise ValueError("preemption_mode swap needs swap_space > 0 GiB")

    def host_tier_blocks(self, kv_block_bytes: int, tp: int) -> int:
        """KV blocks the host tier holds: kv_offloading_size over all `tp` ranks, `kv_block_bytes` per rank."""
        return int(self.kv_offloading_size * GIB) // (kv_block_bytes * tp) if kv_block_bytes > 0 else 0

    def swap_blocks(self, kv_block_bytes: int) -> int:
        """KV blocks of `kv_block_bytes` that swap_space holds (0 when the shell gives no block size)."""
        return int(self.swap_space * GIB) // kv_block_bytes if kv_block_bytes > 0 else 0

    def preemption(self, streaming_diffusion: bool, swap_blocks: int) -> PreemptionMode:
        """The preemption mode a worker runs: the one asked for, else swap for streaming diffusion windows when
        there is swap space (a recompute rewrites their K/V differently), recompute otherwise."""
        if self.preemption_mode is not None:
            return PreemptionMode(self.preemption_mode)
        return PreemptionMode.SWAP if streaming_diffusion and swap_blocks > 0 else PreemptionMode.RECOMPUTE

    def phase_spec(self) -> PhaseSpec:
        """The Refresh/Reuse policy of the dLLM-Serve mode (ValueError names a bad knob)."""
        return PhaseSpec(max(2, self.dllm_block_length), self.dllm_delay_step, self.dllm_refresh_interval,
                         self.dllm_refresh_span, self.dllm_kv_retention)


@dataclass(slots=True)
class WorkerConfig:
    """Scheduling knobs of one worker (vLLM names where they exist); defaults are SchedulerConfig's. Shells
    get one from tandem.core.factory.build_worker, never by hand."""

    role: str
    tp: int
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # sequences prefilling or decoding at once
    mix_decode_with_prefill: bool = False   # co-located chunked prefill: decodes ride along prefill chunks
    retain_s: float = 0.0                   # idle session KV is pinned this long after a round (Continuum TTL)
    watermark: float = DEFAULT_WATERMARK    # share of blocks an admitted prefill must leave free so sequences can
                                            # grow (vLLM's watermark); waived for a context that needs the rest
    window_s: float = DEFAULT_WINDOW_S      # windowed TTFT/ITL statistics
    decode_query_tokens: int = 1            # query tokens per decode step (1: AR; >1: multi-token steps)
    itl_chunk_beta: float | None = None     # decode worker: local prefills ride along the decodes in chunks whose
                                            # estimate fits itl_chunk_beta * the round's ITL SLO (None: prefill-first)
    dllm_block: int = 0                     # block-diffusion decoding: positions per block (0: autoregressive)
    dllm_prefill_share: float = 0.5         # elastic windows leave waiting prefills up to this share of the budget
    dllm_admission: str = ""                # dLLM-Serve mode (co-located diffusion workers): Refresh/Reuse phases
                                            # packed by "phase", "static" or "reserve" admission ("": Optimus windows)
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE   # how a running sequence gives up its KV
    swap_blocks: int = 0                    # host KV blocks for preemption by swap (falls back to recompute when full)
