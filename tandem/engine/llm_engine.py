"""The engine shell: a WorkerCore (the same scheduler and KV block manager the simulator runs) driving
the torch ModelRunner, with requests, multi-round sessions, sampling and stop handling around it."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem.core.prefix_hash import extend_hashes
from tandem.core.types import COLOCATED, PrefillTask, RoundDone, SessionFailed, StepResult
from tandem.core.worker import WorkerConfig, WorkerCore
from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.model_runner import ModelInput, ModelRunner
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.sampler import make_generator
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.stop import StopChecker
from tandem.engine.tokenizer import Tokenizer


@dataclass
class _Request:
    request_id: str
    session_id: str
    keep_session: bool            # a named session keeps its KV on this engine after the round
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    generator: object
    metrics: RequestMetrics
    task: PrefillTask
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finished: bool = False
    error: str | None = None


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)     # every token of the conversation so far
    hashes: list[int] = field(default_factory=list)     # chained hashes of its full blocks
    rounds: int = 0
    request: _Request | None = None


@dataclass
class StepStats:
    """Where the engine's time goes: scheduling (core + input building) versus model execution."""

    steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class LLMEngine:
    """Add requests, call `step()` until done; each step runs one planned batch of the worker core."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.clock = clock
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.runner = ModelRunner(config, self.tokenizer.eos_token_ids)
        mc = self.runner.model_config
        self.model_config = mc
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        bs = config.block_size
        capacity = self.runner.num_blocks * bs
        if capacity < self.max_model_len:
            raise EngineError(
                f"the KV pool holds {capacity} tokens ({self.runner.num_blocks} blocks of {bs}), fewer than "
                f"max_model_len={self.max_model_len}: raise kv_cache_memory_bytes/num_kv_blocks or lower max_model_len")
        self.core = WorkerCore(0, WorkerConfig(
            role=COLOCATED, tp=1, num_blocks=self.runner.num_blocks, block_size=bs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            mix_decode_with_prefill=True))
        self.requests: dict[str, _Request] = {}
        self.sessions: dict[str, _Session] = {}
        self.stats = StepStats()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests in
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    session_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; with `session_id`, its prompt extends that session's conversation and reuses its KV."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise EngineError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already running")
        text, ids = self._tokens(prompt)
        n = len(ids)
        if n >= self.max_model_len:
            raise EngineError(f"prompt of {n} tokens leaves no room to generate: the model's context "
                              f"(max_model_len) is {self.max_model_len} tokens")
        max_tokens = self.max_model_len - n
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        sid = session_id if session_id is not None else f"req-{request_id}"
        sess = self.sessions.get(sid)
        if sess is not None and sess.request is not None:
            raise EngineError(f"session {sid!r} already has a request running ({sess.request.request_id!r})")
        if sess is not None and ids[:len(sess.tokens)] != sess.tokens:
            self.core.release(sid)                   # the conversation was rewritten: start it afresh
            sess = None
        if sess is None:
            sess = self.sessions[sid] = _Session()
        now = self.clock() if arrival_time is None else arrival_time
        sess.tokens = list(ids)
        hist = self.core.begin_round(sid)
        if self.config.enable_prefix_caching:
            extend_hashes(sess.hashes, ids, self.config.block_size)
        else:
            sess.hashes = []
        task = PrefillTask(sid, sess.rounds, hist, n - hist, now, output_tokens=max_tokens, decode_worker=0,
                           worker=0, local=True, block_hashes=tuple(sess.hashes))
        stop_params = params.clone()
        stop_params.max_tokens = max_tokens
        req = _Request(request_id, sid, session_id is not None, text, list(ids), params,
                       StopChecker(stop_params, self.tokenizer.eos_token_ids, self._decoder(params), ids),
                       make_generator(params.seed, self.runner.device), RequestMetrics(now), task,
                       logprobs=[] if params.logprobs is not None else None,
                       cumulative_logprob=0.0 if params.logprobs is not None else None)
        sess.request = req
        sess.rounds += 1
        self.requests[request_id] = req
        self.core.submit(task, now)
        return request_id

    def _tokens(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise EngineError("a prompt must be a string or a list of token ids")
        if not ids:
            raise EngineError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return text, ids

    def _decoder(self, params: SamplingParams) -> Callable[[list[int]], str]:
        tok, skip = self.tokenizer, params.skip_special_tokens
        return lambda ids: tok.decode(ids, skip_special_tokens=skip)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV (its session's KV too)."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort", self.clock(), release=True)

    def end_session(self, session_id: str) -> None:
        """Forget a session and free its KV (prefix-cached blocks stay reusable)."""
        sess = self.sessions.pop(session_id, None)
        if sess is not None and sess.request is not None:
            self._finish(sess.request, "abort", self.clock(), release=False)
        self.core.release(session_id)

    def has_unfinished_requests(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns the requests that produced a token or finished in it."""
        t0 = self.clock()
        core = self.core
        plan = core.schedule(t0)
        touched: dict[str, _Request] = {}
        if plan is None:
            self._on_events(core.drain(), t0, touched)
            if not touched and self.has_unfinished_requests() and not core.has_work():
                for req in [r for r in self.requests.values() if not r.finished]:
                    req.error = "the engine could not schedule this request"
                    self._finish(req, "abort", t0, release=True)
                    touched[req.request_id] = req
            return self._collect(touched)
        batch = ModelInput()
        rows: list[_Request] = []
        tables = core.blocks.tables
        for t, n in plan.prefill:
            sess = self.sessions[t.session_id]
            start = t.l_hist + t.done
            batch.add(sess.tokens[start:start + n], start, tables[core.seqs[t.session_id]])
            req = sess.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            req.metrics.num_computed_tokens += n
            if t.done + n == t.l_incr and not t.recompute:
                self._sample_row(batch, req, len(batch.query_lens) - 1)
                rows.append(req)
        self.stats.prefill_tokens += sum(n for _, n in plan.prefill)
        for seq in plan.decode:
            sess = self.sessions[seq.session_id]
            start = seq.num_tokens
            batch.add(sess.tokens[start:start + 1], start, tables[seq])
            self._sample_row(batch, sess.request, len(batch.query_lens) - 1)
            rows.append(sess.request)
        self.stats.decode_tokens += len(plan.decode)
        t1 = self.clock()
        out = self.runner.execute(batch)
        t2 = self.clock()
        finished: set[str] = set()
        for i, req in enumerate(rows):
            tok = out.token_ids[i]
            self.sessions[req.session_id].tokens.append(tok)
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = t2
            m.last_token_time = t2
            if req.logprobs is not None:
                lp = out.logprobs[i]
                entry = {tok: lp}
                if out.top_logprobs is not None:
                    entry.update(out.top_logprobs[i])
                req.logprobs.append(entry)
                req.cumulative_logprob += lp
            if req.stop.append(tok) is not None:
                finished.add(req.session_id)
            touched[req.request_id] = req
        core.on_step_done(plan, StepResult(t2 - t0, None, finished), t2)
        self._on_events(core.drain(), t2, touched)
        t3 = self.clock()
        st = self.stats
        st.steps += 1
        st.execute_s += t2 - t1
        st.schedule_s += (t1 - t0) + (t3 - t2)
        return self._collect(touched)

    def _sample_row(self, batch: ModelInput, req: _Request, row: int) -> None:
        batch.sample_rows.append(row)
        batch.params.append(req.params)
        batch.generators.append(req.generator)
        batch.output_tokens.append(req.stop.token_ids)
        batch.prompt_tokens.append(req.prompt_token_ids)

    def _on_events(self, events: list, now: float, touched: dict[str, _Request]) -> None:
        for ev in events:
            sess = self.sessions.get(ev.session_id)
            req = sess.request if sess is not None else None
            if req is None:
                continue
            if isinstance(ev, RoundDone):
                req.metrics.num_preemptions = ev.preemptions
                reason = req.stop.finish_reason or "length"
                self._finish(req, reason, now, release=not req.keep_session)
            elif isinstance(ev, SessionFailed):
                req.error = ev.reason
                self._finish(req, "abort", now, release=True)
            else:
                continue
            touched[req.request_id] = req

    def _finish(self, req: _Request, reason: str, now: float, release: bool) -> None:
        req.finished = True
        if req.stop.finish_reason is None:
            req.stop.finish(reason)
        req.metrics.finished_time = now
        req.metrics.num_cached_tokens = req.task.l_hist
        sess = self.sessions.get(req.session_id)
        if sess is not None:
            sess.request = None
        if release or reason == "abort":
            self.core.release(req.session_id)
            self.sessions.pop(req.session_id, None)

    def _collect(self, touched: dict[str, _Request]) -> list[RequestOutput]:
        outs = [self._output(r) for r in touched.values()]
        for r in touched.values():
            if r.finished:
                self.requests.pop(r.request_id, None)
        return outs

    def _output(self, req: _Request) -> RequestOutput:
        st = req.stop
        comp = CompletionOutput(0, st.text, list(st.token_ids), req.cumulative_logprob,
                                list(req.logprobs) if req.logprobs is not None else None,
                                st.finish_reason if req.finished else None, st.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.finished, req.metrics,
                             session_id=req.session_id if req.keep_session else None, error=req.error,
                             num_cached_tokens=req.task.l_hist)
