"""The disaggregated backend: a coordinator (this process) and prefill/decode worker processes.

`ServingCluster` implements the server's EngineClient: it spawns the workers (each an LLMEngine of one
role, `tandem.runtime.worker_main`), runs the Coordinator core with the chosen policy over the state
store's view, and pumps messages between them (tandem/runtime/coordinator_shell.py does the mapping).
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from pathlib import Path

from tandem.core.admission import check_worker_counts
from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_coordinator, resolve_policy
from tandem.core.types import COLOCATED, DECODE, PREFILL
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.policy.laps.classify import PrefillClass
from tandem.policy.laps.cost import boundary_from_profile
from tandem.policy.presets import PolicySpec, PrefillSchedKind, get_policy
from tandem.runtime import messages as m
from tandem.runtime.client import BackendStats, RequestError, add_memory_reports
from tandem.runtime.cluster_config import KV_TRANSFERS, ClusterConfig, RESTART_WINDOW_S, worker_cpu_binds
from tandem.runtime.coordinator_shell import CoordinatorShell
from tandem.runtime.costs import serving_cost_model
from tandem.runtime.launcher import Cluster, WorkerSpec, WorkerStartupError
from tandem.runtime.state_store import open_store
from tandem.runtime.store_view import StoreView
from tandem.runtime.transport import HEARTBEAT_S, Hub, WorkerDead, WorkerUnreachable
from tandem.runtime.worker_main import CODEC

log = logging.getLogger("tandem.cluster")
# wait before a replacement: none for a worker that had served a while (a crash, a kill: replace it at once), then
# longer for each death in a row that came within QUICK_DEATH_S of the worker's (re)start (a crash loop)
RESTART_BACKOFF_S = (0.0, 2.0, 5.0)
QUICK_DEATH_S = 10.0
# a replacement's startup phases, in order: (name, the mark that ends it); each runs from the previous mark
STARTUP_PHASES = (("backoff", "begun"), ("fork", "started"), ("imports", "imported"), ("model load", "model_loaded"),
                  ("setup", "ready"), ("handshake", "ready_received"), ("registration", "routable"))


async def _refused(err: RequestError):
    """A generation that fails at its first output (EngineClient.generate's contract for add-time errors)."""
    raise err
    yield  # unreachable: makes this an async generator


class ServingCluster:
    """EngineClient over worker processes; `await ServingCluster.start(cfg)`, then `await .shutdown()`."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self._policy: PolicySpec | None = None      # policy_spec(), made once (it may read the profile)
        self.tokenizer = Tokenizer.from_pretrained(cfg.model)
        self.model_name = cfg.served_model_name or Path(cfg.model).name
        self.max_model_len = 0
        self.vocab_size: int | None = None          # the model's (rows of its embedding), once started
        self.hub: Hub | None = None
        self.procs: Cluster | None = None
        self.shell: CoordinatorShell | None = None
        self.roles: dict[int, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._lost: set[int] = set()
        self._specs_by_id: dict[int, WorkerSpec] = {}
        self._restarts: dict[int, list[float]] = {}       # worker id -> monotonic times of its recent restarts
        self._restarting: set[asyncio.Task] = set()
        self._up_since: dict[int, float] = {}             # worker id -> monotonic time its replacement became routable
        self._quick_deaths: dict[int, int] = {}            # worker id -> its deaths in a row soon after a (re)start
        self.recoveries: list[dict] = []                   # each replacement's phases (restart_phases), newest last
        self._closing = False
        self._ray = None                                  # the RayLauncher under --launcher ray
        self._cache_config: dict[str, str] = {}
        self._memory: dict[int, dict[str, int]] = {}       # worker -> its memory figures (Ready), for /metrics

    @classmethod
    async def start(cls, cfg: ClusterConfig) -> "ServingCluster":
        self = cls(cfg)
        await self._start()
        return self

    def policy_spec(self) -> PolicySpec:
        """The cluster's policy with its knobs (ValueError names a bad one); a LAPS policy without a threshold
        takes the boundary L_m fitted to the workers' profile (--perf), as the simulator on that profile does."""
        if self._policy is not None:
            return self._policy
        opts = self.cfg.policy_knobs()
        if get_policy(self.cfg.policy).prefill_sched is PrefillSchedKind.LAPS \
                and "laps_length_threshold" not in opts and self.cfg.perf:
            from tandem.perf.profile_io import load_perf
            prof = load_perf(self.cfg.perf)
            boundary = boundary_from_profile(prof) if hasattr(prof, "measurements") else None
            if boundary is not None:
                opts["laps_length_threshold"] = boundary
        try:
            self._policy = resolve_policy(self.cfg.policy, **opts)
        except TypeError as e:
            raise ValueError(f"policy {self.cfg.policy}: {e}") from None
        return self._policy

    def _specs(self) -> list[WorkerSpec]:
        cfg = self.cfg
        spec = self.policy_spec()
        check_worker_counts(spec, cfg.prefill_workers, cfg.decode_workers, cfg.colocated)
        roles = ([PREFILL] * cfg.prefill_workers + [DECODE] * cfg.decode_workers if spec.disaggregated
                 else [COLOCATED] * cfg.colocated)
        opts = {k: getattr(spec, k) for k in ("laps_length_threshold",) if getattr(spec, k) is not None}
        model, perf = cfg.model, cfg.perf
        if cfg.launcher == "ray":              # actors run in Ray's folders: paths absolute (the same on every node)
            model, perf = str(Path(model).resolve()), perf and str(Path(perf).resolve())
        args = dict(cfg.engine_args, model=model, policy=spec.name, policy_options={**cfg.policy_knobs(), **opts})
        self.roles = dict(enumerate(roles))
        rank_kv = wants_rank_kv(cfg, [self._role_args(args, r) for r in set(roles)])
        worker_args = [self._role_args(args, r) for r in roles]
        binds = worker_cpu_binds(cfg, [int(a.get("tensor_parallel_size", 1)) for a in worker_args])
        worker_args = [a if b is None else {**a, "cpu_omp_threads_bind": b} for a, b in zip(worker_args, binds)]
        return [WorkerSpec(i, "tandem.runtime.worker_main:main",
                           dict(role=r, engine_args=worker_args[i], state=cfg.state, perf=perf,
                                threads=cfg.threads, rank_kv=rank_kv, **cfg.worker_kwargs.get(i, {})))
                for i, r in enumerate(roles)]

    def _role_args(self, args: dict, role: str) -> dict:
        """A role's engine arguments: the cluster's, at the role's tensor-parallel degree (role_tp)."""
        tp = self.cfg.role_tp.get(role)
        return args if tp is None else {**args, "tensor_parallel_size": tp}

    def worker_tp(self, wid: int) -> int:
        """Worker `wid`'s tensor-parallel degree (ranks, one process each)."""
        return int(self._specs_by_id[wid].kwargs["engine_args"].get("tensor_parallel_size", 1))

    def _launcher(self) -> tuple[str, dict]:
        """The hub's address and the Cluster's spawner: local processes, or Ray actors (joins the Ray cluster)."""
        cfg = self.cfg
        if cfg.launcher == "embedded":
            return "tcp://127.0.0.1:0", {}
        if cfg.launcher != "ray":
            raise ValueError(f"unknown launcher {cfg.launcher!r} (embedded or ray)")
        from tandem.runtime.ray_launcher import RayLauncher
        ray = RayLauncher(cfg.ray_address, place=dict(cfg.ray_place), threads=cfg.threads or 1,
                          min_cpus=sum(self._role_args(cfg.engine_args, r).get("tensor_parallel_size", 1)
                                       for r in self.roles.values()) * (cfg.threads or 1))   # a private Ray: every rank
        if cfg.ray_namespace:
            ray.namespace = cfg.ray_namespace
        self._ray = ray.start()
        return ray.hub_address, {"spawner": ray.spawn}

    async def _start(self) -> None:
        cfg = self.cfg
        if not cfg.worker_timeout_s > 0:
            raise ValueError(f"worker timeout must be > 0 s, got {cfg.worker_timeout_s}")
        specs = self._specs()
        self._specs_by_id = {s.worker_id: s for s in specs}
        store = open_store(cfg.state)
        hub_address, launch = self._launcher()
        try:
            self.hub = await Hub(CODEC, address=hub_address, dead_after_s=cfg.worker_timeout_s,
                                 allow_remote=self._ray is not None).start()
            self.procs = Cluster(self.hub, startup_timeout_s=cfg.startup_timeout_s,
                                 heartbeat_s=min(HEARTBEAT_S, cfg.worker_timeout_s / 4), **launch)
            infos = {wid: wp.info for wid, wp in (await self.procs.start(specs)).items()}
        except BaseException:
            if self.hub is not None:
                await self.hub.close()
            if self._ray is not None:
                self._ray.close()
            raise
        try:
            first = infos[0]
            self.max_model_len = int(first["max_model_len"])
            self.vocab_size = int(first["vocab_size"])
            cost = self._cost(first)
            view = StoreView(store, cost)
            await self._await_states(store, {s.worker_id for s in specs})
        except BaseException:                                  # stop the workers started above, then re-raise
            await self.shutdown()
            raise
        view.refresh()
        sched = SchedulerConfig(block_size=int(first["block_size"]), kv_timeout_s=cfg.kv_timeout_s,
                                session_ttl_s=cfg.session_ttl_s)
        coord = build_coordinator(view, self.policy_spec(), sched, random.Random(cfg.seed),
                                  max_context=self.max_model_len)
        kv_addr = {wid: info["kv_address"] for wid, info in infos.items()}
        self._cache_config = next((dict(info.get("cache_config") or {}) for wid, info in sorted(infos.items())
                                   if self.roles.get(wid) != PREFILL), {})
        self._memory = {wid: memory_info(info) for wid, info in infos.items()}
        self.shell = CoordinatorShell(coord, store, self._send, kv_addr, self.max_model_len,
                                      block_size=int(first["block_size"]), slo=self._slo(),
                                      vocab_size=int(first["vocab_size"]), max_unread=cfg.max_unread_outputs,
                                      dllm_block=first.get("dllm_block"), dllm_canvas=first.get("dllm_canvas") is True,
                                      audit_s=cfg.audit_interval_s, rank_addr=rank_kv_map(infos))
        self.hub.on_worker_dead(self._on_dead)
        self._tasks = [asyncio.create_task(self._pump(), name="coordinator-pump"),
                       asyncio.create_task(self._tick(), name="coordinator-tick")]
        for t in self._tasks:
            t.add_done_callback(self._task_ended)

    def _task_ended(self, t: asyncio.Task) -> None:
        """The pump and the tick run for the server's life: one that ends is a bug, logged, never unseen."""
        if t.cancelled():
            return
        e = t.exception()
        log.critical("coordinator task %s ended (%s): the server no longer serves", t.get_name(),
                     f"{type(e).__name__}: {e}" if e is not None else "returned", exc_info=e)

    async def _await_states(self, store, ids: set[int]) -> None:
        """Wait until every worker's first state is in the store: relayed here as Stats (embedded store), or
        published by the workers themselves (Redis: they send no Stats, and published before Ready)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.startup_timeout_s
        while not ids <= {st.worker_id for st in store.all()}:
            if loop.time() > deadline:
                missing = sorted(ids - {st.worker_id for st in store.all()})
                raise WorkerStartupError(f"workers {missing} published no state to the store ({self.cfg.state}) "
                                         f"within {self.cfg.startup_timeout_s:g} s")
            try:
                _, msg, _ = await asyncio.wait_for(self.hub.recv(), timeout=0.05)
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, m.Stats):
                store.publish(msg.state)

    async def _await_fresh_state(self, wid: int, after_s: float) -> None:
        """Wait (serving: the pump relays states into the store) for a state of `wid` published after `after_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.startup_timeout_s
        while not any(st.worker_id == wid and st.published_s >= after_s for st in self.shell.store.all()):
            if loop.time() > deadline:
                raise WorkerStartupError(f"worker {wid} published no state within {self.cfg.startup_timeout_s:g} s")
            await asyncio.sleep(0.05)

    def _slo(self):
        from tandem.workload.session import SLO
        c = self.cfg
        if c.slo_ttft_s is None and c.slo_itl_s is None:
            return None
        return SLO(c.slo_ttft_s if c.slo_ttft_s is not None else math.inf,
                   c.slo_itl_s if c.slo_itl_s is not None else math.inf)

    def _cost(self, info: dict):
        return serving_cost_model(self.cfg.model, int(info["kv_bytes_per_token"]), self.max_model_len, self.cfg.perf,
                                  tps=sorted({self.worker_tp(w) for w in self._specs_by_id}))

    # ------------------------------------------------------------------ plumbing
    def _send(self, worker: int, msg) -> None:
        """Send one message now (no task per message: a burst of requests sends thousands); a failure, now or once
        zmq gets to it, fails the request it belongs to (never a silent, hanging request)."""
        if worker in self._lost:
            return
        try:
            fut = self.hub.post(worker, msg)
        except Exception as e:                                   # noqa: BLE001 - unencodable, or a dead worker
            self._send_failed(worker, msg, e)
            return
        if not fut.done():                                       # at the high-water mark: zmq sends it later
            fut.add_done_callback(lambda f: self._sent(worker, msg, f))
        elif fut.exception() is not None:
            self._send_failed(worker, msg, Hub.send_error(worker, fut.exception()))

    def _sent(self, worker: int, msg, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._send_failed(worker, msg, Hub.send_error(worker, fut.exception()))

    def _send_failed(self, worker: int, msg, e: BaseException) -> None:
        """Fail the request of an unsent message, on the next loop iteration (not inside the core's call that sent
        it)."""
        if isinstance(e, WorkerUnreachable):
            log.warning("send %s to worker %d failed: %s", type(msg).__name__, worker, e)
        else:
            log.error("send %s to worker %d failed: %s: %s", type(msg).__name__, worker, type(e).__name__, e)

        def fail() -> None:
            try:
                self.shell.on_send_failed(worker, msg, f"{type(e).__name__}: {e}", lost=isinstance(e, WorkerUnreachable))
            except Exception:                                    # a bug must not stop the server
                log.exception("coordinator: failing the request of an unsent %s failed", type(msg).__name__)
        asyncio.get_running_loop().call_soon(fail)

    async def _pump(self) -> None:
        while True:
            wid, msg, _ = await self.hub.recv()
            try:
                self.shell.on_message(wid, msg)
            except Exception:                                    # a bug must not stop the server
                log.exception("coordinator: handling %s from worker %d failed", type(msg).__name__, wid)
            # one worker message per loop iteration: an Outputs message wakes every stream it carries a token
            # for, and a queue of them handled at once would hold /health and new requests for that long
            await asyncio.sleep(0)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            try:
                self.shell.check_timeouts()
            except Exception:                                    # a bug must not stop the timeouts
                log.exception("coordinator: check_timeouts failed")

    def _on_dead(self, ev: WorkerDead) -> None:
        wid = ev.worker_id
        if wid in self._lost:
            return
        self._lost.add(wid)
        log.error("worker %d (%s) lost: %s", wid, self.roles.get(wid), ev.reason)
        # no store I/O before the requests are failed or re-routed: the store may be down too
        self.shell.coord.view.drop(wid)        # re-routing must not see the dead worker (no store round trip)
        try:
            self.shell.on_worker_lost(wid)
        except Exception:                                        # never leave its requests hanging
            log.exception("coordinator: handling the loss of worker %d failed; failing its requests", wid)
            for req in list(self.shell.reqs.values()):
                if wid in (req.worker, req.prefill_worker):
                    self.shell._fail(req, f"worker lost: worker {wid} stopped")
        try:
            self.shell.store.remove(wid)
        except Exception as e:                                   # noqa: BLE001 - its key expires by itself
            log.warning("removing worker %d from the state store failed: %s", wid, e)
        self._supervise(wid, ev.at_s)

    # ------------------------------------------------------------------ supervisor
    def _supervise(self, wid: int, dead_at: float | None = None) -> None:
        """Replace a dead worker (same id and role, fresh keys), unless it died too often lately: at once after a
        worker that had served a while, after a growing backoff when it keeps dying soon after its start."""
        if self._closing or self.cfg.max_restarts <= 0:
            return
        now = asyncio.get_running_loop().time()
        dead_at = time.monotonic() if dead_at is None else dead_at
        recent = [t for t in self._restarts.get(wid, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= self.cfg.max_restarts:
            log.error("worker %d (%s) died %d times in %g s: not restarting it again", wid, self.roles.get(wid),
                      len(recent), RESTART_WINDOW_S)
            return
        self._restarts[wid] = recent + [now]
        quick = dead_at - self._up_since.get(wid, -math.inf) < QUICK_DEATH_S
        streak = self._quick_deaths.get(wid, 0) + 1 if quick else 0
        self._quick_deaths[wid] = streak
        delay = RESTART_BACKOFF_S[min(streak, len(RESTART_BACKOFF_S) - 1)]
        t = asyncio.get_running_loop().create_task(self._restart(wid, delay, dead_at), name=f"restart-worker-{wid}")
        self._restarting.add(t)
        t.add_done_callback(self._restarted)

    def _restarted(self, t: asyncio.Task) -> None:
        self._restarting.discard(t)
        if not t.cancelled() and t.exception() is not None:     # _restart reports its own failures: a bug
            log.error("restarting a worker failed", exc_info=t.exception())

    async def _restart(self, wid: int, delay_s: float, dead_at: float) -> None:
        """Start the replacement (the dead process is killed and reaped beside its startup), wait for its first
        state, then make it routable; log where the time went (restart_phases)."""
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        begun, begun_wall = time.monotonic(), time.time()
        log.warning("restarting worker %d (%s)%s", wid, self.roles.get(wid),
                    f" after a backoff of {delay_s:g} s" if delay_s > 0 else "")
        try:
            wp = await self.procs.replace(self._specs_by_id[wid])
            await self._await_fresh_state(wid, begun_wall)
        except Exception as e:                                   # noqa: BLE001 - the next death may try again
            log.error("worker %d could not be restarted: %s", wid, e)
            if wid in self._lost:
                self._supervise(wid)
            return
        if self._closing:
            return
        self._lost.discard(wid)
        self._memory[wid] = memory_info(wp.info)
        self.shell.coord.view.revive(wid)
        self.shell.on_worker_joined(wid, wp.info["kv_address"], rank_kv_addresses(wp.info))
        routable = time.monotonic()
        self._up_since[wid] = routable
        started = self.procs.started.get(wid, {})
        marks = {**startup_marks_of(wp.info), "begun": begun, "ready_received": started.get("ready", routable),
                 "routable": routable}
        phases = restart_phases(dead_at, marks)
        self.recoveries.append({"worker": wid, "role": self.roles.get(wid), "pid": wp.pid, "dead_at": dead_at,
                                "routable_at": routable, "phases": phases})
        log.warning("worker %d (%s) is back (pid %s), %.2f s after its death was noticed: %s [noticed at monotonic "
                    "%.3f]", wid, self.roles.get(wid), wp.pid, routable - dead_at,
                    ", ".join(f"{name} {sec:.2f} s" for name, sec in phases.items()), dead_at)

    # ------------------------------------------------------------------ EngineClient
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 session_id: str | None = None, prompt: str | None = None, tool_s: float | None = None):
        if not self.is_healthy():                 # raised by the first __anext__, where the server expects it
            return _refused(RequestError("no live decode worker: the server cannot serve", 503,
                                         code="engine_unavailable"))
        return self.shell.generate(prompt_token_ids, params, request_id, session_id, prompt, tool_s)

    async def abort(self, request_id: str) -> None:
        req = self.shell.reqs.get(request_id)
        if req is not None:
            self.shell._abort(req, "aborted")

    def stats(self) -> BackendStats:
        s = self.shell.stats
        out = BackendStats(**{k: dict(v) if isinstance(v, dict) else v     # counters copied, not shared
                              for k, v in ((k, getattr(s, k)) for k in BackendStats.__dataclass_fields__)})
        s.kv_transfer_seconds = []
        out.cache_config = self._cache_config
        if self.hub is not None:                         # the workers' counts arrive in their StepCounts
            out.rejected_frames += self.hub.rejected_frames
            out.rejected_handshakes += self.hub.rejected_handshakes
        states = [st for st in self.shell.coord.view.states() if st.worker_id not in self._lost]
        _worker_gauges(out, states)
        out.workers_alive = len(self.roles) - len(self._lost)
        _laps_stats(out, states, self.shell.coord.router)
        add_memory_reports(out, [r for wid, r in self._memory.items() if wid not in self._lost])
        return out

    def worker_pids(self) -> dict[int, tuple[str, int]]:
        """Each running worker's (role, process id), by worker id (a Ray actor's pid is on its node)."""
        return {wid: (self.roles.get(wid, "?"), wp.pid) for wid, wp in sorted(self.procs.workers.items())} \
            if self.procs is not None else {}

    def deployment(self) -> dict:
        """The deployment as given (`--deploy`'s form) and each running worker (`describe`)."""
        return describe(self)

    def rank_pids(self) -> dict[int, list[int]]:
        """Each running worker's other tensor-parallel ranks' process ids (from its Ready; empty at tp=1)."""
        if self.procs is None:
            return {}
        return {wid: [int(p) for p in (wp.info or {}).get("rank_pids") or () if isinstance(p, int)]
                for wid, wp in sorted(self.procs.workers.items())}

    @property
    def ray_namespace(self) -> str | None:
        """The Ray namespace of the worker actors (None for local workers)."""
        return None if self._ray is None else self._ray.namespace

    def is_healthy(self) -> bool:
        return any(r != PREFILL and w not in self._lost for w, r in self.roles.items())

    async def shutdown(self) -> None:
        self._closing = True
        for t in [*self._tasks, *self._restarting]:
            t.cancel()
        if self.procs is not None:
            await self.procs.stop()
        if self.hub is not None:
            await self.hub.close()
        if self._ray is not None:
            self._ray.close()


def startup_marks_of(info: dict) -> dict[str, float]:
    """A worker's startup marks from its Ready info, validated (finite numbers under known names; else dropped)."""
    marks = info.get("startup")
    names = {mark for _, mark in STARTUP_PHASES}
    if not isinstance(marks, dict):
        return {}
    return {k: float(v) for k, v in marks.items() if k in names and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def restart_phases(dead_at: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each STARTUP_PHASES phase of a replacement, from the death's notice (`dead_at`) through its monotonic
    `marks`; a phase whose mark is missing (a worker that sent none) is folded into the next one."""
    out, last = {}, dead_at
    for name, mark in STARTUP_PHASES:
        t = marks.get(mark)
        if t is None:
            continue
        out[name] = max(0.0, t - last)
        last = max(last, t)
    return out


def deploy_spec(cfg: ClusterConfig, roles: dict[int, str], tp_of) -> str:
    """The deployment in `--deploy`'s form: as given, else from the worker counts and degrees ("P:tp1x1,D:tp2x1")."""
    if cfg.deploy:
        return cfg.deploy
    letters = {PREFILL: "P", DECODE: "D", COLOCATED: "C"}
    groups: dict[tuple[str, int], int] = {}
    for wid, role in sorted(roles.items()):
        key = (role, tp_of(wid))
        groups[key] = groups.get(key, 0) + 1
    return ",".join(f"{letters[r]}:tp{t}x{n}" for (r, t), n in groups.items())


def describe(cluster: ServingCluster) -> dict:
    """The deployment as given and each running worker from its Ready info: role, tensor-parallel degree, driver and
    rank process ids, and how many of its ranks have KV endpoints (all: KV moves rank to rank with workers of another
    degree; none: only through its driver)."""
    workers = []
    for wid, (role, pid) in cluster.worker_pids().items():
        info = cluster.procs.workers[wid].info or {}
        ranks = [int(p) for p in info.get("rank_pids") or () if isinstance(p, int)]
        workers.append({"worker": wid, "role": role, "tensor_parallel_size": cluster.worker_tp(wid), "pid": pid,
                        "rank_pids": ranks, "kv_rank_endpoints": len(rank_kv_addresses(info))})
    return {"deploy": deploy_spec(cluster.cfg, cluster.roles, cluster.worker_tp), "workers": workers}


def wants_rank_kv(cfg: ClusterConfig, role_args: list[dict]) -> bool:
    """Whether the workers open rank KV endpoints: KV rank to rank is asked for and some worker is at tp > 1 (between
    tp=1 workers KV always goes driver to driver)."""
    return cfg.kv_transfer == KV_TRANSFERS[0] and any(a.get("tensor_parallel_size", 1) > 1 for a in role_args)


def rank_kv_map(infos: dict[int, dict]) -> dict[int, list[str]]:
    """Each worker's ranks' KV endpoints (rank_kv_addresses), by worker id."""
    return {wid: rank_kv_addresses(info) for wid, info in infos.items()}


def rank_kv_addresses(info: dict) -> list[str]:
    """A worker's ranks' KV endpoints from its Ready (rank order; empty when it has none: KV then goes driver to
    driver)."""
    addrs = info.get("rank_kv_addresses") or []
    ok = isinstance(addrs, list) and all(isinstance(a, str) and a.startswith("tcp://") for a in addrs)
    return list(addrs) if ok else []


def memory_info(info: dict) -> dict[str, int]:
    """A worker's memory figures from its Ready info, validated (non-negative integers; anything else dropped)."""
    mem = info.get("memory")
    if not isinstance(mem, dict):
        return {}
    return {str(k): int(v) for k, v in mem.items()
            if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _worker_gauges(out: BackendStats, states: list) -> None:
    """Requests, KV and host-tier occupancy over the live workers' last published states."""
    homes = [st for st in states if st.role != PREFILL]
    out.num_requests_running = sum(st.num_running for st in homes)
    out.num_requests_waiting = sum(st.num_waiting for st in states)
    out.kv_cache_usage_perc = sum(st.kv_usage for st in homes) / len(homes) if homes else 0.0
    out.num_requests_swapped = sum(st.num_swapped for st in homes)
    out.cpu_cache_usage_perc = sum(st.swap_usage for st in homes) / len(homes) if homes else 0.0
    out.host_tier_bytes = sum(st.host_tier_bytes for st in homes)
    out.host_tier_capacity_bytes = sum(st.host_tier_capacity_bytes for st in homes)
    out.host_tier_usage = out.host_tier_bytes / out.host_tier_capacity_bytes if out.host_tier_capacity_bytes else 0.0


def _laps_stats(out: BackendStats, states, router) -> None:
    """LAPS's gauges: the pools (the coordinator's router) and the prefill workers' AWD state and step counts."""
    pools = router.pools() if hasattr(router, "pools") else None
    if pools is not None:
        out.laps_pool_short, out.laps_pool_long = len(pools[PrefillClass.SHORT]), len(pools[PrefillClass.LONG])
        out.laps_pool_moves = len(router.moves)
    laps = [st for st in states if st.laps_depth > 0 or st.laps_short_steps > 0]   # prefill and AMPD+LAPS decode
    if laps:
        out.laps_short_waiting = sum(st.laps_short_waiting for st in laps)
        out.laps_long_waiting = sum(st.laps_long_waiting for st in laps)
        out.laps_window_s = sum(st.laps_window_s for st in laps) / len(laps)
        out.laps_depth = sum(st.laps_depth for st in laps) / len(laps)
        out.laps_short_steps = sum(st.laps_short_steps for st in laps)
        out.laps_graph_steps = sum(st.laps_graph_steps for st in laps)
