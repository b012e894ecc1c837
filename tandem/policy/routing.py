"""Where a prefill task runs: AMPD adaptive routing (Alg. 1) and the baselines' fixed rules."""
from __future__ import annotations

import math
import random
from typing import Protocol, Sequence

from tandem.policy.task import PrefillTask


class ClusterView(Protocol):
    """What routing may read about the cluster: the state store's windowed stats and queues."""

    def prefill_workers(self) -> Sequence[int]: ...
    def windowed_ttft(self, worker: int, now: float) -> float: ...
    def windowed_itl(self, worker: int, now: float) -> float: ...
    def queued_prefill_s(self, worker: int) -> float: ...
    def t_pre(self, worker: int, l_hist: int, l_incr: int) -> float: ...
    def t_kv(self, tokens: int, src: int, dst: int) -> float: ...
    def can_hold(self, worker: int, tokens: int) -> bool: ...


def remote_cost(task: PrefillTask, worker: int, view: ClusterView) -> float:
    """AMPD Eq. 2: prefill compute + history read + incremental write-back + queueing on `worker`."""
    d = task.decode_worker
    t_kv = view.t_kv(task.l_hist, d, worker) if task.l_hist else 0.0
    return (view.t_pre(worker, task.l_hist, task.l_incr) + t_kv + view.t_kv(task.l_incr, worker, d)
            + view.queued_prefill_s(worker))


def local_cost(task: PrefillTask, view: ClusterView, chunk_budget_s: float | None = None) -> float:
    """AMPD Eq. 1: prefill compute on the decode worker plus its queued prefill work. With `chunk_budget_s` the
    local prefill runs in chunks mixed with the worker's decodes, each step within that budget (Sarathi-style):
    its compute is then the steps of itl_chunk_tokens chunks."""
    d = task.decode_worker
    if chunk_budget_s is None:
        return view.t_pre(d, task.l_hist, task.l_incr) + view.queued_prefill_s(d)
    n = itl_chunk_tokens(lambda h, k: view.t_pre(d, h, k), task.l_hist, task.l_incr, chunk_budget_s)
    total, done = 0.0, 0
    while done < task.l_incr:
        k = min(n, task.l_incr - done)
        total += view.t_pre(d, task.l_hist + done, k)
        done += k
    return total + view.queued_prefill_s(d)


MIN_CHUNK_TOKENS = 16      # a chunked local prefill advances at least this much a step, whatever the budget


def itl_chunk_tokens(t_pre, l_hist: int, remaining: int, budget_s: float) -> int:
    """The largest chunk n <= remaining whose prefill estimate t_pre(l_hist, n) fits budget_s (at least
    MIN_CHUNK_TOKENS, or what remains): the chunk a decode worker mixes with its decodes under an ITL budget."""
    if remaining <= MIN_CHUNK_TOKENS or t_pre(l_hist, remaining) <= budget_s:
        return remaining
    lo, hi = MIN_CHUNK_TOKENS, remaining           # t_pre(lo) may exceed the budget: lo is the floor anyway
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if t_pre(l_hist, mid) <= budget_s:
            lo = mid
        else:
            hi = mid
    return lo


def _eligible(task: PrefillTask, view: ClusterView) -> list[int]:
    need = task.l_hist + task.l_incr
    return [w for w in view.prefill_workers() if view.can_hold(w, need)]


class Router(Protocol):
    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        """Return the worker id to run `task` on (its decode worker id means local execution)."""
        ...


class AdaptiveRouter:
    """AMPD Alg. 1: a prefill worker with TTFT slack, else local if the decode worker has ITL slack, else the cheapest.

    `slack="window"` is Alg. 1 verbatim: a prefill worker has slack when its windowed (10 s) mean
    TTFT is <= alpha * SLO. That statistic lags by a window: a drained worker still looks slow and
    a flooded one still looks fast, so routing swings between all-local and all-remote (measured
    in docs/ampd-routing.md). `slack="predicted"` (tandem's default) asks the same question of the
    prediction the algorithm already makes (Eq. 2): the task's wait so far plus its estimated remote
    completion must be <= alpha * SLO; and local execution on ITL slack also needs Eq. 1's estimate
    to meet the TTFT SLO.
    """

    def __init__(self, rng: random.Random, alpha: float = 0.9, beta: float = 0.85, allow_local: bool = True,
                 slack: str = "predicted", local_chunked: bool = False) -> None:
        if slack not in ("predicted", "window"):
            raise ValueError(f"slack must be 'predicted' or 'window', got {slack!r}")
        self.rng, self.alpha, self.beta, self.allow_local, self.slack = rng, alpha, beta, allow_local, slack
        self.local_chunked = local_chunked    # local prefills run in ITL-budget chunks mixed with decodes

    def _local(self, task: PrefillTask, view: ClusterView) -> float:
        """Eq. 1 for the local path that runs: prefill-first, or chunks within beta * ITL SLO per step."""
        budget = self.beta * task.itl_slo_s if self.local_chunked and math.isfinite(task.itl_slo_s) else None
        return local_cost(task, view, budget)

    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        d = task.decode_worker
        prefill = _eligible(task, view)
        self.rng.shuffle(prefill)                           # line 1: random order
        ttft_thres = self.alpha * task.ttft_slo_s
        waited = now - task.enqueue_s
        predicted = self.slack == "predicted"
        for w in prefill:                                   # lines 1-3
            ttft = waited + remote_cost(task, w, view) if predicted else view.windowed_ttft(w, now)
            if ttft <= ttft_thres:
                return w
        if self.allow_local and view.windowed_itl(d, now) <= self.beta * task.itl_slo_s:
            if not predicted or waited + self._local(task, view) <= task.ttft_slo_s:
                return d                                    # lines 4-5
        best, best_t = -1, float("inf")
        if self.allow_local:
            best, best_t = d, self._local(task, view)       # line 6
        for w in prefill:                                   # lines 7-9
            t = remote_cost(task, w, view)
            if t < best_t:
                best, best_t = w, t
        return best if best >= 0 else d


class LeastCostRemoteRouter:
    """Dynamo-like: always remote, to the prefill worker with the lowest estimated completion (KV-aware)."""

    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        best, best_t = -1, float("inf")
        for w in _eligible(task, view):
            t = remote_cost(task, w, view)
            if t < best_t:
                best, best_t = w, t
        return best if best >= 0 else task.decode_worker


class LocalRouter:
    """Co-located serving: every prefill runs on the session's own worker."""

    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        return task.decode_worker


class RoundRobinRouter:
    """SGLang's vanilla data parallelism: every prefill remote, the eligible prefill workers taken in turn."""

    def __init__(self) -> None:
        self._next = 0

    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        workers = sorted(_eligible(task, view))
        if not workers:
            return task.decode_worker
        w = workers[self._next % len(workers)]
        self._next += 1
        return w


class LeastLoadRouter:
    """SGLang's router in load-balancing mode: the prefill worker with the least queued prefill work (ties: the
    lowest id). Unaware of SLOs, transfers and the task's own cost."""

    def route(self, task: PrefillTask, view: ClusterView, now: float) -> int:
        workers = _eligible(task, view)
        if not workers:
            return task.decode_worker
        return min(workers, key=lambda w: (view.queued_prefill_s(w), w))
