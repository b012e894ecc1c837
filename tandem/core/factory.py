"""The one construction path of the cores: every Coordinator and WorkerCore of the simulator, the engine and
the runtime's processes is built here, from a validated PolicySpec and SchedulerConfig, so a policy named
anywhere is the policy that runs everywhere."""
from __future__ import annotations

import random
from typing import Callable

from tandem.core.chunked_planner import ChunkedPlanner, StepPlanner
from tandem.core.config import PreemptionMode, SchedulerConfig
from tandem.core.coordinator import Coordinator, CoordinatorView
from tandem.core.host_tier import HostTier
from tandem.core.laps_planner import LapsPlanner
from tandem.core.laps_sched import LapsScheduler, LocalLaps, laps_options
from tandem.core.phase_planner import PhasePlanner
from tandem.core.tiering import TierManager
from tandem.core.types import COLOCATED, Role
from tandem.core.window_planner import WindowPlanner
from tandem.core.worker import WorkerConfig, WorkerCore
from tandem.policy.binding import CacheAwareBinder, LeastKVBinder, PrefixAffinityBinder
from tandem.policy.kv_tiers import make_idle_rule
from tandem.policy.laps.classify import DEFAULT_THRESHOLD, LengthClassifier
from tandem.policy.laps.pools import PooledRouter
from tandem.perf.batch_shape import BatchShape
from tandem.policy.laps.pressure import PressureConfig
from tandem.policy.dllm_serve import Admission, DllmServe
from tandem.policy.optimus.chunk import ChunkMode, ChunkSizer, StepLatency, parse_chunk
from tandem.policy.optimus.latency import ChunkLatency
from tandem.policy.presets import (
    POLICIES, BinderKind, LapsRole, HistorySource, PickerKind, PolicySpec, RouterKind, get_policy,
)
from tandem.policy.reorder import FCFS, Picker, SessionFirst, TTFTAwareReorder
from tandem.policy.routing import (
    AdaptiveRouter, LeastCostRemoteRouter, LeastLoadRouter, LocalRouter, RoundRobinRouter, Router,
)

__all__ = ["build_worker", "build_coordinator", "laps_threshold", "make_planner", "make_router", "make_picker",
           "resolve_policy"]


def resolve_policy(policy: str | PolicySpec, **options) -> PolicySpec:
    """A validated policy spec from a name or spec, with knobs overridden (ValueError names the bad one)."""
    spec = get_policy(policy)
    return spec.with_options(**options) if options else spec


def laps_threshold(spec: PolicySpec, boundary: int | None = None) -> int:
    """LAPS's class threshold: the policy's laps_length_threshold if set, else the cost model's boundary L_m
    (a roofline's or a fit's, given by the shell with its cost model), else LAPS's own default, 256."""
    return spec.laps_length_threshold or boundary or DEFAULT_THRESHOLD


def make_router(spec: PolicySpec, rng: random.Random, boundary: int | None = None) -> Router:
    """The routing object of a policy (AMPD Alg. 1 and the baselines' fixed rules), within LAPS's class pools
    when the policy has them."""
    router = _base_router(spec, rng)
    if spec.laps_pools:
        return PooledRouter(router, LengthClassifier(laps_threshold(spec, boundary)),
                            PressureConfig(n_min=spec.laps_min_pool))
    return router


# the routers without state of their own, and the AdaptiveRouter variants' options beside AMPD's (alpha, beta)
_FIXED_ROUTERS = {RouterKind.LEAST_COST_REMOTE: LeastCostRemoteRouter, RouterKind.LOCAL: LocalRouter,
                  RouterKind.ROUND_ROBIN: RoundRobinRouter, RouterKind.LEAST_LOAD: LeastLoadRouter}
_ADAPTIVE = {RouterKind.ADAPTIVE_WINDOW: {"slack": "window"}, RouterKind.ADAPTIVE_REMOTE: {"allow_local": False}}


def _base_router(spec: PolicySpec, rng: random.Random) -> Router:
    kind = spec.router
    if kind is RouterKind.ADAPTIVE:
        return AdaptiveRouter(rng, spec.alpha, spec.beta, local_chunked=spec.local_chunked)
    if kind in _ADAPTIVE:
        return AdaptiveRouter(rng, spec.alpha, spec.beta, **_ADAPTIVE[kind])
    if kind in _FIXED_ROUTERS:
        return _FIXED_ROUTERS[kind]()
    raise ValueError(f"no router for {kind!r}")


def make_picker(spec: PolicySpec) -> Picker:
    """The queue-ordering object of a policy (one per worker: it keeps no cross-worker state)."""
    kind = spec.picker
    if kind is PickerKind.TTFT_AWARE:
        return TTFTAwareReorder(spec.reorder_window)
    if kind is PickerKind.SESSION_FIRST:
        return SessionFirst()
    if kind is PickerKind.FCFS:
        return FCFS()
    raise ValueError(f"no picker for {kind!r}")


def build_worker(wid: int, role: Role | str, tp: int, num_blocks: int, policy: str | PolicySpec,
                 sched: SchedulerConfig | None = None, t_pre: Callable[[int, int], float] | None = None,
                 max_num_batched_tokens: int | None = None, boundary: int | None = None,
                 t_step: Callable[[BatchShape], float] | None = None,
                 latency: ChunkLatency | None = None, kv_block_bytes: int = 0,
                 host_link_s: Callable[[int], float] | None = None) -> WorkerCore:
    """One worker core of `role` with the policy's picker and idle-KV retention and the scheduler's knobs.
    `max_num_batched_tokens` overrides the scheduler's budget for this worker (the simulator's co-located one);
    `boundary` is the cost model's LAPS boundary L_m, the class threshold unless the policy sets one; `t_step`, the
    shell's step timer, gives block-diffusion workers Optimus's T(c, b) (else it is sampled from t_pre) unless the
    shell has `latency`, a fitted T(c, b) of its own (the engine's measured one, a profile's), used as it is. With
    `sched.dllm_admission` the diffusion worker runs dLLM-Serve's Refresh/Reuse phases under that admission policy
    instead of Optimus's windows (co-located workers only: ValueError otherwise). `kv_block_bytes`, the bytes of one
    KV block on this worker, sizes its swap space (0: no swap space, so preemption recomputes) and its host KV tier
    (a tiered policy's, sched.kv_offloading_size GiB; `host_link_s`: seconds to copy n positions over the host link)."""
    spec = get_policy(policy)
    sched = sched or SchedulerConfig()
    role = Role(role)
    swap_blocks = sched.swap_blocks(kv_block_bytes)
    streaming = (bool(sched.dllm_block_length) and not sched.dllm_admission and role != Role.PREFILL
                 and parse_chunk(sched.dllm_chunk).mode is not ChunkMode.BLOCK)
    preemption = sched.preemption(streaming, swap_blocks)
    if preemption is PreemptionMode.SWAP and swap_blocks == 0:
        raise ValueError(f"preemption_mode swap: swap_space {sched.swap_space} GiB holds no KV block of "
                         f"{kv_block_bytes} bytes")
    cfg = WorkerConfig(
        role=role, tp=tp, num_blocks=num_blocks, block_size=sched.block_size,
        max_num_batched_tokens=max_num_batched_tokens or sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs, mix_decode_with_prefill=role == COLOCATED and spec.mixed_chunk,
        retain_s=spec.retain_idle_kv_s, watermark=sched.watermark, window_s=sched.window_s,
        decode_query_tokens=sched.decode_query_tokens,
        dllm_block=sched.dllm_block_length if role != Role.PREFILL else 0, dllm_prefill_share=sched.dllm_prefill_share,
        dllm_admission=sched.dllm_admission or "",
        itl_chunk_beta=spec.beta if spec.local_chunked and role == Role.DECODE else None,
        preemption_mode=preemption, swap_blocks=swap_blocks if preemption is PreemptionMode.SWAP else 0)
    laps, local = None, None
    laps_role = spec.laps_role(role)
    if laps_role is not LapsRole.NONE:
        opts = laps_options(laps_threshold(spec, boundary), spec.laps_split, spec.laps_graphs, spec.laps_long_chunk,
                            cfg.max_num_batched_tokens)
        if laps_role is LapsRole.PREFILL:
            laps = LapsScheduler(opts, t_pre or (lambda h, n: 0.0))
        else:
            local = LocalLaps(opts, t_pre or (lambda h, n: 0.0))
    chunker, dllm = None, None
    if sched.dllm_admission:
        if role != COLOCATED:
            raise ValueError(f"dLLM-Serve admission ({sched.dllm_admission}) runs on co-located workers: a request's "
                             f"first step is its prefill and its first Refresh; got a {role} worker")
        dllm = DllmServe(sched.phase_spec(), Admission(sched.dllm_admission, cfg.max_num_batched_tokens,
                                                       cfg.max_num_seqs))
    elif sched.dllm_block_length and role != Role.PREFILL:
        chunker = ChunkSizer(parse_chunk(sched.dllm_chunk), sched.dllm_block_length,
                             latency.rows if latency is not None else chunk_latency(t_step, t_pre))
    core = WorkerCore(wid, cfg, make_picker(spec), t_pre, laps=laps, local_laps=local, chunker=chunker, dllm=dllm,
                      planner=make_planner(laps, chunker, dllm))
    if sched.kv_offloading_size and not spec.tiered:
        raise ValueError(f"policy {spec.name} keeps no KV in host memory: --kv-offloading-size needs a tiered policy "
                         f"({', '.join(p.name for p in POLICIES.values() if p.tiered)})")
    if spec.tiered and role != Role.PREFILL:
        core.kv.tier = make_tier(core, spec, sched, kv_block_bytes, host_link_s, t_pre)
    return core


def make_tier(core: WorkerCore, spec: PolicySpec, sched: SchedulerConfig, kv_block_bytes: int,
              host_link_s: Callable[[int], float] | None, t_pre: Callable[[int, int], float] | None) -> TierManager:
    """The host KV tier of a (decode or co-located, autoregressive) worker of a tiered policy."""
    if core.cfg.dllm_block:
        raise ValueError(f"policy {spec.name}: host KV tiers serve autoregressive models only")
    blocks = sched.host_tier_blocks(kv_block_bytes, core.cfg.tp)
    if blocks < 1:
        raise ValueError(f"policy {spec.name} keeps idle KV in host memory: give --kv-offloading-size (GiB per "
                         f"worker) room for at least one block of {kv_block_bytes * core.cfg.tp} bytes")
    if host_link_s is None:
        raise ValueError(f"policy {spec.name}: this shell has no host-link cost for the KV tier's copies")
    return TierManager(core.kv, HostTier(blocks, spec.kv_eviction), make_idle_rule(spec.idle_kv, spec.retain_idle_kv_s),
                       host_link_s, t_pre or (lambda h, n: 0.0))


def make_planner(laps: LapsScheduler | None, chunker: ChunkSizer | None, dllm: DllmServe | None) -> StepPlanner:
    """A worker's step planner, picked once from its mode: dLLM-Serve phases, Optimus windows, LAPS buckets
    (temporal disaggregation on), else autoregressive chunked steps."""
    if dllm is not None:
        return PhasePlanner(dllm)
    if chunker is not None:
        return WindowPlanner(chunker)
    if laps is not None and laps.opts.split:
        return LapsPlanner()
    return ChunkedPlanner()


def chunk_latency(t_step: Callable[[BatchShape], float] | None,
                  t_pre: Callable[[int, int], float] | None) -> StepLatency:
    """Optimus's T for a diffusion step of `rows` query rows in `seqs` windows over `ctx` cached tokens in all, beside
    `prefill` prompt rows (one chunk with no history: the sizer prices what its windows add to them): the
    shell's step timer (the roofline's or a profile's) priced on that batch, which also charges the cached keys the
    windows read (once per sequence, whatever the window: at long contexts they decide the step); with no step
    timer, ChunkLatency fitted to the prefill estimate of b·c tokens (the paper's form, piecewise affine in b·c).
    The step timer charges the LM head on every window row, as the simulated step it times does, so the rows
    sampled (the sizer's fourth argument) do not change its price."""
    if t_step is None:
        return ChunkLatency.sample(lambda x: t_pre(0, x) if t_pre is not None else 1e-3 * x).rows

    def priced(rows: int, seqs: int, ctx: int, sampled: int, prefill: int) -> float:
        shape = BatchShape()
        shape.add_windows(seqs, ctx, rows)
        if prefill:
            shape.add_prefill(0, prefill)
        return t_step(shape)
    return priced


def build_coordinator(view: CoordinatorView, policy: str | PolicySpec, sched: SchedulerConfig | None = None,
                      seed: int | random.Random = 0, max_context: int | None = None,
                      boundary: int | None = None) -> Coordinator:
    """The coordinator core with the policy's router and binder and the scheduler's timeouts (`boundary`: as
    build_worker's, so that the router and the workers classify alike)."""
    spec = get_policy(policy)
    sched = sched or SchedulerConfig()
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    if spec.cache_aware:
        binder = CacheAwareBinder()
    else:
        binder = PrefixAffinityBinder() if spec.binder is BinderKind.PREFIX_AFFINITY else LeastKVBinder()
    return Coordinator(view, make_router(spec, rng, boundary), binder, max_context=max_context,
                       kv_timeout_s=sched.kv_timeout_s, session_ttl_s=sched.session_ttl_s,
                       block_size=sched.block_size, recompute_history=spec.remote_history is HistorySource.RECOMPUTE,
                       tool_hints=spec.tiered)
