"""The interface between the HTTP server and whatever serves requests (vLLM's EngineClient).

Implementations: `tandem.runtime.async_llm.AsyncLLM` (one in-process engine on a thread) and the
disaggregated multi-process runtime (a coordinator driving prefill and decode worker processes).
The server layer only talks to this protocol, so it serves both the same way.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer


class RequestError(Exception):
    """A request the backend rejects; `status` is the HTTP status the server should answer with."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param


@dataclass
class BackendStats:
    """Gauges and counters the server exports on /metrics (vLLM names where one exists)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0               # 0..1, mean over decode/co-located workers
    num_requests_swapped: int = 0                  # preempted by swap (vLLM v0's gauge)
    cpu_cache_usage_perc: float = 0.0              # swap space in use, 0..1, mean over decode/co-located workers
    prefix_cache_queries: int = 0                  # prompt tokens looked up
    prefix_cache_hits: int = 0                     # prompt tokens found cached (session history or prefix cache)
    local_prefills: int = 0                        # tandem: prefills run on the session's decode worker
    remote_prefills: int = 0                       # tandem: prefills run on a prefill worker
    kv_transfer_seconds: list[float] = field(default_factory=list)   # new observations since the last call
    kv_transfer_timeouts: int = 0                  # transfers that fell back to local recompute
    lost_requests: int = 0                         # tandem: requests failed because their worker no longer held
                                                   # them (a message between them was lost; coordinator_shell.audit)
    workers_alive: int = 0
    iteration_tokens: dict[int, int] = field(default_factory=dict)   # tokens per engine step -> steps (cumulative)
    dllm_commits: dict[int, int] = field(default_factory=dict)       # diffusion: tokens committed by a sequence in
                                                                     # a step -> how often (cumulative)
    dllm_chunks: dict[int, int] = field(default_factory=dict)        # diffusion: chunk size chosen -> steps
    dllm_serve: dict[str, int] = field(default_factory=dict)         # dLLM-Serve: phase and admission counters
                                                                     # (cumulative, summed over the workers)
    cache_config: dict[str, str] = field(default_factory=dict)       # vllm:cache_config_info labels
    rejected_frames: int = 0                       # tandem: messages dropped as malformed (hub and workers)
    rejected_handshakes: int = 0                   # tandem: connections refused at the CURVE handshake (likewise)
    kv_bytes: dict[str, int] = field(default_factory=dict)   # "WORKER/driver", "WORKER/sent/RANK",
                                                   # "WORKER/received/RANK" -> KV bytes by path (cumulative)
    laps_pool_short: int = 0                       # LAPS spatial mode: prefill workers in the short / long pool
    laps_pool_long: int = 0
    laps_pool_moves: int = 0                       # workers moved between the pools so far
    laps_short_waiting: int = 0                    # short / long prefills waiting on LAPS prefill workers
    laps_long_waiting: int = 0
    laps_window_s: float = 0.0                     # AWD window W and target depth D, mean over LAPS prefill workers
    laps_depth: float = 0.0
    laps_short_steps: int = 0                      # short-batch steps, and those run in a captured bucket (hits)
    laps_graph_steps: int = 0
    kv_cache_pool_bytes: int = 0                   # tandem: KV pool bytes, summed over the workers
    activation_peak_bytes: dict[str, int] = field(default_factory=dict)   # logit mode (monolithic, decomposed) ->
                                                   # profiled activation peak, the largest over the workers
    activation_budget_bytes: int = 0               # bytes set aside for activations (peak + guard), largest worker
    host_tier: dict[str, int] = field(default_factory=dict)   # host KV tier copy counters, summed over the workers
                                                   # (engine.tier_copies HOST_TIER_COUNTERS; cumulative)
    host_tier_usage: float = 0.0                   # host KV tier in use, 0..1, over the workers that have one
    host_tier_bytes: int = 0                       # host KV tier bytes in use and capacity, summed over the workers
    host_tier_capacity_bytes: int = 0


def add_memory_reports(out: BackendStats, reports: list[dict[str, int]]) -> None:
    """Fold the workers' memory figures (engine.memory_profile.memory_report) into the snapshot: pool bytes summed,
    activation peaks and budgets the largest of any worker."""
    out.kv_cache_pool_bytes = sum(r.get("kv_cache_pool_bytes", 0) for r in reports)
    peaks: dict[str, int] = {}
    for mode in ("monolithic", "decomposed"):
        vals = [r[f"activation_peak_{mode}_bytes"] for r in reports if f"activation_peak_{mode}_bytes" in r]
        if vals:
            peaks[mode] = max(vals)
    out.activation_peak_bytes = peaks
    out.activation_budget_bytes = max((r.get("activation_budget_bytes", 0) for r in reports), default=0)


class EngineClient(Protocol):
    """What the server needs from a backend."""

    model_name: str            # the served model name (`--served-model-name`, default: the checkpoint directory)
    max_model_len: int
    tokenizer: Tokenizer

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 session_id: str | None = None, prompt: str | None = None,
                 tool_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative RequestOutputs until one with `finished` True; raises RequestError on bad input.

        A failure after acceptance ends the stream with a finished output whose `error` says why
        (finish_reason "abort"). Closing the iterator early (client gone) aborts the request and frees its KV.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; a no-op for unknown or finished requests."""
        ...

    def stats(self) -> BackendStats:
        """A snapshot of the backend's gauges; kv_transfer_seconds holds observations since the last call."""
        ...

    def is_healthy(self) -> bool:
        """False when the backend cannot serve (no live decode/co-located worker)."""
        ...

    async def shutdown(self) -> None:
        """Stop every worker and free resources."""
        ...
