"""What happens to a session's KV while it waits on a tool: keep it on the GPU, offload it to the worker's host
tier, or drop it (recompute later); and which host entry goes first when the tier is full.

Rules (each a plain object the factory picks from the policy):
- `TTLRule` (Continuum): pinned for a TTL after each round; past it, a copy goes to the host tier when it has
  room (the GPU copy stays, evictable), never brought back ahead of the next round.
- `InferCeptRule` (InferCept, §4): of preserve / swap / discard, the one wasting the least memory-time:
  preserve holds the context for the whole tool call, swap holds the running batch's memory while the context's
  copy comes back, discard while it is recomputed.
- `ToolAwareRule` (tandem): a gap shorter than a few copy times stays pinned until the expected return; a longer
  one is copied to the host tier (GPU copy evictable) and prefetched ahead of the expected return; with no host room
  a context cheaper to recompute than to reload is dropped.
- `WriteThroughRule` (HiCache-like): every idle session's KV is written to the host tier at once, unpinned, loaded
  back only when its next round asks; no tool awareness.

Expected tool times come from the trace (`tool_s`, passed by the coordinator) or from `ToolTimeEstimator`, a
per-session running mean of log gaps with a global prior.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, StrEnum


class IdleRuleKind(StrEnum):
    """The rule a tiered worker applies to a session going idle (PolicySpec.idle_kv)."""

    NONE = "none"                # no host tier: the untiered behaviour (retain_idle_kv_s pin, else evictable)
    TTL = "ttl"                  # Continuum's TTL, then offload
    INFERCEPT = "infercept"      # InferCept's min-waste preserve / swap / discard
    TOOL_AWARE = "tool-aware"    # keep short gaps, offload + prefetch long ones
    WRITE_THROUGH = "write-through"   # HiCache-like: offload every idle session, load on demand


class EvictionKind(StrEnum):
    """Which idle KV goes first when a tier is full."""

    LRU = "lru"                  # least recently used first (vLLM's and HiCache's rule)
    RETURN_TIME = "return-time"  # latest expected next use first (Belady with predicted reuse times)


class IdleAction(Enum):
    """The decision for one idle session's KV."""

    KEEP = "keep"                # stay on the GPU (pinned until `pin_until`; evictable after)
    OFFLOAD = "offload"          # copy to the host tier; the GPU copy stays, evictable (or is freed: free_gpu)
    DROP = "drop"                # free the GPU blocks now; the next round recomputes


@dataclass(frozen=True, slots=True)
class IdleContext:
    """What a rule reads about one session going idle (or whose pin ran out)."""

    now: float
    tokens: int                  # KV positions the session holds
    expected_gap_s: float        # expected tool time from now
    reload_s: float              # one copy of its KV over the host link, backlog included
    recompute_s: float           # prefilling its whole context again
    gpu_usage: float             # share of the worker's KV pool in use (memory pressure)
    running_tokens: int          # KV positions of the running batch (InferCept's waste of a stall)
    host_room: bool              # the host tier can take its KV (evicting by its rule if need be)
    pin_expired: bool = False    # called at the end of a pin (TTL), not at the end of a round


@dataclass(frozen=True, slots=True)
class IdleDecision:
    """An action, how long the GPU copy stays pinned, whether to prefetch it ahead of the expected return, and
    whether an offload frees the GPU copy once it has landed."""

    action: IdleAction
    pin_until: float = 0.0
    prefetch: bool = False
    free_gpu: bool = False


KEEP_EVICTABLE = IdleDecision(IdleAction.KEEP)


class TTLRule:
    """Continuum: pin for `ttl_s` after each round; at its end offload when the host tier has room."""

    name = IdleRuleKind.TTL

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s

    def decide(self, c: IdleContext) -> IdleDecision:
        """Pin first; past the TTL, a host copy if it fits (the GPU copy stays evictable)."""
        if not c.pin_expired:
            return IdleDecision(IdleAction.KEEP, pin_until=c.now + self.ttl_s)
        return IdleDecision(IdleAction.OFFLOAD) if c.host_room else KEEP_EVICTABLE


class InferCeptRule:
    """InferCept's min-waste choice per paused request: preserve = gap x context, swap = copy time x (batch +
    context), discard = recompute time x (batch + context); swap only with host room. Swapped KV is freed on the GPU
    and copied back when the next round comes (no prefetch)."""

    name = IdleRuleKind.INFERCEPT

    def decide(self, c: IdleContext) -> IdleDecision:
        """The least wasteful of preserve, swap and discard."""
        if c.pin_expired:
            return KEEP_EVICTABLE
        batch = c.running_tokens + c.tokens
        preserve = c.expected_gap_s * c.tokens
        swap = c.reload_s * batch if c.host_room else math.inf
        discard = c.recompute_s * batch
        best = min(preserve, swap, discard)
        if best == preserve:
            return IdleDecision(IdleAction.KEEP, pin_until=c.now + c.expected_gap_s)
        if best == swap:
            return IdleDecision(IdleAction.OFFLOAD, free_gpu=True)
        return IdleDecision(IdleAction.DROP)


SHORT_GAP_COPIES = 4.0           # a gap under this many copy times (or SHORT_GAP_MIN_S) stays pinned
SHORT_GAP_MIN_S = 1.0
PRESSURE_PIN_LIMIT = 0.95        # above this GPU pool usage nothing new is pinned


class ToolAwareRule:
    """tandem's rule: keep what comes back before a copy out and in would pay off, offload the rest with a
    prefetch ahead of the expected return, drop what is cheaper to recompute than to reload when the host is full."""

    name = IdleRuleKind.TOOL_AWARE

    def decide(self, c: IdleContext) -> IdleDecision:
        """Keep short gaps pinned (below the pressure limit), offload long ones with a prefetch, else drop."""
        if c.pin_expired:                        # the return came later than expected: offload now if it fits
            return IdleDecision(IdleAction.OFFLOAD, prefetch=True) if c.host_room else KEEP_EVICTABLE
        short = c.expected_gap_s <= max(SHORT_GAP_MIN_S, SHORT_GAP_COPIES * c.reload_s)
        if short and c.gpu_usage < PRESSURE_PIN_LIMIT:
            return IdleDecision(IdleAction.KEEP, pin_until=c.now + c.expected_gap_s)
        if c.host_room:
            return IdleDecision(IdleAction.OFFLOAD, prefetch=True)
        if c.recompute_s <= c.reload_s:
            return IdleDecision(IdleAction.DROP)
        return KEEP_EVICTABLE


class WriteThroughRule:
    """HiCache-like: write every idle session's KV to the host tier, keep the GPU copy evictable, no prefetch."""

    name = IdleRuleKind.WRITE_THROUGH

    def decide(self, c: IdleContext) -> IdleDecision:
        """Offload when it fits, whatever the tool."""
        if c.pin_expired:
            return KEEP_EVICTABLE
        return IdleDecision(IdleAction.OFFLOAD) if c.host_room else KEEP_EVICTABLE


IdleRule = TTLRule | InferCeptRule | ToolAwareRule | WriteThroughRule


def make_idle_rule(kind: IdleRuleKind | str, ttl_s: float) -> IdleRule:
    """The rule object of a policy's idle_kv kind (ValueError for NONE: an untiered worker has no rule)."""
    kind = IdleRuleKind(kind)
    if kind is IdleRuleKind.TTL:
        return TTLRule(ttl_s)
    rules = {IdleRuleKind.INFERCEPT: InferCeptRule, IdleRuleKind.TOOL_AWARE: ToolAwareRule,
             IdleRuleKind.WRITE_THROUGH: WriteThroughRule}
    if kind not in rules:
        raise ValueError("an untiered policy (idle_kv none) has no idle rule")
    return rules[kind]()


PRIOR_GAP_S = 10.0               # expected tool time before any gap was seen
LOG_EWMA = 0.3                   # weight of the newest gap in the running mean of log gaps


class ToolTimeEstimator:
    """Expected tool time of a session: its running geometric mean of observed gaps, else the worker's, else a
    prior (gaps span seconds to hours, so they are averaged in log space)."""

    def __init__(self, prior_s: float = PRIOR_GAP_S) -> None:
        self._global = math.log(prior_s)
        self._seen = False
        self._by_session: dict[str, float] = {}

    def observe(self, session_id: str, gap_s: float) -> None:
        """A session came back after `gap_s` idle seconds."""
        x = math.log(max(gap_s, 1e-3))
        self._global = x if not self._seen else (1 - LOG_EWMA) * self._global + LOG_EWMA * x
        self._seen = True
        old = self._by_session.get(session_id)
        self._by_session[session_id] = x if old is None else (1 - LOG_EWMA) * old + LOG_EWMA * x

    def expected(self, session_id: str) -> float:
        """Expected gap of the session's current tool call."""
        return math.exp(self._by_session.get(session_id, self._global))

    def forget(self, session_id: str) -> None:
        """The session ended."""
        self._by_session.pop(session_id, None)
