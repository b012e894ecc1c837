"""LAPS spatial disaggregation: prefill workers split into a short and a long pool, each prefill routed to its class.

A router wrapper, sans-I/O. The inner router (least-cost remote for LAPS, AMPD's Alg. 1 for AMPD+LAPS) decides as
always, but sees only the prefill workers of the task's class pool; a decode worker (local prefill) stays its
choice. The pools come from a PoolController (Alg. 2), stepped at most once per control period when a task is
routed — the pools only matter at routing time, so no timer is needed. A moved worker keeps what it has queued and
drains it (each worker schedules both classes, one per step); new tasks of its new class are routed to it.

Signals per prefill worker, all in units the two pools share: backlog q = queued prefill seconds of the pool's
class / TTFT SLO (the view's queued_prefill_by_class; the whole queue when it has no split), SLA
deviation e = windowed mean TTFT / TTFT SLO − 1 (−1 when nothing finished in the window), utilisation u = the
busy share of the last window. With one prefill worker (or none) there are no pools: LAPS is then temporal only.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol, Sequence

from tandem.policy.laps.classify import LengthClassifier, PrefillClass
from tandem.policy.laps.pressure import InstanceSignal, Move, PoolController, PressureConfig
from tandem.policy.routing import ClusterView, Router
from tandem.policy.task import PrefillTask

__all__ = ["PoolView", "PooledRouter", "initial_pools"]

DEFAULT_SLO_S = 1.0          # normalises backlog and TTFT of tasks without a TTFT SLO


class PoolView(ClusterView, Protocol):
    """Routing's view plus each worker's busy share of the last window (the controller's u) and its queued prefill
    seconds split by class (each pool is scored on its class's backlog; an empty pool on its class's backlog
    wherever it waits)."""

    def utilization(self, worker: int, now: float) -> float: ...
    def queued_prefill_by_class(self, worker: int) -> tuple[float, float]: ...


def initial_pools(workers: Sequence[int]) -> tuple[list[int], list[int]]:
    """Half of the prefill workers (the lower ids, the extra one included) short, the rest long."""
    ws = sorted(workers)
    n_short = (len(ws) + 1) // 2
    return ws[:n_short], ws[n_short:]


class _PoolFilter:
    """The view with prefill_workers() narrowed to one pool (everything else passes through)."""

    def __init__(self, view: ClusterView, members: frozenset[int]) -> None:
        self._view, self._members = view, members

    def prefill_workers(self) -> Sequence[int]:
        return [w for w in self._view.prefill_workers() if w in self._members]

    def __getattr__(self, name: str):
        return getattr(self._view, name)


class PooledRouter:
    """Routes through `inner` within the pool of the task's length class; steps the pool controller."""

    def __init__(self, inner: Router, classifier: LengthClassifier, config: PressureConfig | None = None,
                 period_s: float = 1.0) -> None:
        if not isinstance(period_s, (int, float)) or isinstance(period_s, bool) or not period_s > 0:
            raise ValueError(f"period_s must be a number of seconds > 0, got {period_s!r}")
        self.inner = inner
        self.classifier = classifier
        self.config = config or PressureConfig()
        self.period_s = float(period_s)
        self.controller: PoolController | None = None
        self._known: tuple[int, ...] = ()
        self._last_step = -math.inf
        self.moves: list[Move] = []

    def pools(self) -> dict[PrefillClass, frozenset[int]] | None:
        """The current pools (None: fewer than two prefill workers, no pools)."""
        return self.controller.pools() if self.controller is not None else None

    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        live = tuple(sorted(view.prefill_workers()))
        self._sync(live)
        if self.controller is None:
            return self.inner.route(task, view, now)
        if now - self._last_step >= self.period_s and hasattr(view, "utilization"):
            self._last_step = now
            slo = task.ttft_slo_s if math.isfinite(task.ttft_slo_s) and task.ttft_slo_s > 0 else DEFAULT_SLO_S
            signals = {w: self._signal(w, view, now, slo) for w in live}
            by_class = None
            if hasattr(view, "queued_prefill_by_class"):
                split = {w: view.queued_prefill_by_class(w) for w in live}
                by_class = {cls: {w: replace(signals[w], queue=max(0.0, split[w][i]) / slo) for w in live}
                            for i, cls in enumerate((PrefillClass.SHORT, PrefillClass.LONG))}
            move = self.controller.step(now, signals, by_class)
            if move is not None:
                self.moves.append(move)
        cls = self.classifier.classify(task.l_incr, task.l_hist)
        members = self.controller.pools()[cls]
        if not members.intersection(live):               # the class has no pool (n_min 0): any prefill worker
            return self.inner.route(task, view, now)
        return self.inner.route(task, _PoolFilter(view, members), now)

    def _sync(self, live: tuple[int, ...]) -> None:
        """Follow the prefill workers the view lists: pools are (re)made when the set changes (a worker lost or
        back); a pool left empty by a loss takes one worker of the other."""
        if live == self._known:
            return
        self._known = live
        if len(live) < 2:
            self.controller = None
            return
        if self.controller is None:
            short, long = initial_pools(live)
        else:
            pools = self.controller.pools()
            short = sorted(w for w in pools[PrefillClass.SHORT] if w in live)
            long = sorted(w for w in pools[PrefillClass.LONG] if w in live)
            new = [w for w in live if w not in short and w not in long]
            for w in new:                                 # a returning worker joins the smaller pool
                (short if len(short) <= len(long) else long).append(w)
            if not short and self.config.n_min > 0:
                short.append(long.pop(0))
            if not long and self.config.n_min > 0:
                long.append(short.pop())
        n_min = min(self.config.n_min, len(short), len(long))
        cfg = self.config if n_min == self.config.n_min else replace(self.config, n_min=n_min)
        self.controller = PoolController(cfg, short, long)

    @staticmethod
    def _signal(w: int, view: ClusterView, now: float, slo: float) -> InstanceSignal:
        ttft = view.windowed_ttft(w, now)
        return InstanceSignal(w, queue=max(0.0, view.queued_prefill_s(w)) / slo,
                              sla_deviation=(ttft / slo - 1.0) if ttft > 0 else -1.0,
                              utilization=min(1.0, max(0.0, view.utilization(w, now))))
