"""The coordinator core: binds sessions, routes every prefill, tracks rounds and tool gaps, keeps records."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from tandem.core.actions import Delivered, HistoryReady, KVArrived, Release, Submit, ToolCall, Transfer
from tandem.core.types import FetchHistory, FirstToken, PrefillDone, PrefillTask, RoundDone, SessionFailed
from tandem.policy.binding import LeastKVBinder
from tandem.policy.routing import ClusterView, Router
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import SLO, Round, Session


class CoordinatorView(ClusterView, Protocol):
    """Routing's view plus what binding needs: homes for sessions and their resident KV."""

    def home_workers(self) -> Sequence[int]: ...
    def capacity(self, worker: int) -> int: ...
    def begin_round(self, worker: int, session_id: str) -> int: ...


@dataclass(slots=True)
class _Live:
    session: Session
    record: SessionRecord
    worker: int
    k: int = 0                 # current round
    context: int = 0           # tokens of all finished rounds (inputs + outputs)
    task: PrefillTask | None = None
    committed: int = 0         # tokens this session adds to its worker's committed KV
    open: bool = False         # live: more rounds may be appended (on_round); ends by end_session


class Coordinator:
    """Sans-I/O: `on_*` methods take events and return actions; time comes in as `now`."""

    def __init__(self, view: CoordinatorView, router: Router, binder: LeastKVBinder | None = None,
                 max_context: int | None = None) -> None:
        self.view = view
        self.max_context = max_context
        self.router = router
        self.binder = binder or LeastKVBinder()
        self.live: dict[str, _Live] = {}
        self.rounds_done = 0                              # rounds finished so far (a progress signal for shells)
        self.records: list[SessionRecord] = []
        self.committed: dict[int, int] = {w: 0 for w in view.home_workers()}
        self.capacity = {w: view.capacity(w) for w in view.home_workers()}

    # ------------------------------------------------------------------ arrivals
    def on_session_arrival(self, session: Session, now: float) -> list:
        """Bind a new session to a worker by KV commitment and start its first round."""
        w = self.binder.bind(self._homes(), self.committed, self.capacity)
        rec = SessionRecord(session.session_id, session.arrival_s, session.slo, len(session.rounds), decode_worker=w)
        self.records.append(rec)
        st = _Live(session, rec, w)
        self.live[session.session_id] = st
        return self._start_round(st, now)

    def _homes(self) -> list[int]:
        """Workers that can host sessions and are not lost."""
        return [w for w in self.view.home_workers() if w in self.capacity]

    def on_tool_result(self, session_id: str, now: float) -> list:
        """The tool call of `session_id` returned: its next round's input is here."""
        st = self.live.get(session_id)
        return self._start_round(st, now) if st is not None else []

    # ------------------------------------------------------------------ live sessions (rounds not known ahead)
    def on_round(self, session_id: str, input_tokens: int, max_output_tokens: int, now: float,
                 slo: SLO | None = None, worker: int | None = None) -> list:
        """A live round arrives: `input_tokens` new tokens after the session's history, at most
        `max_output_tokens` to generate. A new session is bound first (to `worker` if given, else by the
        binder); the session stays bound after the round until end_session."""
        st = self.live.get(session_id)
        if st is not None and st.task is not None:
            raise ValueError(f"session {session_id!r} already has a round in flight")
        rnd = Round(input_tokens, max_output_tokens)
        if st is None:
            w = worker if worker is not None else self.binder.bind(self._homes(), self.committed, self.capacity)
            session = Session(session_id, now, [rnd], slo)
            rec = SessionRecord(session_id, now, slo, 1, decode_worker=w)
            self.records.append(rec)
            st = self.live[session_id] = _Live(session, rec, w, open=True)
        else:
            st.session.rounds.append(rnd)
            st.record.num_rounds += 1
        return self._start_round(st, now)

    def end_session(self, session_id: str, now: float, reason: str | None = None) -> list:
        """The session is over (idle expiry, client gone, worker lost): release its KV; a reason marks it failed."""
        st = self.live.get(session_id)
        if st is None:
            return []
        if reason is not None:
            return self._fail(st, now, reason)
        st.record.finish_s = now
        return self._end(st)

    def in_round(self) -> list[str]:
        """Live sessions with a round between its input and its last token."""
        return [sid for sid, st in self.live.items() if st.task is not None]

    def in_flight(self) -> list[str]:
        """Live sessions with a round under way (not a live session idle until its client's next round)."""
        return [sid for sid, st in self.live.items() if not (st.open and st.k >= len(st.session.rounds))]

    def session_worker(self, session_id: str) -> int | None:
        """The worker a live session is bound to, None if unknown."""
        st = self.live.get(session_id)
        return st.worker if st is not None else None

    def on_worker_lost(self, worker: int, now: float) -> list:
        """`worker` died: sessions bound to it fail (in-flight rounds end with the reason); prefill tasks
        running on it are routed again (their input is still at the coordinator's shell). The view must no
        longer list the worker (the state store's liveness does that; InProcessState.drop in tests)."""
        out: list = []
        for st in list(self.live.values()):
            if st.worker == worker:
                out += self._fail(st, now, f"worker lost: decode worker {worker} stopped")
            elif st.task is not None and st.task.worker == worker and not st.task.local:
                t = st.task
                t.worker, t.done, t.kv_ready, t.start_s = -1, 0, True, None
                target = self.router.route(t, self.view, now)
                t.worker, t.local = target, target == st.worker
                rec = st.record.rounds[-1]
                rec.prefill_where, rec.prefill_worker = ("local" if t.local else "remote"), target
                out.append(Submit(target, t))
        self.committed.pop(worker, None)
        self.capacity.pop(worker, None)
        return out

    def _start_round(self, st: _Live, now: float) -> list:
        s, k, w = st.session, st.k, st.worker
        rnd = s.rounds[k]
        rec = RoundRecord(k, now, rnd.input_tokens)
        st.record.rounds.append(rec)
        need = st.context + rnd.input_tokens + rnd.output_tokens
        if self.max_context is not None and need > self.max_context:
            return self._fail(st, now, f"context exceeds the model's maximum: round {k} needs {need} "
                                       f"tokens, the model takes {self.max_context}")
        if need > self.capacity[w]:
            return self._fail(st, now, f"KV exceeds the worker's capacity: round {k} needs {need} tokens, "
                                       f"worker {w} holds at most {self.capacity[w]}")
        hist = self.view.begin_round(w, s.session_id)
        l_incr = st.context - hist + rnd.input_tokens     # includes the previous round's last token
        rec.history_tokens = hist
        rec.recomputed_tokens = max(0, st.context - hist - (1 if k else 0))
        self.committed[w] += rnd.input_tokens + rnd.output_tokens
        st.committed += rnd.input_tokens + rnd.output_tokens
        slo = s.slo
        task = PrefillTask(s.session_id, k, hist, l_incr, now,
                           ttft_slo_s=slo.ttft_s if slo else math.inf,
                           itl_slo_s=slo.itl_s if slo else math.inf,
                           output_tokens=rnd.output_tokens, decode_worker=w)
        target = self.router.route(task, self.view, now)
        task.worker = target
        task.local = target == w
        rec.prefill_where = "local" if task.local else "remote"
        rec.prefill_worker = target
        st.task = task
        return [Submit(target, task)]

    # ------------------------------------------------------------------ worker events
    def on_event(self, ev, now: float) -> list:
        """Consume one event from a worker core."""
        if isinstance(ev, RoundDone):
            return self._round_done(ev, now)
        if isinstance(ev, FirstToken):
            st = self.live.get(ev.session_id)
            if st is not None:
                rec = st.record.rounds[-1]
                rec.first_token_s = ev.time_s
                rec.prefill_start_s = ev.prefill_start_s
            return []
        if isinstance(ev, PrefillDone):
            t = ev.task
            return [Transfer(ev.worker, t.decode_worker, t.l_incr, "incremental", t)]
        if isinstance(ev, FetchHistory):
            t = ev.task
            return [Transfer(t.decode_worker, t.worker, ev.tokens, "history", t)]
        if isinstance(ev, SessionFailed):
            st = self.live.get(ev.session_id)
            return self._fail(st, now, ev.reason) if st is not None else []
        raise TypeError(f"unknown worker event {ev!r}")

    def on_transfer_done(self, tr: Transfer, now: float, elapsed_s: float) -> list:
        """A KV transfer finished after `elapsed_s`."""
        st = self.live.get(tr.task.session_id)
        if st is not None and st.task is tr.task:
            st.record.rounds[-1].kv_transfer_s += elapsed_s
        if tr.purpose == "history":
            return [HistoryReady(tr.dst, tr.task)]
        return [KVArrived(tr.dst, tr.task), Delivered(tr.src, tr.task)]

    def _round_done(self, ev: RoundDone, now: float) -> list:
        st = self.live.get(ev.session_id)
        if st is None:
            return []
        rnd = st.session.rounds[st.k]
        rec = st.record.rounds[-1]
        rec.finish_s = ev.time_s
        self.rounds_done += 1
        produced = min(ev.output_tokens, rnd.output_tokens) if ev.output_tokens > 0 else rnd.output_tokens
        rec.output_tokens = produced
        rec.itl_sum_s, rec.itl_count, rec.itl_max_s = ev.itl_sum, ev.itl_count, ev.itl_max
        rec.preemptions = ev.preemptions
        unused = rnd.output_tokens - produced             # a stop ended the round early: uncommit the rest
        self.committed[st.worker] -= unused
        st.committed -= unused
        st.context += rnd.input_tokens + produced
        st.k += 1
        st.task = None
        if st.k < len(st.session.rounds):
            return [ToolCall(ev.session_id, rnd.tool_s)]
        if st.open:
            return []                                     # live: stays bound, KV resident, until end_session
        st.record.finish_s = now
        return self._end(st)

    def _fail(self, st: _Live, now: float, reason: str) -> list:
        st.record.failed = True
        st.record.fail_reason = reason
        st.record.finish_s = now
        return self._end(st)

    def _end(self, st: _Live) -> list:
        sid = st.session.session_id
        del self.live[sid]
        if st.worker in self.committed:
            self.committed[st.worker] -= st.committed
        return [Release(st.worker, sid)]
