"""The live coordinator's view of the cluster, read from a state store (InProcessState's twin).

Implements `CoordinatorView` (and so routing's `ClusterView`) over `StateStore.all()` and an AMPD
cost model, making the same cost-model calls as `tandem.core.state.InProcessState`. Rules:

- liveness: a worker counts (prefill_workers, home_workers) only while `alive` and its last publish
  is at most `liveness_s` old on the injected wall clock;
- staleness: its TTFT/ITL means count as 0 (an empty window) once its last publish is older than
  its `window_s`; the `now` argument of windowed_ttft/itl is the coordinator core's clock, which
  need not be wall time, so the view ages states with its own `clock` instead;
- cache: `all()` is read at most once per `max_age_s` (default 10 ms), so one routing call, which
  asks several questions about every prefill worker, costs one store round trip;
- residency: `begin_round` returns the resident tokens the coordinator last recorded in the
  session's `SessionInfo` (0 when unknown or bound elsewhere). The decode worker owns the truth:
  if its KV was evicted meanwhile, the worker corrects l_hist/l_incr of the task when it arrives.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tandem.core.types import PREFILL
from tandem.perf.ampd_cost import AMPDCostModel
from tandem.runtime.state_store import SessionInfo, StateStore, StateStoreError, WorkerState


class StoreView:
    """CoordinatorView over a StateStore: cached snapshot, liveness filter, stale-window zeroing."""

    def __init__(self, store: StateStore, cost: AMPDCostModel, liveness_s: float = 2.0,
                 max_age_s: float = 0.010, clock: Callable[[], float] = time.time) -> None:
        self.store, self.cost = store, cost
        self.liveness_s, self.max_age_s, self.clock = liveness_s, max_age_s, clock
        self._loaded_s = -float("inf")
        self._states: dict[int, WorkerState] = {}
        self._prefill: list[int] = []
        self._homes: list[int] = []

    # ------------------------------------------------------------------ snapshot
    def refresh(self) -> None:
        """Re-read every worker state now (the cache otherwise lives `max_age_s`)."""
        now = self.clock()
        states = {s.worker_id: s for s in self.store.all()}
        alive = [s for s in states.values() if s.alive and now - s.published_s <= self.liveness_s]
        alive.sort(key=lambda s: s.worker_id)
        self._states, self._loaded_s = states, now
        self._prefill = [s.worker_id for s in alive if s.role == PREFILL]
        self._homes = [s.worker_id for s in alive if s.role != PREFILL]

    def _fresh(self) -> None:
        age = self.clock() - self._loaded_s
        if not 0.0 <= age <= self.max_age_s:
            self.refresh()

    def state(self, worker: int) -> WorkerState:
        """The last published state of `worker`, alive or not; StateStoreError if the store has none."""
        self._fresh()
        s = self._states.get(worker)
        if s is None:
            raise StateStoreError(f"worker {worker} has no state in the state store (never published or expired)")
        return s

    def _windowed(self, s: WorkerState, mean: float) -> float:
        return mean if self._loaded_s - s.published_s <= s.window_s else 0.0

    # ------------------------------------------------------------------ ClusterView
    def prefill_workers(self) -> Sequence[int]:
        self._fresh()
        return self._prefill

    def home_workers(self) -> Sequence[int]:
        self._fresh()
        return self._homes

    def windowed_ttft(self, worker: int, now: float) -> float:
        s = self.state(worker)
        return self._windowed(s, s.ttft_mean_s)

    def windowed_itl(self, worker: int, now: float) -> float:
        s = self.state(worker)
        return self._windowed(s, s.itl_mean_s)

    def queued_prefill_s(self, worker: int) -> float:
        return self.state(worker).queued_prefill_s

    def t_pre(self, worker: int, l_hist: int, l_incr: int) -> float:
        return self.cost.t_pre(l_hist, l_incr, self.state(worker).tp)

    def t_kv(self, tokens: int, src: int, dst: int) -> float:
        a, b = self.state(src), self.state(dst)
        return self.cost.t_kv(tokens, a.tp, b.tp, a.node == b.node)

    def can_hold(self, worker: int, tokens: int) -> bool:
        return tokens <= self.state(worker).capacity_tokens

    # ------------------------------------------------------------------ CoordinatorView
    def capacity(self, worker: int) -> int:
        return self.state(worker).capacity_tokens

    def begin_round(self, worker: int, session_id: str) -> int:
        """Resident history tokens of `session_id` on `worker` as last recorded; records the binding if new."""
        info = self.store.get_session(session_id)
        if info is not None and info.decode_worker == worker:
            return info.resident_tokens
        self.store.put_session(session_id, SessionInfo(decode_worker=worker, resident_tokens=0,
                                                       updated_s=self.clock()))
        return 0
