"""Named scheduling policies: AMPD, its ablations, and the Dynamo / vLLM / Continuum baselines."""
from __future__ import annotations

import random
from dataclasses import dataclass

from tandem.policy.reorder import FCFS, Picker, SessionFirst, TTFTAwareReorder
from tandem.policy.routing import AdaptiveRouter, LeastCostRemoteRouter, LocalRouter, Router


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One serving policy: where prefills run, how queues are ordered, how idle KV is kept."""

    name: str
    disaggregated: bool
    router: str                  # adaptive | adaptive-window | adaptive-remote | least-cost-remote | local
    picker: str                  # fcfs | ttft-aware | session-first
    retain_idle_kv: bool = False  # Continuum: pin a session's KV for a TTL across its tool call
    description: str = ""


POLICIES: dict[str, PolicySpec] = {p.name: p for p in (
    PolicySpec("ampd", True, "adaptive", "ttft-aware",
               description="AMPD: adaptive local/remote routing (Alg. 1) + TTFT-aware prefill reordering (Alg. 2)"),
    PolicySpec("ampd-window", True, "adaptive-window", "ttft-aware",
               description="AMPD with Alg. 1 verbatim: TTFT slack read from the 10 s windowed mean TTFT"),
    PolicySpec("ampd-no-pr", True, "adaptive", "fcfs",
               description="AMPD without prefill reordering"),
    PolicySpec("ampd-no-ar-pr", True, "adaptive-remote", "fcfs",
               description="AMPD without adaptive routing and reordering: always remote (Alg. 1 lines 1-3, then cheapest prefill worker), FCFS"),
    PolicySpec("dynamo", True, "least-cost-remote", "fcfs",
               description="Dynamo-like: every prefill on a prefill worker (KV-aware cheapest), FCFS"),
    PolicySpec("vllm", False, "local", "fcfs",
               description="vLLM-like co-located: continuous batching with chunked prefill, prefix-cached KV evictable"),
    PolicySpec("continuum", False, "local", "session-first", retain_idle_kv=True,
               description="Continuum-like co-located: same-session priority, KV pinned for a TTL across tool calls"),
)}


def get_policy(name: str) -> PolicySpec:
    """Look up a policy by name; ValueError lists the valid ones."""
    try:
        return POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def make_router(spec: PolicySpec, rng: random.Random, alpha: float = 0.9, beta: float = 0.85) -> Router:
    """The routing object of a policy."""
    if spec.router == "adaptive":
        return AdaptiveRouter(rng, alpha, beta)
    if spec.router == "adaptive-window":
        return AdaptiveRouter(rng, alpha, beta, slack="window")
    if spec.router == "adaptive-remote":
        return AdaptiveRouter(rng, alpha, beta, allow_local=False)
    if spec.router == "least-cost-remote":
        return LeastCostRemoteRouter()
    return LocalRouter()


def make_picker(spec: PolicySpec, window: int = 3) -> Picker:
    """The queue-ordering object of a policy (one per worker: it keeps no cross-worker state)."""
    if spec.picker == "ttft-aware":
        return TTFTAwareReorder(window)
    if spec.picker == "session-first":
        return SessionFirst()
    return FCFS()
