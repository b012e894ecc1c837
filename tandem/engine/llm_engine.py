"""The engine shell: a WorkerCore (the same scheduler and KV block manager the simulator runs) driving
the torch ModelRunner, with requests, multi-round sessions, sampling and stop handling around it."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem.core.prefix_hash import extend_hashes
from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import (COLOCATED, DECODE, PREFILL, FirstToken, PrefillTask, RoundDone, SessionFailed, StepPlan,
                               StepResult, Swap)
from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.diffusion.engine_step import DiffusionBatch, DiffusionDecoder
from tandem.engine.diffusion.llada_generate import DEFAULT_BLOCK_LENGTH
from tandem.engine.diffusion.window_timing import measure_window_latency
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.kv_transfer import KVPayload, export_kv, import_kv
from tandem.engine.model_input import ModelInput, PromptLogprobsSpec
from tandem.engine.model_runner import ModelRunner
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.engine.sampler import SampleOutput, make_generator
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError, check_diffusion
from tandem.engine.stop import StopChecker
from tandem.engine.structured_output import RequestGrammar, StructuredOutputManager
from tandem.engine.tokenizer import Tokenizer
from tandem.perf.profile_io import PerfFileError, WindowLatencyProfile, load_window_latency
from tandem.policy.dllm_serve import canvas_max_tokens
from tandem.policy.optimus.chunk import ChunkMode, parse_chunk
from tandem.policy.optimus.latency import ChunkLatency


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
    first_token: tuple[int, dict[int, float] | None] | None = None   # prefill role: sampled at the end of prefill
    grammar: RequestGrammar | None = None     # structured output: masks sampling, advanced with every token
    prompt_logprobs: list[dict[int, float] | None] | None = None   # vLLM's shape: None, then one dict per position
    dllm_chunk: str | None = None             # Optimus windows: the chunk the core decided this round decodes with


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
    rows: list[_Request] = field(default_factory=list)
    prompt_lp: list[tuple[_Request, int]] = field(default_factory=list)    # (request, first position predicted)
    t1: float = 0.0
    t2: float = 0.0
    dbatch: DiffusionBatch | None = None    # a block-diffusion step's windows (instead of batch)
    committed: dict[str, int] = field(default_factory=dict)   # ... and what each sequence committed

    @property
    def runs(self) -> bool:
        """Whether the step has a model run (execute_step does something)."""
        return self.batch is not None or self.dbatch is not None


def _dllm_defaults(config: EngineConfig, block: int) -> DllmConfig:
    """The engine's diffusion decoding defaults (a request may override them); EngineError when its denoising steps
    do not divide the block."""
    defaults = DllmConfig(block, config.dllm_unmasking_strategy, config.dllm_denoising_steps,
                          config.dllm_confidence_threshold)
    steps = defaults.dllm_denoising_steps
    if steps is not None and block % steps:
        raise EngineError(f"dllm_denoising_steps {steps} must divide the block length {block}")
    return defaults


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
        if config.tensor_parallel_size > 1 and role != COLOCATED:
            raise EngineError(f"tensor_parallel_size {config.tensor_parallel_size} runs on co-located workers only: "
                              f"prefill/decode workers at TP > 1 (KV regrouped between TP degrees) are not supported yet")
        profiled = self._load_latency_profile(config)     # a bad file fails before the model loads
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
        self.dllm = self._diffusion(config, role, mc)     # diffusion decoding (SDAR, LLaDA), else None
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
                                preemption_mode=config.preemption_mode, swap_space=config.swap_space)
        latency = None
        if self.dllm is not None and not phased:   # Optimus's T(c, b): a profile's, or fitted on this engine's own
            latency = self._window_latency(config, profiled)  # forward (also its prefill estimate: the same steps)
            t_pre = lambda h, n: latency.rows(n, 1, 0, 0)   # noqa: E731 - n query tokens' forward, none sampled
        try:
            self.core = build_worker(worker_id, role, config.tensor_parallel_size, self.runner.num_blocks,
                                     config.policy_spec(), sched, t_pre, latency=latency,
                                     kv_block_bytes=self.runner.kv_block_bytes)
        except ValueError as e:
            raise EngineError(str(e)) from None
        if phased:                  # dLLM-Serve: each request's packed KV is the buffer the core's admission reserves
            self.dllm.kv_slots = self.core.dllm.phases.kv_tokens
        self.forward_events = role != COLOCATED if forward_events is None else forward_events
        self.core_events: list = []                          # every core event, for a coordinator to drain
        self._task_req: dict[PrefillTask, _Request] = {}     # prefill role: its tasks' requests
        self._kv_inbox: dict[str, KVPayload] = {}            # request id -> KV received, not yet placed
        self._swapped: dict[str, KVPayload] = self.runner.swap_space.held   # session -> its KV preempted by swap
        self._landing: dict[str, _Request] = {}              # session -> remote request whose KV awaits blocks
        self.requests: dict[str, _Request] = {}
        self.sessions: dict[str, _Session] = {}
        self.stats = StepStats()
        self._ids = itertools.count()

    @staticmethod
    def _load_latency_profile(config: EngineConfig) -> WindowLatencyProfile | None:
        """The dllm_latency section of the profile named by dllm_latency_profile (EngineError, one line, on a bad
        file), None without one."""
        if config.dllm_latency_profile is None:
            return None
        try:
            return load_window_latency(str(config.dllm_latency_profile), "dllm_latency_profile")
        except PerfFileError as e:
            raise EngineError(str(e)) from None

    def _window_latency(self, config: EngineConfig, profiled: WindowLatencyProfile | None) -> ChunkLatency:
        """T(c, b) from the profile (EngineError when it was measured with other diffusion blocks), else measured now
        on this engine's forward."""
        if profiled is None:
            return measure_window_latency(self.runner.model, self.dllm.block, config.max_num_batched_tokens,
                                          self.runner.device, max_seqs=config.max_num_seqs)
        if profiled.block != self.dllm.block:
            raise EngineError(f"dllm_latency_profile {config.dllm_latency_profile}: measured with diffusion blocks of "
                              f"{profiled.block}, this engine decodes blocks of {self.dllm.block}")
        return ChunkLatency.from_profile(profiled)

    def _diffusion(self, config: EngineConfig, role: str, mc) -> DiffusionDecoder | None:
        """The diffusion decoder of a block-diffusion checkpoint (None for an autoregressive one); EngineError when
        the options do not fit the model."""
        if mc.is_canvas_diffusion:
            return self._canvas_diffusion(config, role, mc)
        if mc.diffusion_block_size is None:
            if config.dllm_block_length is not None:
                raise EngineError("dllm_block_length is for block-diffusion models; this checkpoint is autoregressive")
            if config.dllm_admission is not None:
                raise EngineError("dllm_admission is for block-diffusion models; this checkpoint is autoregressive")
            if config.dllm_latency_profile is not None:
                raise EngineError("dllm_latency_profile is for block-diffusion models; this checkpoint is "
                                  "autoregressive")
            return None
        if role != COLOCATED:
            raise EngineError("block-diffusion models run on co-located workers (no prefill/decode disaggregation)")
        block = config.dllm_block_length or mc.diffusion_block_size
        if block != mc.diffusion_block_size:
            raise EngineError(f"dllm_block_length {block} is not supported by this model: it was trained with blocks "
                              f"of {mc.diffusion_block_size} (config.json block_size)")
        defaults = _dllm_defaults(config, block)
        r = self.runner
        return DiffusionDecoder(r.model, r.kv_caches, config.block_size, block, config.dllm_chunk != "block",
                                defaults, self.tokenizer.eos_token_ids, self.max_model_len, r.device,
                                config.max_num_logits,
                                config.sparse_kv() if config.dllm_admission is not None else None)

    def _canvas_diffusion(self, config: EngineConfig, role: str, mc) -> DiffusionDecoder:
        """The diffusion decoder of a LLaDA-style (bidirectional) checkpoint: Fast-dLLM's prefix cache as dLLM-Serve
        phases (default admission phase, delay_step 0, ρ 1); EngineError for the options that do not apply."""
        if role != COLOCATED:
            raise EngineError("LLaDA-style models run on co-located workers (a request's first step is its prefill "
                              "and its first Refresh)")
        if parse_chunk(config.dllm_chunk).mode not in (ChunkMode.AUTO, ChunkMode.ELASTIC):
            raise EngineError(f"dllm_chunk {config.dllm_chunk} sizes Optimus's streaming windows, which need a "
                              f"block-causal model (SDAR): in a LLaDA-style bidirectional model every position attends "
                              f"to the whole canvas, masks after the active block included, so no position's K/V is "
                              f"final when it is committed; LLaDA runs Fast-dLLM's prefix cache as dLLM-Serve phases "
                              f"(dllm_admission, dllm_refresh_interval)")
        if config.dllm_latency_profile is not None:
            raise EngineError("dllm_latency_profile sizes Optimus's streaming windows, which a LLaDA-style "
                              "bidirectional model does not run (its steps are dLLM-Serve phases)")
        block = config.dllm_block_length or DEFAULT_BLOCK_LENGTH
        if block < 2:
            raise EngineError(f"dllm_block_length must be at least 2 for a LLaDA-style model, got {block}")
        defaults = _dllm_defaults(config, block)
        r = self.runner
        return DiffusionDecoder(r.model, r.kv_caches, config.block_size, block, False, defaults,
                                self.tokenizer.eos_token_ids, self.max_model_len, r.device, config.max_num_logits,
                                config.sparse_kv(retention_default=1.0), canvas=True)

    # ------------------------------------------------------------------ requests in
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    session_id: str | None = None, arrival_time: float | None = None, remote: bool = False,
                    slo: tuple[float, float] | None = None, keep_session: bool | None = None) -> str:
        """Queue a request; with `session_id`, its prompt extends that session's conversation and reuses its KV.

        Runtime (decode role): `remote` means a prefill worker computes the new tokens; the request waits
        for their KV (`receive_kv`, then `on_kv_arrived`). `slo` = (TTFT, ITL) seconds for the core's stats.
        """
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
        text, ids = self._tokens(prompt)
        self._check_logit_bias(params)
        self._check_diffusion(params)
        full = params.prompt_logprobs is not None        # every prompt position computed here: no KV reused
        if full and remote:
            raise EngineError("a request with prompt_logprobs is prefilled on its decode worker, not remotely")
        grammar = self.structured.grammar(params.structured_output) if params.structured_output else None
        n = len(ids)
        if n >= self.max_model_len:
            raise EngineError(f"prompt of {n} tokens leaves no room to generate: the model's context "
                              f"(max_model_len) is {self.max_model_len} tokens")
        max_tokens = self.max_model_len - n
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if self.dllm is not None and self.dllm.canvas:      # LLaDA: the canvas holds G rounded up to whole blocks
            try:
                max_tokens = canvas_max_tokens(n, params.max_tokens, self.dllm.block, self.max_model_len)
            except ValueError as e:
                raise EngineError(str(e)) from None
        sid = session_id if session_id is not None else f"req-{request_id}"
        sess = self.sessions.get(sid)
        if sess is not None and sess.request is not None:
            raise EngineError(f"session {sid!r} already has a request running; send its rounds one at a time")
        if full or (sess is not None and ids[:len(sess.tokens)] != sess.tokens):
            self.core.release(sid)                   # rewritten, or every position must be computed: start afresh
            sess = None
        if sess is None:
            sess = self.sessions[sid] = _Session()
        now = self.clock() if arrival_time is None else arrival_time
        sess.tokens = list(ids)
        if self.config.enable_prefix_caching:
            extend_hashes(sess.hashes, ids, self.config.block_size)
        else:
            sess.hashes = []
        # a local round takes its prompt's cached prefix as history; a remote one keeps the history the
        # coordinator routed with (RoundBegun told it what begin_round below returns)
        hist = self.core.begin_round(sid, () if remote or full else sess.hashes, n)
        wid = self.core.id
        task = PrefillTask(sid, sess.rounds, hist, n - hist, now, output_tokens=max_tokens, decode_worker=wid,
                           worker=wid, local=not remote, block_hashes=tuple(sess.hashes), full_prefill=full)
        if slo is not None:
            task.ttft_slo_s, task.itl_slo_s = slo
        stop_params = params.clone()
        stop_params.max_tokens = max_tokens
        keep = session_id is not None if keep_session is None else keep_session
        req = _Request(request_id, sid, keep, text, list(ids), params,
                       StopChecker(stop_params, self.tokenizer.eos_token_ids, self._decoder(params), ids),
                       make_generator(params.seed, self.runner.device), RequestMetrics(now), task,
                       logprobs=[] if params.logprobs is not None else None,
                       cumulative_logprob=0.0 if params.logprobs is not None else None)
        req.grammar = grammar
        req.dllm_chunk = self._choose_chunk(sid, params)
        if full:
            req.prompt_logprobs = [None] * n
        sess.request = req
        sess.rounds += 1
        self.requests[request_id] = req
        if not remote:
            self.core.submit(task, now)
        return request_id

    # ------------------------------------------------------------------ disaggregation (runtime)
    def begin_round(self, session_id: str, prompt_token_ids: list[int] | None = None) -> int:
        """Pin a session's resident KV for its next round; returns how many tokens of it are resident. With the
        round's prompt, a session with nothing resident first takes the prompt's cached prefix as its history."""
        hashes: list[int] = []
        if prompt_token_ids and self.config.enable_prefix_caching:
            extend_hashes(hashes, prompt_token_ids, self.config.block_size)
        return self.core.begin_round(session_id, hashes, len(prompt_token_ids or ()))

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, session_id: str,
                    l_hist: int, round_idx: int = 0, arrival_time: float | None = None,
                    ttft_slo_s: float = float("inf"), hist_compute: int = 0) -> None:
        """Prefill role: compute tokens [l_hist, len) of a session on top of its history KV, read lazily; with
        `hist_compute` the last that many history tokens are computed here instead of read (vLLM-like PD sends the
        whole prompt). The KV sent back is always [l_hist, len)."""
        if self.role != PREFILL:
            raise EngineError("add_prefill() runs on a prefill worker")
        _, ids = self._tokens(list(prompt_token_ids))
        self._check_logit_bias(params)
        if params.prompt_logprobs is not None:
            raise EngineError("a request with prompt_logprobs is prefilled on its decode worker, not remotely")
        grammar = self.structured.grammar(params.structured_output) if params.structured_output else None
        if not 0 <= l_hist < len(ids):
            raise EngineError(f"history of {l_hist} tokens leaves nothing to prefill in a {len(ids)}-token prompt")
        if len(ids) > self.max_model_len:
            raise EngineError(f"prompt of {len(ids)} tokens exceeds max_model_len={self.max_model_len}")
        if isinstance(hist_compute, bool) or not isinstance(hist_compute, int) or not 0 <= hist_compute <= l_hist:
            raise EngineError(f"hist_compute must be an integer in [0, l_hist={l_hist}], got {hist_compute!r}")
        now = self.clock() if arrival_time is None else arrival_time
        task = PrefillTask(session_id, round_idx, l_hist, len(ids) - l_hist, now, decode_worker=-1,
                           worker=self.core.id, local=False, ttft_slo_s=ttft_slo_s, hist_compute=hist_compute)
        req = _Request(request_id, session_id, False, None, ids, params,
                       StopChecker(params, self.tokenizer.eos_token_ids, self._decoder(params), ids),
                       make_generator(params.seed, self.runner.device), RequestMetrics(now), task,
                       logprobs=[] if params.logprobs is not None else None)
        req.grammar = grammar
        self.requests[request_id] = req
        self._task_req[task] = req
        self.core.submit(task, now)

    def export_history(self, session_id: str, tokens: int) -> KVPayload:
        """Decode role: the first `tokens` positions of a resident session's KV (a remote prefill's history)."""
        seq = self.core.seqs.get(session_id)
        if seq is None or seq.num_tokens < tokens:
            have = 0 if seq is None else seq.num_tokens
            raise EngineError(f"session {session_id!r} has {have} tokens of KV here, {tokens} were asked for")
        return export_kv(self.runner.kv_caches, self.core.blocks.tables[seq], self.config.block_size, 0, tokens)

    def receive_kv(self, request_id: str, payload: KVPayload) -> None:
        """Keep KV that arrived for a request until the coordinator says where it goes (HistoryReady/KVArrived)."""
        if request_id not in self.requests:
            raise EngineError(f"KV for unknown request {request_id!r}")
        self._kv_inbox[request_id] = payload

    def on_history_ready(self, request_id: str) -> None:
        """Prefill role: the history KV is here: place it in the task's blocks and let the task run."""
        req = self.requests[request_id]
        payload = self._kv_inbox.pop(request_id)
        import_kv(self.runner.kv_caches, self.core.blocks.tables[req.task], self.config.block_size, 0, payload)
        self.core.on_history_fetched(req.task, self.clock())

    def export_new_kv(self, request_id: str) -> tuple[KVPayload, int, dict[int, float] | None]:
        """Prefill role: the KV this task computed, and the first token it sampled (with its logprobs)."""
        req = self.requests[request_id]
        t = req.task
        if req.first_token is None:
            raise EngineError(f"request {request_id!r} has not finished its prefill")
        payload = export_kv(self.runner.kv_caches, self.core.blocks.tables[t], self.config.block_size,
                            t.l_hist, t.l_hist + t.l_incr)
        tok, lps = req.first_token
        return payload, tok, lps

    def on_delivered(self, request_id: str) -> None:
        """Prefill role: the decode worker has the new KV: free it here."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._task_req.pop(req.task, None)
            self.core.on_delivered(req.task, self.clock())

    def on_kv_arrived(self, request_id: str, first_token: int,
                      first_logprobs: dict[int, float] | None = None) -> list[RequestOutput]:
        """Decode role: a remote prefill's KV (already received) and first token are here: start decoding."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            self._kv_inbox.pop(request_id, None)
            return []
        now = self.clock()
        touched = {request_id: req}
        stopped = self._append_token(req, first_token, first_logprobs, now)
        if stopped:
            req.task.output_tokens = 1                       # the first token already ends the round
        self._landing[req.session_id] = req
        self.core.on_kv_received(req.task, now)
        self._land_kv()
        self._on_events(self.core.drain(), now, touched)
        return self._collect(touched)

    def make_local(self, request_id: str) -> None:
        """Decode role: a remote round whose KV did not come is prefilled here instead (recompute)."""
        req = self.requests.get(request_id)
        if req is None or req.finished or req.task.local:
            return
        self._kv_inbox.pop(request_id, None)
        self._landing.pop(req.session_id, None)
        self.core.run_local(req.task, self.clock())

    def cache_config(self) -> dict[str, str]:
        """The labels of vllm:cache_config_info for this engine's KV cache and swap space."""
        cfg, core = self.config, self.core
        return {"block_size": str(cfg.block_size), "num_gpu_blocks": str(self.runner.num_blocks),
                "num_cpu_blocks": str(core.cfg.swap_blocks), "preemption_mode": core.cfg.preemption_mode.value,
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "cache_dtype": str(self.runner.kv_caches[0].dtype).removeprefix("torch.")}

    def _swap(self, swaps: list[Swap]) -> None:
        """Carry out the core's swaps in order on every rank: KV of preempted sequences to host memory and back, bit
        for bit."""
        self.runner.swap(swaps)
        self.stats.swapped_out_bytes = self.runner.swap_space.nbytes * self.config.tensor_parallel_size

    def close(self) -> None:
        """Release what outlives the engine object: a tensor-parallel group's rank processes. Idempotent."""
        self.runner.close()

    def _land_kv(self) -> None:
        """Place received KV once the core has given the session its blocks (FirstToken of a remote round)."""
        for ev in self.core.events:
            if isinstance(ev, FirstToken) and ev.session_id in self._landing:
                req = self._landing.pop(ev.session_id)
                payload = self._kv_inbox.pop(req.request_id)
                seq = self.core.seqs[req.session_id]
                import_kv(self.runner.kv_caches, self.core.blocks.tables[seq], self.config.block_size,
                          seq.num_tokens - payload.num_tokens, payload)

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

    def _check_diffusion(self, params: SamplingParams) -> None:
        """EngineError when a request's diffusion options do not fit this model (or it sets them on an AR model)."""
        try:
            check_diffusion(params, self.dllm.block if self.dllm is not None else None)
        except SamplingParamsError as e:
            raise EngineError(str(e)) from None
        if params.dllm_chunk is not None and self.dllm is not None and self.dllm.sparse is not None:
            raise EngineError(f"dllm_chunk {params.dllm_chunk} sizes Optimus's streaming windows; this engine decodes "
                              f"in dLLM-Serve phases, whose tokens do not depend on the load")

    def _choose_chunk(self, sid: str, params: SamplingParams) -> str | None:
        """The core's decision of the chunk this round decodes with (Optimus windows; None otherwise): the request's
        own `dllm_chunk`, else the engine's, `auto` giving a greedy or seeded request the whole block."""
        asked = parse_chunk(params.dllm_chunk) if params.dllm_chunk is not None else None
        spec = self.core.choose_chunk(sid, asked, reproducible=params.temperature == 0 or params.seed is not None)
        return str(spec) if spec is not None else None

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """EngineError when a logit_bias names a token id outside the model's vocabulary."""
        if not params.logit_bias:
            return
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise EngineError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")

    def _decoder(self, params: SamplingParams) -> Callable[[list[int]], str]:
        tok, skip = self.tokenizer, params.skip_special_tokens
        return lambda ids: tok.decode(ids, skip_special_tokens=skip)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV (its session's KV too; on a prefill worker, the task's)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if self.role == PREFILL:
            self.requests.pop(request_id, None)
            self._task_req.pop(req.task, None)
            self._kv_inbox.pop(request_id, None)
            self.core.cancel(req.task)
        elif not req.finished:
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
        prep = self.prepare_step()
        return self.finish_step(prep, self.execute_step(prep))

    def prepare_step(self) -> PreparedStep:
        """The first part of a step: the core plans the batch and its model input is built (engine state read)."""
        t0 = self.clock()
        core = self.core
        plan = core.schedule(t0)
        if core.swaps:
            self._swap(core.take_swaps())
        if self._landing:
            self._land_kv()
        prep = PreparedStep(plan, t0)
        if plan is None:
            return prep
        if self.dllm is not None:
            self._prepare_diffusion(prep)
            prep.t1 = self.clock()
            return prep
        batch = prep.batch = ModelInput()
        rows, prompt_lp = prep.rows, prep.prompt_lp
        tables = core.blocks.tables
        prefill_role = self.role == PREFILL
        for t, n in plan.prefill:
            start = t.first + t.done
            if prefill_role:
                req = self._task_req[t]
                batch.add(req.prompt_token_ids[start:start + n], start, tables[t])
            else:
                sess = self.sessions[t.session_id]
                batch.add(sess.tokens[start:start + n], start, tables[core.seqs[t.session_id]])
                req = sess.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
            req.metrics.num_computed_tokens += n
            if req.prompt_logprobs is not None and not t.recompute and not prefill_role:
                self._want_prompt_logprobs(batch, req, start, n, prompt_lp)
            if t.done + n == t.work and not t.recompute:
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
        if plan.shape.graph and not plan.decode:         # a LAPS short batch the core placed in a bucket
            batch.pad_to = plan.shape.prefill_tokens
            batch.bucket = (plan.shape.prefill_tokens // plan.shape.num_prefill, plan.shape.num_prefill)
        prep.t1 = self.clock()
        return prep

    def _prepare_diffusion(self, prep: PreparedStep) -> None:
        """A block-diffusion step: the plan's prefill chunks and decode windows (engine/diffusion/engine_step.py)."""
        plan, core, dllm = prep.plan, self.core, self.dllm
        tables = core.blocks.tables
        batch = prep.dbatch = DiffusionBatch()
        for t, n in plan.prefill:
            sess = self.sessions[t.session_id]
            start = t.first + t.done
            req = sess.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = prep.t0
            req.metrics.num_computed_tokens += n
            seq = core.seqs[t.session_id]
            dllm.prefill(batch, sess.tokens, start, n, t.done + n == t.work, tables[seq])
        for seq in plan.decode:
            sid = seq.session_id
            sess = self.sessions[sid]
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

    def execute_step(self, prep: PreparedStep) -> SampleOutput | None:
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

    def finish_step(self, prep: PreparedStep, out: SampleOutput | None) -> list[RequestOutput]:
        """The last part of a step: tokens appended, stops checked, the core told; returns the touched requests."""
        core = self.core
        touched: dict[str, _Request] = {}
        if prep.plan is None:
            t0 = prep.t0
            self._on_events(core.drain(), t0, touched)
            if not touched and self.role != PREFILL and not core.has_work():
                for req in [r for r in self.requests.values()
                            if not r.finished and (r.task.local or r.metrics.first_token_time is not None)]:
                    req.error = "the engine could not schedule this request"
                    self._finish(req, "abort", t0, release=True)
                    touched[req.request_id] = req
            return self._collect(touched)
        plan, t0, t1, t2 = prep.plan, prep.t0, prep.t1, prep.t2
        if prep.dbatch is not None:
            return self._finish_diffusion(prep)
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
            if self._append_token(req, tok, entry, t2):
                finished.add(req.session_id)
            touched[req.request_id] = req
        committed = {seq.session_id: 1 for seq in plan.decode}   # an AR step commits one token per sequence
        core.on_step_done(plan, StepResult(t2 - t0, committed, finished), t2)
        self._on_events(core.drain(), t2, touched)
        t3 = self.clock()
        st = self.stats
        st.steps += 1
        n_iter = sum(n for _, n in plan.prefill) + len(plan.decode)    # tokens through the model this step
        st.iteration_tokens[n_iter] = st.iteration_tokens.get(n_iter, 0) + 1
        st.execute_s += t2 - t1
        st.schedule_s += (t1 - t0) + (t3 - t2)
        return self._collect(touched)

    def _finish_diffusion(self, prep: PreparedStep) -> list[RequestOutput]:
        """A block-diffusion step's end: each request's committed prefix streamed, the core told what each
        sequence committed and which rounds a stop rule ended."""
        plan, t0, t1, t2 = prep.plan, prep.t0, prep.t1, prep.t2
        touched: dict[str, _Request] = {}
        finished: set[str] = set()
        for t, n in plan.prefill:                            # a preempted sequence recomputed: its active block
            if t.recompute and t.done + n >= t.work:         # is not cached any more
                st = self.dllm.states.get(t.session_id)
                if st is not None:
                    st.prefilled()
        for seq in plan.decode:
            sid = seq.session_id
            sess = self.sessions.get(sid)
            req = sess.request if sess is not None else None
            state = self.dllm.states.get(sid)
            if req is None or req.finished or state is None:
                continue                                     # aborted while the step ran (the core skips it too)
            for tok in state.take_committed():
                if self._append_token(req, tok, None, t2):
                    finished.add(sid)
                    break
            touched[req.request_id] = req
        self.core.on_step_done(plan, StepResult(t2 - t0, prep.committed, finished), t2)
        self._on_events(self.core.drain(), t2, touched)
        t3 = self.clock()
        st = self.stats
        st.steps += 1
        n_iter = prep.dbatch.tokens
        st.iteration_tokens[n_iter] = st.iteration_tokens.get(n_iter, 0) + 1
        if plan.decode:
            for c in prep.committed.values():
                st.dllm_commits[c] = st.dllm_commits.get(c, 0) + 1
            if self.core.chunker is not None:
                chunk = self.core.chunker.last
                st.dllm_chunks[chunk] = st.dllm_chunks.get(chunk, 0) + 1
        if self.core.dllm is not None:
            st.dllm_serve = self.core.dllm.stats.counters()
        st.execute_s += t2 - t1
        st.schedule_s += (t1 - t0) + (t3 - t2)
        return self._collect(touched)

    def _append_token(self, req: _Request, tok: int, logprobs: dict[int, float] | None, now: float) -> bool:
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

    @staticmethod
    def _want_prompt_logprobs(batch: ModelInput, req: _Request, start: int, n: int,
                              prompt_lp: list[tuple[_Request, int]]) -> None:
        """Ask the runner for the logprobs of the prompt tokens this chunk (positions start..start+n-1) predicts."""
        targets = req.prompt_token_ids[start + 1:start + n + 1]
        if targets:
            batch.prompt_logprobs.append(PromptLogprobsSpec(len(batch.query_lens) - 1, targets,
                                                            req.params.prompt_logprobs))
            prompt_lp.append((req, start + 1))

    def _sample_row(self, batch: ModelInput, req: _Request, row: int) -> None:
        batch.sample_rows.append(row)
        batch.params.append(req.params)
        batch.generators.append(req.generator)
        batch.output_tokens.append(req.stop.token_ids)
        batch.prompt_tokens.append(req.prompt_token_ids)
        batch.grammars.append(req.grammar)

    def _on_events(self, events: list, now: float, touched: dict[str, _Request]) -> None:
        if self.forward_events:
            self.core_events.extend(events)
        if self.role == PREFILL:
            return                                   # FetchHistory / PrefillDone are the coordinator's
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
                             num_cached_tokens=req.task.l_hist, prompt_logprobs=req.prompt_logprobs,
                             dllm_chunk=req.dllm_chunk)
