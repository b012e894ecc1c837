"""The scheduler configuration every shell shares: one set of defaults (vLLM's names) for the simulator,
the engine and the runtime's workers and coordinator; and the knobs of one worker core drawn from it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tandem.knob import KnobError, knob, nonneg_float, nonneg_int, positive_float, positive_int, share, unit_fraction
from tandem.policy.checks import check_int
from tandem.policy.dllm_serve import PhaseSpec, parse_admission
from tandem.policy.dllm_serve.admission import AdmissionMode
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


def chunk_text(text: str) -> str:
    """--dllm-chunk: auto, elastic, block or a positive N, normalised."""
    try:
        return str(parse_chunk(text))
    except ValueError as e:
        raise KnobError(str(e)) from None


def _seconds(name: str, v, allow_inf: bool = True) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or (not allow_inf and math.isinf(v)):
        raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How every worker core schedules and how the coordinator times out (validated on construction)."""

    block_size: int = knob(DEFAULT_BLOCK_SIZE, "tokens per KV block", parse=positive_int, metavar="N")
    max_num_batched_tokens: int = knob(DEFAULT_MAX_NUM_BATCHED_TOKENS, "query tokens per step of every worker "
                                       "(chunked prefill's budget)", parse=positive_int, metavar="N")
    max_num_seqs: int = knob(DEFAULT_MAX_NUM_SEQS, "sequences prefilling or decoding at once per worker",
                             parse=positive_int, metavar="N")
    watermark: float = DEFAULT_WATERMARK
    window_s: float = DEFAULT_WINDOW_S
    decode_query_tokens: int = 1              # query tokens a decoding sequence computes per step (1: AR; the
                                              # diffusion chunk or 1 + draft tokens for multi-token steps)
    kv_timeout_s: float = knob(DEFAULT_KV_TIMEOUT_S, "a KV transfer not landed after S seconds is recomputed "
                               "locally", parse=positive_float, metavar="S", flags=("--kv-timeout",))
    session_ttl_s: float = knob(DEFAULT_SESSION_TTL_S, "a session idle this long (no round) is ended and its KV "
                                "freed", parse=positive_float, metavar="S", flags=("--session-ttl",))
    dllm_block_length: int = knob(0, "block-diffusion decoding in blocks of B positions (0: autoregressive)",
                                  parse=nonneg_int, metavar="B")
    dllm_chunk: str = knob(DEFAULT_CHUNK, "block-diffusion models: each step's window: auto (block for a greedy or "
                           "seeded request, whose tokens then do not depend on the load; elastic for the others), "
                           "elastic (Optimus, chosen per step from the load, for every request), block (the whole "
                           "block recomputed every step) or a fixed streaming chunk N (N masked positions a step, "
                           "besides the K/V writes of the last commits)", parse=chunk_text,
                           metavar="auto|elastic|block|N")
    dllm_prefill_share: float = knob(0.5, "elastic windows leave waiting prefills up to this share of the step's "
                                     "token budget, in [0, 1); 0: the windows may take all of it, as the paper's c*",
                                     parse=share, metavar="F")
    dllm_admission: str | None = knob(None, "block-diffusion models: dLLM-Serve's Refresh/Reuse phases over sparse "
                                      "KV, admitted by phase (dLLM-Serve), static (Fast-dLLM-like batches reserving "
                                      "each request's Refresh peak) or reserve (request-level continuous); default: "
                                      "Optimus windows (--dllm-chunk); docs/dllm-serve.md",
                                      choices=tuple(a.value for a in AdmissionMode))
    dllm_delay_step: int = knob(1, "dLLM-Serve: full-length steps at a block's start before its cache is written",
                                parse=nonneg_int, metavar="N")
    dllm_refresh_interval: int = knob(0, "dLLM-Serve: also refresh every N steps after the block's cache write (0: "
                                      "only at block transitions)", parse=nonneg_int, metavar="N")
    dllm_refresh_span: str = knob("full", "dLLM-Serve: a Refresh recomputes the prompt and the whole generation "
                                  "length (full, LLaDA) or the prompt, the generated tokens and the active block "
                                  "(prefix)", choices=("full", "prefix"))
    # ("aligned": SDAR's blocks at absolute positions and "canvas": LLaDA's, set by the engine for its model)
    dllm_kv_retention: float = knob(1.0, "dLLM-Serve: share of a request's positions whose KV it keeps "
                                    "(head-centric sparse KV), in (0, 1]", parse=unit_fraction, metavar="R")
    preemption_mode: str | None = knob(None, "how a running sequence gives up its KV when the pool runs short: "
                                       "recompute (drop it, prefill again) or swap (copy it to host memory and back; "
                                       "recompute when --swap-space is full); default: swap for streaming diffusion "
                                       "windows, whose K/V a recompute would change, else recompute",
                                       choices=tuple(m.value for m in PreemptionMode))
    swap_space: float = knob(DEFAULT_SWAP_SPACE_GIB, "GiB of host memory per worker for KV preempted by swap",
                             parse=nonneg_float, metavar="GIB")
    kv_offloading_size: float = knob(DEFAULT_KV_OFFLOADING_SIZE_GIB, "GiB of host-memory KV tier per worker "
                                     "(summed over its TP ranks, as vLLM's --kv-offloading-size); a tiered policy "
                                     "needs it", parse=nonneg_float, metavar="GIB")

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "decode_query_tokens"):
            check_int(name, getattr(self, name), 1)
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        _seconds("window_s", self.window_s, allow_inf=False)
        _seconds("kv_timeout_s", self.kv_timeout_s)
        _seconds("session_ttl_s", self.session_ttl_s)
        if self.dllm_block_length != 0:
            check_int("dllm_block_length", self.dllm_block_length, 2)
        object.__setattr__(self, "dllm_chunk", str(parse_chunk(self.dllm_chunk)))
        if not (isinstance(self.dllm_prefill_share, (int, float)) and not isinstance(self.dllm_prefill_share, bool)
                and 0 <= self.dllm_prefill_share < 1):
            raise ValueError(f"dllm_prefill_share must be in [0, 1), got {self.dllm_prefill_share!r}")
        if self.dllm_admission is not None:
            object.__setattr__(self, "dllm_admission", parse_admission(self.dllm_admission).value)
            if not self.dllm_block_length:
                raise ValueError("dllm_admission needs a block-diffusion model (dllm_block_length > 0)")
        self.phase_spec()                         # validates the Refresh/Reuse knobs
        for name in ("swap_space", "kv_offloading_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number of GiB >= 0, got {v!r}")
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
