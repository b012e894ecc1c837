"""A worker's StepCounts (counter deltas since its last) added to the coordinator's cumulative BackendStats, every
key and value checked: a worker's message is input like any other (a bad entry is dropped, never trusted)."""
from __future__ import annotations

import re

from tandem.engine.tier_copies import HOST_TIER_COUNTERS
from tandem.policy.dllm_serve.admission import COUNTERS as DLLM_COUNTERS
from tandem.runtime import messages as m
from tandem.runtime.client import BackendStats

MAX_STEP_TOKENS = 1 << 20  # a StepCounts key beyond this (tokens in one engine step) is not a real step: dropped
KV_BYTES_KEY = re.compile(r"driver|(sent|received)/\d{1,3}")    # StepCounts.kv_bytes keys a worker may report


def add_kv_bytes(into: dict[str, int], worker: int, kv: dict[str, int]) -> None:
    """A worker's StepCounts.kv_bytes (deltas by path) added to the cumulative counts, keys checked."""
    for k, n in kv.items():
        if KV_BYTES_KEY.fullmatch(k) and isinstance(n, int) and n >= 0:
            into[f"{worker}/{k}"] = into.get(f"{worker}/{k}", 0) + n


def add_step_counts(stats: BackendStats, worker: int, msg: m.StepCounts) -> None:
    """Add `worker`'s deltas: steps by tokens, diffusion commits and chunks, dLLM-Serve and host-tier counters, the
    frames and handshakes its readers refused, KV bytes by path."""
    for mine, theirs in ((stats.iteration_tokens, msg.iteration_tokens),
                         (stats.dllm_commits, msg.dllm_commits), (stats.dllm_chunks, msg.dllm_chunks)):
        for k, n in theirs.items():
            if isinstance(k, int) and isinstance(n, int) and 0 <= k <= MAX_STEP_TOKENS and n > 0:
                mine[k] = mine.get(k, 0) + n
    for k, n in msg.dllm_serve.items():
        if k in DLLM_COUNTERS and isinstance(n, int) and 0 < n <= MAX_STEP_TOKENS:
            stats.dllm_serve[k] = stats.dllm_serve.get(k, 0) + n
    for k, n in msg.host_tier.items():
        if k in HOST_TIER_COUNTERS and isinstance(n, int) and n > 0:
            stats.host_tier[k] = stats.host_tier.get(k, 0) + n
    stats.rejected_frames += min(max(msg.rejected_frames, 0), MAX_STEP_TOKENS)
    stats.rejected_handshakes += min(max(msg.rejected_handshakes, 0), MAX_STEP_TOKENS)
    add_kv_bytes(stats.kv_bytes, worker, msg.kv_bytes)
