"""A worker process's logic: carry out the coordinator's messages on an LLMEngine, step it, report back.

Transport-agnostic: `send_up(msg)` goes to the coordinator, `send_peer(addr, msg, *frames)` to another
worker's KV inbox; `tandem.runtime.worker_main` wires them to ZeroMQ.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Sequence

from tandem.core.host_tier import AllBlocksCleared, BlockRemoved, BlockStored, Medium
from tandem.core.types import DECODE, FetchHistory, FirstToken, PrefillDone, RoundDone, SessionFailed
from tandem.engine.config import EngineError
from tandem.engine.kv_transfer import KVAssembly, KVPayload, KVTransferError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestMetrics, RequestOutput
from tandem.engine.parallel.kv_ranks import CLAIM_WAIT_S
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError
from tandem.runtime import messages as m
from tandem.runtime.kv_send import KVSender

log = logging.getLogger("tandem.worker")
# the early messages whose engine call runs a collective of a tensor-parallel group (a session's KV gathered from or
# scattered to the ranks): under TP they wait for the running step's end, as the step's own collectives run meanwhile
RANK_COLLECTIVES = (m.SendKV, m.HistoryReady, m.KVArrived)


class WorkerShell:
    """One worker: its engine, the KV it holds for peers' requests, what it has streamed so far."""

    def __init__(self, engine: LLMEngine, worker_id: int, send_up: Callable, send_peer: Callable,
                 wall: Callable[[], float] = time.time, drop_kv_sends: int = 0,
                 kv_send_faults: Sequence[str | float | None] = (), step_sleep_s: float = 0.0,
                 drop_control: Sequence[str] = (), kv_part_tokens: int | None = None,
                 kv_claim_wait_s: float = CLAIM_WAIT_S) -> None:
        self.engine, self.id = engine, worker_id
        self._assembling: dict[tuple[str, str], tuple[KVAssembly, float]] = {}   # (request, purpose) -> parts so far
        self.step_sleep_s = step_sleep_s                      # fault injection: every model run that much longer
        # fault injection: the next control message of each type named here is lost on the wire, once per entry
        names = {t.__name__ for t in m.CONTROL}
        bad = sorted(set(drop_control) - names)
        if bad:
            raise ValueError(f"drop_control names control messages ({', '.join(sorted(names))}), got {bad}")
        self.drop_control: list[str] = list(drop_control)
        self.send_up, self.wall = send_up, wall
        # KV out to peers: rank to rank or driver to driver, in parts, with the fault injection of KV sends
        self.sender = KVSender(engine, worker_id, send_peer, wall, ["drop"] * drop_kv_sends + list(kv_send_faults),
                               kv_part_tokens)
        self._sent: dict[str, tuple[int, str]] = {}          # request -> (tokens, text) streamed so far
        self._first: dict[str, tuple[int, dict | None]] = {}  # remote request -> first token from its prefill
        # Held while the engine's state is read or changed: by the step thread except while the model runs
        # (execute_step), so that early control messages (messages.EARLY) are carried out during the model's run
        # rather than after it: a new round's BeginRound and AddRequest then cost no extra step.
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)          # the step thread waits on it for work or messages
        self._pending: collections.deque = collections.deque()   # (message, frames) waiting for the step's end
        self._in_step = False                                # the model runs a step (between prepare and finish)
        self._stopping = False
        self._tp = engine.config.tensor_parallel_size > 1     # the engine's ranks run one collective at a time
        self.received_driver_bytes = 0                       # KV payload bytes received driver to driver
        self._awaiting: dict[str, tuple[m.KVRanked, float]] = {}   # transfer -> (its manifest, give up at)
        self.kv_claim_wait_s = kv_claim_wait_s               # a rank-to-rank transfer's ranks have this long
        if engine.tier is not None:                          # a host-tier copy's end wakes an idle step thread
            engine.tier.on_end = self._copy_ended

    def _copy_ended(self) -> None:
        """A host-tier copy ended (on a copy thread): wake the step thread, which reports it to the core."""
        with self.lock:
            self._wake.notify()

    # ------------------------------------------------------------------ messages from the I/O thread
    def post(self, msg, frames: list | None = None) -> bool:
        """A coordinator message (`frames` None) or a peer's KV (m.KVData with its frames), from the I/O thread:
        carried out at once when the running step allows it (no step runs, or it is one of m.EARLY and nothing
        waits before it), else queued for the step thread, which carries it out at the step's end.
        True when carried out now (its replies are then queued for sending)."""
        if frames is None and type(msg).__name__ in self.drop_control:     # fault injection: lost on the wire
            self.drop_control.remove(type(msg).__name__)
            log.warning("worker %d: dropped %s of %s (fault injection)", self.id, type(msg).__name__,
                        getattr(msg, "request_id", "?"))
            return False
        with self.lock:
            early = isinstance(msg, m.EARLY) and not (self._tp and isinstance(msg, RANK_COLLECTIVES))
            if isinstance(msg, m.KVRanked) and not self.engine.runner.kv_ready(msg.transfer, msg.num_tokens):
                # its ranks' heads are still on their way: applied by poll_kv once they are in (or failed after
                # CLAIM_WAIT_S), never waited for here, where the heartbeats and other messages must keep moving
                self._awaiting[msg.transfer] = (msg, time.monotonic() + self.kv_claim_wait_s)
                return False
            # rank-to-rank sends wait on sockets: on the step thread, not on the I/O thread
            sends = isinstance(msg, m.SendKV) and bool(msg.dst_rank_addrs)
            now = not self._pending and (not self._in_step or early) and not sends
            if now:
                self._apply(msg, frames)
            else:
                self._pending.append((msg, frames))
            self._wake.notify()                               # a new request is work; a queued message too
            return now

    def poll_kv(self) -> bool:
        """Apply the rank-to-rank manifests whose ranks now all hold their heads, and fail those that waited
        CLAIM_WAIT_S; True if any was applied (its replies are then queued)."""
        if not self._awaiting:
            return False
        with self.lock:
            now, ready = time.monotonic(), self.engine.runner.kv_ready
            due = [t for t, (msg, give_up) in self._awaiting.items()
                   if give_up <= now or ready(msg.transfer, msg.num_tokens)]
            for t in due:
                self._apply(self._awaiting.pop(t)[0], [])
        return bool(due)

    def _apply(self, msg, frames: list | None) -> None:
        if frames is None:
            self._control(msg)
            return
        try:
            self._kv(msg, frames)
        except Exception:  # noqa: BLE001 - a peer's bad payload must not stop this worker
            log.exception("worker %d: dropped a KV message it could not apply (%s)", self.id,
                          getattr(msg, "request_id", "?"))

    def _drain(self) -> bool:
        """Carry out the queued messages in arrival order (lock held); True if there were any."""
        ran = bool(self._pending)
        while self._pending:
            self._apply(*self._pending.popleft())
        return ran

    # ------------------------------------------------------------------ control plane
    def _control(self, msg) -> None:
        eng = self.engine
        try:
            if isinstance(msg, m.BeginRound):
                resident = eng.begin_round(msg.session_id, msg.prompt_token_ids)
                self.send_up(m.RoundBegun(msg.request_id, msg.session_id, resident, eng.kv_loading(msg.session_id)))
            elif isinstance(msg, m.AddRequest):
                eng.add_request(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.params),
                                session_id=msg.session_id, remote=msg.remote,
                                slo=(msg.ttft_slo_s, msg.itl_slo_s), keep_session=msg.keep_session)
            elif isinstance(msg, m.AddPrefill):
                eng.add_prefill(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.params), msg.session_id,
                                msg.l_hist, msg.round_idx, ttft_slo_s=msg.ttft_slo_s, hist_compute=msg.hist_compute)
            elif isinstance(msg, m.SendKV):
                self.sender.send(msg)
            elif isinstance(msg, m.HistoryReady):
                eng.on_history_ready(msg.request_id)
            elif isinstance(msg, m.KVArrived):
                tok, lps = self._first.pop(msg.request_id)
                self._emit(eng.on_kv_arrived(msg.request_id, tok, lps))
            elif isinstance(msg, m.Delivered):
                eng.on_delivered(msg.request_id)
            elif isinstance(msg, m.RunLocal):
                self._first.pop(msg.request_id, None)
                self._forget_parts(msg.request_id)
                eng.make_local(msg.request_id)
            elif isinstance(msg, m.Release):
                eng.end_session(msg.session_id)
            elif isinstance(msg, m.ExpectReturn):
                eng.expect_return(msg.session_id, msg.tool_s)
            elif isinstance(msg, m.Abort):
                self._first.pop(msg.request_id, None)
                self._forget_parts(msg.request_id)
                eng.abort_request(msg.request_id)
                self._sent.pop(msg.request_id, None)
            elif isinstance(msg, m.Audit):
                self.send_up(m.Holding(msg.nonce, list(eng.requests)))
            else:
                raise TypeError(f"unexpected control message {type(msg).__name__}")
        except (EngineError, SamplingParamsError, KVTransferError, KeyError, TypeError, ValueError) as e:
            rid = getattr(msg, "request_id", "")
            log.warning("worker %d: %s failed: %s", self.id, type(msg).__name__, e)
            self.send_up(m.WorkerFailure(rid, f"{type(msg).__name__} failed on worker {self.id}: {e}"))
        self._flush_events()

    @property
    def driver_kv_bytes(self) -> int:
        """KV payload bytes this worker's driver sent or received driver to driver."""
        return self.sender.driver_bytes + self.received_driver_bytes

    # ------------------------------------------------------------------ KV plane
    def _kv(self, head: m.KVData | m.KVRanked, frames: list) -> None:
        req = self.engine.requests.get(head.request_id)
        if req is None or (self.engine.role == DECODE and req.task.local):
            # Late: the request was aborted or finished here, or its transfer timed out and the round is being
            # recomputed locally (RunLocal). Not a failure of the request: drop the bytes (staged ones expire).
            self._forget_parts(head.request_id)
            log.info("worker %d: dropped late %s KV for %s", self.id, head.purpose, head.request_id)
            return
        if isinstance(head, m.KVRanked):
            self._kv_ranked(head)
        else:
            self._kv_payload(head, frames)

    def _kv_ranked(self, head: m.KVRanked) -> None:
        """A transfer that came rank to rank: acknowledged once every rank holds its heads, else failed whole (the
        coordinator's core falls back to a local recompute, as for a transfer that timed out)."""
        try:
            staged = self.engine.receive_staged(head.request_id, head.transfer, head.num_tokens, wait_s=0.0)
        except (EngineError, KVTransferError) as e:
            log.warning("worker %d: dropped KV for %s: %s", self.id, head.request_id, e)
            self.send_up(m.KVReceived(head.request_id, head.purpose, head.src_worker, 0,
                                      max(0.0, self.wall() - head.sent_s),
                                      failed=f"worker {self.id}, {self.kv_claim_wait_s:g} s after its control "
                                             f"message: {e}"))
            return
        self._received(head, staged.nbytes, head.sent_s)

    def _received(self, head: m.KVData | m.KVRanked, nbytes: int, sent_s: float) -> None:
        if head.first_token >= 0:
            self._first[head.request_id] = (head.first_token, head.first_logprobs)
        self.send_up(m.KVReceived(head.request_id, head.purpose, head.src_worker, nbytes,
                                  max(0.0, self.wall() - sent_s)))

    def _kv_payload(self, head: m.KVData, frames: list) -> None:
        key = (head.request_id, head.purpose)
        if head.total_tokens and head.offset and key not in self._assembling:
            # the rest of a transfer whose start was refused (already reported) or never came (the transfer times out)
            log.warning("worker %d: dropped a %s KV part of %s at token %d without its start", self.id, head.purpose,
                        head.request_id, head.offset)
            return
        try:
            payload = KVPayload.from_buffer(frames[0] if frames else b"", head.num_tokens, head.dtype,
                                            tuple(head.shape))
            self.received_driver_bytes += payload.nbytes
            sent_s = head.sent_s
            if head.offset and not head.total_tokens:
                raise KVTransferError(f"a whole transfer at token {head.offset}")
            if head.total_tokens:
                payload, sent_s = self._add_part(key, head, payload)
                if payload is None:
                    return
            self.engine.receive_kv(head.request_id, payload)
        except (EngineError, KVTransferError) as e:
            self._assembling.pop(key, None)
            log.warning("worker %d: dropped KV for %s: %s", self.id, head.request_id, e)
            self.send_up(m.WorkerFailure(head.request_id, f"KV transfer to worker {self.id} failed: {e}"))
            return
        self._received(head, payload.nbytes, sent_s)

    def _add_part(self, key: tuple[str, str], head: m.KVData, part: KVPayload) -> tuple[KVPayload | None, float]:
        """One part of a transfer sent in parts: (the whole payload once its last part is in, else None; the
        transfer's send time). Its first part allocates the whole, sized by this worker's cache and max_model_len."""
        if head.offset == 0:
            self._forget_parts()
            eng = self.engine
            self._assembling[key] = (KVAssembly(head.total_tokens, eng.runner.wire_geometry,
                                                eng.max_model_len), head.sent_s)
        assembly, sent_s = self._assembling[key]
        if assembly.total != head.total_tokens:
            raise KVTransferError(f"a KV part of a {head.total_tokens}-token transfer in one of {assembly.total}")
        whole = assembly.add(head.offset, part)
        if whole is not None:
            del self._assembling[key]
        return whole, sent_s

    def _forget_parts(self, request_id: str | None = None) -> None:
        """Drop the partial transfers of `request_id` and of requests this engine no longer holds (aborted,
        finished, recomputed here): what a worker holds of unfinished transfers is bounded by its live requests."""
        for key in [k for k in self._assembling if k[0] == request_id or k[0] not in self.engine.requests]:
            del self._assembling[key]

    # ------------------------------------------------------------------ stepping
    def has_work(self) -> bool:
        """Requests to run, or a host tier wanting a step (copies ended or planned, idle sessions to decide)."""
        return self.engine.core.has_work() or self.engine.tier_due()

    def step(self) -> None:
        """Run one engine step and report its outputs and core events; the lock is free while the model runs."""
        with self.lock:
            prep = self.engine.prepare_step()
        self._finish(prep, self._execute(prep))

    def _execute(self, prep):
        if self.step_sleep_s > 0 and prep.runs:
            time.sleep(self.step_sleep_s)                      # a slow model run (fault injection)
        return self.engine.execute_step(prep)

    def _finish(self, prep, out) -> None:
        with self.lock:
            self._in_step = False
            self._emit(self.engine.finish_step(prep, out))

    def run(self, notify: Callable[[], None], idle_s: float = 0.05) -> None:
        """The step thread's body: steps back to back while there is work, the messages queued during a step
        carried out at its end, until stop(). `notify()` (thread-safe) follows every step and every batch of
        messages, so the I/O thread sends what they produced. Idle, or with work that cannot be scheduled (KV on
        its way), it waits for the next message, at most `idle_s` at a time. An exception ends the thread (the caller reports
        it and ends the worker)."""
        eng = self.engine
        while True:
            with self.lock:
                if self._drain():
                    notify()
                while not (self._stopping or self._pending or self.has_work()):
                    self._wake.wait(idle_s)                   # work that time alone makes ready is seen too
                if self._stopping:
                    return
                if self._drain():
                    notify()
                    if not self.has_work():
                        continue
                prep = eng.prepare_step()
                self._in_step = prep.runs
            out = self._execute(prep) if prep.runs else None
            self._finish(prep, out)
            notify()
            if prep.plan is None:
                with self.lock:
                    if not (self._stopping or self._pending):
                        self._wake.wait(self._idle_wait(idle_s))

    def _idle_wait(self, idle_s: float) -> float:
        """How long to wait for a message when nothing can run: idle_s, or less when the core asked to be woken
        sooner (LAPS's AWD batcher closes its window then)."""
        left = self.engine.core.wake_s - self.engine.clock()
        return left if 0.0 < left < idle_s else idle_s

    def stop(self) -> None:
        """Make run() return after the step it runs (thread-safe)."""
        with self.lock:
            self._stopping = True
            self._wake.notify_all()

    def _emit(self, outs: list[RequestOutput]) -> None:
        deltas = [d for d in (self._delta(o) for o in outs) if d is not None]
        if deltas:
            self.send_up(m.Outputs(deltas))
        self._flush_events()

    def _delta(self, out: RequestOutput) -> m.Delta | None:
        comp = out.outputs[0]
        n, text = self._sent.get(out.request_id, (0, ""))
        new_ids = comp.token_ids[n:]
        if not new_ids and not out.finished:
            return None
        reset = not comp.text.startswith(text)
        d = m.Delta(out.request_id, list(new_ids), comp.text if reset else comp.text[len(text):], reset,
                    out.finished, comp.finish_reason, comp.stop_reason, out.num_cached_tokens, out.error,
                    comp.logprobs[n:] if comp.logprobs is not None else None, comp.cumulative_logprob,
                    out.prompt_logprobs if n == 0 else None, out.metrics.num_preemptions,
                    dllm_chunk=out.dllm_chunk if n == 0 else None,
                    scheduled_ago_s=self._scheduled_ago(out.metrics) if n == 0 else None)
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = (len(comp.token_ids), comp.text)
        return d

    def _scheduled_ago(self, metrics: RequestMetrics) -> float | None:
        """Seconds since this worker first scheduled a request (None: not yet): clocks differ between processes and
        hosts, an age does not."""
        t = metrics.first_scheduled_time
        return None if t is None else max(0.0, self.engine.clock() - t)

    def _flush_events(self) -> None:
        eng = self.engine
        if not eng.core_events:
            return
        evs, eng.core_events = eng.core_events, []
        out = []
        for ev in evs:
            if isinstance(ev, (FetchHistory, PrefillDone)):
                req = eng.task_req.get(ev.task)
                if req is None:
                    continue                                   # aborted meanwhile
                if isinstance(ev, FetchHistory):
                    out.append(m.EvFetchHistory(ev.task.session_id, req.request_id, ev.tokens))
                else:
                    out.append(m.EvPrefillDone(ev.task.session_id, req.request_id,
                                               scheduled_ago_s=self._scheduled_ago(req.metrics)))
            elif isinstance(ev, FirstToken):
                out.append(m.EvFirstToken(ev.session_id, ev.prefill_start_s))
            elif isinstance(ev, RoundDone):
                out.append(m.EvRoundDone(ev.session_id, ev.output_tokens, ev.itl_sum, ev.itl_count, ev.itl_max,
                                         ev.preemptions))
            elif isinstance(ev, SessionFailed):
                out.append(m.EvSessionFailed(ev.session_id, ev.reason))
            elif isinstance(ev, AllBlocksCleared):
                out.append(m.EvKVBlocks(False, Medium.GPU.value, cleared=True))
            elif isinstance(ev, (BlockStored, BlockRemoved)):
                out.append(m.EvKVBlocks(isinstance(ev, BlockStored), ev.medium.value, list(ev.hashes)))
        if out:
            self.send_up(m.Events(out))
