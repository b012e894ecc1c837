"""Worker processes of the runtime: spawn, readiness handshake, graceful stop, kill, and no orphans.

A child imports `target` ("module:function") and calls it with a `WorkerEnv` (worker id, hub address,
heartbeat period) and the keyword arguments given; an `async def` target runs under asyncio.run. The
target connects a `Link` (`env.link(codec)`) and sends `Ready` when it can serve. Children ignore SIGINT
(the coordinator owns Ctrl-C) and exit by themselves when their parent dies. docs/runtime-transport.md.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (imported first so our atexit hook runs before its join)
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.runtime import event_loop
from tandem.runtime.transport import HEARTBEAT_S, LOCAL_HOSTS, Codec, Hub, Link, PeerInbox, PeerOutbox, Shutdown, \
    WorkerAuth, WorkerDead, WorkerDied, WorkerUnreachable

ORPHAN_EXIT = 75           # exit code of a child that noticed its parent died
PARENT_POLL_S = 0.2        # how often a child checks that its parent is alive
STARTUP_TIMEOUT_S = 60.0   # default time a worker has to send Ready

# Workers are forked from a fork server that has imported torch and the worker's modules once (multiprocessing's
# "forkserver", started on the first worker): a worker then starts in a fraction of a second instead of importing
# torch itself (about 2 s of CPU). The server is a fresh process that never touches CUDA or opens a socket, so what
# it forks is as clean as a spawned process. Where there is no fork server (Windows), workers are spawned.
# TANDEM_WORKER_MULTIPROC_METHOD=spawn starts workers the old way (as vLLM's VLLM_WORKER_MULTIPROC_METHOD).
# What the server imports, and why, is tandem/runtime/fork_preload.py (torch._dynamo and uvloop too, then gc.freeze);
# none of it starts a thread, so forking the server stays safe.
PRELOAD = ["tandem.runtime.fork_preload"]
START_METHODS = ("forkserver", "spawn")


def _start_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context workers start from: TANDEM_WORKER_MULTIPROC_METHOD, else the fork server where
    there is one."""
    method = os.environ.get("TANDEM_WORKER_MULTIPROC_METHOD")
    if method is not None and method not in START_METHODS:
        raise ValueError(f"TANDEM_WORKER_MULTIPROC_METHOD is one of {', '.join(START_METHODS)}, got {method!r}")
    if method is None:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


log = logging.getLogger("tandem.launcher")
_SPAWN = _start_context()
_LIVE: set[WorkerProcess] = set()
_MARKS: dict[str, float] = {}        # this process's startup phases (mark_startup), sent to the hub with Ready


def mark_startup(phase: str) -> None:
    """Note that this worker process reached startup `phase` now (time.monotonic(): one clock for every process of a
    host), so a slow start can be broken down; the marks travel with Ready (startup_marks)."""
    _MARKS[phase] = time.monotonic()


def startup_marks() -> dict[str, float]:
    """The startup phases this process marked, by name (monotonic seconds)."""
    return dict(_MARKS)


class WorkerStartupError(RuntimeError):
    """A worker that exited, or did not send Ready in time, during startup (message says which and why)."""


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker target is called with: who it is, where the hub is, and its keys.

    `auth` (from `Hub.credentials`) reaches the child inside this object, which multiprocessing's spawn sends
    through a pipe: the keys are never on the command line or in the environment. `bind_host` is where the
    worker's KV inbox listens: 127.0.0.1 for local workers, the node's address for workers on other hosts (Ray)."""

    worker_id: int
    hub_address: str
    heartbeat_s: float = HEARTBEAT_S
    parent_pid: int = 0
    auth: WorkerAuth | None = field(default=None, repr=False)
    bind_host: str = "127.0.0.1"

    def link(self, codec: Codec) -> Link:
        """A Link to the hub for this worker (use `async with env.link(codec) as link:`)."""
        return Link(codec, self.hub_address, self.worker_id, self.heartbeat_s, auth=self.auth)

    def inbox(self, codec: Codec, accept: tuple[type, ...] = (), **options: Any) -> PeerInbox:
        """This worker's KV inbox (CURVE: only holders of the cluster's KV client key get in); with `accept`,
        messages of other types are dropped (and counted); `options` are PeerInbox's (e.g. max_msg_bytes)."""
        return PeerInbox(codec, address=f"tcp://{self.bind_host}:0", allow_remote=self.bind_host not in LOCAL_HOSTS,
                         auth=self.auth, accept=accept, **options)

    def outbox(self, codec: Codec, **options: Any) -> PeerOutbox:
        """An outbox to the cluster's KV inboxes, with the cluster's KV client keys; `options` are PeerOutbox's."""
        return PeerOutbox(codec, auth=self.auth, **options)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its id, target "module:function" and the target's keyword arguments."""

    worker_id: int
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] | None = None    # extra environment variables (e.g. CUDA_VISIBLE_DEVICES)


def resolve_target(target: str) -> Callable[..., Any]:
    """The function named by "package.module:function"."""
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"worker target {target!r} must look like 'package.module:function'")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                   # it exists, owned by another user
        pass
    return True


def _watch_parent(parent_pid: int) -> None:
    """Exit this process (without cleanup) as soon as the process that started it is gone: no orphans. That is
    `parent_pid` (the coordinator) and the process that forked this one: the coordinator itself, or its fork server,
    which exits with it (this process is then re-parented)."""
    forked_by = os.getppid()

    def loop() -> None:
        while True:
            if os.getppid() != forked_by or (parent_pid and not _alive(parent_pid)):
                os._exit(ORPHAN_EXIT)
            time.sleep(PARENT_POLL_S)
    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def run_target(target: str, kwargs: dict[str, Any], env: WorkerEnv) -> None:
    """Import `target` and run it with `env` (an `async def` target under asyncio) until it returns."""
    result = resolve_target(target)(env, **kwargs)
    if inspect.iscoroutine(result):
        event_loop.run(result)


def _child_main(target: str, kwargs: dict[str, Any], env: WorkerEnv, extra_env: dict[str, str] | None,
                err: multiprocessing.connection.Connection) -> None:
    """Entry point of a spawned worker: guard, import, run; report an exception's message to the parent.
    `extra_env` is the whole environment the worker runs with (the parent's when it started the worker, plus the
    spec's): a fork server's own environment is the parent's when the server started."""
    mark_startup("started")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(env.parent_pid)
    if extra_env is not None:
        os.environ.clear()
        os.environ.update(extra_env)
    try:
        run_target(target, kwargs, env)
    except SystemExit:
        raise
    except BaseException as e:
        with contextlib.suppress(OSError):
            err.send(f"{type(e).__name__}: {e}")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


class WorkerProcess:
    """A spawned worker process: pid, liveness, the child's reported error, stop/kill."""

    def __init__(self, worker_id: int, target: str, process: multiprocessing.process.BaseProcess,
                 err: multiprocessing.connection.Connection) -> None:
        self.worker_id, self.target, self.process = worker_id, target, process
        self.info: dict[str, Any] | None = None     # its Ready.info once ready
        self._err, self._error = err, None

    def __repr__(self) -> str:
        return f"WorkerProcess(id={self.worker_id}, pid={self.pid}, alive={self.alive}, exitcode={self.exitcode})"

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def error(self) -> str | None:
        """The last exception message the child reported ("Type: message"), if any."""
        try:
            while not self._err.closed and self._err.poll():
                self._error = self._err.recv()
        except (EOFError, OSError):
            pass
        return self._error

    def _release(self) -> None:
        """Forget this exited process: keep its last error, close the pipe."""
        self.error()
        self._err.close()
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL now (fault injection, fencing); does not wait."""
        if self.alive:
            self.process.kill()

    async def wait(self, timeout_s: float) -> bool:
        """Whether the process exited within `timeout_s` (polls without blocking the loop)."""
        deadline = time.monotonic() + timeout_s
        while self.alive:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        self.process.join(0)
        return True

    def terminate(self) -> None:
        """SIGTERM (a polite stop); does not wait."""
        self.process.terminate()

    async def stop(self, hub: Hub | None = None, grace_s: float = 5.0, term_s: float = 2.0) -> int | None:
        """Shutdown message (if `hub`), then SIGTERM after `grace_s`, then SIGKILL after `term_s`; exit code."""
        await stop_worker(self, hub, grace_s, term_s)
        self._release()
        return self.exitcode

    def stop_sync(self, term_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `term_s` (blocking; for atexit and non-async callers)."""
        if self.alive:
            self.process.terminate()
            self.process.join(term_s)
        if self.alive:
            self.process.kill()
            self.process.join(5.0)
        self._release()


class WorkerHandle(Protocol):
    """A running worker as the Cluster and the hub see it, wherever it runs: a local process (WorkerProcess) or a
    Ray actor (tandem.runtime.ray_launcher.RayWorker)."""

    worker_id: int
    target: str
    info: dict[str, Any] | None

    @property
    def pid(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def exitcode(self) -> int | None: ...

    def error(self) -> str | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    async def wait(self, timeout_s: float) -> bool: ...

    async def stop(self, hub: Hub | None = None, grace_s: float = 5.0, term_s: float = 2.0) -> int | None: ...


Spawner = Callable[[WorkerSpec, WorkerEnv], WorkerHandle]
"""Starts a worker for a spec with its WorkerEnv (keys included) and returns at once; Cluster's default spawns a
local process (spawn_local)."""


async def stop_worker(w: WorkerHandle, hub: Hub | None, grace_s: float, term_s: float) -> None:
    """The one stop sequence of every kind of worker: Shutdown through `hub` (if given), then `terminate()` after
    `grace_s`, then `kill()` after `term_s`."""
    if hub is not None:
        hub.forget(w.worker_id)
        if w.alive:
            try:
                await hub.send(w.worker_id, Shutdown("stop"))
            except WorkerUnreachable:
                grace_s = 0.0
    if not await w.wait(grace_s):
        w.terminate()
        if not await w.wait(term_s):
            w.kill()
            await w.wait(10.0)


def spawn_local(spec: WorkerSpec, wenv: WorkerEnv) -> WorkerProcess:
    """The default Spawner: `spec` as a child process of this one (multiprocessing spawn)."""
    recv_err, send_err = _SPAWN.Pipe(duplex=False)
    proc = _SPAWN.Process(target=_child_main, args=(spec.target, spec.kwargs, wenv, {**os.environ, **(spec.env or {})},
                                                    send_err),
                          name=f"tandem-worker-{spec.worker_id}", daemon=False)
    proc.start()
    send_err.close()
    wp = WorkerProcess(spec.worker_id, spec.target, proc, recv_err)
    _LIVE.add(wp)
    return wp


@atexit.register
def _reap_all() -> None:
    """At interpreter exit, stop any worker still running (runs before multiprocessing joins them)."""
    for wp in list(_LIVE):
        wp.stop_sync(term_s=1.0)


class Cluster:
    """Workers around one Hub: start them and wait until all are ready, fence the dead, stop them all."""

    def __init__(self, hub: Hub, *, startup_timeout_s: float = STARTUP_TIMEOUT_S, stop_grace_s: float = 5.0,
                 heartbeat_s: float = HEARTBEAT_S, spawner: Spawner = spawn_local) -> None:
        self.hub, self.startup_timeout_s, self.stop_grace_s = hub, startup_timeout_s, stop_grace_s
        self.heartbeat_s = heartbeat_s
        self.spawner = spawner
        self.workers: dict[int, WorkerHandle] = {}
        self.deaths: list[WorkerDead] = []
        # worker id -> monotonic times of its latest start: "spawn" (asked for) and "ready" (its Ready received)
        self.started: dict[int, dict[str, float]] = {}
        hub.on_worker_dead(self._on_dead)

    def _on_dead(self, event: WorkerDead) -> None:
        """Record a death; kill a hung worker so it cannot come back with stale state (fencing)."""
        self.deaths.append(event)
        wp = self.workers.get(event.worker_id)
        if wp is not None:
            wp.kill()

    async def start(self, specs: Iterable[WorkerSpec]) -> dict[int, WorkerHandle]:
        """Spawn all, wait until every one is ready; on any failure stop all and raise WorkerStartupError."""
        specs = list(specs)
        ids = [s.worker_id for s in specs]
        if len(set(ids)) != len(ids) or set(ids) & set(self.workers):
            raise ValueError(f"duplicate worker ids in {ids} (running: {sorted(self.workers)})")
        started = [self._spawn(s) for s in specs]
        results = await asyncio.gather(*(self._await_ready(wp) for wp in started), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(self._stop_one(wp) for wp in started))
            first = next((e for e in errors if not isinstance(e, WorkerStartupError)), None)
            if first is not None:
                raise first
            raise WorkerStartupError("; ".join(str(e) for e in errors))
        return {wp.worker_id: wp for wp in started}

    async def add(self, spec: WorkerSpec) -> WorkerHandle:
        """Start one more worker (or restart a dead id) and wait until it is ready."""
        old = self.workers.get(spec.worker_id)
        if old is not None:
            if old.alive:
                raise ValueError(f"worker {spec.worker_id} is running")
            del self.workers[spec.worker_id]
        return (await self.start([spec]))[spec.worker_id]

    async def replace(self, spec: WorkerSpec, reap_s: float = 5.0) -> WorkerHandle:
        """Start a replacement for worker `spec.worker_id` at once and wait until it is ready; the old process (if
        any) is killed first and reaped beside the replacement's startup, not before it (no zombie is left)."""
        old = self.workers.pop(spec.worker_id, None)
        reap = None
        if old is not None:
            old.kill()
            reap = asyncio.ensure_future(self._reap(old, reap_s))
        try:
            return (await self.start([spec]))[spec.worker_id]
        finally:
            if reap is not None:
                await reap

    @staticmethod
    async def _reap(old: WorkerHandle, reap_s: float) -> None:
        """Wait for a killed worker to exit and release it (its handle's pipe); a failure is logged, not raised."""
        try:
            await old.stop(None, grace_s=reap_s, term_s=1.0)
        except Exception as e:                                  # noqa: BLE001 - the replacement must not fail for it
            log.warning("reaping the old process of worker %d failed: %s: %s", old.worker_id, type(e).__name__, e)

    def _spawn(self, spec: WorkerSpec) -> WorkerHandle:
        auth = self.hub.credentials(spec.worker_id)            # fresh keys per spawn (a restart revokes the old)
        self.started[spec.worker_id] = {"spawn": time.monotonic()}
        wp = self.spawner(spec, WorkerEnv(spec.worker_id, self.hub.address, self.heartbeat_s, os.getpid(), auth))
        self.workers[spec.worker_id] = wp
        self.hub.watch(spec.worker_id, wp)
        return wp

    async def _await_ready(self, wp: WorkerHandle) -> None:
        where = f"worker {wp.worker_id} ({wp.target}, pid {wp.pid})"
        try:
            wp.info = await self.hub.wait_ready(wp.worker_id, self.startup_timeout_s)
            self.started.setdefault(wp.worker_id, {})["ready"] = time.monotonic()
        except WorkerDied:
            await wp.wait(2.0)
            why = wp.error() or "no exception reported (see its stderr)"
            raise WorkerStartupError(f"{where} exited with code {wp.exitcode} during startup: {why}") from None
        except asyncio.TimeoutError:
            why = wp.error()                                   # e.g. a Ray worker still waiting for resources
            wp.kill()
            raise WorkerStartupError(f"{where} was not ready within {self.startup_timeout_s:g} s (killed)"
                                     + (f": {why}" if why else "")) from None

    async def _stop_one(self, wp: WorkerHandle) -> None:
        await wp.stop(self.hub, grace_s=self.stop_grace_s)
        self.workers.pop(wp.worker_id, None)

    async def stop(self) -> None:
        """Stop every worker: Shutdown, then SIGTERM, then SIGKILL (see WorkerProcess.stop)."""
        await asyncio.gather(*(self._stop_one(wp) for wp in list(self.workers.values())))

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
