"""The live coordinator's view of the cluster, read from a state store (InProcessState's twin).

Implements `CoordinatorView` (and so routing's `ClusterView`) over `StateStore.all()` and an AMPD
cost model, making the same cost-model calls as `tandem.core.state.InProcessState`. Rules:

- liveness: a worker counts (prefill_workers, home_workers) only while `alive` and its last publish
  is at most `liveness_s` old on the injected wall clock (its last state known to the view: a key missing from a
  read, e.g. Redis restarted empty, does not end a worker's liveness before that). The default is the store's key
  TTL: the transport's heartbeats find dead workers within 1.5 s (`drop`), so a state's age only has to outlast a
  coordinator whose event loop was too busy to relay the workers' states for a while (a loaded host), not to find
  deaths;
- staleness: its TTFT/ITL means count as 0 (an empty window) once its last publish is older than
  its `window_s`; the `now` argument of windowed_ttft/itl is the coordinator core's clock, which
  need not be wall time, so the view ages states with its own `clock` instead;
- cache: `all()` is read at most once per `max_age_s` (default 10 ms), so one routing call, which
  asks several questions about every prefill worker, costs one store round trip;
- residency: `begin_round` returns the resident tokens the coordinator last recorded in the
  session's `SessionInfo` (0 when unknown or bound elsewhere). The decode worker owns the truth:
  if its KV was evicted meanwhile, the worker corrects l_hist/l_incr of the task when it arrives;
- outages: when the store cannot be read, the view keeps answering from its last snapshot (liveness as
  of that snapshot; the transport's heartbeats still catch dead workers, `drop`), logs (rate-limited)
  and retries after `retry_s`;
- `drop(worker)`: a worker the transport declared dead leaves the routing sets at once, without a store
  round trip (so a store outage cannot keep a dead worker routable).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tandem.core.types import PREFILL
from tandem.perf.ampd_cost import AMPDCostModel
from tandem.runtime.state_store import DEFAULT_TTL_S, SessionInfo, StateStore, StateStoreError, WorkerState

log = logging.getLogger("tandem.store_view")


class StoreView:
    """CoordinatorView over a StateStore: cached snapshot, liveness filter, stale-window zeroing."""

    def __init__(self, store: StateStore, cost: AMPDCostModel, liveness_s: float = DEFAULT_TTL_S,
                 max_age_s: float = 0.010, clock: Callable[[], float] = time.time, retry_s: float = 0.2) -> None:
        self.store, self.cost = store, cost
        self.liveness_s, self.max_age_s, self.clock, self.retry_s = liveness_s, max_age_s, clock, retry_s
        self._loaded_s = -float("inf")
        self._states: dict[int, WorkerState] = {}
        self._prefill: list[int] = []
        self._homes: list[int] = []
        self.lost: set[int] = set()              # declared dead by the transport (drop): never routed to again
        self.stale = False                       # True while the last read failed (answers from the last snapshot)
        self._failed_s = -float("inf")           # wall time of the last failed read
        self._logged_s = -float("inf")

    # ------------------------------------------------------------------ snapshot
    def refresh(self) -> None:
        """Re-read every worker state now (the cache otherwise lives `max_age_s`). If the store cannot be read
        and a snapshot exists, keep answering from it (StateStoreError only before the first read)."""
        now = self.clock()
        try:
            states = {s.worker_id: s for s in self.store.all()}
        except StateStoreError as e:
            if self._loaded_s == -float("inf"):
                raise
            self._failed_s, self.stale = now, True
            if now - self._logged_s >= 5.0:
                self._logged_s = now
                log.warning("routing view: %s; answering from the snapshot of %.2f s ago", e, now - self._loaded_s)
            self._prefill = [w for w in self._prefill if w not in self.lost]
            self._homes = [w for w in self._homes if w not in self.lost]
            return
        self.stale = False
        # a worker missing from this read (its key expired, or Redis restarted empty and it has not published
        # again yet) stays readable (state(): costs of a task bound to it) from its last state, and routable
        # while that state is fresh: an emptied Redis says nothing about the workers, the transport's heartbeats
        # do (drop); a worker that stopped publishing leaves once its last state is liveness_s old, as any
        self._states = {**{w: st for w, st in self._states.items() if w not in states and w not in self.lost},
                        **states}
        alive = [s for s in self._states.values()
                 if s.alive and now - s.published_s <= self.liveness_s and s.worker_id not in self.lost]
        alive.sort(key=lambda s: s.worker_id)
        self._loaded_s = now
        self._prefill = [s.worker_id for s in alive if s.role == PREFILL]
        self._homes = [s.worker_id for s in alive if s.role != PREFILL]

    def drop(self, worker: int) -> None:
        """`worker` is dead (the transport says so): out of the routing sets now, whatever the store says."""
        self.lost.add(worker)
        self._prefill = [w for w in self._prefill if w != worker]
        self._homes = [w for w in self._homes if w != worker]

    def revive(self, worker: int) -> None:
        """`worker` was restarted (a fresh process under the same id): routable again once its state is read."""
        self.lost.discard(worker)
        self._loaded_s = float("-inf")             # the next read reloads the store

    def states(self) -> list[WorkerState]:
        """Every worker's last state (fresh, or the last snapshot while the store is unreachable)."""
        self._fresh()
        return [s for _, s in sorted(self._states.items())]

    def _fresh(self) -> None:
        now = self.clock()
        age = now - self._loaded_s
        if 0.0 <= age <= self.max_age_s:
            return
        if self.stale and 0.0 <= now - self._failed_s < self.retry_s:   # the store is down: back off
            return
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

    def queued_prefill_by_class(self, worker: int) -> tuple[float, float]:
        s = self.state(worker)
        return s.queued_short_s, s.queued_long_s

    def utilization(self, worker: int, now: float) -> float:
        s = self.state(worker)
        return self._windowed(s, s.utilization)

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

    def _bound_here(self, worker: int, session_id: str):
        """The session's recorded info if it is bound to `worker` (None: elsewhere, unknown, or the store is out)."""
        try:
            info = self.store.get_session(session_id)
        except StateStoreError as e:
            log.warning("routing view: %s", e)
            return None
        return info if info is not None and info.decode_worker == worker else None

    def kv_loading(self, worker: int, session_id: str) -> bool:
        """Whether the session's history is on its way back from `worker`'s host tier (its RoundBegun said so)."""
        info = self._bound_here(worker, session_id)
        return info is not None and info.loading

    def held(self, worker: int, session_id: str) -> tuple[int, int]:
        """Tokens of the session's context on `worker` as its last BeginRound reported them (a worker loads a context
        back from its host tier at BeginRound, so they count as on the GPU), and none known in a host tier."""
        info = self._bound_here(worker, session_id)
        return (info.resident_tokens, 0) if info is not None else (0, 0)

    def begin_round(self, worker: int, session_id: str, block_hashes: Sequence[int] = (),
                    prompt_tokens: int = 0, now: float | None = None) -> int:
        """Resident history tokens of `session_id` on `worker` as last recorded; records the binding if new. The
        prompt's block hashes are not used: the decode worker itself finds a cached prefix when the task arrives
        (`now` too: its own clock times it)."""
        try:
            info = self.store.get_session(session_id)
        except StateStoreError as e:                           # an outage: the shell corrects residency anyway
            log.warning("routing view: %s", e)
            info = None
        if info is not None and info.decode_worker == worker:
            return info.resident_tokens
        try:
            self.store.put_session(session_id, SessionInfo(decode_worker=worker, resident_tokens=0,
                                                           updated_s=self.clock()))
        except StateStoreError as e:
            log.warning("routing view: %s", e)
        return 0
