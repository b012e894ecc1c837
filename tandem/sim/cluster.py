"""Build a simulated cluster from a deployment and a policy, run sessions through it, return records."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from tandem.core.admission import check_deployment
from tandem.core.coordinator import Coordinator
from tandem.core.deploy import Deployment, DeploymentError, parse_deploy
from tandem.core.factory import build_coordinator, build_worker
from tandem.core.state import InProcessState
from tandem.core.types import COLOCATED, PREFILL
from tandem.core.worker import WorkerCore
from tandem.perf.costs import routing_costs, step_timer
from tandem.perf.measured.source import MissingCostData
from tandem.perf.dllm import FIXED_SCHEDULE_COMMITS, OPTIMUS_TABLE2, commit_model, stretch_model
from tandem.perf.dllm_memory import DllmMemory
from tandem.perf.errors import DoesNotFitError, UnknownNameError
from tandem.perf.hardware import get_gpu
from tandem.perf.models import get_model
from tandem.perf.roofline import kv_bytes_per_token_per_gpu, kv_capacity_tokens
from tandem.perf.profile_io import PerfFileError, load_perf
from tandem.perf.step_model import Profile
from tandem.policy.presets import POLICIES
from tandem.sim.config import ConfigError, SimConfig
from tandem.sim.commit import StretchCommit, UniformCommit
from tandem.policy.laps.cost import boundary_from_profile
from tandem.policy.optimus.latency import ChunkLatency
from tandem.sim.faults import FaultError
from tandem.sim.host_loop import HostLoop
from tandem.sim.loop import EventLoop
from tandem.sim.network import Network
from tandem.workload.metrics import RecordStream
from tandem.workload.records import SessionRecord
from tandem.workload.session import Session

__all__ = ["SimConfig", "SimResult", "simulate", "build", "load_perf", "ConfigError", "POLICIES", "FaultError",
           "dllm_pool", "dllm_serve_summary", "kv_tier_summary"]


@dataclass(slots=True)
class SimResult:
    records: list[SessionRecord]
    sim_time_s: float
    wall_s: float
    events: int
    deployment: str
    policy: str
    workers: list[dict] = field(default_factory=list)   # per worker: id, role, tp, steps, busy_s, KV (+ "laps" counters)
    pool_moves: list[dict] = field(default_factory=list)  # LAPS pools: prefill workers moved (instance, from, to, at_s)
    metrics: dict | None = None     # with a record stream: summarize() of the streamed records (records is then [])
    rebinds: int = 0                # bound sessions moved to another worker between rounds (cache-aware binding)


def dllm_summary(workers: list[dict]) -> dict:
    """Block-diffusion figures of a run over its workers: mean tokens committed per sequence-step, mean window
    chosen per step, and both histograms ({} for an autoregressive run)."""
    chunks: dict[int, int] = {}
    commits: dict[int, int] = {}
    for w in workers:
        d = w.get("dllm")
        if d:
            for c, n in d["chunk_steps"].items():
                chunks[c] = chunks.get(c, 0) + n
            for k, n in d["commits"].items():
                commits[k] = commits.get(k, 0) + n
    if not chunks and not commits:
        return {}
    steps, seq_steps = sum(chunks.values()), sum(commits.values())
    return {"dllm_tokens_per_step": sum(k * n for k, n in commits.items()) / seq_steps if seq_steps else None,
            "dllm_chunk_mean": sum(c * n for c, n in chunks.items()) / steps if steps else None,
            "dllm_chunk_steps": dict(sorted(chunks.items())), "dllm_commits": dict(sorted(commits.items()))}


def place(dep: Deployment, gpus_per_node: int, gpus: int) -> list[int]:
    """Node index of every worker: GPUs are packed in order; a worker never straddles two nodes."""
    nodes, used = [], 0
    for _, tp in dep.workers():
        if tp > gpus_per_node:
            raise DeploymentError(f"tp{tp} spans more than one node of {gpus_per_node} GPUs")
        if used % gpus_per_node + tp > gpus_per_node:
            used += gpus_per_node - used % gpus_per_node
        nodes.append(used // gpus_per_node)
        used += tp
    if used > gpus:
        raise DeploymentError(f"deployment {dep} cannot be packed into {gpus} GPUs without splitting a worker "
                              f"across nodes of {gpus_per_node}")
    return nodes


def build(cfg: SimConfig) -> tuple[Coordinator, list[WorkerCore], EventLoop]:
    """Instantiate the cores (through the factory), the cost models and the shell for `cfg`."""
    spec = cfg.policy_spec()
    if cfg.gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {cfg.gpus}")
    c = cfg.concurrency
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ConfigError(f"concurrency must be None or an integer >= 1, got {c!r}")
    dep = parse_deploy(cfg.deploy, cfg.gpus)
    try:
        check_deployment(spec, dep)
    except DeploymentError as e:
        raise ConfigError(str(e)) from None
    try:
        perf = load_perf(cfg.perf) if cfg.perf else None
    except PerfFileError as e:
        raise ConfigError(str(e)) from None
    if isinstance(perf, Profile):
        return _build_profiled(cfg, spec, dep, perf)
    model, gpu = cfg.model_spec(), get_gpu(cfg.gpu)
    nodes = place(dep, gpu.gpus_per_node, cfg.gpus)
    tps = tuple(sorted({tp for _, tp in dep.workers()}))
    eps = dep.expert_parallel()                 # routing costs stay those of tp-sharded experts
    choice = cfg.cost_choice()
    try:
        step_timers = {(tp, ep): step_timer(model, gpu.name, tp, choice, ep)
                       for (_, tp), ep in zip(dep.workers(), eps)}
        cost = perf if perf is not None else routing_costs(model, gpu.name, tps, choice)
    except MissingCostData as e:                # an unreadable or incomplete table of the package
        raise ConfigError(str(e)) from None
    sched = cfg.scheduler()
    workers, timers, swaps = [], [], []
    prefill = [(tp, ep) for (role, tp), ep in zip(dep.workers(), eps) if role == PREFILL]
    boundary = step_timers[min(prefill)].prefill_boundary() if prefill else None   # LAPS's L_m
    for wid, ((role, tp), ep) in enumerate(zip(dep.workers(), eps)):
        budget = cfg.colocated_max_num_batched_tokens if role == COLOCATED else None
        if sched.dllm_admission:
            cap, budget = dllm_pool(cfg, tp)
        else:
            cap = kv_capacity_tokens(model, gpu, tp, mem_util=cfg.mem_util)
        def t_pre(h: int, n: int, _tp: int = tp) -> float:
            return cost.t_pre(h, n, _tp)
        roof = step_timers[(tp, ep)]
        timer = roof.step_time
        try:
            workers.append(build_worker(wid, role, tp, cap // cfg.block_size, spec, sched, t_pre,
                                        max_num_batched_tokens=budget, boundary=boundary, t_step=timer,
                                        kv_block_bytes=kv_bytes_per_token_per_gpu(model, tp) * cfg.block_size,
                                        host_link_s=step_timers[(tp, ep)].swap_time))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        timers.append(timer)
        swaps.append(roof.swap_time)
    state = InProcessState(workers, cost, nodes)
    coord = build_coordinator(state, spec, sched, random.Random(cfg.seed), max_context=model.max_context,
                              boundary=boundary)
    net = Network(nodes, [w.cfg.tp for w in workers],
                  nvlink_bps=gpu.nvlink_gbs * 1e9 * gpu.link_eff, net_bps=gpu.net_gbs * 1e9 * gpu.link_eff,
                  nvlink_latency_s=gpu.nvlink_latency_s, net_latency_s=gpu.net_latency_s, schedule=None)
    loop = EventLoop(coord, workers, timers, net, model.kv_bytes_per_token)
    loop.swap_time = swaps
    _shell_options(loop, cfg, state)
    return coord, workers, loop


def dllm_pool(cfg: SimConfig, tp: int) -> tuple[int, int]:
    """dLLM-Serve mode: a co-located worker's KV pool (positions) and token budget from the memory model
    (tandem.perf.dllm_memory): the budget is colocated_max_num_batched_tokens, or, when 0, the largest whose peak
    (at max_num_logits rows of logits at once) leaves KV for the retained positions of that many query tokens (what
    request-level batching that reserves each request's Refresh peak can run); the pool is what that peak leaves."""
    mem = DllmMemory(cfg.model_spec(), get_gpu(cfg.gpu), tp, cfg.mem_util)
    logits = cfg.max_num_logits
    if logits is not None and (isinstance(logits, bool) or not isinstance(logits, int) or logits < 1):
        raise ConfigError(f"max_num_logits must be None or an integer >= 1, got {logits!r}")
    budget = cfg.colocated_max_num_batched_tokens
    if not budget:
        budget = mem.feasible_batched_tokens(logits, cfg.dllm_kv_retention)
        if budget < 1:
            raise ConfigError(f"{mem.model.name} on {mem.gpu.name} (tp{tp}) leaves no memory for a step: weights "
                              f"{mem.weights_bytes / 2**30:.2f} GiB of a {mem.budget_bytes / 2**30:.2f} GiB budget")
    try:
        return mem.kv_pool_tokens(budget, logits), budget
    except DoesNotFitError as e:
        raise ConfigError(str(e)) from None


def kv_tier_summary(workers: list[dict]) -> dict:
    """Host KV tier counters of a run summed over its workers ({"kv_tier": {...}}; {} for an untiered run)."""
    tiers = [w["kv_tier"] for w in workers if w.get("kv_tier")]
    return {"kv_tier": {k: sum(t[k] for t in tiers) for k in tiers[0]}} if tiers else {}


def dllm_serve_summary(workers: list[dict]) -> dict:
    """dLLM-Serve figures of a run over its workers: packed query tokens per step (mean, max), the Refresh share of
    the sequence-steps, deferrals and the longest wait, and the largest running set ({} outside the mode)."""
    rows = [w["dllm_serve"] for w in workers if w.get("dllm_serve")]
    if not rows:
        return {}
    steps = sum(r["steps"] for r in rows)
    seq = {k: sum(r["seq_steps"][k] for r in rows) for k in rows[0]["seq_steps"]}
    total = sum(seq.values())
    return {"dllm_batch_tokens_mean": sum(r["tokens"] for r in rows) / steps if steps else None,
            "dllm_batch_tokens_max": max(r["max_tokens"] for r in rows),
            "dllm_refresh_share": (seq.get("full", 0) + seq.get("refresh", 0)) / total if total else None,
            "dllm_deferrals": sum(r["deferrals"] for r in rows),
            "dllm_max_deferred_steps": max(r["max_deferred"] for r in rows),
            "dllm_max_running": max(r["max_running"] for r in rows),
            "dllm_admitted_while_running": sum(r["admitted_while_running"] for r in rows),
            "dllm_max_num_batched_tokens": max(r["max_num_batched_tokens"] for r in rows),
            "dllm_kv_pool_tokens": max(r["kv_pool_tokens"] for r in rows)}


def _shell_options(loop: EventLoop, cfg: SimConfig, state: InProcessState) -> None:
    """Faults and multi-token commits of the run, checked against the deployment."""
    if cfg.faults is not None and cfg.faults.any:
        bad = [w for w, _ in cfg.faults.kills if w >= len(loop.workers)]
        if bad:
            raise ConfigError(f"--faults kills worker {bad[0]} but the deployment has workers 0-{len(loop.workers) - 1}")
        loop.set_faults(cfg.faults, cfg.seed, state)
    if cfg.commit_tokens is not None and cfg.dllm_block_length:
        raise ConfigError("--commit-tokens and --dllm-block-length are exclusive (diffusion commits follow "
                          "--dllm-dataset)")
    if cfg.commit_tokens is not None:
        lo, hi = cfg.commit_tokens
        try:
            loop.commit = UniformCommit(lo, hi, cfg.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif cfg.dllm_block_length:
        name = _commit_model_name(cfg) if cfg.dllm_commits is None else ""
        try:
            if cfg.dllm_commits is not None:
                model = stretch_model(*cfg.dllm_commits)
            elif name in FIXED_SCHEDULE_COMMITS and name not in OPTIMUS_TABLE2:
                model = stretch_model(*FIXED_SCHEDULE_COMMITS[name])
            else:
                model = commit_model(name, cfg.dllm_dataset)
            loop.commit = StretchCommit(model, cfg.seed)
        except ValueError as e:
            raise ConfigError(f"--dllm-block-length: {e}") from None


def _commit_model_name(cfg: SimConfig) -> str:
    """The catalogue model whose commits per step the simulated diffusion steps draw; ConfigError for a model the
    catalogue lacks (a profiled checkpoint): its commits are then given with --dllm-commits."""
    try:
        return get_model(cfg.model).name
    except UnknownNameError:
        raise ConfigError(f"--dllm-block-length: no commit statistics for {cfg.model!r} (not in the catalogue); give "
                          f"its commits per step with --dllm-commits MEAN[,STD]") from None


def _profile_latency(cfg: SimConfig, prof: Profile) -> ChunkLatency | None:
    """The profile's measured T(c, b) for the chunk sizer of a block-diffusion simulation (as the engine started with
    the profile uses), None when the simulation is autoregressive or the profile has none (then the step timer
    prices windows); ConfigError when it was measured with other diffusion blocks."""
    w = prof.dllm_latency
    if w is None or not cfg.dllm_block_length:
        return None
    if w.block != cfg.dllm_block_length:
        raise ConfigError(f"the profile {cfg.perf} measured T(c, b) with diffusion blocks of {w.block}; "
                          f"--dllm-block-length is {cfg.dllm_block_length}")
    return ChunkLatency.from_profile(w)


def _build_profiled(cfg: SimConfig, spec, dep: Deployment, prof: Profile) -> tuple[Coordinator, list[WorkerCore], EventLoop]:
    """Workers that are copies of the profiled engine on one host: its step-time model as the executor
    timer, its AMPD costs for routing, its KV pool, chunk budget and sequence limit, and the profile's
    local KV link between them. cfg.model/gpu/mem_util/block_size and the token budgets are not used."""
    tps = sorted({tp for _, tp in dep.workers()})
    try:
        cost = prof.cost_model(tps)                  # the profile's own fit when every worker is at its degree
        step_timers = {tp: prof.step_timer(tp).step_time for tp in tps}
    except ValueError as e:
        raise ConfigError(f"--perf {cfg.perf}: {e} (deployment {dep})") from None
    sched = cfg.scheduler(block_size=prof.block_size, max_num_batched_tokens=prof.max_num_batched_tokens,
                          max_num_seqs=prof.max_num_seqs)
    workers, timers = [], []
    boundary = boundary_from_profile(prof)
    latency = _profile_latency(cfg, prof)
    block_bytes = int(prof.kv_bytes_per_token * prof.block_size)
    for wid, (role, tp) in enumerate(dep.workers()):
        step_time = step_timers[tp]

        def t_pre(h: int, n: int, _tp: int = tp) -> float:
            return cost.t_pre(h, n, _tp)
        try:
            workers.append(build_worker(wid, role, tp, prof.num_blocks, spec, sched, t_pre,
                                        boundary=boundary, t_step=step_time, latency=latency,
                                        kv_block_bytes=block_bytes // tp))       # per rank: each holds 1/tp
        except ValueError as e:
            raise ConfigError(str(e)) from None
        timers.append(step_time)
    nodes = [0] * len(workers)                       # one host: every transfer takes the local link
    state = InProcessState(workers, cost, nodes)
    coord = build_coordinator(state, spec, sched, random.Random(cfg.seed), max_context=prof.max_model_len,
                              boundary=boundary)
    bw, lat = float(prof.kv_link["bandwidth_bytes_per_s"]), float(prof.kv_link["latency_s"])
    net = Network(nodes, [1] * len(workers), nvlink_bps=bw, net_bps=bw, nvlink_latency_s=lat, net_latency_s=lat,
                  schedule=None)
    # the engines are served by tandem's runtime: messages between steps, KV export/import on the workers,
    # the runtime's latencies and the step slow-down of processes sharing the host (docs/simulator.md)
    loop = HostLoop(coord, workers, timers, net, prof.kv_bytes_per_token, prof.runtime_costs())
    _shell_options(loop, cfg, state)
    return coord, workers, loop


def simulate(sessions: list[Session], cfg: SimConfig, progress=None, stream: RecordStream | None = None) -> SimResult:
    """Run `sessions` through the deployment and policy of `cfg`; every session ends completed or failed. With
    `cfg.concurrency` N, N closed-loop clients run them one at a time each, in arrival order (EventLoop.run). With
    `stream`, each session's record goes to it as the session ends (in the records' order; a profiled run's shell
    finishes its records last, so there they go at the end) and the result carries its metrics, not the records."""
    coord, workers, loop = build(cfg)
    loop.progress = progress
    if stream is not None and not isinstance(loop, HostLoop):
        loop.record_sink = stream.add
    wall = loop.run(sessions, concurrency=cfg.concurrency)
    if stream is not None:
        loop.record_sink = stream.add
        loop.stream_records()
    stats = []
    for w in workers:
        st = {"id": w.id, "role": w.role, "tp": w.cfg.tp, "steps": w.steps, "busy_s": w.busy_s,
              "kv_capacity_tokens": w.capacity_tokens}
        laps = w.laps if w.laps is not None else w.local_laps
        if laps is not None:
            st["laps"] = dataclasses.asdict(laps.stats)
        if w.dllm is not None:
            d = w.dllm_stats()
            st["dllm_serve"] = {**d, "max_num_batched_tokens": w.cfg.max_num_batched_tokens,
                                "kv_pool_tokens": w.cfg.num_blocks * w.cfg.block_size}
            n = sum(d["commits"].values())
            st["dllm"] = {"chunk_steps": {}, "commits": d["commits"],
                          "tokens_per_step": sum(k * v for k, v in d["commits"].items()) / n if n else 0.0}
        if w.kv.tier is not None:
            st["kv_tier"] = w.kv.tier.summary()
        if w.chunker is not None:
            st["dllm"] = {"chunk_steps": dict(sorted(w.chunker.steps_by_chunk.items())),
                          "commits": dict(sorted(w.chunker.commit_counts.items())),
                          "tokens_per_step": w.chunker.tokens_per_step()}
        stats.append(st)
    moves = [{"instance": m.instance, "from": str(m.from_pool), "to": str(m.to_pool), "at_s": m.at_s}
             for m in getattr(coord.router, "moves", ())]
    return SimResult(coord.records, loop.now, wall, loop.events, cfg.deploy, cfg.policy, stats, moves,
                     stream.summary(loop.now) if stream is not None else None, coord.rebinds)
