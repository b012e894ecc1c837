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
from dataclasses import dataclass, field
from typing import Callable

from tandem.core import actions as act
from tandem.core.commands import DELIVERED, KV_ARRIVED, RELEASE, RUN_LOCAL, SEND_KV, SUBMIT, commands
from tandem.core.coordinator import Coordinator
from tandem.core.prefix_hash import extend_hashes
from tandem.core.types import FetchHistory, FirstToken, PrefillDone, PrefillTask, RoundDone, SessionFailed
from tandem.policy.dllm_serve import canvas_max_tokens
from tandem.policy.dllm_serve.admission import COUNTERS as DLLM_COUNTERS
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError, check_diffusion
from tandem.runtime import messages as m
from tandem.runtime.client import BackendStats, RequestError
from tandem.runtime.state_store import SessionInfo, StateStoreError
from tandem.workload.session import SLO

log = logging.getLogger("tandem.coordinator")

MAX_UNREAD = 4096          # outputs a request may have queued unread before it is cancelled (a stalled client)
MAX_KV_SAMPLES = 10_000    # kv_transfer_seconds kept between two /metrics scrapes (the oldest go first)
MAX_STEP_TOKENS = 1 << 20  # a StepCounts key beyond this (tokens in one engine step) is not a real step: dropped
AUDIT_S = 5.0             # how often each worker is asked which requests it holds (a lost message fails its round)
AUDIT_RETRY = 4            # an Audit unanswered for this many intervals is asked again (it may be what was lost)


@dataclass
class _Req:
    """One HTTP request = one round of a session."""

    request_id: str
    session_id: str
    prompt: list[int]
    params: SamplingParams
    keep_session: bool
    ready: asyncio.Event                # set when `out` changed since the consumer last read it
    out: RequestOutput                  # cumulative, updated in place; the consumer reads snapshots of it
    worker: int = -1                    # the session's decode/co-located worker
    task: PrefillTask | None = None
    prefill_worker: int = -1            # remote prefill worker, -1 when local
    sent_to_decode: bool = False
    kv_arrived: bool = False            # its remote prefill's KV reached the decode worker (KVArrived sent)
    transfers: dict = field(default_factory=dict)    # purpose -> Transfer in flight (the core times it)
    done: bool = False
    unread: int = 0                     # outputs (deltas) coalesced into `out` since the consumer last read


def _snapshot(o: RequestOutput) -> RequestOutput:
    """A copy of a cumulative output the shell may go on updating (what one generate() step yields)."""
    c = o.outputs[0]
    return dataclasses.replace(o, outputs=[dataclasses.replace(c, token_ids=list(c.token_ids),
                                                               logprobs=list(c.logprobs) if c.logprobs else c.logprobs)],
                               metrics=dataclasses.replace(o.metrics))


def params_dict(p: SamplingParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


class CoordinatorShell:
    """Runs the Coordinator core for live requests; one instance per server."""

    def __init__(self, coord: Coordinator, store, send: Callable[[int, object], None], kv_addr: dict[int, str],
                 max_model_len: int, block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic, slo: SLO | None = None,
                 vocab_size: int | None = None, max_unread: int = MAX_UNREAD, dllm_block: int | None = None,
                 dllm_canvas: bool = False, audit_s: float = AUDIT_S) -> None:
        self.coord, self.store, self.send, self.kv_addr = coord, store, send, kv_addr
        self.dllm_block = dllm_block                         # a block-diffusion model's block length (None: AR)
        self.dllm_canvas = dllm_canvas                       # a LLaDA canvas: whole blocks of masks after the prompt
        self.vocab_size = vocab_size                         # token ids are checked here, as the engine would
        self.max_unread = max_unread                         # a stream this far behind is cancelled (_push)
        self.max_model_len, self.block_size, self.clock = max_model_len, block_size, clock
        self.slo = slo                                       # every round's TTFT/ITL target (routing reads it)
        self.reqs: dict[str, _Req] = {}
        self.by_task: dict[PrefillTask, _Req] = {}
        self.session_req: dict[str, _Req] = {}
        self.conv: dict[str, list[int]] = {}                 # session -> conversation tokens resident on its worker
        self._begun: dict[str, tuple[asyncio.Future, int]] = {}    # request -> (RoundBegun answer, its worker)
        self._ids = itertools.count()
        self.stats = BackendStats()
        if not audit_s > 0:
            raise ValueError(f"the audit interval must be > 0 s, got {audit_s}")
        self.audit_s = audit_s
        self._next_audit = clock() + audit_s
        # worker -> (Audit nonce, the requests it must hold, when asked)
        self._audits: dict[int, tuple[int, list[_Req], float]] = {}

    # ------------------------------------------------------------------ requests in
    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       session_id: str | None = None, prompt_text: str | None = None):
        """Stream cumulative RequestOutputs for one round (EngineClient.generate)."""
        if not prompt:
            raise RequestError("the prompt is empty", 400, param="prompt")
        if self.vocab_size is not None:                        # rejected now (400), not by a worker later (500)
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", 400,
                                   param="prompt")
        try:                                                   # diffusion options against the model: 400 here
            check_diffusion(params, self.dllm_block)
        except SamplingParamsError as e:
            raise RequestError(str(e), 400) from None
        if params.dllm_chunk is not None and self.dllm_canvas:
            raise RequestError(f"dllm_chunk {params.dllm_chunk} sizes Optimus's streaming windows, which need a "
                               f"block-causal model (SDAR); this LLaDA-style model decodes in dLLM-Serve phases",
                               400, param="dllm_chunk")
        if len(prompt) >= self.max_model_len:
            raise RequestError(f"prompt of {len(prompt)} tokens leaves no room to generate: the model's context "
                               f"(max_model_len) is {self.max_model_len} tokens", 400, param="messages")
        if request_id in self.reqs:
            raise RequestError(f"request id {request_id!r} is already running", 409)
        max_out = self.max_model_len - len(prompt)
        if params.max_tokens is not None:
            max_out = min(max_out, params.max_tokens)
        if self.dllm_canvas and self.dllm_block:                # as the engine clamps it: 400 here, not a worker 500
            try:
                max_out = canvas_max_tokens(len(prompt), params.max_tokens, self.dllm_block, self.max_model_len)
            except ValueError as e:
                raise RequestError(str(e), 400, param="messages") from None
        keep = session_id is not None
        sid = session_id if keep else f"req-{request_id}"
        if sid in self.session_req:
            raise RequestError(f"session {sid!r} already has a request running "
                               f"({self.session_req[sid].request_id!r}); send rounds one at a time", 409)
        now = self.clock()
        req = _Req(request_id, sid, list(prompt), params, keep, asyncio.Event(),
                   RequestOutput(request_id, prompt_text, list(prompt), [CompletionOutput(0, "", [], None, None)],
                                 False, RequestMetrics(now), session_id=session_id))
        self.reqs[request_id] = req
        self.session_req[sid] = req
        try:
            await self._start(req, max_out, now)
            while True:                                         # outputs queued meanwhile are coalesced: the latest
                if not req.unread:
                    await req.ready.wait()
                req.ready.clear()
                req.unread = 0
                out = _snapshot(req.out)
                yield out
                if out.finished:
                    return
        finally:
            if not req.done:                                    # the client went away: abort, free the KV
                self._abort(req, "client disconnected")

    async def _start(self, req: _Req, max_out: int, now: float) -> None:
        sid, coord = req.session_id, self.coord
        worker = coord.session_worker(sid)
        hist_tokens = self.conv.get(sid)
        full = req.params.prompt_logprobs is not None          # every prompt position computed: no KV reused
        if worker is not None and (full or hist_tokens is None or req.prompt[:len(hist_tokens)] != hist_tokens
                                   or len(req.prompt) <= len(hist_tokens)):
            del self.session_req[sid]                          # the conversation was rewritten: start afresh
            self._apply(coord.end_session(sid, now))
            self.session_req[sid] = req
            worker = None
        hashes: list[int] = []
        extend_hashes(hashes, req.prompt, self.block_size)
        if worker is not None:                                 # pin the resident KV and learn how much there is
            coord.touch(sid, now)
            resident = await self._begin_round(req, worker, [])
            new = len(req.prompt) - len(hist_tokens)
        else:
            # a new session: the core's binder picks the worker (longest cached prefix of the prompt, else least
            # KV), which takes the prompt's cached prefix as the session's history, wherever its prefill runs
            worker = coord.pick_worker(hashes)
            if worker is None:
                raise RequestError("no live decode worker: the server cannot serve", 503, code="engine_unavailable")
            try:
                resident = await self._begin_round(req, worker, [] if full else req.prompt)
            except BaseException:                              # never bound: free what the worker pinned
                self.send(worker, m.Release(sid))
                raise
            new = len(req.prompt)
        self._put_session(sid, SessionInfo(decode_worker=worker, resident_tokens=resident, updated_s=time.time()))
        try:
            actions = coord.on_round(sid, new, max_out, self.clock(), slo=self.slo, worker=worker,
                                     block_hashes=hashes, full_prefill=full)
        except ValueError as e:                                # no live decode worker left (the core says why)
            raise RequestError(str(e), 503, code="engine_unavailable") from None
        self._apply(actions)

    async def _begin_round(self, req: _Req, worker: int, prompt: list[int]) -> int:
        """Ask `worker` to pin the session's resident KV (with `prompt`: first take its cached prefix); returns
        how many tokens are resident."""
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
                                               self.kv_addr[a.dst]))
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
                                                    remote=not local, keep_session=True,
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
            for mine, theirs in ((self.stats.iteration_tokens, msg.iteration_tokens),
                                 (self.stats.dllm_commits, msg.dllm_commits), (self.stats.dllm_chunks, msg.dllm_chunks)):
                for k, n in theirs.items():
                    if isinstance(k, int) and isinstance(n, int) and 0 <= k <= MAX_STEP_TOKENS and n > 0:
                        mine[k] = mine.get(k, 0) + n
            for k, n in msg.dllm_serve.items():
                if k in DLLM_COUNTERS and isinstance(n, int) and 0 < n <= MAX_STEP_TOKENS:
                    self.stats.dllm_serve[k] = self.stats.dllm_serve.get(k, 0) + n
            self.stats.rejected_frames += min(max(msg.rejected_frames, 0), MAX_STEP_TOKENS)
            self.stats.rejected_handshakes += min(max(msg.rejected_handshakes, 0), MAX_STEP_TOKENS)
        elif isinstance(msg, m.KVReceived):
            req = self.reqs.get(msg.request_id)
            if req is None or msg.purpose not in req.transfers:
                return
            tr = req.transfers.pop(msg.purpose)
            samples = self.stats.kv_transfer_seconds
            samples.append(msg.elapsed_s)
            if len(samples) > MAX_KV_SAMPLES:                  # nobody scrapes /metrics: keep the newest only
                del samples[:len(samples) - MAX_KV_SAMPLES]
            self.stats.kv_transfer_bytes += msg.nbytes
            self._apply(self.coord.on_transfer_done(tr, now, msg.elapsed_s))
        elif isinstance(msg, m.RoundBegun):
            fut, _ = self._begun.pop(msg.request_id, (None, -1))
            if fut is not None and not fut.done():
                fut.set_result(msg.resident_tokens)
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
        if isinstance(ev, (m.EvFetchHistory, m.EvPrefillDone)):
            req = self.reqs.get(ev.request_id)
            if req is None or req.task is None:
                return
            core_ev = (FetchHistory(req.task, ev.tokens) if isinstance(ev, m.EvFetchHistory)
                       else PrefillDone(req.task, worker, now))
            if isinstance(ev, m.EvPrefillDone):
                _scheduled(req.out, now, ev.scheduled_ago_s)
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
        out = req.out
        comp = out.outputs[0]
        now = self.clock()
        _scheduled(out, now, d.scheduled_ago_s)
        if d.token_ids and out.metrics.first_token_time is None:
            out.metrics.first_token_time = now
        if d.token_ids:
            out.metrics.last_token_time = now
        comp.token_ids.extend(d.token_ids)                    # in place: consumers get copies (_snapshot)
        comp.text = d.text if d.reset else comp.text + d.text
        if d.logprobs is not None:
            if comp.logprobs is None:
                comp.logprobs = []
            comp.logprobs.extend(d.logprobs)
            comp.cumulative_logprob = d.cumulative_logprob
        if d.prompt_logprobs is not None:
            out.prompt_logprobs = d.prompt_logprobs
        cached = d.num_cached_tokens                          # the decode worker's history; what a remote prefill
        if req.task is not None and req.task.hist_compute:    # recomputed (vllm-pd) was not reused
            cached = max(0, cached - req.task.hist_compute)
        out.num_cached_tokens = out.metrics.num_cached_tokens = cached
        out.metrics.num_preemptions = d.num_preemptions       # vllm:num_preemptions_total counts finished requests'
        if d.dllm_chunk is not None:                          # block diffusion: the chunk the worker's core chose
            out.dllm_chunk = d.dllm_chunk
        if d.finished:
            comp.finish_reason, comp.stop_reason = d.finish_reason, d.stop_reason
            out.error = d.error
            self._finish(req, now)
            if req.keep_session and d.error is None:
                self.conv[req.session_id] = req.prompt + comp.token_ids
            elif not req.keep_session:
                self._apply(self.coord.end_session(req.session_id, now))
        self._push(req)

    def _push(self, req: _Req) -> None:
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

    def _finish(self, req: _Req, now: float) -> None:
        req.done = True
        req.out.finished = True
        req.out.metrics.finished_time = now
        self.reqs.pop(req.request_id, None)
        if self.session_req.get(req.session_id) is req:
            del self.session_req[req.session_id]
        if req.task is not None and self.by_task.get(req.task) is req:    # a local prefill gets no Delivered
            del self.by_task[req.task]

    def _fail(self, req: _Req, reason: str) -> None:
        """End a request with an error the client sees (finish_reason abort)."""
        if req.done:
            return
        req.out.error = reason
        req.out.outputs[0].finish_reason = "abort"
        self._finish(req, self.clock())
        self._push(req)

    def _abort(self, req: _Req, reason: str) -> None:
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
    def on_worker_joined(self, worker: int, kv_address: str) -> None:
        """A replacement for a lost worker is up: its new KV inbox, and the core may route to it again."""
        self.kv_addr[worker] = kv_address
        self._audits.pop(worker, None)
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
        if now >= self._next_audit:
            self._next_audit = now + self.audit_s
            self.audit()
        coord = self.coord
        if len(coord.records) > 2 * len(coord.live) + 1000:  # live serving keeps records of live sessions only
            coord.records = [r for r in coord.records if r.session_id in coord.live]

    def _holders(self, req: _Req) -> list[int]:
        """The workers that must hold `req` now, by the messages sent them: its decode worker from AddRequest to its
        last output, its prefill worker from AddPrefill until Delivered (sent with KVArrived) or RunLocal."""
        out = [req.worker] if req.sent_to_decode and req.worker >= 0 else []
        if req.prefill_worker >= 0 and not req.kv_arrived:
            out.append(req.prefill_worker)
        return out

    def audit(self) -> None:
        """Ask each worker that must hold running requests which ones it holds (Audit). Messages between two
        processes arrive in order, so its answer (Holding) follows everything sent before the question and every
        output it sent before the answer: a request it should hold and does not was lost on the way (a dropped
        message, a worker that forgot it), and fails with that reason instead of waiting forever. One question
        per worker at a time (a worker busy with a long step answers after it), asked again after AUDIT_RETRY
        intervals unanswered (the question itself may be the message lost)."""
        now = self.clock()
        expect: dict[int, list[_Req]] = {}
        for req in self.reqs.values():
            if not req.done:
                for w in self._holders(req):
                    expect.setdefault(w, []).append(req)
        for w, reqs in expect.items():
            asked = self._audits.get(w)
            if asked is None or now - asked[2] > AUDIT_RETRY * self.audit_s:
                nonce = next(self._ids)
                self._audits[w] = (nonce, reqs, now)
                self.send(w, m.Audit(nonce))

    def _holding(self, worker: int, msg: m.Holding) -> None:
        """A worker's answer to audit(): fail the requests it should hold and does not."""
        nonce, expected, _ = self._audits.get(worker, (None, [], 0.0))
        if nonce != msg.nonce:
            return                                             # not the question outstanding (a stale answer)
        del self._audits[worker]
        held = set(msg.request_ids)
        for req in expected:
            rid = req.request_id
            if rid in held or req.done or self.reqs.get(rid) is not req or worker not in self._holders(req):
                continue                                       # held, or finished, failed or moved since the question
            self.stats.lost_requests += 1
            log.error("request %s: worker %d no longer holds it; failing it", rid, worker)
            self._abort(req, f"lost: worker {worker} no longer holds request {rid!r} (a message between the "
                             f"coordinator and the worker was lost)")

    def on_worker_lost(self, worker: int) -> None:
        """A worker died: fail its sessions' requests, re-route prefills it was running."""
        self._audits.pop(worker, None)
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


def _scheduled(out: RequestOutput, now: float, ago_s: float | None) -> None:
    """Date the request's first scheduling by a worker's report (`ago_s` before `now`, never before its arrival
    here): the earliest report wins, so a remote prefill's counts, not the decode worker's later step."""
    if ago_s is not None and out.metrics.first_scheduled_time is None:
        out.metrics.first_scheduled_time = max(out.metrics.arrival_time, now - ago_s)
