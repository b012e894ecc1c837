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


STALL_S = 86_400.0
"""Simulated time with rounds under way but none finishing anywhere, after which the loop calls it a livelock."""


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
        self.stall_s = STALL_S
        self._progress_mark = (0, 0.0)                  # (coordinator.rounds_done, when it last changed)

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
            if not self.events & 4095:
                self._check_progress()
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
        self._fail_stalled(self.coord.in_flight(), "no event left")
        return time.perf_counter() - t0

    def _check_progress(self) -> None:
        """Every few thousand events: fail the rounds under way if none has finished for `stall_s` (a livelock)."""
        done, since = self._progress_mark
        in_round = self.coord.in_round()
        if self.coord.rounds_done != done or not in_round:
            self._progress_mark = (self.coord.rounds_done, self.now)
        elif self.now - since > self.stall_s:
            self._fail_stalled(in_round, f"no round finished anywhere in {self.stall_s:g} s of simulated time")
            self._progress_mark = (self.coord.rounds_done, self.now)

    def _fail_stalled(self, stuck: list[str], why: str) -> None:
        """Sessions are stuck (a scheduling bug): fail them with the reason; never drop them."""
        for sid in sorted(stuck):
            w = self.coord.session_worker(sid)
            self._apply(self.coord.end_session(
                sid, self.now, f"simulation stalled: {why} while the session waited on worker {w}"))



# ---------------------------------------------------------------------------------------------- host loop

REQ, TOOLREQ, BEGUN, CTL, CTLDONE, EVT, HOST = range(5, 12)


class HostLoop(EventLoop):
    """The event loop for copies of tandem's engine served by tandem's runtime on one host (a profile).

    On top of EventLoop's model (workers step, KV flows over a link) it keeps what the live runtime does
    around the engine (tandem/runtime/worker_main.py, coordinator_shell.py), with the costs of a
    `RuntimeCosts` (docs/simulator.md, "Runtime model"):

    - a round reaches the coordinator `request_s` after the client sent it; a round > 0 first asks its decode
      worker for the resident KV (one message there and back) before it is routed; its TTFT still counts from
      the client's send, and every token reaches the client `output_s` after its worker produced it (the tool
      gap runs from there);
    - every coordinator action is a message that reaches its worker `hop_s` later, and every worker event
      reaches the coordinator `hop_s` later;
    - a worker handles its messages only between two steps, one after the other (`msg_s` each); a KV send
      first gathers the KV on the source worker (export), the bytes then cross the link, and the destination
      worker places them between its own steps (import): both hold their worker like a message does;
    - every step takes `step_factor[kind]` times the step model plus `step_gap_s` (the worker loop between
      steps);
    - a step runs `interference[kind]` times slower while another worker is in a step (the slow-down applies
      to the overlapping part only);
    - with `cores` > 0, the host's cores are shared (processor sharing) by the workers' steps (one thread
      each) and the serving processes' own work: `host_token_s` CPU seconds per token streamed to a client
      and `host_round_s` per round (coordinator, HTTP, client), queued as one more runnable thread; while more
      threads run than there are cores, each progresses at cores / threads.
    """

    def __init__(self, coordinator: Coordinator, workers: list[WorkerCore],
                 step_time: list[Callable[[BatchShape], float]], network: Network, kv_bytes_per_token: float,
                 costs, progress: Callable[[int], None] | None = None) -> None:
        super().__init__(coordinator, workers, step_time, network, kv_bytes_per_token, progress)
        self.costs = costs
        n = len(workers)
        self._inbox: list[list] = [[] for _ in range(n)]
        self._handling = [False] * n
        self._step: list[list | None] = [None] * n      # [remaining solo seconds, factor, rate, updated, version]
        self._stepping = 0
        self._cores = float(getattr(costs, "cores", 0) or 0)
        self._host = [0.0, 1.0, 0.0, -1]                  # [remaining CPU seconds, rate, updated, version]
        self._version = 0
        self._client_sent: dict[str, float] = {}

    # ------------------------------------------------------------------ messages
    def _to_worker(self, wid: int, item: tuple) -> None:
        self._push(self.now + self.costs.hop_s, CTL, wid, item)

    def _apply(self, actions: list) -> None:
        for act in actions:
            if isinstance(act, Submit):
                self._to_worker(act.worker, ("submit", act.task))
            elif isinstance(act, Transfer):
                if act.tokens <= 0:
                    self._apply(self.coord.on_transfer_done(act, self.now, 0.0))
                else:
                    self._to_worker(act.src, ("send_kv", act))
            elif isinstance(act, KVArrived):
                self._to_worker(act.worker, ("kv_arrived", act.task))
            elif isinstance(act, Delivered):
                self._to_worker(act.worker, ("delivered", act.task))
            elif isinstance(act, HistoryReady):
                self._to_worker(act.worker, ("history_ready", act.task))
            elif isinstance(act, Release):
                self._to_worker(act.worker, ("release", act.session_id))
            elif isinstance(act, ToolCall):
                st = self.coord.live.get(act.session_id)
                fin = st.record.rounds[-1].finish_s if st is not None and st.record.rounds else None
                end = (fin if fin is not None else self.now) + self.costs.output_s
                self._push(max(self.now, end + act.delay_s), TOOL, act.session_id)
            else:
                raise TypeError(f"unknown action {act!r}")

    def _deliver(self, wid: int, item: tuple) -> None:
        self._inbox[wid].append(item)
        if not self.workers[wid].busy and not self._handling[wid]:
            self._handle(wid)

    def _handle(self, wid: int) -> None:
        """Work through the worker's inbox (it is between steps); then let it step."""
        box = self._inbox[wid]
        c = self.costs
        while box:
            item = box[0]
            cost = c.msg_s
            if item[0] == "send_kv":
                cost += c.export_s(item[1].tokens * self.kv_bytes)
            elif item[0] == "kv_in":
                cost += c.import_s(item[1].tokens * self.kv_bytes)
            if cost > 0:
                self._handling[wid] = True
                self._push(self.now + cost, CTLDONE, wid)
                return
            box.pop(0)
            self._effect(wid, item)
        self._handling[wid] = False
        self._kick(wid)

    def _effect(self, wid: int, item: tuple) -> None:
        w = self.workers[wid]
        kind, arg = item[0], item[1]
        now = self.now
        if kind == "submit":
            w.submit(arg, now)
        elif kind == "kv_arrived":
            w.on_kv_received(arg, now)
            self._host_work(self.costs.host_token_s)
        elif kind == "delivered":
            w.on_delivered(arg, now)
        elif kind == "history_ready":
            w.on_history_fetched(arg, now)
        elif kind == "release":
            w.release(arg)
        elif kind == "begin":
            self._push(now + self.costs.hop_s, BEGUN, arg)
        elif kind == "send_kv":
            self.network.start(arg.src, arg.dst, arg.tokens * self.kv_bytes, (arg, now), now)
        elif kind == "kv_in":
            tr, started = arg, item[2]
            self._push(now + self.costs.hop_s, EVT, None, ("kv", tr, started))
        if w.events:
            self._forward(w)

    def _forward(self, worker: WorkerCore) -> None:
        if worker.events:
            self._push(self.now + self.costs.hop_s, EVT, None, ("events", worker.id, worker.drain()))

    # ------------------------------------------------------------------ steps with interference
    def _kick(self, wid: int) -> None:
        w = self.workers[wid]
        if w.busy or self._handling[wid] or self._inbox[wid]:
            return
        plan = w.schedule(self.now)
        if plan is not None:
            w.busy = True
            self._plans[wid] = plan
            self._started[wid] = self.now
            kind = "prefill" if plan.prefill else "decode"
            solo = self.step_time[wid](plan.shape) * self.costs.step_factor.get(kind, 1.0) + self.costs.step_gap_s
            self._reshare()                                    # progress of the others up to now
            self._step[wid] = [solo, self.costs.interference.get(kind, 1.0), 1.0, self.now, -1]
            self._stepping += 1
            self._reshare(changed=True)
        elif w.wake_s < self._wakes[wid] and w.wake_s > self.now:
            self._wakes[wid] = w.wake_s
            self._push(w.wake_s, WAKE, wid)
        if w.events:
            self._forward(w)

    def _reshare(self, changed: bool = False) -> None:
        """Advance every running step (and the host's own work) to now at its current rate; with `changed`,
        give each its new rate (1, 1/interference while another worker steps, times the host's CPU share when
        more threads run than it has cores) and reschedule its end."""
        now = self.now
        others = self._stepping - 1
        h = self._host
        if h[0] > 0:
            h[0] = max(0.0, h[0] - (now - h[2]) * h[1])
        h[2] = now
        share = 1.0
        if self._cores > 0:
            threads = self._stepping + (1 if h[0] > 1e-12 else 0)
            share = min(1.0, self._cores / threads) if threads else 1.0
        for wid, st in enumerate(self._step):
            if st is None:
                continue
            st[0] -= (now - st[3]) * st[2]
            st[3] = now
            if changed:
                rate = (1.0 / st[1] if others > 0 else 1.0) * share
                st[2] = rate
                self._version += 1                             # unique: a stale end never matches a later step
                st[4] = self._version
                self._push(now + max(st[0], 0.0) / rate, STEP, wid, st[4])
        if changed and h[0] > 1e-12:
            h[1] = share
            self._version += 1
            h[3] = self._version
            self._push(now + h[0] / share, HOST, None, h[3])

    def _host_work(self, cpu_s: float) -> None:
        """The serving processes need `cpu_s` more CPU seconds (tokens streamed, a round's request)."""
        if self._cores <= 0 or cpu_s <= 0:
            return
        self._reshare()
        self._host[0] += cpu_s
        self._reshare(changed=True)

    # ------------------------------------------------------------------ run
    def run(self, sessions: list[Session]) -> float:
        t0 = time.perf_counter()
        for s in sorted(sessions, key=lambda s: s.arrival_s):
            self._push(s.arrival_s, ARRIVAL, s)
        heap, pop = self.heap, heapq.heappop
        coord, c = self.coord, self.costs
        done_sessions = 0
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            self.events += 1
            if not self.events & 4095:
                self._check_progress()
            if kind == STEP:
                st = self._step[a]
                if st is None or b != st[4]:
                    continue                                   # superseded by a rate change
                self._reshare()
                self._step[a] = None
                self._stepping -= 1
                self._reshare(changed=True)
                w = self.workers[a]
                plan = self._plans[a]
                self._plans[a] = None
                w.busy = False
                w.on_step_done(plan, StepResult(t - self._started[a]), t)
                if w.role != "prefill":                        # tokens this step streams to clients
                    toks = len(plan.decode) + sum(1 for tk, n in plan.prefill if tk.done >= tk.l_incr and not tk.recompute)
                    self._host_work(toks * c.host_token_s)
                self._forward(w)
                if self._inbox[a]:
                    self._handle(a)
                else:
                    self._kick(a)
            elif kind == CTL:
                self._deliver(a, b)
            elif kind == HOST:
                if b == self._host[3]:
                    self._reshare()
                    self._host[0] = 0.0
                    self._reshare(changed=True)
            elif kind == CTLDONE:
                item = self._inbox[a].pop(0)
                self._effect(a, item)
                self._handle(a)
            elif kind == EVT:
                if b[0] == "events":
                    for ev in b[2]:
                        self._apply(coord.on_event(ev, t))
                else:
                    _, tr, started = b
                    self._apply(coord.on_transfer_done(tr, t, t - started))
            elif kind == XFER:
                if b != a.version:
                    continue
                self.network.finish(a, t)
                tr, started = a.payload
                self._deliver(tr.dst, ("kv_in", tr, started))
            elif kind == ARRIVAL:
                self._push(t + c.request_s, REQ, a, t)
            elif kind == REQ:
                self._host_work(c.host_round_s)
                self._apply(coord.on_session_arrival(a, t))
                self._stamp(a.session_id, b)
            elif kind == TOOL:                                 # the client sends the session's next round
                self._push(t + c.request_s, TOOLREQ, a, t)
            elif kind == TOOLREQ:                              # it reached the coordinator: ask its worker
                st = coord.live.get(a)
                self._host_work(c.host_round_s)
                if st is not None:
                    self._client_sent[a] = b
                    self._to_worker(st.worker, ("begin", a))
            elif kind == BEGUN:
                sent = self._client_sent.pop(a, t)
                self._apply(coord.on_tool_result(a, t))
                self._stamp(a, sent)
            elif kind == WAKE:
                self._wakes[a] = float("inf")
                self.workers[a].wake_s = float("inf")
                self._kick(a)
            if self.progress is not None and len(coord.records) - len(coord.live) != done_sessions:
                done_sessions = len(coord.records) - len(coord.live)
                self.progress(done_sessions)
        self._fail_stalled(self.coord.in_flight(), "no event left")
        self._shift_outputs()
        return time.perf_counter() - t0

    def _stamp(self, sid: str, sent: float) -> None:
        """The round just started counts from the client's send (its TTFT includes request_s and the RTT)."""
        st = self.coord.live.get(sid)
        rec = st.record if st is not None else next((r for r in reversed(self.coord.records) if r.session_id == sid), None)
        if rec is not None and rec.rounds:
            rec.rounds[-1].arrival_s = sent

    def _shift_outputs(self) -> None:
        """Tokens reach the client output_s after their worker produced them."""
        d = self.costs.output_s
        if d <= 0:
            return
        for rec in self.coord.records:
            for r in rec.rounds:
                if r.first_token_s is not None:
                    r.first_token_s += d
                if r.finish_s is not None:
                    r.finish_s += d
            if rec.finish_s is not None and not rec.failed and rec.rounds and rec.rounds[-1].finish_s is not None:
                rec.finish_s = rec.rounds[-1].finish_s
