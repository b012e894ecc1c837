"""The engine's public entry: a WorkerCore (the same scheduler and KV block manager the simulator runs) driving
the torch ModelRunner. Its parts: input processing (engine/input_processor.py), the requests and sessions
(engine/request_state.py), sessions' KV across rounds, disaggregation and swap (engine/session_kv.py), and the step
(engine/step_executor.py)."""
from __future__ import annotations

import itertools
import time
from typing import Callable

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, DECODE, PREFILL, PrefillTask
from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.diffusion_setup import build_decoder, load_latency_profile, window_latency
from tandem.engine.input_processor import InputProcessor
from tandem.engine.kv_transfer import KVPayload
from tandem.engine.model_runner import ModelRunner
from tandem.engine.omp_affinity import Binding
from tandem.engine.outputs import RequestOutput
from tandem.engine.parallel.kv_ranks import CLAIM_WAIT_S
from tandem.engine.parallel.kv_stage import StagedKV
from tandem.engine.request_state import RequestTable
from tandem.engine.sampler import SampleOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.session_kv import SessionKV
from tandem.engine.step_executor import PreparedStep, StepExecutor
from tandem.engine.structured_output import StructuredOutputManager
from tandem.engine.tier_copies import TierRunner, host_tier_setup, nominal_t_pre
from tandem.engine.tokenizer import Tokenizer
from tandem.perf.profile_io import WindowLatencyProfile
from tandem.policy.optimus.chunk import parse_chunk


class LLMEngine:
    """Add requests, call `step()` until done; each step runs one planned batch of the worker core.

    `role` is the worker kind of the PD-disaggregated runtime: `colocated` (the offline engine: prefill
    and decode together), `decode` (home of sessions; prefills locally first, or receives a remote
    prefill's KV) or `prefill` (computes a remote task on top of history KV read from the decode worker).
    In the runtime every core event is also kept in `core_events` for the coordinator.
    """

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.perf_counter, role: str = COLOCATED,
                 worker_id: int = 0, t_pre: Callable[[int, int], float] | None = None,
                 forward_events: bool | None = None) -> None:
        if role not in (COLOCATED, DECODE, PREFILL):
            raise EngineError(f"role must be colocated, decode or prefill, got {role!r}")
        self.config = config
        self.clock = clock
        self.role = role
        profiled = load_latency_profile(config)     # a bad file fails before the model loads
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.runner = ModelRunner(config, self.tokenizer.eos_token_ids, role=role)   # role: which capture LAPS graphs
        try:
            self._setup(config, role, worker_id, t_pre, profiled, forward_events)
        except BaseException:
            self.runner.close()                 # a tensor-parallel group's ranks do not outlive a failed start
            raise

    def _setup(self, config: EngineConfig, role: str, worker_id: int, t_pre: Callable[[int, int], float] | None,
               profiled: WindowLatencyProfile | None, forward_events: bool | None) -> None:
        """Everything after the model: diffusion decoder, the worker core, the request tables."""
        self.structured = StructuredOutputManager(self.tokenizer, self.runner.model_config.vocab_size)
        mc = self.runner.model_config
        self.model_config = mc
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        bs = config.block_size
        capacity = self.runner.num_blocks * bs
        if capacity < self.max_model_len:
            raise EngineError(
                f"the KV pool holds {capacity} tokens ({self.runner.num_blocks} blocks of {bs}), fewer than "
                f"max_model_len={self.max_model_len}: raise kv_cache_memory_bytes/num_kv_blocks (or the memory budget: "
                f"cpu_memory_budget_bytes, gpu_memory_utilization; max_num_logits shrinks the activation peak) or "
                f"lower max_model_len")
        self.dllm = build_decoder(config, role, self.runner, self.tokenizer.eos_token_ids, self.max_model_len)
        canvas = self.dllm is not None and self.dllm.canvas
        phased = self.dllm is not None and self.dllm.sparse is not None
        delay, interval = config.phase_knobs(0 if canvas else None)
        sched = SchedulerConfig(block_size=bs, max_num_batched_tokens=config.max_num_batched_tokens,
                                max_num_seqs=config.max_num_seqs,
                                dllm_block_length=self.dllm.block if self.dllm is not None else 0,
                                dllm_chunk=config.dllm_chunk,
                                dllm_admission=(config.dllm_admission or "phase") if phased else None,
                                dllm_delay_step=delay, dllm_refresh_interval=interval,
                                dllm_refresh_span="canvas" if canvas else "aligned",
                                dllm_kv_retention=self.dllm.sparse.kv_retention_ratio if phased else 1.0,
                                preemption_mode=config.preemption_mode, swap_space=config.swap_space,
                                kv_offloading_size=config.kv_offloading_size)
        latency = None
        if self.dllm is not None and not phased:   # Optimus's T(c, b), also its prefill estimate (the same steps)
            latency = window_latency(config, profiled, self.runner, self.dllm.block)
            t_pre = lambda h, n: latency.rows(n, 1, 0, 0)   # noqa: E731 - n query tokens' forward, none sampled
        try:
            pool, link_s = host_tier_setup(config, self.runner, sched, role, config.policy_spec())
            if pool is not None and t_pre is None:
                t_pre = nominal_t_pre(self.runner, self.max_model_len)
            self.core = build_worker(worker_id, role, config.tensor_parallel_size, self.runner.num_blocks,
                                     config.policy_spec(), sched, t_pre, latency=latency,
                                     kv_block_bytes=self.runner.kv_block_bytes, host_link_s=link_s)
        except ValueError as e:
            raise EngineError(str(e)) from None
        # the host KV tier's copies, beside the steps (None: no tier)
        self.tier = None
        if pool is not None and self.core.kv.tier is not None:
            self.tier = TierRunner(self.core.kv.tier, pool, self.runner.kv_caches, self.clock, group=self.runner.group)
        if phased:                  # dLLM-Serve: each request's packed KV is the buffer the core's admission reserves
            self.dllm.kv_slots = self.core.dllm.phases.kv_tokens
        self.forward_events = role != COLOCATED if forward_events is None else forward_events
        self.core_events: list = []                          # every core event, for a coordinator to drain
        forward = (lambda evs: self.core_events.extend(evs)) if self.forward_events else None
        self.table = RequestTable(self.core, self.dllm, role, forward)
        self.requests, self.sessions = self.table.requests, self.table.sessions
        self.task_req = self.table.task_req                  # a prefill task -> its request (the worker shell reads it)
        self.inputs = InputProcessor(self.tokenizer, self.structured, mc.vocab_size, self.max_model_len, self.dllm,
                                     self.runner.device)
        self.steps = StepExecutor(self.core, self.runner, self.dllm, self.table, role, self.clock)
        self.stats = self.steps.stats
        self.kv = SessionKV(config, self.core, self.runner, self.table, self.clock, self.stats, self.tier)
        self._ids = itertools.count()

    @property
    def cpu_binding(self) -> Binding | None:
        """What the driver's OpenMP threads are bound to (cpu_omp_threads_bind; None: left to the OS scheduler)."""
        return self.runner.cpu_binding

    # ------------------------------------------------------------------ requests in
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    session_id: str | None = None, arrival_time: float | None = None, remote: bool = False,
                    slo: tuple[float, float] | None = None, keep_session: bool | None = None,
                    tool_s: float | None = None) -> str:
        """Queue a request; with `session_id`, its prompt extends that session's conversation and reuses its KV.

        Runtime (decode role): `remote` means a prefill worker computes the new tokens; the request waits
        for their KV (`receive_kv`, then `on_kv_arrived`). `slo` = (TTFT, ITL) seconds for the core's stats.
        `tool_s`: the client's expected tool time after this round; the core's host tier hears it when the round
        ends, before it decides for the idle session (None: the tier's learnt estimate).
        """
        if tool_s is not None:
            self._check_tool_s(tool_s)
        if self.role == PREFILL:
            raise EngineError("a prefill worker takes add_prefill(), not add_request()")
        if remote and self.role != DECODE:
            raise EngineError("only a decode worker receives remote prefills")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise EngineError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already running")
        text, ids, grammar, max_tokens = self.inputs.process(prompt, params, remote)
        full = params.prompt_logprobs is not None        # every prompt position computed here: no KV reused
        sid = session_id if session_id is not None else f"req-{request_id}"
        sess, task = self.kv.open_round(sid, ids, full, remote, arrival_time, max_tokens, slo)
        keep = session_id is not None if keep_session is None else keep_session
        req = self.inputs.request(request_id, sid, keep, text, ids, params, task, grammar, max_tokens)
        asked = parse_chunk(params.dllm_chunk) if params.dllm_chunk is not None else None
        spec = self.core.choose_chunk(sid, asked, reproducible=params.temperature == 0 or params.seed is not None)
        req.dllm_chunk = str(spec) if spec is not None else None     # Optimus windows: the core's chunk decision
        if full:
            req.prompt_logprobs = [None] * len(ids)
        sess.request = req
        sess.rounds += 1
        self.requests[request_id] = req
        if tool_s is not None:
            self.core.expect_return(sid, float(tool_s), self.clock())    # the core holds it for the round's end
        if not remote:
            self.core.submit(task, task.enqueue_s)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV (its session's KV too; on a prefill worker, the task's)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if self.role == PREFILL:
            self.kv.cancel(req)
        elif not req.finished:
            self.table.finish(req, "abort", self.clock(), release=True)

    def end_session(self, session_id: str) -> None:
        """Forget a session and free its KV (prefix-cached blocks stay reusable)."""
        self.kv.end_session(session_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still running."""
        return any(not r.finished for r in self.requests.values())

    # ------------------------------------------------------------------ disaggregation (runtime)
    def begin_round(self, session_id: str, prompt_token_ids: list[int] | None = None) -> int:
        """Pin a session's resident KV for its next round; returns how many tokens of it are resident. With the
        round's prompt, a session with nothing resident first takes the prompt's cached prefix as its history."""
        return self.kv.begin_round(session_id, prompt_token_ids)

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, session_id: str,
                    l_hist: int, round_idx: int = 0, arrival_time: float | None = None,
                    ttft_slo_s: float = float("inf"), hist_compute: int = 0) -> None:
        """Prefill role: compute tokens [l_hist, len) of a session on top of its history KV, read lazily; with
        `hist_compute` the last that many history tokens are computed here instead of read (vLLM-like PD sends the
        whole prompt). The KV sent back is always [l_hist, len)."""
        if self.role != PREFILL:
            raise EngineError("add_prefill() runs on a prefill worker")
        ids, grammar = self.inputs.process_prefill(prompt_token_ids, params, l_hist, hist_compute)
        now = self.clock() if arrival_time is None else arrival_time
        task = PrefillTask(session_id, round_idx, l_hist, len(ids) - l_hist, now, decode_worker=-1,
                           worker=self.core.id, local=False, ttft_slo_s=ttft_slo_s, hist_compute=hist_compute)
        req = self.inputs.request(request_id, session_id, False, None, ids, params, task, grammar)
        self.requests[request_id] = req
        self.task_req[task] = req
        self.core.submit(task, now)

    def export_history(self, session_id: str, tokens: int) -> KVPayload:
        """Decode role: the first `tokens` positions of a resident session's KV (a remote prefill's history)."""
        return self.kv.export_history(session_id, tokens)

    def receive_kv(self, request_id: str, payload: KVPayload) -> None:
        """Keep KV that arrived for a request until the coordinator says where it goes (HistoryReady/KVArrived)."""
        self.kv.receive_kv(request_id, payload)

    def receive_staged(self, request_id: str, transfer: str, tokens: int, wait_s: float = CLAIM_WAIT_S) -> StagedKV:
        """KV a peer sent rank to rank (every rank holds its heads, waiting at most wait_s, or KVTransferError and
        none keeps any), kept until the coordinator says where it goes."""
        return self.kv.receive_staged(request_id, transfer, tokens, wait_s)

    def send_kv_ranks(self, purpose: str, session_id: str, request_id: str, tokens: int, transfer: str,
                      dst: list[str], part_tokens: int) -> tuple[int, int, dict[int, float] | None, int]:
        """A session's history or a task's new KV from every rank straight to the receiving ranks' endpoints `dst`:
        (tokens, first token or -1, its logprobs, bytes sent)."""
        return self.kv.send_kv_ranks(purpose, session_id, request_id, tokens, transfer, dst, part_tokens)

    def on_history_ready(self, request_id: str) -> None:
        """Prefill role: the history KV is here: place it in the task's blocks and let the task run."""
        self.kv.on_history_ready(request_id)

    def export_new_kv(self, request_id: str) -> tuple[KVPayload, int, dict[int, float] | None]:
        """Prefill role: the KV this task computed, and the first token it sampled (with its logprobs)."""
        return self.kv.export_new_kv(request_id)

    def on_delivered(self, request_id: str) -> None:
        """Prefill role: the decode worker has the new KV: free it here."""
        self.kv.on_delivered(request_id)

    def on_kv_arrived(self, request_id: str, first_token: int,
                      first_logprobs: dict[int, float] | None = None) -> list[RequestOutput]:
        """Decode role: a remote prefill's KV (already received) and first token are here: start decoding."""
        return self.kv.on_kv_arrived(request_id, first_token, first_logprobs)

    def make_local(self, request_id: str) -> None:
        """Decode role: a remote round whose KV did not come is prefilled here instead (recompute)."""
        self.kv.make_local(request_id)

    def cache_config(self) -> dict[str, str]:
        """The labels of vllm:cache_config_info for this engine's KV cache and swap space."""
        return self.kv.cache_config()

    def expect_return(self, session_id: str, tool_s: float) -> None:
        """The session's client expects its tool call after the current round (the last one, between rounds) to take
        `tool_s` seconds (a host tier plans with it)."""
        self._check_tool_s(tool_s)
        self.core.expect_return(session_id, tool_s, self.clock())

    @staticmethod
    def _check_tool_s(tool_s: float) -> None:
        if isinstance(tool_s, bool) or not isinstance(tool_s, (int, float)) or not 0 <= tool_s < float("inf"):
            raise EngineError(f"an expected tool time is a finite number of seconds >= 0, got {tool_s!r}")

    def kv_loading(self, session_id: str) -> bool:
        """Whether the session's KV is on its way back from the host tier (its round waits for it here)."""
        seq = self.core.seqs.get(session_id)
        return seq is not None and seq.loading is not None

    def tier_due(self) -> bool:
        """Whether the host tier wants a step now although no request does (copies ended or planned, idle
        sessions to decide, a prefetch or pin end due)."""
        return self.tier is not None and self.tier.due(self.clock())

    def close(self) -> None:
        """Release what outlives the engine object: a tensor-parallel group's rank processes, the copy threads.
        Idempotent."""
        if self.tier is not None:
            self.tier.close()
        self.runner.close()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns the requests that produced a token or finished in it."""
        prep = self.prepare_step()
        if prep.plan is None and self.tier is not None and self.tier.busy():
            self.tier.wait(0.05)                    # KV on its way back from the host tier: wait for a copy's end
        return self.finish_step(prep, self.execute_step(prep))

    def prepare_step(self) -> PreparedStep:
        """The first part of a step: the core plans the batch (its swaps and received KV carried out first) and its
        model input is built (engine state read)."""
        tier = self.tier
        if tier is not None:
            tier.poll()                             # copies that ended: the core hears of them first
        t0 = self.clock()
        plan = self.core.schedule(t0)
        if tier is not None:
            tier.start(self.core.kv.tier.take_copies())
            tier.check(plan, self.core)
        self.kv.before_step()
        return self.steps.prepare(plan, t0)

    def execute_step(self, prep: PreparedStep) -> SampleOutput | None:
        """The model runs the prepared batch. It reads only the batch, the weights and the KV blocks the batch
        owns, so a runtime may add requests to the engine meanwhile (under its own lock)."""
        return self.steps.execute(prep)

    def finish_step(self, prep: PreparedStep, out: SampleOutput | None) -> list[RequestOutput]:
        """The last part of a step: tokens appended, stops checked, the core told; returns the touched requests."""
        return self.steps.finish(prep, out)
