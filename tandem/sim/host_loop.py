"""The event loop for copies of tandem's engine served by tandem's runtime on one host (a `tandem profile`):
EventLoop's run and action dispatch, with each action carried as the runtime's message."""
from __future__ import annotations

from typing import Callable

from tandem.core.actions import ToolCall, Transfer
from tandem.core.commands import BEGIN, EARLY, KV_ARRIVED, KV_IN, SEND_KV
from tandem.core.coordinator import Coordinator
from tandem.core.types import BatchShape, PREFILL, StepPlan, Swap, SwapKind
from tandem.core.worker import WorkerCore
from tandem.sim.faults import Fate
from tandem.sim.loop import STEP, TOOL, EventLoop
from tandem.sim.network import Network
from tandem.workload.records import SessionRecord
from tandem.workload.session import Session

REQ, TOOLREQ, BEGUN, CTL, CTLDONE, EVT, HOST = range(8, 15)


class HostLoop(EventLoop):
    """On top of EventLoop's model (workers step, KV flows over a link) it keeps what the live runtime does
    around the engine (tandem/runtime/worker_main.py, coordinator_shell.py), with the costs of a
    `RuntimeCosts` (docs/simulator.md, "Runtime model"):

    - a round reaches the coordinator `request_s` after the client sent it; a round > 0 first asks its decode
      worker for the resident KV (one message there and back) before it is routed; its TTFT still counts from
      the client's send, and every token reaches the client `output_s` after its worker produced it (the tool
      gap runs from there);
    - every coordinator action is a message that reaches its worker `hop_s` later, and every worker event
      reaches the coordinator `hop_s` later;
    - a worker handles its messages one after the other (`msg_s` each); between two steps all of them, during
      a step those of `EARLY` (tandem.core.commands, as in the runtime: BeginRound, Submit and the KV moves
      of requests outside the running batch) as long as nothing waits before them; the others wait for the
      step's end, and so does everything after them. A KV send first gathers the KV on the source worker
      (export), the bytes then cross the link, and the destination worker places them (import): each holds
      its worker's message handling like a message does, and a step that ends meanwhile waits for it before
      the next one starts (the runtime's I/O thread holds the shell's lock);
    - every step takes `step_factor[kind]` times the step model plus `step_gap_s` (the worker loop between
      steps);
    - a step runs `interference[kind]` times slower while another worker is in a step (the slow-down applies
      to the overlapping part only);
    - with `cores` > 0, the host's cores are shared (processor sharing) by the workers' steps (one thread
      each) and the serving processes' own work: `host_token_s` CPU seconds per token streamed to a client
      and `host_round_s` per round (coordinator, HTTP, client), and the KV wire's encryption (the profile's
      `kv_link.crypto_s_per_byte` per byte sent), queued as one more runnable thread; while more threads run
      than there are cores, each progresses at cores / threads.
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
        self.handlers.update({REQ: self._on_req, TOOLREQ: self._on_toolreq, BEGUN: self._on_begun,
                              CTL: self._on_ctl, CTLDONE: self._on_ctldone, EVT: self._on_evt,
                              HOST: self._on_host})

    # ------------------------------------------------------------------ messages
    def _send(self, wid: int, kind: int, act, kick: set[int]) -> None:
        """The command travels to its worker as a message (hop_s)."""
        self._push(self.now + self.costs.hop_s, CTL, wid, (kind, act))

    def _tool_call(self, act: ToolCall) -> None:
        st = self.coord.live.get(act.session_id)
        fin = st.record.rounds[-1].finish_s if st is not None and st.record.rounds else None
        end = (fin if fin is not None else self.now) + self.costs.output_s
        self._push(max(self.now, end + act.delay_s), TOOL, act.session_id)

    def _deliver(self, wid: int, item: tuple) -> None:
        if self.dead[wid]:
            return
        self._inbox[wid].append(item)
        if not self._handling[wid]:
            self._handle(wid)

    def _cost(self, item: tuple) -> float:
        c = self.costs
        if item[0] == SEND_KV:
            return c.msg_s + c.export_s(item[1].tokens * self.kv_bytes)
        if item[0] == KV_IN:
            return c.msg_s + c.import_s(item[1].tokens * self.kv_bytes)
        return c.msg_s

    def _handle(self, wid: int) -> None:
        """Work through the worker's inbox: all of it between steps (then let it step), during a step only the
        EARLY messages at its head."""
        box = self._inbox[wid]
        while box and (not self.workers[wid].busy or box[0][0] in EARLY):
            cost = self._cost(box[0])
            if cost > 0:
                self._handling[wid] = True
                self._push(self.now + cost, CTLDONE, wid)
                return
            self._carry_out(wid, box.pop(0))
        self._handling[wid] = False
        if not self.workers[wid].busy:
            self._kick(wid)

    def _carry_out(self, wid: int, item: tuple) -> None:
        """A message handled between two steps: its effect on the worker, then the events it caused."""
        w = self.workers[wid]
        kind = item[0]
        if kind == BEGIN:
            self._push(self.now + self.costs.hop_s, BEGUN, item[1])
        elif kind == KV_IN:
            tr, started, fate = item[1], item[2], item[3]
            self._push(self.now + self.costs.hop_s, EVT, None, ("kv", tr, started, fate))
        else:
            self._effect(wid, kind, item[1])
            if kind == KV_ARRIVED:
                self._host_work(self.costs.host_token_s)
            elif kind == SEND_KV:              # its encryption takes CPU on both ends while the bytes move
                self._host_work(self.costs.crypto_s(item[1].tokens * self.kv_bytes))
        if w.events:
            self._forward(w)

    def _forward(self, worker: WorkerCore) -> None:
        if worker.events:
            self._push(self.now + self.costs.hop_s, EVT, None, ("events", worker.id, worker.drain()))

    def _landed(self, tr: Transfer, started: float, fate: Fate) -> None:
        """The bytes reached the destination worker, which imports them between its steps."""
        self._deliver(tr.dst, (KV_IN, tr, started, fate))

    # ------------------------------------------------------------------ steps with interference
    def _kick(self, wid: int) -> None:
        if self._handling[wid] or self._inbox[wid]:
            return
        super()._kick(wid)

    def _charge_swaps(self, wid: int, swaps: list[Swap]) -> None:
        """On one host a swap is the engine's KV export (out) or import (in), at the profile's measured rates."""
        per_block = self.workers[wid].cfg.block_size * self.kv_bytes
        for sw in swaps:
            if sw.blocks:
                nbytes = len(sw.blocks) * per_block
                self._swap_s[wid] += (self.costs.export_s(nbytes) if sw.kind is SwapKind.OUT
                                      else self.costs.import_s(nbytes))

    def _start_step(self, wid: int, plan: StepPlan) -> None:
        kind = "prefill" if plan.prefill else "decode"
        solo = (self.step_time[wid](plan.shape) * self.costs.step_factor.get(kind, 1.0) + self.costs.step_gap_s
                + self._take_swap_s(wid))
        self._reshare()                                    # progress of the others up to now
        self._step[wid] = [solo, self.costs.interference.get(kind, 1.0), 1.0, self.now, -1]
        self._stepping += 1
        self._reshare(changed=True)

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

    # ------------------------------------------------------------------ events
    def _on_step(self, a, b) -> None:
        st = self._step[a]
        if st is None or b != st[4]:
            return                                         # superseded by a rate change
        self._reshare()
        self._step[a] = None
        self._stepping -= 1
        self._reshare(changed=True)
        plan = self._end_step(a)
        w = self.workers[a]
        if w.role != PREFILL:                              # tokens this step streams to clients
            toks = len(plan.decode) + sum(1 for tk, n in plan.prefill if tk.done >= tk.work and not tk.recompute)
            self._host_work(toks * self.costs.host_token_s)
        self._forward(w)
        if not self._handling[a]:                          # else the message being handled continues, then steps
            self._handle(a)

    def _on_kill(self, wid: int, b) -> None:
        if not self.dead[wid] and self._step[wid] is not None:
            self._reshare()
            self._step[wid] = None
            self._stepping -= 1
            self._reshare(changed=True)
        self._inbox[wid].clear()
        super()._on_kill(wid, b)

    def _on_ctl(self, wid: int, item: tuple) -> None:
        self._deliver(wid, item)

    def _on_host(self, a, version) -> None:
        if version == self._host[3]:
            self._reshare()
            self._host[0] = 0.0
            self._reshare(changed=True)

    def _on_ctldone(self, wid: int, b) -> None:
        if self.dead[wid]:
            return
        item = self._inbox[wid].pop(0)
        self._carry_out(wid, item)
        self._handle(wid)

    def _on_evt(self, a, b: tuple) -> None:
        if b[0] == "events":
            for ev in b[2]:
                self._apply(self.coord.on_event(ev, self.now))
        else:
            _, tr, started, fate = b
            EventLoop._landed(self, tr, started, fate)

    def _on_arrival(self, s: Session, b) -> None:
        self._push(self.now + self.costs.request_s, REQ, s, self.now)

    def _on_req(self, s: Session, sent: float) -> None:
        self._host_work(self.costs.host_round_s)
        self._apply(self.coord.on_session_arrival(s, self.now))
        self._stamp(s.session_id, sent)

    def _on_tool(self, sid: str, b) -> None:                # the client sends the session's next round
        self._push(self.now + self.costs.request_s, TOOLREQ, sid, self.now)

    def _on_toolreq(self, sid: str, sent: float) -> None:   # it reached the coordinator: ask its worker
        st = self.coord.live.get(sid)
        self._host_work(self.costs.host_round_s)
        if st is not None:
            self._client_sent[sid] = sent
            self._send(st.worker, BEGIN, sid, set())

    def _on_begun(self, sid: str, b) -> None:
        sent = self._client_sent.pop(sid, self.now)
        self._apply(self.coord.on_tool_result(sid, self.now))
        self._stamp(sid, sent)

    # ------------------------------------------------------------------ records
    def _client_end_s(self, rec: SessionRecord) -> float:
        """A closed-loop client sees its session end when the last token reaches it (output_s after its worker
        produced it; a failure, output_s after the coordinator's)."""
        last = rec.rounds[-1].finish_s if rec.completed and rec.rounds else None
        return max(self.now, (last if last is not None else self.now) + self.costs.output_s)

    def _stamp(self, sid: str, sent: float) -> None:
        """The round just started counts from the client's send (its TTFT includes request_s and the RTT)."""
        st = self.coord.live.get(sid)
        rec = st.record if st is not None else next((r for r in reversed(self.coord.records) if r.session_id == sid), None)
        if rec is not None and rec.rounds:
            rec.rounds[-1].arrival_s = sent

    def _finish_run(self) -> None:
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
