"""The driver's side of a tensor-parallel group: it starts the other ranks (one process each, from the fork server),
waits for their shards, broadcasts each model call's inputs once, notices a dead rank and fails the engine with one
clear line, and stops the ranks when the engine closes. `TPModel` is the model the driver's engine calls: the same
call runs on every rank, the logits are gathered here, where sampling runs.

Besides the group's collectives, each rank has a notice pipe to the driver (one way, a pipe per rank): what a rank
finishes on a thread of its own (a host-tier copy) it reports there, without waiting, and the driver reads the pipes
on a thread of its own (`listen`), never between the ranks' collectives."""
from __future__ import annotations

import atexit
import multiprocessing
import os
import logging
import signal
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, TypeVar

import torch

from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.parallel import channel, group
from tandem.engine.parallel.rank import RankSpec, rank_main, ready_key

STARTUP_TIMEOUT_S = 300.0      # the ranks have this long to load their shards
STOP_GRACE_S = 5.0             # a stopped rank has this long to exit before it is killed
PRELOAD = ["torch", "tandem.engine.loader", "tandem.engine.parallel.rank"]
T = TypeVar("T")
log = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[RankGroup]" = weakref.WeakSet()


class TensorParallelError(EngineError):
    """The group cannot run: a rank failed to start or died; every later call raises the same line."""


def _context() -> multiprocessing.context.BaseContext:
    """Ranks fork from multiprocessing's fork server (torch imported once), spawned where there is none."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "is unresponsive"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class RankGroup:
    """Ranks 1..size-1 of one worker, as processes, and the driver's end of their process group."""

    def __init__(self, cfg: EngineConfig, size: int, device: torch.device,
                 cpus: tuple[tuple[int, ...], ...] | None = None) -> None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            raise EngineError("this process already drives a tensor-parallel engine: close it first (LLM.close())")
        self.size = size
        self.device = device
        self.error: str | None = None
        self.forwarded_bytes = 0     # KV bytes this driver gathered from or scattered to its ranks (kv_group.py)
        # cpus: each rank's CPUs when its OpenMP threads are bound (omp_affinity.engine_plan): one thread per CPU
        self.threads = group.default_rank_threads(size) if device.type == "cpu" else torch.get_num_threads()
        if cpus is not None:
            self.threads = len(cpus[0])
        self._threads_before = torch.get_num_threads()
        sock = channel.listen_loopback()
        self.port = sock.getsockname()[1]
        try:
            self._store = channel.driver_store(sock, size)
        except BaseException:
            sock.close()
            raise
        sock.detach()              # the store owns the listening descriptor now and closes it when it is dropped
        ctx = _context()
        env = dict(os.environ)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.notices: list[Connection] = []      # the read end of each rank's notice pipe (rank 1 first)
        self._listening = False
        for r in range(1, size):
            dev = str(device) if device.type == "cpu" else f"cuda:{(device.index or 0) + r}"
            read, write = ctx.Pipe(duplex=False)
            spec = RankSpec(r, size, self.port, os.getpid(), cfg, dev, len(cpus[r]) if cpus else self.threads, env,
                            write, cpus[r] if cpus else None)
            p = ctx.Process(target=rank_main, args=(spec,), name=f"tandem-tp-rank{r}", daemon=True)
            p.start()
            write.close()                        # the rank holds the write end: its exit is the pipe's end here
            self.procs.append(p)
            self.notices.append(read)
        self.joined = False
        _LIVE.add(self)

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids (rank 1 first)."""
        return [p.pid or 0 for p in self.procs]

    def join(self) -> None:
        """Wait until every rank has loaded its shard (TensorParallelError naming the first that failed, with the
        ranks stopped), then form the process group and give this rank its share of the cores."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [ready_key(r) for r in range(1, self.size)]
        while not self._store.check(keys):
            dead = self._dead()
            if dead:
                self._fail(f"tensor-parallel rank {dead[0][0]} (pid {dead[0][1].pid}) {_how(dead[0][1].exitcode)} "
                           f"while loading its shard")
            if time.monotonic() > deadline:
                self._fail(f"tensor-parallel ranks did not load their shards within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        for r, key in enumerate(keys, 1):
            status = self._store.get(key).decode()
            if status != "ok":
                self._fail(f"tensor-parallel rank {r} could not load its shard: {status}")
        channel.join_group(self._store, 0, self.size, self.device)
        self.joined = True
        torch.set_num_threads(self.threads)

    def send(self, *command: Any) -> None:
        """Broadcast one command to the ranks (TensorParallelError when the group is broken or a rank is dead)."""
        self.check()
        self.run(lambda: channel.broadcast_command(command))

    def listen(self, fn: Callable[[int, Any], None]) -> None:
        """Call fn(rank, notice) on a thread of its own for each notice a rank sends, and fn(rank, None) once when a
        rank's pipe ends (it exited); one listener per group."""
        if self._listening:
            raise RuntimeError("the group's notices already have a listener")
        self._listening = True
        readers = {conn: r for r, conn in enumerate(self.notices, 1)}

        def loop() -> None:
            while readers:
                for conn in wait(list(readers)):
                    r = readers[conn]
                    try:
                        notice = conn.recv()
                    except (EOFError, OSError):
                        del readers[conn]
                        notice = None
                    try:
                        fn(r, notice)
                    except Exception:  # noqa: BLE001 - one bad notice must not stop the others
                        log.exception("a notice of tensor-parallel rank %d could not be handled", r)
        threading.Thread(target=loop, name="tandem-tp-notices", daemon=True).start()

    def run(self, fn: Callable[[], T]) -> T:
        """Run the driver's part of a collective step; a failure with a dead rank becomes TensorParallelError."""
        try:
            return fn()
        except RuntimeError as e:
            deadline = time.monotonic() + 2.0          # the dead rank's exit may lag its closed sockets a little
            while not self._dead() and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._dead() or "closed by peer" in str(e) or "Connection reset" in str(e):
                self.check()
                self._fail(f"tensor-parallel group failed: {str(e).splitlines()[0][:200]}")
            raise

    def check(self) -> None:
        """TensorParallelError if the group broke or a rank died."""
        if self.error is not None:
            raise TensorParallelError(self.error)
        dead = self._dead()
        if dead:
            r, p = dead[0]
            self._fail(f"tensor-parallel rank {r} (pid {p.pid}) {_how(p.exitcode)}: this engine cannot run steps "
                       f"any more (its requests fail); start a new one")

    def failure(self) -> str | None:
        """Why the group cannot run (a rank died, or it failed or was closed), in one line; None while it can. Reads
        the ranks' state only: safe from another thread than the one running steps."""
        if self.error is not None:
            return self.error
        dead = self._dead()
        if not dead:
            return None
        r, p = dead[0]
        return f"tensor-parallel rank {r} (pid {p.pid}) {_how(p.exitcode)}"

    def _dead(self) -> list[tuple[int, multiprocessing.process.BaseProcess]]:
        return [(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]

    def _fail(self, message: str) -> None:
        self.error = message
        self.close()
        raise TensorParallelError(message)

    def close(self) -> None:
        """Stop the ranks (a stop command, then SIGKILL after STOP_GRACE_S), leave the process group, restore the
        driver's threads. Idempotent."""
        import torch.distributed as dist
        if self.joined and self.error is None and not self._dead():
            try:
                channel.broadcast_command(("stop",))
            except RuntimeError:
                pass
        deadline = time.monotonic() + (STOP_GRACE_S if self.joined and self.error is None else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if self.joined:
            self.joined = False
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._threads_before)
        if self.error is None:
            self.error = "the tensor-parallel engine was closed"
        self._store = None         # closes the store's listening descriptor (once: never closed here as well)
        _LIVE.discard(self)


@atexit.register
def _close_all() -> None:
    """No rank outlives a driver that exits without closing its engine."""
    for g in list(_LIVE):
        g.close()


class TPModel:
    """The driver's model: each call is broadcast to the ranks (inputs once per call), then run on this rank's
    shard; compute_logits returns the gathered full-vocabulary logits. Other attributes are the shard's."""

    def __init__(self, model: torch.nn.Module, group: RankGroup) -> None:
        self.model = model
        self.group = group

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None, kv_caches: Any,
                 meta: Any) -> torch.Tensor:
        """The forward on every rank; `kv_caches` given as tensors means each rank's own pool."""
        kv = "pool" if kv_caches and isinstance(kv_caches[0], torch.Tensor) else kv_caches
        self.group.send("forward", input_ids, positions, kv, meta)
        return self.group.run(lambda: self.model(input_ids, positions, kv_caches, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of hidden rows [N, hidden], the ranks' vocabulary slices gathered here."""
        self.group.send("logits", hidden)
        return self.group.run(lambda: self.model.compute_logits(hidden))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
