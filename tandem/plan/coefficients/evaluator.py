"""Runs deployments through the simulator, from cache when possible, in parallel processes or on a given executor
(e.g. Ray tasks: tandem.bench.ray_pool) (Evaluator)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, wait
from dataclasses import dataclass, field

from tandem.plan.coefficients.cache import RunCache, usable
from tandem.plan.coefficients.measurement import Measurement
from tandem.plan.coefficients.objective import INF
from tandem.plan.coefficients.simulate import simulate_one, warm
from tandem.plan.coefficients.workload import SimSpec, Workload
from tandem.workload.session import Session


_SHARED: dict[str, Sequence[Session]] = {}
"""Workloads registered before a process pool starts; forked workers inherit them, so tasks carry a key only."""


def share(workload: Workload) -> None:
    """Make `workload` available to process pools created from now on without sending it with every task."""
    if len(_SHARED) > 8:
        _SHARED.clear()
    _SHARED[workload.key] = workload.sessions


def _task(args) -> Measurement:
    sessions, key, *rest = args
    if sessions is None:
        sessions = _SHARED[key]
    return simulate_one(sessions, key, *rest)


def _ignore_sigint() -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass(slots=True)
class Stats:
    requested: int = 0
    simulated: int = 0
    stopped_early: int = 0
    cached: int = 0
    sim_wall_s: float = 0.0


@dataclass
class Evaluator:
    """Runs deployments through the simulator, from cache when possible, in `jobs` processes, or `jobs` at a time on
    `executor` when given (its owner shuts it down; this only cancels what it submitted on an error)."""

    spec: SimSpec
    jobs: int = 1
    cache: RunCache = field(default_factory=lambda: RunCache(None))
    on_done: Callable[[Measurement], None] | None = None
    stats: Stats = field(default_factory=Stats)
    executor: Executor | None = None
    _pool: Executor | None = None
    _inherited: frozenset = frozenset()

    def evaluate(self, workload: Workload, deploys: Iterable[str], gpus: int,
                 cutoff: Callable[[], float] = lambda: INF,
                 on_result: Callable[[Measurement], None] | None = None) -> dict[str, Measurement]:
        """Measure every deployment; each run gets the cutoff current when it starts."""
        todo = list(dict.fromkeys(deploys))
        out: dict[str, Measurement] = {}

        def finish(d: str, key: str, m: Measurement) -> None:
            out[d] = m
            if not m.cached:
                self.cache.put(key, m)
                self.stats.simulated += 1
                self.stats.stopped_early += not m.exact
                self.stats.sim_wall_s += m.wall_s
            else:
                self.stats.cached += 1
            if on_result is not None:
                on_result(m)
            if self.on_done is not None:
                self.on_done(m)

        self.stats.requested += len(todo)
        queue = []
        for d in todo:   # cached answers first: they tighten the cutoff for the runs that follow
            key = self.cache.key(self.spec, workload.key, d)
            hit = usable(self.cache.get(key), cutoff())
            if hit is not None:
                finish(d, key, hit)
            else:
                queue.append((d, key))
        if not queue:
            return out
        if self.jobs <= 1 or len(queue) == 1:
            for d, key in queue:
                c = cutoff()
                hit = usable(self.cache.get(key), c)
                finish(d, key, hit if hit is not None else
                       simulate_one(workload.sessions, workload.key, self.spec, d, gpus, c))
            return out
        if self._pool is None and self.executor is None:
            warm(self.spec, [d for d, _ in queue], gpus)
        pool = self._get_pool()
        running: dict = {}
        pos = 0
        try:
            while pos < len(queue) or running:
                while pos < len(queue) and len(running) < self.jobs:
                    d, key = queue[pos]
                    pos += 1
                    c = cutoff()
                    hit = usable(self.cache.get(key), c)
                    if hit is not None:
                        finish(d, key, hit)
                        continue
                    sessions = None if workload.key in self._inherited else workload.sessions
                    fut = pool.submit(_task, (sessions, workload.key, self.spec, d, gpus, c))
                    running[fut] = (d, key)
                if not running:
                    continue
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    d, key = running.pop(fut)
                    finish(d, key, fut.result())
        except BaseException:
            self.close(cancel=True)
            raise
        return out

    def _get_pool(self) -> Executor:
        if self._pool is None and self.executor is not None:
            self._pool, self._inherited = self.executor, frozenset()     # tasks carry their sessions
        if self._pool is None:
            import multiprocessing as mp                    # with its process pool: only when runs go to processes
            from concurrent.futures import ProcessPoolExecutor
            ctx = mp.get_context()
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx, initializer=_ignore_sigint)
            self._inherited = frozenset(_SHARED) if ctx.get_start_method() == "fork" else frozenset()
        return self._pool

    def close(self, cancel: bool = False) -> None:
        if self._pool is not None and self._pool is self.executor:
            if cancel:
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._pool is not None:
            if cancel:
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    proc.terminate()
            self._pool.shutdown(wait=not cancel, cancel_futures=cancel)
            self._pool = None

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)
