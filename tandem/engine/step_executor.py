"""One engine step in three parts, autoregressive and block-diffusion: the core's plan made a model input
(prepare), the model run (execute), the tokens appended and the core told (finish)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tandem.core.types import PREFILL, StepPlan, StepResult
from tandem.engine.diffusion.engine_step import DiffusionBatch, DiffusionDecoder
from tandem.engine.model_input import ModelInput, PromptLogprobsSpec
from tandem.engine.model_runner import ModelRunner
from tandem.engine.outputs import RequestOutput
from tandem.engine.request_state import Request, RequestTable
from tandem.engine.sampler import SampleOutput
from tandem.policy.optimus.chunk import ChunkMode


@dataclass
class StepStats:
    """Where the engine's time goes: scheduling (core + input building) versus model execution."""

    steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    iteration_tokens: dict[int, int] = field(default_factory=dict)   # tokens in a step -> steps (cumulative)
    dllm_commits: dict[int, int] = field(default_factory=dict)       # diffusion: tokens a sequence committed in
                                                                     # a step -> how often (cumulative)
    dllm_chunks: dict[int, int] = field(default_factory=dict)        # diffusion: chunk size chosen -> steps
    dllm_serve: dict[str, int] = field(default_factory=dict)         # dLLM-Serve: the core's counters
                                                                     # (DllmServeStats.counters(), cumulative)
    swapped_out_bytes: int = 0                                       # KV of sequences preempted by swap, now


@dataclass
class PreparedStep:
    """A step between its parts (prepare_step, execute_step, finish_step): the plan, its batch, the sampled rows."""

    plan: StepPlan | None
    t0: float
    batch: ModelInput | None = None
    rows: list[Request] = field(default_factory=list)
    prompt_lp: list[tuple[Request, int]] = field(default_factory=list)    # (request, first position predicted)
    t1: float = 0.0
    t2: float = 0.0
    dbatch: DiffusionBatch | None = None    # a block-diffusion step's windows (instead of batch)
    committed: dict[str, int] = field(default_factory=dict)   # ... and what each sequence committed

    @property
    def runs(self) -> bool:
        """Whether the step has a model run (execute_step does something)."""
        return self.batch is not None or self.dbatch is not None


class StepExecutor:
    """Runs the worker core's plans on the model runner (or the diffusion decoder) for the request table."""

    def __init__(self, core, runner: ModelRunner, dllm: DiffusionDecoder | None, table: RequestTable, role: str,
                 clock: Callable[[], float]) -> None:
        self.core, self.runner, self.dllm, self.table, self.role, self.clock = core, runner, dllm, table, role, clock
        self.stats = StepStats()

    def prepare(self, plan: StepPlan | None, t0: float) -> PreparedStep:
        """The plan's model input (engine state read): prefill chunks and decodes, the rows to sample."""
        prep = PreparedStep(plan, t0)
        if plan is None:
            return prep
        if self.dllm is not None:
            self._prepare_diffusion(prep)
            prep.t1 = self.clock()
            return prep
        core, sessions = self.core, self.table.sessions
        batch = prep.batch = ModelInput()
        rows, prompt_lp = prep.rows, prep.prompt_lp
        tables = core.blocks.tables
        prefill_role = self.role == PREFILL
        for t, n in plan.prefill:
            start = t.first + t.done
            if prefill_role:
                req = self.table.task_req[t]
                batch.add(req.prompt_token_ids[start:start + n], start, tables[t])
            else:
                sess = sessions[t.session_id]
                batch.add(sess.tokens[start:start + n], start, tables[core.seqs[t.session_id]])
                req = sess.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            req.metrics.num_computed_tokens += n
            if req.prompt_logprobs is not None and not t.recompute and not prefill_role:
                _want_prompt_logprobs(batch, req, start, n, prompt_lp)
            if t.done + n == t.work and not t.recompute:
                _sample_row(batch, req)
                rows.append(req)
        self.stats.prefill_tokens += sum(n for _, n in plan.prefill)
        for seq in plan.decode:
            sess = sessions[seq.session_id]
            start = seq.num_tokens
            batch.add(sess.tokens[start:start + 1], start, tables[seq])
            _sample_row(batch, sess.request)
            rows.append(sess.request)
        self.stats.decode_tokens += len(plan.decode)
        if plan.shape.graph and not plan.decode:         # a LAPS short batch the core placed in a bucket
            batch.pad_to = plan.shape.prefill_tokens
            batch.bucket = (plan.shape.prefill_tokens // plan.shape.num_prefill, plan.shape.num_prefill)
        prep.t1 = self.clock()
        return prep

    def _prepare_diffusion(self, prep: PreparedStep) -> None:
        """A block-diffusion step: the plan's prefill chunks and decode windows (engine/diffusion/engine_step.py)."""
        plan, core, dllm, sessions = prep.plan, self.core, self.dllm, self.table.sessions
        tables = core.blocks.tables
        batch = prep.dbatch = DiffusionBatch()
        for t, n in plan.prefill:
            sess = sessions[t.session_id]
            start = t.first + t.done
            req = sess.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = prep.t0
            req.metrics.num_computed_tokens += n
            seq = core.seqs[t.session_id]
            dllm.prefill(batch, sess.tokens, start, n, t.done + n == t.work, tables[seq])
        for seq in plan.decode:
            sid = seq.session_id
            sess = sessions[sid]
            state = dllm.states.get(sid)
            if core.dllm is not None:                        # dLLM-Serve: the phase the core planned
                if state is None:
                    state = dllm.start_phases(sid, sess.tokens, sess.request.params, tables[seq],
                                              sess.request.task.output_tokens)
                    if sess.request.metrics.first_scheduled_time is None:
                        sess.request.metrics.first_scheduled_time = prep.t0
                dllm.phase(batch, sid, state, core.phase_of(sid))
                continue
            if state is None:
                state = dllm.start(sid, sess.tokens, sess.request.params)
            dllm.decode(batch, sid, state, seq.commit_cap, seq.query_tokens, tables[seq],
                        streaming=core.chunk_of(sid).mode is not ChunkMode.BLOCK)
        self.stats.prefill_tokens += sum(n for _, n in plan.prefill)
        self.stats.decode_tokens += batch.tokens

    def execute(self, prep: PreparedStep) -> SampleOutput | None:
        """The model runs the prepared batch. It reads only the batch, the weights and the KV blocks the batch
        owns, so a runtime may add requests to the engine meanwhile (under its own lock)."""
        if prep.dbatch is not None:
            prep.committed = self.dllm.execute(prep.dbatch)
            prep.t2 = self.clock()
            return None
        if prep.batch is None:
            return None
        out = self.runner.execute(prep.batch)
        prep.t2 = self.clock()
        return out

    def finish(self, prep: PreparedStep, out: SampleOutput | None) -> list[RequestOutput]:
        """Tokens appended, stops checked, the core told; returns the touched requests' outputs."""
        if prep.plan is None:
            return self._finish_idle(prep.t0)
        if prep.dbatch is not None:
            return self._finish_diffusion(prep)
        plan, table = prep.plan, self.table
        touched: dict[str, Request] = {}
        prefill_role = self.role == PREFILL
        for (req, first), entries in zip(prep.prompt_lp, out.prompt_logprobs if prep.prompt_lp else ()):
            req.prompt_logprobs[first:first + len(entries)] = entries
        finished: set[str] = set()
        for i, req in enumerate(prep.rows):
            tok = out.token_ids[i]
            entry = None
            if req.logprobs is not None:
                entry = {tok: out.logprobs[i]}
                if out.top_logprobs is not None:
                    entry.update(out.top_logprobs[i])
            if prefill_role:
                req.first_token = (tok, entry)                  # goes to the decode worker with the KV
                continue
            if table.append_token(req, tok, entry, prep.t2):
                finished.add(req.session_id)
            touched[req.request_id] = req
        committed = {seq.session_id: 1 for seq in plan.decode}   # an AR step commits one token per sequence
        n_iter = sum(n for _, n in plan.prefill) + len(plan.decode)    # tokens through the model this step
        return self._done(prep, committed, finished, touched, n_iter)

    def _finish_idle(self, t0: float) -> list[RequestOutput]:
        """A step with nothing planned: the core's events applied; when nothing can ever run, the requests still
        waiting (local, or decoding) fail rather than hang."""
        core, table = self.core, self.table
        touched: dict[str, Request] = {}
        table.on_events(core.drain(), t0, touched)
        if not touched and self.role != PREFILL and not core.has_work():
            for req in [r for r in table.requests.values()
                        if not r.finished and (r.task.local or r.metrics.first_token_time is not None)]:
                req.error = "the engine could not schedule this request"
                table.finish(req, "abort", t0, release=True)
                touched[req.request_id] = req
        return table.collect(touched)

    def _finish_diffusion(self, prep: PreparedStep) -> list[RequestOutput]:
        """A block-diffusion step's end: each request's committed prefix streamed, the core told what each
        sequence committed and which rounds a stop rule ended."""
        plan, table, dllm = prep.plan, self.table, self.dllm
        touched: dict[str, Request] = {}
        finished: set[str] = set()
        for t, n in plan.prefill:                            # a preempted sequence recomputed: its active block
            if t.recompute and t.done + n >= t.work:         # is not cached any more
                st = dllm.states.get(t.session_id)
                if st is not None:
                    st.prefilled()
        for seq in plan.decode:
            sid = seq.session_id
            sess = table.sessions.get(sid)
            req = sess.request if sess is not None else None
            state = dllm.states.get(sid)
            if req is None or req.finished or state is None:
                continue                                     # aborted while the step ran (the core skips it too)
            for tok in state.take_committed():
                if table.append_token(req, tok, None, prep.t2):
                    finished.add(sid)
                    break
            touched[req.request_id] = req
        outs = self._done(prep, prep.committed, finished, touched, prep.dbatch.tokens)
        st = self.stats
        if plan.decode:
            for c in prep.committed.values():
                st.dllm_commits[c] = st.dllm_commits.get(c, 0) + 1
            if self.core.chunker is not None:
                chunk = self.core.chunker.last
                st.dllm_chunks[chunk] = st.dllm_chunks.get(chunk, 0) + 1
        return outs

    def _done(self, prep: PreparedStep, committed: dict[str, int], finished: set[str], touched: dict[str, Request],
              n_iter: int) -> list[RequestOutput]:
        """The core told the step's result, its events applied, the step's time and tokens counted."""
        plan, t0, t1, t2 = prep.plan, prep.t0, prep.t1, prep.t2
        core = self.core
        core.on_step_done(plan, StepResult(t2 - t0, committed, finished), t2)
        self.table.on_events(core.drain(), t2, touched)
        t3 = self.clock()
        st = self.stats
        st.steps += 1
        st.iteration_tokens[n_iter] = st.iteration_tokens.get(n_iter, 0) + 1
        if core.dllm is not None:
            st.dllm_serve = core.dllm.stats.counters()
        st.execute_s += t2 - t1
        st.schedule_s += (t1 - t0) + (t3 - t2)
        return self.table.collect(touched)


def _want_prompt_logprobs(batch: ModelInput, req: Request, start: int, n: int,
                          prompt_lp: list[tuple[Request, int]]) -> None:
    """Ask the runner for the logprobs of the prompt tokens this chunk (positions start..start+n-1) predicts."""
    targets = req.prompt_token_ids[start + 1:start + n + 1]
    if targets:
        batch.prompt_logprobs.append(PromptLogprobsSpec(len(batch.query_lens) - 1, targets,
                                                        req.params.prompt_logprobs))
        prompt_lp.append((req, start + 1))


def _sample_row(batch: ModelInput, req: Request) -> None:
    """Sample the batch's last row for `req`: its params, generator, tokens so far and grammar go with it."""
    batch.sample_rows.append(len(batch.query_lens) - 1)
    batch.params.append(req.params)
    batch.generators.append(req.generator)
    batch.output_tokens.append(req.stop.token_ids)
    batch.prompt_tokens.append(req.prompt_token_ids)
    batch.grammars.append(req.grammar)
