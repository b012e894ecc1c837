"""Named scheduling policies (AMPD, its ablations, the Dynamo / vLLM / Continuum baselines) as validated specs."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

from tandem.policy.checks import check_int
from tandem.policy.kv_tiers import EvictionKind, IdleRuleKind


class RouterKind(StrEnum):
    """Where a round's prefill runs (tandem/policy/routing.py)."""

    ADAPTIVE = "adaptive"                    # AMPD Alg. 1, slack predicted by Eq. 1-2
    ADAPTIVE_WINDOW = "adaptive-window"      # AMPD Alg. 1 verbatim: slack from the windowed mean TTFT
    ADAPTIVE_REMOTE = "adaptive-remote"      # Alg. 1 lines 1-3 then the cheapest prefill worker, never local
    LEAST_COST_REMOTE = "least-cost-remote"  # Dynamo-like: always the cheapest prefill worker
    LOCAL = "local"                          # co-located: on the session's own worker
    ROUND_ROBIN = "round-robin"              # SGLang's vanilla data parallelism: prefill workers in turn
    LEAST_LOAD = "least-load"                # SGLang's router, load balancing: the least queued prefill work


class PickerKind(StrEnum):
    """Which queued prefill a worker takes next (tandem/policy/reorder.py)."""

    FCFS = "fcfs"
    TTFT_AWARE = "ttft-aware"                # AMPD Alg. 2
    SESSION_FIRST = "session-first"          # Continuum: continuations first


class PrefillSchedKind(StrEnum):
    """How a prefill worker forms its steps (tandem/core/worker.py, tandem/core/laps_sched.py)."""

    CHUNKED = "chunked"                      # FCFS admission, steps filled up to the token budget (SGLang/vLLM)
    LAPS = "laps"                            # LAPS temporal disaggregation: short batches by AWD, long by chunks


class HistorySource(StrEnum):
    """Where a remote prefill gets the KV of the session's history."""

    READ = "read"                            # AMPD: read from the decode worker that holds it (incremental prefill)
    RECOMPUTE = "recompute"                  # vLLM's PD proxy: the prefill instance is sent the whole prompt and
                                             # computes it (the history's KV on the decode worker is not read)


class BinderKind(StrEnum):
    """Which decode worker a new session is bound to (tandem/policy/binding.py)."""

    PREFIX_AFFINITY = "prefix-affinity"      # longest cached prefix, else least committed KV
    LEAST_KV = "least-kv"                    # least committed KV (AMPD step 1, Dynamo's KV router)


def _enum(kind: type[StrEnum], value, what: str):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(k.value for k in kind)}") from None


class LapsRole(StrEnum):
    """What LAPS does on one worker."""

    NONE = "none"
    PREFILL = "prefill"      # a prefill worker: length classes, AWD bucket steps, long prefills in chunks
    LOCAL = "local"          # a decode worker: AWD over its short local prefills


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One serving policy: where prefills run, how queues are ordered, how idle KV is kept. Validated on
    construction (unknown names and out-of-range knobs raise ValueError); `with_options` makes a variant."""

    name: str
    disaggregated: bool
    router: RouterKind
    picker: PickerKind
    binder: BinderKind = BinderKind.PREFIX_AFFINITY
    reorder_window: int = 3      # AMPD Alg. 2: tasks considered at the head of the queue (and postponement cap)
    retain_idle_kv_s: float = 0.0  # Continuum: pin a session's idle KV this long across its tool call (0: evictable)
    alpha: float = 0.9           # AMPD Alg. 1: a prefill worker has TTFT slack below alpha * SLO
    beta: float = 0.85           # AMPD Alg. 1: the decode worker has ITL slack below beta * SLO
    prefill_sched: PrefillSchedKind = PrefillSchedKind.CHUNKED
    laps_pools: bool = False     # LAPS spatial mode: remote prefills go to the short or long pool of their class
    laps_split: bool = True      # LAPS: short and long prefills in separate queues (False: one chunked FCFS queue)
    laps_graphs: bool = True     # LAPS: short batches padded to a captured (length, batch) bucket, run as a graph
    laps_length_threshold: int | None = None   # LAPS: SHORT below this many new tokens (None: 256, LAPS's default)
    laps_long_chunk: int | None = None         # LAPS C_l: tokens per long-prefill step (None: the token budget)
    laps_min_pool: int = 1       # LAPS Alg. 2: neither pool drops below this many prefill workers (0: a class may
                                 # lose its pool; its prefills then go to any prefill worker, served temporally)
    local_chunked: bool = False  # a decode worker's local prefill runs in chunks mixed with its decodes, each step
                                 # within beta * the round's ITL SLO (Sarathi-style), not prefill-first
    remote_history: HistorySource = HistorySource.READ   # a remote prefill reads or recomputes the history
    laps_local_awd: bool = False  # AMPD+LAPS: a decode worker's short local prefills wait in AWD and run as one
                                  # batch (padded to a bucket with laps_graphs), pausing its decodes once per batch
    mixed_chunk: bool = True     # co-located: decodes ride along prefill chunks (vLLM); False: a waiting prefill runs
                                 # first and the decodes pause for it (SGLang's default, --enable-mixed-chunk off)
    idle_kv: IdleRuleKind = IdleRuleKind.NONE   # host KV tier: the rule for a session going idle (none: no tier)
    kv_eviction: EvictionKind = EvictionKind.LRU  # host KV tier: which idle KV goes first from either tier
    cache_aware: bool = False    # bind new sessions by the KV events' tiers (longest held prefix, weighted by load)
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "router", _enum(RouterKind, self.router, "router"))
        object.__setattr__(self, "picker", _enum(PickerKind, self.picker, "picker"))
        object.__setattr__(self, "binder", _enum(BinderKind, self.binder, "binder"))
        object.__setattr__(self, "prefill_sched", _enum(PrefillSchedKind, self.prefill_sched, "prefill scheduler"))
        object.__setattr__(self, "remote_history", _enum(HistorySource, self.remote_history, "remote history"))
        object.__setattr__(self, "idle_kv", _enum(IdleRuleKind, self.idle_kv, "idle KV rule"))
        object.__setattr__(self, "kv_eviction", _enum(EvictionKind, self.kv_eviction, "KV eviction rule"))
        for knob in ("laps_pools", "laps_split", "laps_graphs", "local_chunked", "laps_local_awd", "mixed_chunk",
                     "cache_aware"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{knob} must be a bool, got {getattr(self, knob)!r}")
        check_int("laps_min_pool", self.laps_min_pool, 0)
        for knob in ("laps_length_threshold", "laps_long_chunk"):
            check_int(knob, getattr(self, knob), 1, optional=True)
        if self.laps_local_awd and (self.prefill_sched is not PrefillSchedKind.LAPS or not self.disaggregated
                                    or self.local_chunked):
            raise ValueError("laps_local_awd needs a disaggregated LAPS policy whose local prefills run prefill-first "
                             "(not local_chunked)")
        if self.laps_pools and not self.disaggregated:
            raise ValueError("laps_pools needs a disaggregated policy (pools of prefill workers)")
        check_int("reorder_window", self.reorder_window, 1)
        if not (isinstance(self.retain_idle_kv_s, (int, float)) and 0 <= self.retain_idle_kv_s < math.inf):
            raise ValueError(f"retain_idle_kv_s must be a finite number of seconds >= 0, got {self.retain_idle_kv_s!r}")
        for knob in ("alpha", "beta"):
            v = getattr(self, knob)
            if not (isinstance(v, (int, float)) and 0 < v <= 10):
                raise ValueError(f"{knob} must be in (0, 10], got {v!r}")
        if self.idle_kv is IdleRuleKind.TTL and not self.retain_idle_kv:
            raise ValueError("the ttl idle KV rule needs retain_idle_kv_s > 0 (its TTL)")
        if not self.disaggregated and self.router != RouterKind.LOCAL:
            raise ValueError(f"a co-located policy routes every prefill locally, got router {self.router.value!r}")

    @property
    def retain_idle_kv(self) -> bool:
        return self.retain_idle_kv_s > 0

    def laps_role(self, role: str) -> LapsRole:
        """What LAPS runs on a worker of this role: AWD bucket steps of a prefill worker, AWD over the short local
        prefills of a decode worker (AMPD+LAPS's laps_local_awd), or nothing."""
        if self.prefill_sched is not PrefillSchedKind.LAPS:
            return LapsRole.NONE
        if role == "prefill":
            return LapsRole.PREFILL
        return LapsRole.LOCAL if role == "decode" and self.laps_local_awd else LapsRole.NONE

    def bucket_steps(self, role: str) -> bool:
        """Whether a worker of this role runs LAPS's bucket steps (captured graphs when laps_graphs)."""
        return self.laps_graphs and self.laps_role(role) is not LapsRole.NONE
    @property
    def tiered(self) -> bool:
        """Whether the policy keeps idle KV in a host-memory tier (needs --kv-offloading-size)."""
        return self.idle_kv is not IdleRuleKind.NONE

    def with_options(self, **options) -> PolicySpec:
        """This policy with some knobs changed (validated again)."""
        return dataclasses.replace(self, **options)


_LAPS = PolicySpec("laps", True, RouterKind.LEAST_COST_REMOTE, PickerKind.FCFS, prefill_sched=PrefillSchedKind.LAPS,
                   laps_pools=True,
                   description="LAPS: every prefill on a prefill worker of its length class's pool (Alg. 2 "
                               "controller); short prefills batched by AWD into graph buckets, long ones in chunks "
                               "(Alg. 1)")
_AMPD_LAPS = PolicySpec("ampd+laps", True, RouterKind.ADAPTIVE, PickerKind.TTFT_AWARE,
                        prefill_sched=PrefillSchedKind.LAPS, laps_pools=True, laps_local_awd=True,
                        description="AMPD's routing (Alg. 1) decides local or remote; a remote prefill goes to its "
                                    "class's LAPS pool, where short ones are batched by AWD and long ones chunked; a "
                                    "decode worker's short local prefills are batched by AWD too")

POLICIES: dict[str, PolicySpec] = {p.name: p for p in (
    PolicySpec("ampd", True, RouterKind.ADAPTIVE, PickerKind.TTFT_AWARE,
               description="AMPD: adaptive local/remote routing (Alg. 1) + TTFT-aware prefill reordering (Alg. 2)"),
    PolicySpec("ampd-window", True, RouterKind.ADAPTIVE_WINDOW, PickerKind.TTFT_AWARE,
               description="AMPD with Alg. 1 verbatim: TTFT slack read from the 10 s windowed mean TTFT"),
    PolicySpec("ampd-no-pr", True, RouterKind.ADAPTIVE, PickerKind.FCFS,
               description="AMPD without prefill reordering"),
    PolicySpec("ampd-no-ar-pr", True, RouterKind.ADAPTIVE_REMOTE, PickerKind.FCFS,
               description="AMPD without adaptive routing and reordering: always remote (Alg. 1 lines 1-3, then cheapest prefill worker), FCFS"),
    PolicySpec("dynamo", True, RouterKind.LEAST_COST_REMOTE, PickerKind.FCFS,
               description="Dynamo-like: every prefill on a prefill worker (KV-aware cheapest), FCFS"),
    _LAPS,
    _LAPS.with_options(name="laps-no-graph", laps_graphs=False,
                       description="LAPS with disaggregation only: short/long queues and pools, short batches run "
                                   "unpadded and eagerly"),
    _LAPS.with_options(name="laps-no-split", laps_split=False, laps_pools=False,
                       description="LAPS with CUDA graphs only: one chunked FCFS queue; a step of short prefills that "
                                   "fits a bucket runs padded as a graph"),
    _AMPD_LAPS,
    _AMPD_LAPS.with_options(name="ampd+laps-no-local-awd", laps_local_awd=False,
                            description="AMPD+LAPS whose decode workers run each local prefill as it comes "
                                        "(prefill-first), without AWD batching"),
    _AMPD_LAPS.with_options(name="ampd+laps-chunked", local_chunked=True, laps_local_awd=False,
                            description="AMPD+LAPS whose local prefills run in chunks mixed with the decode worker's "
                                        "decodes, each step within beta * the ITL SLO (Sarathi-style), instead of "
                                        "pausing them"),
    PolicySpec("sglang-pd", True, RouterKind.ROUND_ROBIN, PickerKind.FCFS,
               description="SGLang-like PD, vanilla data parallelism: prefill workers in turn, FCFS, steps filled up "
                           "to the token budget"),
    PolicySpec("sglang-pd-router", True, RouterKind.LEAST_LOAD, PickerKind.FCFS,
               description="SGLang-like PD behind its SLO-unaware router (load balancing): the prefill worker with the "
                           "least queued work, FCFS, steps filled up to the token budget"),
    PolicySpec("vllm-pd", True, RouterKind.ROUND_ROBIN, PickerKind.FCFS, binder=BinderKind.LEAST_KV,
               remote_history=HistorySource.RECOMPUTE,
               description="vLLM-like PD (its disaggregated-serving proxy): every prefill on a prefill instance taken "
                           "in turn, which is sent the whole prompt and computes it (history included), FCFS, steps "
                           "filled up to the token budget; sessions bound to the decode worker with the least KV"),
    PolicySpec("vllm", False, RouterKind.LOCAL, PickerKind.FCFS,
               description="vLLM-like co-located: continuous batching with chunked prefill, prefix-cached KV evictable"),
    PolicySpec("sglang", False, RouterKind.LOCAL, PickerKind.FCFS, mixed_chunk=False,
               description="SGLang-like co-located: a waiting prefill runs before the decodes, which pause for it "
                           "(mixed chunks off, SGLang's default); prefix-cached KV evictable"),
    PolicySpec("continuum", False, RouterKind.LOCAL, PickerKind.SESSION_FIRST, retain_idle_kv_s=30.0,
               description="Continuum-like co-located: same-session priority, KV pinned for a TTL across tool calls"),
    # host KV tiers (docs/kv-tiers.md): each needs --kv-offloading-size
    PolicySpec("continuum-tiered", False, RouterKind.LOCAL, PickerKind.SESSION_FIRST, retain_idle_kv_s=30.0,
               idle_kv=IdleRuleKind.TTL,
               description="Continuum with a host tier: KV pinned for the TTL, then copied to host memory (GPU copy "
                           "evictable), loaded back when its round comes; LRU in both tiers"),
    PolicySpec("continuum-tool", False, RouterKind.LOCAL, PickerKind.SESSION_FIRST,
               idle_kv=IdleRuleKind.TOOL_AWARE, kv_eviction=EvictionKind.RETURN_TIME, cache_aware=True,
               description="co-located, tool-aware host tier: short tool gaps pinned, long ones offloaded and "
                           "prefetched before the expected return; latest expected return evicted first; "
                           "cache-aware binding"),
    PolicySpec("ampd-tiered", True, RouterKind.ADAPTIVE, PickerKind.TTFT_AWARE,
               idle_kv=IdleRuleKind.TOOL_AWARE, kv_eviction=EvictionKind.RETURN_TIME, cache_aware=True,
               description="AMPD with the tool-aware host tier on its decode workers and cache-aware session "
                           "binding"),
    PolicySpec("hicache", False, RouterKind.LOCAL, PickerKind.FCFS, idle_kv=IdleRuleKind.WRITE_THROUGH,
               description="HiCache-like co-located: every idle KV written through to host memory, LRU in both "
                           "tiers, loaded back on demand; no tool awareness"),
    PolicySpec("infercept", False, RouterKind.LOCAL, PickerKind.FCFS, idle_kv=IdleRuleKind.INFERCEPT,
               description="InferCept-like co-located: per paused session the least wasteful of preserve, swap "
                           "(to the host tier) and discard"),
)}


def get_policy(name: str | PolicySpec) -> PolicySpec:
    """Look up a policy by name (a spec is returned as is); ValueError lists the valid ones."""
    if isinstance(name, PolicySpec):
        return name
    if not isinstance(name, str):
        raise ValueError(f"a policy is named by a string, got {name!r}")
    try:
        return POLICIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
