"""The discrete-event loop: runs the coordinator and worker cores unchanged on a virtual clock.

One run loop and one action dispatcher serve both simulated shells: `EventLoop` carries every coordinator
action out at once (a cluster of GPUs, timed by a cost model), `HostLoop` (tandem/sim/host_loop.py) turns each
into a message the runtime would send, with its latencies and the host's CPU sharing.
"""
from __future__ import annotations

import heapq
import time
from typing import Callable

from tandem.core.actions import ToolCall, Transfer
from tandem.core.commands import CANCEL, DELIVERED, EXPECT, HISTORY_READY, KV_ARRIVED, RELEASE, RUN_LOCAL, SEND_KV, \
    SUBMIT, TOOL_CALL, commands
from tandem.core.host_tier import KVCopy
from tandem.core.coordinator import Coordinator
from tandem.core.types import BatchShape, StepPlan, StepResult, Swap
from tandem.core.worker import WorkerCore, decode_step_done, steady_decoder
from tandem.sim.clients import ClosedLoop
from tandem.sim.faults import Fate, FaultInjector, FaultSpec
from tandem.sim.network import Flow, Network
from tandem.workload.records import SessionRecord
from tandem.workload.session import Session

# event kinds (the heap holds (time, seq, kind, a, b)); HostLoop adds its own after these
ARRIVAL, TOOL, STEP, XFER, WAKE, TICK, KILL, COPY = range(8)

STALL_S = 86_400.0
"""Simulated time with rounds under way but none finishing anywhere, after which the loop calls it a livelock."""

_OK = Fate.OK


class EventLoop:
    """Virtual-time shell: arrivals, tool gaps, worker steps (timed by `step_time`), KV flows, the coordinator's
    timers, injected faults."""

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
        self.dead: list[bool] = [False] * len(workers)
        self.stall_s = STALL_S
        self._progress_mark = (0, 0.0)                  # (coordinator.rounds_done, when it last changed)
        self.faults: FaultInjector | None = None
        self._state = None                              # the coordinator's view (drops a killed worker)
        self.commit: Callable[[StepPlan], dict[str, int] | None] | None = None   # multi-token commits
        self.swap_time: list[Callable[[int], float]] | None = None   # per worker: seconds to swap n KV positions
        self._swap_s: list[float] = [0.0] * len(workers)  # swap copies planned, charged to the worker's next step
        self._host_link = [[0.0, 0.0] for _ in workers]
        self.tiered = any(w.kv.tier is not None for w in workers)   # per worker: when its host link is free (to host, to GPU)
        self._done_sessions = 0                         # sessions ended (completed or failed) so far
        self._closed: ClosedLoop | None = None          # closed loop: its clients and the sessions they have not begun
        self._arrivals: list[Session] = []              # open loop: sessions by arrival, fed to the heap in turn
        self.record_sink: Callable[[SessionRecord], None] | None = None   # takes each ended record (stream_records)
        self.streamed = 0                               # records handed to record_sink so far
        self._arrivals_n0 = self._arrivals_next = 0     # the number before the first arrival's; the next to feed
        self._steady: list[bool] = [False] * len(workers)   # per worker: decode steps by decode_step_done (run sets)
        self.handlers: dict[int, Callable] = {ARRIVAL: self._on_arrival, TOOL: self._on_tool, STEP: self._on_step,
                                              XFER: self._on_xfer, WAKE: self._on_wake, TICK: self._on_tick,
                                              KILL: self._on_kill, COPY: self._on_copy}

    def set_faults(self, spec: FaultSpec, seed: int, state) -> None:
        """Inject `spec`'s faults: transfer fates drawn from `seed`, workers killed at their times."""
        self.faults = FaultInjector(spec, seed)
        self._state = state
        for w, t in spec.kills:
            self._push(t, KILL, w)

    def _push(self, t: float, kind: int, a, b=None) -> None:
        self._n += 1
        heapq.heappush(self.heap, (t, self._n, kind, a, b))

    def _schedule_flow(self, t: float, flow: Flow, version: int) -> None:
        self._push(t, XFER, flow, version)

    # ------------------------------------------------------------------ actions
    def _apply(self, actions: list) -> None:
        """Carry out the coordinator's actions: each command reaches its worker (`_send`; a KV send starts a
        flow), a tool call waits out its gap, a timer ticks the coordinator."""
        kick: set[int] = set()
        send = self._send
        for kind, wid, act in commands(actions):
            if wid >= 0:
                if kind == SEND_KV and act.tokens <= 0:
                    self._apply(self.coord.on_transfer_done(act, self.now, 0.0))
                else:
                    send(wid, kind, act, kick)
            elif kind == TOOL_CALL:
                self._tool_call(act)
            else:
                self._push(max(act.at_s, self.now), TICK, None)
        for w in kick:
            self._kick(w)

    def _send(self, wid: int, kind: int, act, kick: set[int]) -> None:
        """A command reaches its worker at once (a lost worker gets nothing)."""
        if self.dead[wid]:
            return
        self._effect(wid, kind, act)
        if kind != SEND_KV:                           # a send starts a flow; the worker's step goes on
            kick.add(wid)

    def _effect(self, wid: int, kind: int, act) -> None:
        """What a command does to its worker's core (or, for a KV send, to the network)."""
        w = self.workers[wid]
        now = self.now
        if kind == SUBMIT:
            w.submit(act.task, now)
        elif kind == KV_ARRIVED:
            w.on_kv_received(act.task, now)
        elif kind == DELIVERED:
            w.on_delivered(act.task, now)
        elif kind == HISTORY_READY:
            w.on_history_fetched(act.task, now)
        elif kind == RELEASE:
            if act.keep_host:
                w.expire(act.session_id)
            else:
                w.release(act.session_id)
        elif kind == RUN_LOCAL:
            w.run_local(act.task, now)
        elif kind == CANCEL:
            w.cancel(act.task)
        elif kind == EXPECT:
            w.expect_return(act.session_id, act.tool_s, now)
        elif kind == SEND_KV:
            fate = self.faults.fate() if self.faults is not None else _OK
            if fate is not Fate.LOST:                   # a lost transfer never lands: the coordinator times out
                self.network.start(act.src, act.dst, act.tokens * self.kv_bytes, (act, now, fate), now)
        else:
            raise TypeError(f"unknown worker command {kind}")

    def _tool_call(self, act: ToolCall) -> None:
        self._push(self.now + act.delay_s, TOOL, act.session_id)

    def _forward(self, worker: WorkerCore) -> None:
        while worker.events:
            for ev in worker.drain():
                self._apply(self.coord.on_event(ev, self.now))

    def _kick(self, wid: int) -> None:
        w = self.workers[wid]
        if self.dead[wid]:
            return
        tier = w.kv.tier
        if tier is not None and tier.copies:
            self._start_copies(wid, tier.take_copies())
        if w.busy:
            if w.events:                                # raised by a command mid-step (a first token once its KV
                self._forward(w)                        # landed): the coordinator hears it now, as live
            return
        plan = w.schedule(self.now)
        if w.swaps:
            self._charge_swaps(wid, w.take_swaps())
        if tier is not None and tier.copies:
            self._start_copies(wid, tier.take_copies())
        if plan is not None:
            w.busy = True
            self._plans[wid] = plan
            self._started[wid] = self.now
            self._start_step(wid, plan)
        elif w.wake_s < self._wakes[wid] and w.wake_s > self.now:
            self._wakes[wid] = w.wake_s
            self._push(w.wake_s, WAKE, wid)
        if w.events:
            self._forward(w)

    def _charge_swaps(self, wid: int, swaps: list[Swap]) -> None:
        """KV copies of swap preemptions: they run before the worker's next forward, which they lengthen."""
        if self.swap_time is None:
            return
        bs = self.workers[wid].cfg.block_size
        self._swap_s[wid] += self.swap_time[wid](sum(len(sw.blocks) for sw in swaps) * bs)

    def _start_copies(self, wid: int, copies: list[KVCopy]) -> None:
        """Host-tier copies run beside the steps, one after the other in each direction of the worker's host link
        (its GPUs' PCIe links in parallel: swap_time prices one rank's share of the bytes). With injected faults a
        copy fails (reported at its end) as often as a KV transfer fails or is lost."""
        link = self._host_link[wid]
        cost = self.swap_time[wid]
        for c in copies:
            d = 0 if c.kind.to_host else 1
            link[d] = max(self.now, link[d]) + cost(c.tokens)
            fate = self.faults.fate() if self.faults is not None else _OK
            self._push(link[d], COPY, wid, (c, fate))

    def _on_copy(self, wid: int, item: tuple[KVCopy, Fate]) -> None:
        if self.dead[wid]:
            return
        w = self.workers[wid]
        c, fate = item
        if fate is _OK:
            w.kv.tier.on_copy_done(c.id, self.now)
        else:
            w.kv.tier.on_copy_failed(c.id, self.now)
        if w.events:
            self._forward(w)
        self._kick(wid)

    def _take_swap_s(self, wid: int) -> float:
        """The swap copies charged to the step the worker starts now."""
        swap_s, self._swap_s[wid] = self._swap_s[wid], 0.0
        return swap_s

    def _start_step(self, wid: int, plan: StepPlan) -> None:
        swap_s = self._swap_s                           # _take_swap_s and _push, inlined: once per step
        t = self.now + swap_s[wid] + self.step_time[wid](plan.shape)
        swap_s[wid] = 0.0
        self._n += 1
        heapq.heappush(self.heap, (t, self._n, STEP, wid, None))

    def _end_step(self, wid: int) -> StepPlan:
        """The worker's step is over: apply its result to the core."""
        w = self.workers[wid]
        plan = self._plans[wid]
        self._plans[wid] = None
        w.busy = False
        committed = self.commit(plan) if self.commit is not None else None
        w.on_step_done(plan, StepResult(self.now - self._started[wid], committed), self.now)
        return plan

    # ------------------------------------------------------------------ events
    def _on_step(self, a, b) -> None:
        if self.dead[a]:
            return
        w = self.workers[a]
        plan = self._plans[a]
        if self._steady[a] and not plan.prefill:
            now = self.now
            if decode_step_done(w, plan, now - self._started[a], now) is not None:
                self._started[a] = now                  # the worker goes on decoding (the plan refilled): nothing
                self._start_step(a, plan)               # else to hear or kick
                return
            self._plans[a] = None
            w.busy = False
        else:
            self._end_step(a)
        if w.events:
            self._forward(w)
        self._kick(a)

    def _on_xfer(self, flow, version) -> None:
        if version != flow.version:
            return                                      # superseded by a rebalance
        self.network.finish(flow, self.now)
        tr, started, fate = flow.payload
        self._landed(tr, started, fate)

    def _landed(self, tr: Transfer, started: float, fate: Fate) -> None:
        """A KV flow reached its destination; a failed one reports its error now."""
        if fate is Fate.FAIL:
            self._apply(self.coord.on_transfer_failed(tr, self.now, "KV transfer failed (injected)"))
        else:
            self._apply(self.coord.on_transfer_done(tr, self.now, self.now - started))

    def _feed_arrival(self) -> None:
        """Put the next session arrival (open loop) in the heap."""
        i = self._arrivals_next
        if i < len(self._arrivals):
            s = self._arrivals[i]
            self._arrivals_next = i + 1
            heapq.heappush(self.heap, (s.arrival_s, self._arrivals_n0 + i + 1, ARRIVAL, s, None))

    def _arrive(self, s: Session, b) -> None:
        """An open-loop arrival: the next one enters the heap, then this one is handled."""
        self._feed_arrival()
        self._on_arrival(s, b)

    def _on_arrival(self, s: Session, b) -> None:
        self._apply(self.coord.on_session_arrival(s, self.now))

    def _on_tool(self, sid: str, b) -> None:
        self._apply(self.coord.on_tool_result(sid, self.now))

    def _on_wake(self, a, b) -> None:
        self._wakes[a] = float("inf")
        self.workers[a].wake_s = float("inf")
        self._kick(a)

    def _on_tick(self, a, b) -> None:
        self._apply(self.coord.on_tick(self.now))

    def _on_kill(self, wid: int, b) -> None:
        """An injected worker death: its step and messages are lost; the coordinator decides what follows."""
        if self.dead[wid]:
            return
        self.dead[wid] = True
        self._plans[wid] = None
        if self._state is not None:
            self._state.drop(wid)
        self._apply(self.coord.on_worker_lost(wid, self.now))

    # ------------------------------------------------------------------ run
    def run(self, sessions: list[Session], concurrency: int | None = None) -> float:
        """Simulate until every session has finished or failed; returns wall-clock seconds.

        With `concurrency` N (closed loop), N clients each run one session at a time: the first N sessions (in
        arrival order) start at t=0, and when a session ends (completed or failed) the next one not yet started
        starts when its client sees that end (`_client_end_s`), its `arrival_s` overwritten with that time (the
        records show it). Without it every session arrives at its own `arrival_s` (open loop)."""
        t0 = time.perf_counter()
        # workers whose plain decode steps take the core's shortcut (not with a commit hook: it decides the commits)
        self._steady = [self.commit is None and steady_decoder(w) for w in self.workers]
        order = sorted(sessions, key=lambda s: s.arrival_s)
        if concurrency is None:
            # arrivals enter the heap one at a time, each numbered as if all had been pushed now: the same order
            # of events, with a heap of the events in flight rather than of every session
            self._arrivals, self._arrivals_n0, self._arrivals_next = order, self._n, 0
            self._n += len(order)
            self.handlers[ARRIVAL] = self._arrive
            self._feed_arrival()
            self._closed = None
        else:
            if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
                raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
            self._closed = ClosedLoop(order)
            for _ in range(min(concurrency, len(order))):
                self._start_next(0.0)
        while True:
            self._run_events()
            self._fail_stalled(self.coord.in_flight(), "no event left")
            self._session_ends()
            if not self.heap:
                break                                   # nothing left, nobody waiting to start
        self._finish_run()
        return time.perf_counter() - t0

    def _run_events(self) -> None:
        """Pop and handle events until the heap is empty."""
        heap, pop = self.heap, heapq.heappop
        handlers = self.handlers
        coord = self.coord
        records, live = coord.records, coord.live
        while heap:
            t, _, kind, a, b = pop(heap)
            if kind == TICK and (t != coord.timer_s or not live):
                continue                                # superseded timer, or nothing left to time out
            if kind == WAKE and not live and self.tiered:
                continue                                # a host tier's prefetch or pin end: nobody left to serve
            self.now = t
            self.events += 1
            if not self.events & 4095:
                self._check_progress()
            handlers[kind](a, b)
            if len(records) - len(live) != self._done_sessions:
                self._session_ends()

    def _session_ends(self) -> None:
        """Sessions ended since the last call: report progress; in a closed loop their clients start the next."""
        done = len(self.coord.records) - len(self.coord.live)
        if done == self._done_sessions:
            return
        self._done_sessions = done
        if self._closed is not None:
            self._free_clients()
        if self.progress is not None:
            self.progress(done + self.streamed)
        if self.record_sink is not None:
            self.stream_records()

    def stream_records(self) -> None:
        """Hand the ended records at the head of the coordinator's list to `record_sink`, in that order, and drop
        them: a long run keeps only the records of sessions under way (and of those that ended after them)."""
        records, live, sink = self.coord.records, self.coord.live, self.record_sink
        i, n = 0, len(records)
        while i < n and records[i].session_id not in live:
            sink(records[i])
            i += 1
        if i:
            del records[:i]
            self.streamed += i
            self._done_sessions -= i
            if self._closed is not None:
                self._closed.dropped(i)

    def _free_clients(self) -> None:
        """Closed loop: each client whose session ended starts the next waiting session when it sees the end."""
        closed = self._closed
        for rec in closed.ended(self.coord.records, self.coord.live):
            if closed.waiting:
                self._start_next(self._client_end_s(rec))

    def _start_next(self, at: float) -> None:
        """A client sends the next waiting session at `at` (its arrival time in the records)."""
        self._push(at, ARRIVAL, self._closed.start(at))

    def _client_end_s(self, rec: SessionRecord) -> float:
        """When the client of a session that just ended sees the end (here: at once)."""
        return self.now

    def _finish_run(self) -> None:
        """Post-processing of the records a shell needs (none here)."""

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
