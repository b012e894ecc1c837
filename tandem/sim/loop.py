"""The discrete-event loop: runs the coordinator and worker cores unchanged on a virtual clock."""
from __future__ import annotations

import heapq
import time
from typing import Callable

from tandem.core.actions import Delivered, HistoryReady, KVArrived, Release, Submit, ToolCall, Transfer
from tandem.core.coordinator import Coordinator
from tandem.core.types import BatchShape, StepPlan, StepResult
from tandem.core.worker import WorkerCore
from tandem.sim.network import Flow, Network
from tandem.workload.session import Session

ARRIVAL, TOOL, STEP, XFER, WAKE = range(5)


class EventLoop:
    """Virtual-time shell: arrivals, tool gaps, worker steps (timed by `step_time`), KV flows."""

    def __init__(self, coordinator: Coordinator, workers: list[WorkerCore],
                 step_time: list[Callable[[BatchShape], float]], network: Network,
                 kv_bytes_per_token: float, progress: Callable[[int], None] | None = None) -> None:
        self.coord = coordinator
        self.workers = workers
        self.step_time = step_time
        self.network = network
        network.schedule = self._schedule_flow
        self.kv_bytes = kv_bytes_per_token
        self.progress = progress
        self.heap: list = []
        self._n = 0
        self.now = 0.0
        self.events = 0
        self._plans: list[StepPlan | None] = [None] * len(workers)
        self._wakes: list[float] = [float("inf")] * len(workers)
        self._started: list[float] = [0.0] * len(workers)

    def _push(self, t: float, kind: int, a, b=None) -> None:
        self._n += 1
        heapq.heappush(self.heap, (t, self._n, kind, a, b))

    def _schedule_flow(self, t: float, flow: Flow, version: int) -> None:
        self._push(t, XFER, flow, version)

    # ------------------------------------------------------------------ actions
    def _apply(self, actions: list) -> None:
        kick = set()
        for act in actions:
            if isinstance(act, Submit):
                self.workers[act.worker].submit(act.task, self.now)
                kick.add(act.worker)
            elif isinstance(act, Transfer):
                if act.tokens <= 0:
                    self._apply(self.coord.on_transfer_done(act, self.now, 0.0))
                else:
                    self.network.start(act.src, act.dst, act.tokens * self.kv_bytes, act, self.now)
            elif isinstance(act, KVArrived):
                self.workers[act.worker].on_kv_received(act.task, self.now)
                kick.add(act.worker)
            elif isinstance(act, Delivered):
                self.workers[act.worker].on_delivered(act.task, self.now)
                kick.add(act.worker)
            elif isinstance(act, HistoryReady):
                self.workers[act.worker].on_history_fetched(act.task, self.now)
                kick.add(act.worker)
            elif isinstance(act, ToolCall):
                self._push(self.now + act.delay_s, TOOL, act.session_id)
            elif isinstance(act, Release):
                self.workers[act.worker].release(act.session_id)
                kick.add(act.worker)
            else:
                raise TypeError(f"unknown action {act!r}")
        for w in kick:
            self._kick(w)

    def _forward(self, worker: WorkerCore) -> None:
        while worker.events:
            for ev in worker.drain():
                self._apply(self.coord.on_event(ev, self.now))

    def _kick(self, wid: int) -> None:
        w = self.workers[wid]
        if w.busy:
            return
        plan = w.schedule(self.now)
        if plan is not None:
            w.busy = True
            self._plans[wid] = plan
            self._started[wid] = self.now
            self._push(self.now + self.step_time[wid](plan.shape), STEP, wid)
        elif w.wake_s < self._wakes[wid] and w.wake_s > self.now:
            self._wakes[wid] = w.wake_s
            self._push(w.wake_s, WAKE, wid)
        if w.events:
            self._forward(w)

    # ------------------------------------------------------------------ run
    def run(self, sessions: list[Session]) -> float:
        """Simulate until every session has finished or failed; returns wall-clock seconds."""
        t0 = time.perf_counter()
        order = sorted(sessions, key=lambda s: s.arrival_s)
        for s in order:
            self._push(s.arrival_s, ARRIVAL, s)
        heap, pop = self.heap, heapq.heappop
        done_sessions = 0
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            self.events += 1
            if kind == STEP:
                w = self.workers[a]
                plan = self._plans[a]
                self._plans[a] = None
                w.busy = False
                w.on_step_done(plan, StepResult(t - self._started[a]), t)
                if w.events:
                    self._forward(w)
                self._kick(a)
            elif kind == XFER:
                if b != a.version:
                    continue                                 # superseded by a rebalance
                self.network.finish(a, t)
                self._apply(self.coord.on_transfer_done(a.payload, t, t - a.start_s))
            elif kind == ARRIVAL:
                self._apply(self.coord.on_session_arrival(a, t))
            elif kind == TOOL:
                self._apply(self.coord.on_tool_result(a, t))
            elif kind == WAKE:
                self._wakes[a] = float("inf")
                self.workers[a].wake_s = float("inf")
                self._kick(a)
            if self.progress is not None and len(self.coord.records) - len(self.coord.live) != done_sessions:
                done_sessions = len(self.coord.records) - len(self.coord.live)
                self.progress(done_sessions)
        return time.perf_counter() - t0

