"""Build a simulated cluster from a deployment and a policy, run sessions through it, return records."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from tandem.core.config import (
    DEFAULT_BLOCK_SIZE, DEFAULT_KV_TIMEOUT_S, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SESSION_TTL_S, DEFAULT_WINDOW_S, SchedulerConfig,
)
from tandem.core.coordinator import Coordinator
from tandem.core.deploy import Deployment, DeploymentError, parse_deploy
from tandem.core.factory import build_coordinator, build_worker, resolve_policy
from tandem.core.state import InProcessState
from tandem.core.types import COLOCATED, PREFILL
from tandem.core.worker import WorkerCore
from tandem.perf.ampd_cost import AMPDCostModel
from tandem.perf.dllm import commit_model
from tandem.perf.hardware import get_gpu
from tandem.perf.models import get_model
from tandem.perf.roofline import Roofline, kv_capacity_tokens
from tandem.perf.profile_io import PerfFileError, load_perf
from tandem.perf.step_model import Profile
from tandem.policy.presets import POLICIES, PolicySpec
from tandem.sim.commit import StretchCommit, UniformCommit
from tandem.policy.laps.cost import boundary_from_profile
from tandem.sim.faults import FaultError, FaultSpec
from tandem.sim.host_loop import HostLoop
from tandem.sim.loop import EventLoop
from tandem.sim.network import Network
from tandem.workload.records import SessionRecord
from tandem.workload.session import Session

__all__ = ["SimConfig", "SimResult", "simulate", "build", "load_perf", "ConfigError", "POLICIES", "FaultError"]


class ConfigError(ValueError):
    """The simulation configuration is inconsistent (policy vs deployment, bad knob values)."""


@dataclass(slots=True)
class SimConfig:
    """Everything a simulation run needs besides the sessions."""

    model: str
    gpu: str
    gpus: int
    deploy: str
    policy: str = "ampd"
    seed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # prefill and decode workers (chunked prefill)
    colocated_max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # co-located workers
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    mem_util: float = 0.9
    window_s: float = DEFAULT_WINDOW_S          # AMPD windowed TTFT/ITL
    alpha: float = 0.9
    beta: float = 0.85
    reorder_window: int = 3
    continuum_ttl_s: float = 30.0               # idle KV retention of policies that retain it (Continuum)
    kv_timeout_s: float = DEFAULT_KV_TIMEOUT_S  # a KV transfer not landed after this falls back to local prefill
    session_ttl_s: float = DEFAULT_SESSION_TTL_S  # an idle session's KV is released after this
    decode_query_tokens: int = 1                # query tokens per decode step (multi-token steps when > 1)
    commit_tokens: tuple[int, int] | None = None  # multi-token steps: each commits U[lo, hi] tokens (None: all)
    dllm_block_length: int = 0                  # block-diffusion decoding in blocks of this many positions (0: AR)
    dllm_chunk: str = "elastic"                 # each diffusion step's window: elastic (Optimus), block, or N
    dllm_dataset: str = "sharegpt"              # Optimus Table 2 row the diffusion commits follow (with the model)
    dllm_prefill_share: float = 0.5             # elastic windows leave waiting prefills this share of the budget
    faults: FaultSpec | None = None             # injected KV-transfer failures and worker deaths
    perf: str | None = None                     # `tandem profile` JSON (step timer, routing costs, KV pool), or
                                                # an AMPDCostModel JSON (routing costs only); roofline if None
    laps_length_threshold: int | None = None    # LAPS class threshold (None: the roofline's boundary L_m)
    concurrency: int | None = None              # closed loop: this many clients, one session each at a time
                                                # (sessions' own arrival times ignored); None: open loop

    def policy_spec(self) -> PolicySpec:
        """The run's policy with this config's knobs (validated; ConfigError names the bad one)."""
        try:
            spec = resolve_policy(self.policy)
            return spec.with_options(
                reorder_window=self.reorder_window, alpha=self.alpha, beta=self.beta,
                retain_idle_kv_s=self.continuum_ttl_s if spec.retain_idle_kv else 0.0,
                laps_length_threshold=self.laps_length_threshold or spec.laps_length_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def scheduler(self, **over) -> SchedulerConfig:
        """The scheduler configuration every core of this run is built with."""
        kw = dict(block_size=self.block_size, max_num_batched_tokens=self.max_num_batched_tokens,
                  max_num_seqs=self.max_num_seqs, window_s=self.window_s, kv_timeout_s=self.kv_timeout_s,
                  session_ttl_s=self.session_ttl_s, decode_query_tokens=self.decode_query_tokens,
                  dllm_block_length=self.dllm_block_length, dllm_chunk=self.dllm_chunk,
                  dllm_prefill_share=self.dllm_prefill_share)
        kw.update(over)
        try:
            return SchedulerConfig(**kw)
        except ValueError as e:
            raise ConfigError(str(e)) from None


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
    if spec.disaggregated != dep.disaggregated:
        kind = "a disaggregated deployment (P:...,D:...)" if spec.disaggregated else "a co-located deployment (C:...)"
        raise ConfigError(f"policy {spec.name} needs {kind}, got {dep}")
    try:
        perf = load_perf(cfg.perf) if cfg.perf else None
    except PerfFileError as e:
        raise ConfigError(str(e)) from None
    if isinstance(perf, Profile):
        return _build_profiled(cfg, spec, dep, perf)
    model, gpu = get_model(cfg.model), get_gpu(cfg.gpu)
    nodes = place(dep, gpu.gpus_per_node, cfg.gpus)
    tps = tuple(sorted({tp for _, tp in dep.workers()}))
    cost = perf if perf is not None else AMPDCostModel.from_roofline(model.name, gpu.name, tps)
    sched = cfg.scheduler()
    workers, timers = [], []
    prefill_tps = [tp for role, tp in dep.workers() if role == PREFILL]
    boundary = Roofline(model, gpu, min(prefill_tps)).prefill_boundary() if prefill_tps else None   # LAPS's L_m
    for wid, (role, tp) in enumerate(dep.workers()):
        cap = kv_capacity_tokens(model, gpu, tp, mem_util=cfg.mem_util)
        def t_pre(h: int, n: int, _tp: int = tp) -> float:
            return cost.t_pre(h, n, _tp)
        timer = Roofline(model, gpu, tp).step_time
        workers.append(build_worker(
            wid, role, tp, cap // cfg.block_size, spec, sched, t_pre,
            max_num_batched_tokens=cfg.colocated_max_num_batched_tokens if role == COLOCATED else None,
            boundary=boundary, t_step=timer))
        timers.append(timer)
    state = InProcessState(workers, cost, nodes)
    coord = build_coordinator(state, spec, sched, random.Random(cfg.seed), max_context=model.max_context,
                              boundary=boundary)
    net = Network(nodes, [w.cfg.tp for w in workers],
                  nvlink_bps=gpu.nvlink_gbs * 1e9 * gpu.link_eff, net_bps=gpu.net_gbs * 1e9 * gpu.link_eff,
                  nvlink_latency_s=gpu.nvlink_latency_s, net_latency_s=gpu.net_latency_s, schedule=None)
    loop = EventLoop(coord, workers, timers, net, model.kv_bytes_per_token)
    _shell_options(loop, cfg, state)
    return coord, workers, loop


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
        try:
            loop.commit = StretchCommit(commit_model(get_model(cfg.model).name, cfg.dllm_dataset), cfg.seed)
        except ValueError as e:
            raise ConfigError(f"--dllm-block-length: {e}") from None


def _build_profiled(cfg: SimConfig, spec, dep: Deployment, prof: Profile) -> tuple[Coordinator, list[WorkerCore], EventLoop]:
    """Workers that are copies of the profiled engine on one host: its step-time model as the executor
    timer, its AMPD costs for routing, its KV pool, chunk budget and sequence limit, and the profile's
    local KV link between them. cfg.model/gpu/mem_util/block_size and the token budgets are not used."""
    bad = sorted({tp for _, tp in dep.workers() if tp != 1})
    if bad:
        raise ConfigError(f"the profile {cfg.perf} measured one engine on one device (tp1); "
                          f"deployment {dep} asks for tp{bad[0]}")
    step_time = prof.step_model.step_time
    cost = prof.ampd
    sched = cfg.scheduler(block_size=prof.block_size, max_num_batched_tokens=prof.max_num_batched_tokens,
                          max_num_seqs=prof.max_num_seqs)
    workers, timers = [], []
    boundary = boundary_from_profile(prof)
    for wid, (role, tp) in enumerate(dep.workers()):
        workers.append(build_worker(wid, role, 1, prof.num_blocks, spec, sched, lambda h, n: cost.t_pre(h, n, 1),
                                    boundary=boundary, t_step=step_time))
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


def simulate(sessions: list[Session], cfg: SimConfig, progress=None) -> SimResult:
    """Run `sessions` through the deployment and policy of `cfg`; every session ends completed or failed. With
    `cfg.concurrency` N, N closed-loop clients run them one at a time each, in arrival order (EventLoop.run)."""
    coord, workers, loop = build(cfg)
    loop.progress = progress
    wall = loop.run(sessions, concurrency=cfg.concurrency)
    stats = []
    for w in workers:
        st = {"id": w.id, "role": w.role, "tp": w.cfg.tp, "steps": w.steps, "busy_s": w.busy_s,
              "kv_capacity_tokens": w.capacity_tokens}
        laps = w.laps if w.laps is not None else w.local_laps
        if laps is not None:
            st["laps"] = dataclasses.asdict(laps.stats)
        if w.chunker is not None:
            st["dllm"] = {"chunk_steps": dict(sorted(w.chunker.steps_by_chunk.items())),
                          "commits": dict(sorted(w.chunker.commit_counts.items())),
                          "tokens_per_step": w.chunker.tokens_per_step()}
        stats.append(st)
    moves = [{"instance": m.instance, "from": str(m.from_pool), "to": str(m.to_pool), "at_s": m.at_s}
             for m in getattr(coord.router, "moves", ())]
    return SimResult(coord.records, loop.now, wall, loop.events, cfg.deploy, cfg.policy, stats, moves)
