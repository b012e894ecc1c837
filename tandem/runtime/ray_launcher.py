"""Workers as Ray actors on the nodes of a Ray cluster: `tandem serve --launcher ray` (docs/ray.md).

Ray gives placement (each worker is one actor in its own placement group: its GPUs, or CPUs on a CPU node, and an
optional custom resource per role, on one node), lifecycle and liveness. Everything else is the embedded
launcher's: the actor runs the same worker target (`launcher.run_target`), which speaks to the coordinator's Hub
and to its peers' KV inboxes over the authenticated ZeroMQ transport on the nodes' addresses (measured faster
than Ray's object store for KV here: BENCHMARKS.md, "KV between Ray nodes"). A `RayWorker` is a
`launcher.WorkerHandle`: the Hub notices its actor's death as it notices a local process's exit, and the
coordinator's supervisor fails or re-routes its sessions and starts a new actor, exactly as for a local worker.

Ray is an optional extra (`pip install 'tandem[ray]'`) and is imported only when asked for.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.runtime.launcher import Hub, WorkerEnv, WorkerSpec, WorkerStartupError, run_target, stop_worker
from tandem.runtime.ray_address import check_ray_address

log = logging.getLogger("tandem.ray")
RAY_EXTRA = "pip install 'tandem[ray]'"
PROBE_S = 3.0              # how long connecting to a Ray head's port may take before the address is refused
PLACE_SHARE = 0.001        # what each worker takes of a --ray-place resource (so a node labelled 1 holds 1000)
POLL_S = 0.1               # a RayWorker asks Ray whether its actor still runs at most this often


class RayLaunchError(WorkerStartupError):
    """The Ray cluster cannot be reached or cannot place the workers (one line, for `tandem: error:`)."""


class RayUnavailable(RayLaunchError):
    """Ray is not installed (the message names the extra)."""


def import_ray(what: str = "--launcher ray") -> Any:
    """The `ray` module, or RayUnavailable naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"{what} needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


def _probe(address: str, timeout_s: float = PROBE_S) -> None:
    """RayLaunchError unless something accepts TCP connections at HOST:PORT (ray.init would retry for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RayLaunchError(f"no Ray cluster at {address} ({e.strerror or e}); start one with `ray start --head` "
                             "or give --ray-address HOST:PORT of its head") from None


def resolve_address(address: str | None) -> str | None:
    """The GCS address to join: HOST:PORT as given, 'auto' as `ray start` recorded it on this machine (or
    $RAY_ADDRESS), None (no --ray-address) as $RAY_ADDRESS or else None: a private Ray on this machine."""
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
        if address is None:
            return None
    if address == "auto" or address == os.environ.get("RAY_ADDRESS") == "auto":
        from ray._private import services
        try:
            found = services.canonicalize_bootstrap_address("auto")
        except Exception:  # noqa: BLE001 - Ray's own lookup: whatever it raises means "none found"
            found = None
        if not found:
            raise RayLaunchError("--ray-address auto: no Ray cluster was started on this machine (run "
                                 "`ray start --head`, or give --ray-address HOST:PORT)")
        address = found
    check_ray_address(address)
    return address


def connect(address: str | None, namespace: str, num_cpus: int | None = None) -> Any:
    """ray.init: join the cluster at `address` (see resolve_address) or start a private single-node one of
    `num_cpus` logical CPUs (default: this machine's); the `ray` module. Connecting twice is a no-op."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    target = resolve_address(address)
    if os.environ.get("RAY_AUTH_MODE"):      # Ray reads its token settings when imported: take today's (a cluster
        try:                                 # with token auth, its token set after `import ray`)
            from ray._raylet import Config
            Config.initialize("")
        except Exception as e:  # noqa: BLE001 - another Ray version: its settings as imported
            log.debug("refreshing Ray's settings failed: %s", e)
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    try:
        if target is not None:
            _probe(target)
            ray.init(address=target, namespace=namespace, logging_level=logging.WARNING)
        else:                                   # a private Ray for this process: small, no dashboard
            ray.init(namespace=namespace, num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                     object_store_memory=256 << 20, logging_level=logging.WARNING)
    except RayLaunchError:
        raise
    except Exception as e:  # noqa: BLE001 - Ray's own errors, as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RayLaunchError(f"joining the Ray cluster at {target or '(a new private one)'} failed: {first}") \
            from None
    finally:
        if main and sigterm is not None:    # ray.init makes SIGTERM a sys.exit; keep the caller's graceful stop
            signal.signal(signal.SIGTERM, sigterm)
    return ray


class WorkerActor:
    """The Ray actor that hosts one worker: `run` runs its target until it returns (Shutdown) or fails; `where`
    answers meanwhile (the actor has two threads)."""

    def __init__(self) -> None:
        try:                                    # the coordinator owns Ctrl-C, as for local workers
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:                      # not the main thread: nothing to do
            pass

    def where(self) -> dict[str, Any]:
        """This actor's node id, address and process id."""
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def run(self, target: str, kwargs: dict[str, Any], env: WorkerEnv, extra_env: dict[str, str] | None) -> int:
        """Run the worker (its KV inbox on this node's address); 0 when it stopped cleanly, raises otherwise."""
        import ray
        os.environ.update({k: v for k, v in (extra_env or {}).items() if k != "CUDA_VISIBLE_DEVICES"})  # Ray's own
        run_target(target, kwargs, dataclasses.replace(env, bind_host=ray.util.get_node_ip_address()))
        return 0


class RayWorker:
    """A worker running in a Ray actor (a launcher.WorkerHandle): alive while its `run` call is; killing it kills
    the actor and frees its placement group."""

    def __init__(self, spec: WorkerSpec, actor: Any, run_ref: Any, pg: Any, bundle: dict[str, float],
                 name: str) -> None:
        self.worker_id, self.target, self.name = spec.worker_id, spec.target, name
        self.info: dict[str, Any] | None = None
        self.bundle = bundle
        self._actor, self._ref, self._pg = actor, run_ref, pg
        self._exitcode: int | None = None
        self._error: str | None = None
        self._done = False
        self._checked = -1.0
        self._released = False

    def __repr__(self) -> str:
        return f"RayWorker(id={self.worker_id}, name={self.name}, alive={self.alive}, exitcode={self.exitcode})"

    @property
    def actor(self) -> Any:
        """The Ray actor handle."""
        return self._actor

    @property
    def pid(self) -> int:
        return int((self.info or {}).get("pid", 0) or 0)

    def _poll(self, force: bool = False) -> bool:
        """Whether the actor's `run` has ended (asks Ray at most every POLL_S unless `force`)."""
        if self._done:
            return True
        import time
        now = time.monotonic()
        if not force and now - self._checked < POLL_S:
            return False
        self._checked = now
        import ray
        ready, _ = ray.wait([self._ref], timeout=0, fetch_local=False)
        if not ready:
            return False
        self._done = True
        try:
            ray.get(self._ref, timeout=0)
            self._exitcode = 0
        except ray.exceptions.RayActorError as e:
            self._exitcode = -signal.SIGKILL
            self._error = f"its Ray actor died: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            self._exitcode = 1
            self._error = f"{type(cause).__name__}: {cause}"
        except Exception as e:  # noqa: BLE001 - anything else Ray raises still ends this worker
            self._exitcode = 1
            self._error = f"{type(e).__name__}: {e}"
        self._release()
        return True

    @property
    def alive(self) -> bool:
        return not self._poll()

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self._poll() else None

    def error(self) -> str | None:
        """Why the worker ended ("Type: message", or its actor's death), or why it has not started (no node has
        the resources its placement group asks for)."""
        if self._poll(force=True):
            return self._error
        import ray
        ready, _ = ray.wait([self._pg.ready()], timeout=0)
        if not ready:
            return f"Ray could not place it: no node has {self.bundle} free (`ray status` shows what is free)"
        return None

    def _release(self) -> None:
        """Kill the actor (a cleanly stopped one still holds its resources) and free its placement group."""
        if self._released:
            return
        self._released = True
        import ray
        from ray.util.placement_group import remove_placement_group
        for step in (lambda: ray.kill(self._actor, no_restart=True), lambda: remove_placement_group(self._pg)):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - already gone, or the cluster is: nothing left to free
                log.debug("releasing worker %d: %s", self.worker_id, e)

    def terminate(self) -> None:
        """A Ray actor has no polite stop besides Shutdown: kill it."""
        self.kill()

    def kill(self) -> None:
        """Kill the actor now (fencing, fault injection) and free its placement group; does not wait."""
        self._release()

    async def wait(self, timeout_s: float) -> bool:
        """Whether the actor's `run` ended within `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._poll(force=True):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self, hub: Hub | None = None, grace_s: float = 5.0, term_s: float = 2.0) -> int | None:
        """Shutdown message (if `hub`), then kill the actor after `grace_s`; its exit code."""
        await stop_worker(self, hub, grace_s, term_s)
        self._release()
        return self.exitcode


def worker_tp(spec: WorkerSpec) -> int:
    """A worker spec's tensor-parallel degree (its engine's tensor_parallel_size; 1 without one)."""
    return int((spec.kwargs.get("engine_args") or {}).get("tensor_parallel_size", 1) or 1)


@dataclass
class RayLauncher:
    """Places workers as Ray actors: `spawn` is a launcher.Spawner (give it to Cluster).

    `place` maps a role (prefill, decode, colocated) to a custom resource that nodes for it offer (`ray start
    --resources '{"NAME": 1}'`); each worker of that role takes PLACE_SHARE of it. A worker's tensor-parallel degree
    (its spec's engine tensor_parallel_size, else `tp`) is its GPUs on a GPU cluster, or `threads` CPUs per rank,
    all in one bundle of one placement group (one node)."""

    address: str | None = None
    namespace: str = field(default_factory=lambda: f"tandem-{uuid.uuid4().hex[:8]}")
    place: dict[str, str] = field(default_factory=dict)
    threads: int = 1
    tp: int = 1
    min_cpus: int = 1                           # a private Ray (no address) gets at least this many logical CPUs
    gpus: bool = False                          # set by start(): the cluster has GPUs
    node_ip: str = "127.0.0.1"                  # this (the coordinator's) node's address, set by start()
    _spawned: dict[int, int] = field(default_factory=dict, init=False)
    _ray: Any = field(default=None, init=False, repr=False)
    _actor_cls: Any = field(default=None, init=False, repr=False)

    def start(self) -> RayLauncher:
        """Join (or start) the Ray cluster and check that it can hold the workers' resources."""
        self._ray = ray = connect(self.address, self.namespace, num_cpus=max(self.min_cpus, os.cpu_count() or 1))
        total = ray.cluster_resources()
        missing = sorted({r for r in self.place.values() if total.get(r, 0) <= 0})
        if missing:
            raise RayLaunchError(f"no node of the Ray cluster offers resource(s) {', '.join(missing)} named by "
                                 f"--ray-place (start nodes with `ray start --resources '{{\"{missing[0]}\": 1}}'`)")
        self.gpus = total.get("GPU", 0) > 0
        self.node_ip = ray.util.get_node_ip_address()
        self._actor_cls = ray.remote(WorkerActor)
        log.info("Ray cluster %s: %s; workers in namespace %s", self.address or "(private)",
                 {k: v for k, v in total.items() if not k.startswith("node:")}, self.namespace)
        return self

    @property
    def hub_address(self) -> str:
        """Where the coordinator's hub listens: this node's address, any port."""
        return f"tcp://{self.node_ip}:0"

    def bundle(self, role: str | None, tp: int | None = None) -> dict[str, float]:
        """What one worker of `role` reserves, its tensor-parallel group whole: tp GPUs (GPU cluster) or `threads`
        CPUs per rank, and its role's label; `tp` the worker's degree (None: this launcher's)."""
        tp = self.tp if tp is None else tp
        b: dict[str, float] = {"CPU": float(self.threads * tp)}
        if self.gpus:
            b["GPU"] = float(tp)
        if role in self.place:
            b[self.place[role]] = PLACE_SHARE
        return b

    def spawn(self, spec: WorkerSpec, env: WorkerEnv) -> RayWorker:
        """Start `spec` as an actor in its own placement group (STRICT_PACK: one node), which holds the worker's
        whole tensor-parallel group (the actor's process drives it; its ranks are that process's children, on the
        same node, within the bundle's resources); returns at once."""
        assert self._ray is not None, "RayLauncher.start() first"
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        role = spec.kwargs.get("role")
        bundle = self.bundle(role, worker_tp(spec))
        gen = self._spawned.get(spec.worker_id, 0)
        self._spawned[spec.worker_id] = gen + 1
        name = f"worker-{spec.worker_id}.{gen}"
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"tandem-{self.namespace}-{name}")
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = self._actor_cls.options(
            name=name, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=extra or None,
            max_restarts=0, max_concurrency=2,              # run + where; restarts are the supervisor's (new keys)
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote()
        ref = actor.run.remote(spec.target, spec.kwargs, dataclasses.replace(env, parent_pid=0), spec.env)
        log.info("worker %d (%s): Ray actor %s, resources %s", spec.worker_id, role, name, bundle)
        return RayWorker(spec, actor, ref, pg, bundle, name)

    def close(self) -> None:
        """Disconnect from Ray (a private Ray started by `start` stops with it)."""
        if self._ray is not None and self._ray.is_initialized():
            self._ray.shutdown()
        self._ray = None


__all__ = ["PLACE_SHARE", "RAY_EXTRA", "RayLaunchError", "RayLauncher", "RayUnavailable", "RayWorker",
           "WorkerActor", "check_ray_address", "connect", "import_ray", "resolve_address", "worker_tp"]
