"""The coordinator's live shell: HTTP-facing requests in, the sans-I/O Coordinator core's actions out as
worker messages, worker messages back in as core events (the simulator's EventLoop does the same on a
virtual clock). Transport-agnostic: `send(worker_id, msg)` is injected; `tandem.runtime.cluster` wires it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Callable

from tandem.core.admission import SessionBusyError, check_one_round, continues
from tandem.core import actions as act
from tandem.core.commands import DELIVERED, EXPECT, KV_ARRIVED, RELEASE, RUN_LOCAL, SEND_KV, SUBMIT, commands
from tandem.core.coordinator import Coordinator
from tandem.core.prefix_hash import extend_hashes
from tandem.core.types import FetchHistory, FirstToken, PrefillDone, PrefillTask, RoundDone, SessionFailed
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime import messages as m
from tandem.runtime.client import BackendStats, RequestError
from tandem.runtime.cluster_config import AUDIT_S
from tandem.runtime.request_audit import RequestAudit
from tandem.runtime.round_checks import check_prompt, round_budget
from tandem.runtime.shell_request import ShellRequest
from tandem.runtime.step_counts import add_step_counts
from tandem.runtime.state_store import SessionInfo, StateStoreError
from tandem.workload.session import SLO

log = logging.getLogger("tandem.coordinator")

MAX_UNREAD = 4096          # outputs a request may have queued unread before it is cancelled (a stalled client)
MAX_KV_SAMPLES = 10_000    # kv_transfer_seconds kept between two /metrics scrapes (the oldest go first)


def params_dict(p: SamplingParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


class CoordinatorShell:
    """Runs the Coordinator core for live requests; one instance per server."""

    def __init__(self, coord: Coordinator, store, send: Callable[[int, object], None], kv_addr: dict[int, str],
                 max_model_len: int, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic, slo: SLO | None = None,
                 vocab_size: int | None = None, max_unread: int = MAX_UNREAD, dllm_block: int | None = None,
                 dllm_canvas: bool = False, audit_s: float = AUDIT_S,
                 rank_addr: dict[int, list[str]] | None = None) -> None:
        self.coord, self.store, self.send, self.kv_addr = coord, store, send, kv_addr
        self.rank_addr = dict(rank_addr or {})               # worker -> its ranks' KV endpoints (rank to rank)
        self.dllm_block = dllm_block                         # a block-diffusion model's block length (None: AR)
        self.dllm_canvas = dllm_canvas                       # a LLaDA canvas: whole blocks of masks after the prompt
        self.vocab_size = vocab_size                         # token ids are checked here, as the engine would
        self.max_unread = max_unread                         # a stream this far behind is cancelled (_push)
        self.max_model_len, self.block_size, self.clock = max_model_len, block_size, clock
        self.slo = slo                                       # every round's TTFT/ITL target (routing reads it)
        self.reqs: dict[str, ShellRequest] = {}
        self.by_task: dict[PrefillTask, ShellRequest] = {}
        self.session_req: dict[str, ShellRequest] = {}
        self.conv: dict[str, list[int]] = {}                 # session -> conversation tokens resident on its worker
        self._begun: dict[str, tuple[asyncio.Future, int]] = {}    # request -> (RoundBegun answer, its worker)
        self._ids = itertools.count()
        self.stats = BackendStats()
        self.audits = RequestAudit(audit_s, clock())       # which requests each worker must hold, asked now and then

    # ------------------------------------------------------------------ requests in
    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       session_id: str | None = None, prompt_text: str | None = None, tool_s: float | None = None):
        """Stream cumulative RequestOutputs for one round (EngineClient.generate); `tool_s`: the client's expected
        tool time after this round (a tiered worker plans the session's KV with it)."""
        check_prompt(prompt, params, self.max_model_len, self.vocab_size, self.dllm_block, self.dllm_canvas)
        if request_id in self.reqs:
            raise RequestError(f"request id {request_id!r} is already running", 409)
        max_out = round_budget(prompt, params, self.max_model_len, self.dllm_block, self.dllm_canvas)
        keep = session_id is not None
        sid = session_id if keep else f"req-{request_id}"
        running = self.session_req.get(sid)
        try:
            check_one_round(sid, running and running.request_id)
        except SessionBusyError as e:
            raise RequestError(str(e), 409) from None
        now = self.clock()
        req = ShellRequest(request_id, sid, list(prompt), params, keep, asyncio.Event(),
                   RequestOutput(request_id, prompt_text, list(prompt), [CompletionOutput(0, "", [], None, None)],
                                 False, RequestMetrics(now), session_id=session_id))
        self.reqs[request_id] = req
        self.session_req[sid] = req
        try:
            req.tool_s = tool_s
            await self._start(req, max_out, now)
            while True:                                         # outputs queued meanwhile are coalesced: the latest
                if not req.unread:
                    await req.ready.wait()
                req.ready.clear()
                req.unread = 0
                out = req.snapshot()
                yield out
                if out.finished:
                    return
        finally:
            if not req.done:                                    # the client went away: abort, free the KV
                self._abort(req, "client disconnected")

    async def _start(self, req: ShellRequest, max_out: int, now: float) -> None:
        sid, coord = req.session_id, self.coord
        worker = coord.session_worker(sid)
        hist_tokens = self.conv.get(sid)
        full = req.params.prompt_logprobs is not None          # every prompt position computed: no KV reused
        if worker is not None and (full or not continues(hist_tokens, req.prompt)):
            del self.session_req[sid]                          # the conversation was rewritten: start afresh
            self._apply(coord.end_session(sid, now))
            self.session_req[sid] = req
            worker = None
        hashes: list[int] = []
        extend_hashes(hashes, req.prompt, self.block_size)
        if worker is not None:                                 # pin the resident KV and learn how much there is
            coord.touch(sid, now)
            worker, moved = coord.move_before_round(sid, len(req.prompt) + max_out, hashes)
            self._apply(moved)                                 # bound again: the old worker releases it
            resident, loading = await self._begin_round(req, worker, req.prompt if moved else [])
            new = len(req.prompt) - len(hist_tokens)
        else:
            # a new session: the core's binder picks the worker (longest cached prefix of the prompt, else least
            # KV), which takes the prompt's cached prefix as the session's history, wherever its prefill runs
            worker = coord.pick_worker(hashes)
            if worker is None:
                raise RequestError("no live decode worker: the server cannot serve", 503, code="engine_unavailable")
            try:
                resident, loading = await self._begin_round(req, worker, [] if full else req.prompt)
            except BaseException:                              # never bound: free what the worker pinned
                self.send(worker, m.Release(sid))
                raise
            new = len(req.prompt)
        self._put_session(sid, SessionInfo(decode_worker=worker, resident_tokens=resident, updated_s=time.time(),
                                           loading=loading))
        try:
            actions = coord.on_round(sid, new, max_out, self.clock(), slo=self.slo, worker=worker,
                                     block_hashes=hashes, full_prefill=full, tool_s=req.tool_s)
        except ValueError as e:                                # no live decode worker left (the core says why)
            raise RequestError(str(e), 503, code="engine_unavailable") from None
        self._apply(actions)

    async def _begin_round(self, req: ShellRequest, worker: int, prompt: list[int]) -> tuple[int, bool]:
        """Ask `worker` to pin the session's resident KV (with `prompt`: first take its cached prefix); returns
        how many tokens are resident and whether they are still on their way back from its host tier."""
        fut = asyncio.get_running_loop().create_future()
        self._begun[req.request_id] = (fut, worker)
        self.send(worker, m.BeginRound(req.request_id, req.session_id, list(prompt)))
        try:                                                   # failed by on_worker_lost / WorkerFailure
            return await asyncio.wait_for(fut, timeout=10.0)
        except asyncio.TimeoutError:
            raise RequestError(f"decode worker {worker} did not answer for session {req.session_id!r} in 10 s",
                               503) from None
        finally:
            self._begun.pop(req.request_id, None)

    def _put_session(self, sid: str, info: SessionInfo) -> None:
        try:                                   # the coordinator's belief: an outage must not fail the request
            self.store.put_session(sid, info)
        except StateStoreError as e:
            log.warning("%s", e)

    # ------------------------------------------------------------------ core actions out
    def _apply(self, actions: list) -> None:
        """Send each command of the core's actions to its worker as its message (a ToolCall waits for the
        client's next request; check_timeouts ticks the core, whatever a Timer says)."""
        for kind, worker, a in commands(actions):
            if kind == SUBMIT:
                self._submit(a)
            elif kind == RELEASE:
                self._release(a)
            elif kind == SEND_KV:
                req = self.by_task.get(a.task)
                if req is not None:
                    req.transfers[a.purpose.value] = a
                    self.send(worker, m.SendKV(req.request_id, req.session_id, a.purpose.value, a.tokens, a.dst,
                                               self.kv_addr[a.dst], list(self.rank_addr.get(a.dst, ()))))
            elif kind == EXPECT:
                self.send(worker, m.ExpectReturn(a.session_id, a.tool_s))
            elif kind in m.NOTICE:
                self._notice(kind, worker, a)

    def _notice(self, kind: int, worker: int, a) -> None:
        """A command about one request's task: KV arrived or delivered, a history fetched, a prefill cancelled (not
        wanted any more) or run locally (its KV transfer failed or timed out)."""
        req = self.by_task.get(a.task)
        if req is None:
            return
        if kind == RUN_LOCAL:
            req.transfers.clear()
            req.prefill_worker = -1
        self.send(worker, m.NOTICE[kind](req.request_id))
        if kind == KV_ARRIVED:
            req.kv_arrived = True
        elif kind == DELIVERED:
            self.by_task.pop(a.task, None)
        elif kind == RUN_LOCAL:
            self.stats.kv_transfer_timeouts += 1

    def _submit(self, a: act.Submit) -> None:
        t = a.task
        req = self.session_req.get(t.session_id)
        if req is None:
            return
        req.task, req.worker = t, t.decode_worker
        self.by_task[t] = req
        params = params_dict(req.params)
        local = a.worker == t.decode_worker
        slo = (t.ttft_slo_s, t.itl_slo_s)
        if not req.sent_to_decode:
            self.send(t.decode_worker, m.AddRequest(req.request_id, req.session_id, req.prompt, params,
                                                    remote=not local, keep_session=req.keep_session,
                                                    ttft_slo_s=slo[0], itl_slo_s=slo[1]))
            req.sent_to_decode = True
        elif local:
            self.send(t.decode_worker, m.RunLocal(req.request_id))  # re-routed home after its prefill worker died
        if local:
            self.stats.local_prefills += 1
            req.prefill_worker = -1
        else:
            self.stats.remote_prefills += 1
            req.prefill_worker = a.worker
            self.send(a.worker, m.AddPrefill(req.request_id, req.session_id, req.prompt, params, t.l_hist, t.round_idx,
                                             t.ttft_slo_s, t.hist_compute))
        self.stats.prefix_cache_queries += len(req.prompt)
        self.stats.prefix_cache_hits += t.l_hist - t.hist_compute

    def _release(self, a: act.Release) -> None:
        sid = a.session_id
        self.send(a.worker, m.Release(sid))
        self.conv.pop(sid, None)
        try:
            self.store.delete_session(sid)
        except StateStoreError as e:
            log.warning("%s", e)
        req = self.session_req.get(sid)
        if req is not None and not req.done:
            rec = next((r for r in reversed(self.coord.records) if r.session_id == sid), None)
            why = rec.fail_reason if rec is not None and rec.failed else "the session ended"
            self._fail(req, why)

    # ------------------------------------------------------------------ worker messages in
    def on_message(self, worker: int, msg) -> None:
        """One message from a worker."""
        now = self.clock()
        if isinstance(msg, m.Outputs):
            for d in msg.deltas:
                self._delta(worker, d)
        elif isinstance(msg, m.Events):
            for ev in msg.events:
                self._event(worker, ev, now)
        elif isinstance(msg, m.StepCounts):
            add_step_counts(self.stats, worker, msg)
        elif isinstance(msg, m.KVReceived):
            req = self.reqs.get(msg.request_id)
            if req is None or msg.purpose not in req.transfers:
                return
            tr = req.transfers.pop(msg.purpose)
            if msg.failed:                                     # the core falls back (local recompute), as on a timeout
                log.warning("worker %d: the %s KV of %s failed: %s", worker, msg.purpose, msg.request_id, msg.failed)
                self._apply(self.coord.on_transfer_failed(tr, now, msg.failed))
                return
            samples = self.stats.kv_transfer_seconds
            samples.append(msg.elapsed_s)
            if len(samples) > MAX_KV_SAMPLES:                  # nobody scrapes /metrics: keep the newest only
                del samples[:len(samples) - MAX_KV_SAMPLES]
            self._apply(self.coord.on_transfer_done(tr, now, msg.elapsed_s))
        elif isinstance(msg, m.RoundBegun):
            fut, _ = self._begun.pop(msg.request_id, (None, -1))
            if fut is not None and not fut.done():
                fut.set_result((msg.resident_tokens, msg.loading))
        elif isinstance(msg, m.WorkerFailure):
            req = self.reqs.get(msg.request_id)
            if req is None or req.done:
                return
            if req.task is not None and worker not in (req.worker, req.prefill_worker):
                return            # from a prefill worker the request no longer uses (its transfer timed out)
            self._abort(req, msg.reason)
            fut, _ = self._begun.pop(msg.request_id, (None, -1))
            if fut is not None and not fut.done():             # BeginRound failed: generate() raises it
                fut.set_exception(RequestError(msg.reason, 500))
        elif isinstance(msg, m.Holding):
            self._holding(worker, msg)
        elif isinstance(msg, m.Stats):
            self.store.publish(msg.state)

    def _event(self, worker: int, ev, now: float) -> None:
        """A worker core's event, back as the core event the coordinator consumes."""
        coord = self.coord
        if isinstance(ev, m.EvKVBlocks):
            core_ev = m.kv_event(worker, ev)
            if core_ev is None:
                log.warning("worker %d sent a KV event in an unknown medium %r: ignored", worker, ev.medium)
                return
        elif isinstance(ev, (m.EvFetchHistory, m.EvPrefillDone)):
            req = self.reqs.get(ev.request_id)
            if req is None or req.task is None:
                return
            core_ev = (FetchHistory(req.task, ev.tokens) if isinstance(ev, m.EvFetchHistory)
                       else PrefillDone(req.task, worker, now))
            if isinstance(ev, m.EvPrefillDone):
                req.mark_scheduled(now, ev.scheduled_ago_s)
        elif coord.session_worker(ev.session_id) is None:
            return
        elif isinstance(ev, m.EvFirstToken):
            core_ev = FirstToken(ev.session_id, worker, now, now)
        elif isinstance(ev, m.EvRoundDone):
            core_ev = RoundDone(ev.session_id, worker, now, ev.output_tokens, ev.itl_sum, ev.itl_count, ev.itl_max,
                                ev.preemptions)
        elif isinstance(ev, m.EvSessionFailed):
            core_ev = SessionFailed(ev.session_id, worker, now, ev.reason)
        else:
            return
        self._apply(coord.on_event(core_ev, now))

    def _delta(self, worker: int, d: m.Delta) -> None:
        req = self.reqs.get(d.request_id)
        if req is None or req.done:
            return
        now = self.clock()
        req.merge(d, now)
        if d.finished:
            self._finish(req, now)
            if req.keep_session and d.error is None:
                self.conv[req.session_id] = req.prompt + req.out.outputs[0].token_ids
            elif not req.keep_session:
                self._apply(self.coord.end_session(req.session_id, now))
        self._push(req)

    def _push(self, req: ShellRequest) -> None:
        """Tell the consumer `req.out` changed. Nothing is copied or queued here: the consumer snapshots the
        cumulative output when it reads (deltas it did not read are coalesced), so an unread stream holds O(1)
        extra memory. A consumer `max_unread` outputs behind is taken as stalled and its request cancelled."""
        req.unread += 1
        req.ready.set()
        if req.unread > self.max_unread and not req.done:
            log.warning("request %s: its client read none of its last %d outputs; cancelling it",
                        req.request_id, req.unread - 1)
            self._abort(req, f"cancelled: the client read none of the last {req.unread - 1} outputs of its stream "
                             f"(limit {self.max_unread})")

    def _finish(self, req: ShellRequest, now: float) -> None:
        req.done = True
        req.out.finished = True
        req.out.metrics.finished_time = now
        self.reqs.pop(req.request_id, None)
        if self.session_req.get(req.session_id) is req:
            del self.session_req[req.session_id]
        if req.task is not None and self.by_task.get(req.task) is req:    # a local prefill gets no Delivered
            del self.by_task[req.task]

    def _fail(self, req: ShellRequest, reason: str) -> None:
        """End a request with an error the client sees (finish_reason abort)."""
        if req.done:
            return
        req.out.error = reason
        req.out.outputs[0].finish_reason = "abort"
        self._finish(req, self.clock())
        self._push(req)

    def _abort(self, req: ShellRequest, reason: str) -> None:
        """Stop a request everywhere, free its KV and end its session (the client gone or a worker failure)."""
        self._fail(req, reason)
        if req.worker >= 0:
            self.send(req.worker, m.Abort(req.request_id))
        if req.prefill_worker >= 0:
            self.send(req.prefill_worker, m.Abort(req.request_id))
        if req.task is not None:
            self.by_task.pop(req.task, None)
        self._apply(self.coord.end_session(req.session_id, self.clock(), reason))

    # ------------------------------------------------------------------ time and faults
    def on_worker_joined(self, worker: int, kv_address: str, rank_addrs: list[str] | None = None) -> None:
        """A replacement for a lost worker is up: its new KV inbox and rank endpoints, and the core may route to it
        again."""
        self.kv_addr[worker] = kv_address
        self.rank_addr[worker] = list(rank_addrs or ())
        self.audits.forget(worker)
        self._apply(self.coord.on_worker_joined(worker, self.clock()))

    def on_send_failed(self, worker: int, msg, reason: str, lost: bool = False) -> None:
        """A message to `worker` could not be sent (encoding, a dead link, ...): the request it belongs to fails
        now, with the reason, instead of waiting for an answer that cannot come. `lost`: the worker is gone (no
        connection to it), which the client hears as on_worker_lost says it (503 "worker lost"), not as a 500."""
        rid = getattr(msg, "request_id", None)
        what = "worker lost" if lost else "internal error"
        why = f"{what}: could not send {type(msg).__name__} to worker {worker}: {reason}"
        fut, _ = self._begun.pop(rid, (None, -1)) if rid is not None else (None, -1)
        if fut is not None and not fut.done():                 # BeginRound: generate() raises it
            fut.set_exception(RequestError(why, 503 if lost else 500))
        req = self.reqs.get(rid) if rid is not None else None
        if req is None and isinstance(msg, m.Release):
            return                                             # the session is over anyway; its KV ages out
        if req is not None and not req.done and not isinstance(msg, m.Abort):
            self._abort(req, why)

    def check_timeouts(self) -> None:
        """Tick the core: it abandons KV transfers older than its kv_timeout_s (the round is recomputed on its
        decode worker) and ends sessions idle longer than its session_ttl_s. Called every 0.1 s."""
        now = self.clock()
        self._apply(self.coord.on_tick(now))
        if self.audits.due(now):
            self.audit()
        coord = self.coord
        if len(coord.records) > 2 * len(coord.live) + 1000:  # live serving keeps records of live sessions only
            coord.records = [r for r in coord.records if r.session_id in coord.live]

    def audit(self) -> None:
        """Ask each worker which of its requests it holds (RequestAudit); the answers come back as Holding."""
        for w, question in self.audits.questions(self.reqs.values(), self.clock()):
            self.send(w, question)

    def _holding(self, worker: int, msg: m.Holding) -> None:
        """A worker's answer to audit(): fail the requests it should hold and does not."""
        for req in self.audits.lost(worker, msg, self.reqs):
            self.stats.lost_requests += 1
            log.error("request %s: worker %d no longer holds it; failing it", req.request_id, worker)
            self._abort(req, f"lost: worker {worker} no longer holds request {req.request_id!r} (a message between "
                             f"the coordinator and the worker was lost)")

    def on_worker_lost(self, worker: int) -> None:
        """A worker died: fail its sessions' requests, re-route prefills it was running."""
        self.audits.forget(worker)
        for req in list(self.reqs.values()):
            if req.prefill_worker == worker and not req.kv_arrived:    # its prefill is lost: re-routed below
                req.transfers.clear()
                req.prefill_worker = -1
        for fut, w in list(self._begun.values()):             # rounds waiting for its RoundBegun answer
            if w == worker and not fut.done():
                fut.set_exception(RequestError(f"worker lost: decode worker {worker} stopped", 503))
        self._apply(self.coord.on_worker_lost(worker, self.clock()))
        for req in list(self.reqs.values()):
            if req.worker == worker and not req.done:
                self._fail(req, f"worker lost: decode worker {worker} stopped")

