"""The coordinator core: binds sessions, routes every prefill, tracks rounds, tool gaps, KV transfers and idle
sessions, handles lost workers and failed transfers, keeps records. Every shell runs this one object."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

from tandem.core.actions import (
    Cancel, Delivered, ExpectReturn, HistoryReady, KVArrived, Release, RunLocal, Submit, ToolCall, Transfer,
    TransferPurpose,
)
from tandem.core.deadlines import Deadlines
from tandem.core.homes import Homes, HomesView
from tandem.core.host_tier import KV_EVENTS
from tandem.core.types import FetchHistory, FirstToken, PrefillDone, PrefillTask, RoundDone, SessionFailed
from tandem.policy.binding import CacheAwareBinder, LeastKVBinder, PrefixAffinityBinder
from tandem.policy.routing import ClusterView, Router
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import SLO, Round, Session

HISTORY, INCREMENTAL = TransferPurpose.HISTORY, TransferPurpose.INCREMENTAL
_XFER, _IDLE = 0, 1                                   # deadline kinds
NO_HOME = "no live decode worker: every worker that can hold sessions is lost"


class CoordinatorView(ClusterView, HomesView, Protocol):
    """Routing's view plus what binding needs (HomesView), and a round's start on its worker."""

    def begin_round(self, worker: int, session_id: str, block_hashes: Sequence[int] = (),
                    prompt_tokens: int = 0, now: float | None = None) -> int: ...


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
    hashes: tuple[int, ...] = ()  # block hashes of the current round's prompt (prefix affinity)
    idle_since: float | None = None  # between rounds since then (KV resident until session_ttl_s)
    kv_home: bool = False      # the round's remote prefill KV has reached its decode worker
    full_prefill: bool = False  # the current round computes its whole prompt at home (prompt logprobs)
    may_move: bool = False     # the next round may be bound again (cache-aware binding; a live shell decides first)
    tool_s: float | None = None  # live: the client's expected tool time after the current round (None: unknown)


class Coordinator:
    """Sans-I/O: `on_*` methods take events and return actions; time comes in as `now`. Built by
    tandem.core.factory.build_coordinator."""

    def __init__(self, view: CoordinatorView, router: Router,
                 binder: LeastKVBinder | PrefixAffinityBinder | CacheAwareBinder | None = None,
                 max_context: int | None = None, kv_timeout_s: float = math.inf, session_ttl_s: float = math.inf,
                 block_size: int = 16, recompute_history: bool = False, tool_hints: bool = False) -> None:
        self.view = view
        self.tool_hints = tool_hints              # host tiers: tell a session's worker its tool's expected time
        self.recompute_history = recompute_history   # a remote prefill computes its history (vLLM's PD) or reads it
        self.max_context = max_context
        self.router = router
        self.placement = Homes(view, binder or LeastKVBinder(), block_size)
        self.binder, self.prefixes = self.placement.binder, self.placement.prefixes
        self.kv_timeout_s = kv_timeout_s
        self.session_ttl_s = session_ttl_s
        self.block_size = block_size
        self.live: dict[str, _Live] = {}
        self.rounds_done = 0                              # rounds finished so far (a progress signal for shells)
        self.records: list[SessionRecord] = []
        self.committed, self.capacity = self.placement.committed, self.placement.capacity   # the same dicts
        self.transfers: dict[int, tuple[Transfer, float]] = {}   # in flight: id -> (transfer, started)
        self._xfer_ids = 0
        self.deadlines = Deadlines(self._stale)
        self.kv_failures = 0                              # transfers failed or timed out (fell back to local)
        self.rebinds = 0                                  # bound sessions moved to another worker between rounds

    # ------------------------------------------------------------------ arrivals
    def on_session_arrival(self, session: Session, now: float) -> list:
        """Bind a new session to a worker (longest cached prefix of its first prompt, else least committed KV)
        and start its first round."""
        hashes = session.first_prompt_hashes(self.block_size)
        w = self.placement.bind(hashes)
        if w is None:                                     # every decode worker is lost: say so, drop nothing
            rec = SessionRecord(session.session_id, session.arrival_s, session.slo, len(session.rounds),
                                finish_s=now, failed=True, fail_reason=NO_HOME)
            self.records.append(rec)
            return []
        rec = SessionRecord(session.session_id, session.arrival_s, session.slo, len(session.rounds), decode_worker=w)
        self.records.append(rec)
        st = _Live(session, rec, w, hashes=hashes)
        self.live[session.session_id] = st
        return self._start_round(st, now)

    def homes(self) -> list[int]:
        """Live workers that can host sessions."""
        return self.placement.live()

    def on_tool_result(self, session_id: str, now: float) -> list:
        """The tool call of `session_id` returned: its next round's input is here."""
        st = self.live.get(session_id)
        return self._start_round(st, now) if st is not None else []

    # ------------------------------------------------------------------ live sessions (rounds not known ahead)
    def on_round(self, session_id: str, input_tokens: int, max_output_tokens: int, now: float,
                 slo: SLO | None = None, worker: int | None = None, block_hashes: Sequence[int] = (),
                 full_prefill: bool = False, tool_s: float | None = None) -> list:
        """A live round arrives: `input_tokens` new tokens after the session's history, at most
        `max_output_tokens` to generate; `block_hashes` are the chained hashes of the whole prompt's full blocks.
        A new session is bound first (to `worker` if given, else by the binder: longest cached prefix); the
        session stays bound after the round until end_session or its idle expiry. `full_prefill`: the round
        wants every prompt position computed (prompt logprobs exist only where the prefill runs), so its
        prefill runs on the session's own worker, whatever the router would say. `tool_s`: the client's expected
        tool time after this round, told to the session's worker (a host tier plans with it; None: its estimate)."""
        st = self.live.get(session_id)
        if st is not None and st.task is not None:
            raise ValueError(f"session {session_id!r} already has a round in flight")
        rnd = Round(input_tokens, max_output_tokens)
        hashes = tuple(block_hashes)
        if st is None:
            w = worker if worker is not None else self.placement.bind(hashes)
            if w is None:
                raise ValueError(NO_HOME)
            session = Session(session_id, now, [rnd], slo)
            rec = SessionRecord(session_id, now, slo, 1, decode_worker=w)
            self.records.append(rec)
            st = self.live[session_id] = _Live(session, rec, w, open=True, hashes=hashes)
        else:
            st.session.rounds.append(rnd)
            st.record.num_rounds += 1
            st.hashes = hashes
            st.may_move = st.may_move and worker is None
        st.full_prefill = full_prefill
        st.tool_s = tool_s
        return self._start_round(st, now)

    def move_before_round(self, session_id: str, tokens: int, block_hashes: Sequence[int] = ()) -> tuple[int, list]:
        """For a shell that pins a round's worker before on_round (the live one): the worker session `session_id`'s
        next round of `tokens` (its context, new input and output) runs on, bound again by the cache-aware rule when
        the policy has it, and the old worker's Release if it moved; on_round(worker=...) then keeps that worker."""
        st = self.live.get(session_id)
        if st is None:
            raise ValueError(f"session {session_id!r} is not bound")
        if not st.may_move or st.task is not None:
            return st.worker, []
        st.hashes = tuple(block_hashes) or st.hashes
        moved = self._rebind(st, tokens)
        st.may_move = False
        return st.worker, moved

    def pick_worker(self, block_hashes: Sequence[int] = ()) -> int | None:
        """The worker the binder would bind a new session with this prompt to (None: no live worker). A shell
        that must ask the worker first (its resident and cached KV) binds with on_round(worker=...) after."""
        return self.placement.bind(block_hashes)

    def touch(self, session_id: str, now: float) -> None:
        """A live session's next round is on its way (its shell is asking the worker): not idle any more."""
        st = self.live.get(session_id)
        if st is not None:
            st.idle_since = None

    def end_session(self, session_id: str, now: float, reason: str | None = None) -> list:
        """The session is over (client gone, worker lost, request without a session): release its KV; a reason
        marks it failed."""
        st = self.live.get(session_id)
        if st is None:
            return []
        if reason is not None:
            return self._fail(st, now, reason)
        if st.hashes and self.prefixes is not None and st.task is None:
            self.prefixes.remember(st.worker, st.hashes)  # a request without a session leaves its prompt cached
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

    # ------------------------------------------------------------------ faults
    def on_worker_lost(self, worker: int, now: float) -> list:
        """`worker` died. Sessions bound to it with a round under way fail with the reason (their KV was there);
        sessions bound to it between rounds are bound again (least committed KV) and recompute their history
        in their next round; prefill tasks running on it whose KV has not reached their decode worker are
        routed again (their input is still at the shell); its transfers are abandoned. The view must no longer list the worker (the state store's
        liveness does that; InProcessState.drop in the simulator)."""
        out: list = []
        self._abandon(lambda tr: worker in (tr.src, tr.dst))
        self.placement.lost(worker)
        homes = self.placement.live()
        reason = f"worker lost: decode worker {worker} stopped"
        for st in list(self.live.values()):
            if st.worker == worker:
                if st.task is None and homes:
                    w = self.placement.bind()
                    st.worker = st.record.decode_worker = w
                    self.committed[w] += st.committed
                else:
                    out += self._fail(st, now, reason)
            elif st.task is not None and st.task.worker == worker and not st.task.local and not st.kv_home:
                t = st.task
                t.worker, t.done, t.kv_ready, t.start_s = -1, 0, True, None
                target = self._route(t, now)
                self._place(t, target)
                rec = st.record.rounds[-1]
                rec.prefill_where, rec.prefill_worker = ("local" if t.local else "remote"), target
                out.append(Submit(target, t))
        return out

    def on_worker_joined(self, worker: int, now: float) -> list:
        """`worker` (re)started empty (a lost worker's replacement under the same id): it may host sessions again
        if it can, with nothing committed and no cached prefix. The view must list it again."""
        self.placement.joined(worker)
        return []

    def on_transfer_failed(self, tr: Transfer, now: float, reason: str = "") -> list:
        """A KV transfer reported failure: the round's prefill is redone on its decode worker."""
        if self.transfers.pop(tr.id, None) is None:
            return []                                     # already abandoned (timed out, session over)
        return self._fall_back(tr, now)

    def on_tick(self, now: float) -> list:
        """Time passed: abandon KV transfers older than kv_timeout_s (local recompute) and release the KV of
        sessions idle longer than session_ttl_s. Shells call this when a Timer falls due (or periodically)."""
        out: list = []
        dl = self.deadlines
        for kind, key in dl.due(now):                   # checked one by one: handling one may end another
            if dl.stale(kind, key):
                continue
            if kind == _XFER:
                out += self._fall_back(self.transfers.pop(key)[0], now)
            else:
                out += self._expire(self.live[key[0]], now)
        dl.rearm(out)
        return out

    def _abandon(self, which) -> None:
        """Stop tracking the in-flight transfers `which(transfer)` selects (their completions are then ignored)."""
        for tid in [tid for tid, (tr, _) in self.transfers.items() if which(tr)]:
            del self.transfers[tid]

    @property
    def timer_s(self) -> float:
        """When the coordinator next wants on_tick (the last Timer it asked for; inf: none)."""
        return self.deadlines.armed

    def _stale(self, kind: int, key) -> bool:
        """A deadline whose transfer landed or whose session is no longer idle since then."""
        if kind == _XFER:
            return key not in self.transfers
        st = self.live.get(key[0])
        return st is None or st.idle_since != key[1] or st.task is not None

    def _fall_back(self, tr: Transfer, now: float) -> list:
        """The transfer of a remote round failed or timed out: drop the remote work, prefill locally."""
        t = tr.task
        st = self.live.get(t.session_id)
        if st is None or st.task is not t or t.local:
            return []
        self._abandon(lambda tr: tr.task is t)
        self.kv_failures += 1
        rec = st.record.rounds[-1]
        rec.kv_failures += 1
        if tr.purpose is INCREMENTAL:
            rec.kv_fallback_tokens += t.l_incr            # computed remotely, computed again here
        rec.prefill_where, rec.prefill_worker = "local", st.worker
        return [Cancel(t.worker, t), RunLocal(st.worker, t)]

    def _expire(self, st: _Live, now: float) -> list:
        """An idle session outlived session_ttl_s: its KV is released. A live session ends (its client resends
        the whole conversation with its next request); a simulated one recomputes its history next round."""
        st.idle_since = None
        if st.open:
            st.record.finish_s = now
            return self._end(st)
        return [Release(st.worker, st.session.session_id, keep_host=self.tool_hints)]

    def _start_round(self, st: _Live, now: float) -> list:
        s, k, w = st.session, st.k, st.worker
        st.idle_since = None
        st.kv_home = False
        rnd = s.rounds[k]
        rec = RoundRecord(k, now, rnd.input_tokens)
        st.record.rounds.append(rec)
        need = st.context + rnd.input_tokens + rnd.output_tokens
        if self.max_context is not None and need > self.max_context:
            return self._fail(st, now, f"context exceeds the model's maximum: round {k} needs {need} "
                                       f"tokens, the model takes {self.max_context}")
        moved = self._rebind(st, need) if k and st.may_move else []
        st.may_move = self.placement.rebinding
        w = st.worker
        if need > self.capacity[w]:
            return moved + self._fail(st, now, f"KV exceeds the worker's capacity: round {k} needs {need} tokens, "
                                               f"worker {w} holds at most {self.capacity[w]}")
        # nothing resident (new, evicted, re-bound): the worker's prefix cache may still hold the conversation's start
        hist = self.view.begin_round(w, s.session_id, st.hashes, st.context + rnd.input_tokens, now)
        l_incr = st.context - hist + rnd.input_tokens     # includes the previous round's last token
        rec.history_tokens = hist
        rec.recomputed_tokens = max(0, st.context - hist - (1 if k else 0))
        self.committed[w] += rnd.input_tokens + rnd.output_tokens
        st.committed += rnd.input_tokens + rnd.output_tokens
        slo = s.slo
        task = PrefillTask(s.session_id, k, hist, l_incr, now,
                           ttft_slo_s=slo.ttft_s if slo else math.inf,
                           itl_slo_s=slo.itl_s if slo else math.inf,
                           output_tokens=rnd.output_tokens, decode_worker=w,
                           block_hashes=st.hashes if k == 0 and not st.open else (), full_prefill=st.full_prefill)
        target = self._route(task, now)
        self._place(task, target)
        rec.prefill_where = "local" if task.local else "remote"
        rec.prefill_worker = target
        rec.recomputed_tokens += task.hist_compute
        st.task = task
        return [*moved, Submit(target, task), *self._tool_hint(st, w)]

    def _tool_hint(self, st: _Live, worker: int) -> list:
        """Host tiers: tell the session's worker, as its round starts, how long the tool call after it takes (the
        trace's time between rounds, a live client's own figure), so that its tier plans the idle KV when the round
        ends, before it decides by its estimate."""
        if not self.tool_hints:
            return []
        rounds, k = st.session.rounds, st.k
        tool_s = st.tool_s if st.open else rounds[k].tool_s if k + 1 < len(rounds) else None
        return [ExpectReturn(worker, st.session.session_id, tool_s)] if tool_s is not None else []

    def _rebind(self, st: _Live, need: int) -> list:
        """Cache-aware binding between rounds (Homes.rebind); the old worker's Release if the session moved."""
        w, sid = st.worker, st.session.session_id
        st.worker = st.record.decode_worker = self.placement.rebind(w, sid, need, st.committed, st.hashes)
        self.rebinds += st.worker != w
        return [Release(w, sid)] if st.worker != w else []

    def _place(self, task: PrefillTask, target: int) -> None:
        """The task runs on `target`: local on its decode worker, else remote, where it reads its history or, with
        recompute_history, computes it (the whole prompt, as vLLM's PD proxy sends it to a prefill instance)."""
        task.worker = target
        task.local = target == task.decode_worker
        task.hist_compute = task.l_hist if self.recompute_history and not task.local else 0

    def _route(self, task: PrefillTask, now: float) -> int:
        """The router's choice; a full prefill, or one whose history is in flight from a host tier, stays home."""
        loading = self.tool_hints and task.l_hist and self.view.kv_loading(task.decode_worker, task.session_id)
        return task.decode_worker if task.full_prefill or loading else self.router.route(task, self.view, now)

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
                if st.hashes and self.prefixes is not None:   # the prompt's KV is now in that worker's cache
                    self.prefixes.remember(st.worker, st.hashes)
            return []
        if isinstance(ev, PrefillDone):
            t = ev.task
            return self._transfer(ev.worker, t.decode_worker, t.l_incr, INCREMENTAL, t, now)
        if isinstance(ev, FetchHistory):
            t = ev.task
            return self._transfer(t.decode_worker, t.worker, ev.tokens, HISTORY, t, now)
        if isinstance(ev, SessionFailed):
            st = self.live.get(ev.session_id)
            return self._fail(st, now, ev.reason) if st is not None else []
        if isinstance(ev, KV_EVENTS):                  # cache-aware binding learns what each worker's tiers hold
            self.placement.observe(ev)
            return []
        raise TypeError(f"unknown worker event {ev!r}")

    def _transfer(self, src: int, dst: int, tokens: int, purpose: TransferPurpose, t: PrefillTask,
                  now: float) -> list:
        self._xfer_ids += 1
        tr = Transfer(src, dst, tokens, purpose, t, self._xfer_ids)
        self.transfers[tr.id] = (tr, now)
        out: list = [tr]
        self.deadlines.arm(now + self.kv_timeout_s, _XFER, tr.id, out)
        return out

    def on_transfer_done(self, tr: Transfer, now: float, elapsed_s: float) -> list:
        """A KV transfer finished after `elapsed_s` (one abandoned meanwhile is ignored)."""
        if self.transfers.pop(tr.id, None) is None:
            return []
        st = self.live.get(tr.task.session_id)
        if st is not None and st.task is tr.task:
            st.record.rounds[-1].kv_transfer_s += elapsed_s
            if tr.purpose is INCREMENTAL:
                st.kv_home = True                         # decoding at home: losing the prefill worker is moot
        if tr.purpose is HISTORY:
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
        out: list = []
        if st.k < len(st.session.rounds) or st.open:      # between rounds: KV resident, idle until the next
            st.idle_since = now
            self.deadlines.arm(now + self.session_ttl_s, _IDLE, (ev.session_id, now), out)
        if st.k < len(st.session.rounds):
            out.append(ToolCall(ev.session_id, rnd.tool_s))
            return out
        if st.open:
            return out                                    # live: stays bound, KV resident, until its expiry
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
        out: list = []
        t = st.task
        if t is not None and not t.local and t.worker >= 0:   # its remote prefill is no longer wanted
            self._abandon(lambda tr: tr.task is t)
            out.append(Cancel(t.worker, t))
        out.append(Release(st.worker, sid))
        return out
