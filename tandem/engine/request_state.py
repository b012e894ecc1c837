"""The engine's requests and sessions, and their life: a token appended, a round ended by the core, an output made."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tandem.core.types import PREFILL, PrefillTask, RoundDone, SessionFailed
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.stop import StopChecker
from tandem.engine.structured_output import RequestGrammar


@dataclass
class Request:
    """One request in the engine: its prompt, sampling state, stop rules, metrics and the core's task."""

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
    first_token: tuple[int, dict[int, float] | None] | None = None   # prefill role: sampled at the end of prefill
    grammar: RequestGrammar | None = None     # structured output: masks sampling, advanced with every token
    prompt_logprobs: list[dict[int, float] | None] | None = None   # vLLM's shape: None, then one dict per position
    dllm_chunk: str | None = None             # Optimus windows: the chunk the core decided this round decodes with


@dataclass
class Session:
    """A conversation resident on this engine across rounds."""

    tokens: list[int] = field(default_factory=list)     # every token of the conversation so far
    hashes: list[int] = field(default_factory=list)     # chained hashes of its full blocks
    rounds: int = 0
    request: Request | None = None


class RequestTable:
    """The engine's requests and sessions, finished as the core's events say (its KV released with them)."""

    def __init__(self, core, dllm, role: str, forward: Callable[[list], None] | None) -> None:
        self.core = core
        self.dllm = dllm
        self.role = role
        self.forward = forward                       # every core event, for a coordinator (None: kept nowhere)
        self.requests: dict[str, Request] = {}
        self.sessions: dict[str, Session] = {}
        self.task_req: dict[PrefillTask, Request] = {}     # prefill role: its tasks' requests

    def append_token(self, req: Request, tok: int, logprobs: dict[int, float] | None, now: float) -> bool:
        """Add a generated token to the request and its session; True when a stop rule ended the round."""
        self.sessions[req.session_id].tokens.append(tok)
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs.get(tok, 0.0)
        stopped = req.stop.append(tok) is not None
        if req.grammar is not None and req.grammar.accept(tok) and not stopped:
            req.stop.finish("stop")            # the grammar is complete (its EOS taken) or refused the token
            stopped = True
        return stopped

    def on_events(self, events: list, now: float, touched: dict[str, Request]) -> None:
        """Apply the core's events: a round done or a session failed finishes its request (added to `touched`)."""
        if self.forward is not None:
            self.forward(events)
        if self.role == PREFILL:
            return                                   # FetchHistory / PrefillDone are the coordinator's
        for ev in events:
            if not isinstance(ev, (RoundDone, SessionFailed)):
                continue                             # first tokens, a host tier's KV events: the coordinator's
            sess = self.sessions.get(ev.session_id)
            req = sess.request if sess is not None else None
            if req is None:
                continue
            if isinstance(ev, RoundDone):
                req.metrics.num_preemptions = ev.preemptions
                reason = req.stop.finish_reason or "length"
                self.finish(req, reason, now, release=not req.keep_session)
            elif isinstance(ev, SessionFailed):
                req.error = ev.reason
                self.finish(req, "abort", now, release=True)
            else:
                continue
            touched[req.request_id] = req

    def finish(self, req: Request, reason: str, now: float, release: bool) -> None:
        """End a request's round; with `release` (or an abort) its session and KV go too."""
        req.finished = True
        if self.dllm is not None:
            self.dllm.drop(req.session_id)
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

    def collect(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the touched requests; the finished ones leave the table."""
        outs = [self.output(r) for r in touched.values()]
        for r in touched.values():
            if r.finished:
                self.requests.pop(r.request_id, None)
        return outs

    @staticmethod
    def output(req: Request) -> RequestOutput:
        """A request's output so far, in vLLM's shape."""
        st = req.stop
        comp = CompletionOutput(0, st.text, list(st.token_ids), req.cumulative_logprob,
                                list(req.logprobs) if req.logprobs is not None else None,
                                st.finish_reason if req.finished else None, st.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.finished, req.metrics,
                             session_id=req.session_id if req.keep_session else None, error=req.error,
                             num_cached_tokens=req.task.l_hist, prompt_logprobs=req.prompt_logprobs,
                             dllm_chunk=req.dllm_chunk)
