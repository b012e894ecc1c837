"""A worker's sans-I/O core: prefill queue, step scheduler, KV residency; plans steps, consumes results."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.core.block_manager import BlockManager
from tandem.core.laps_sched import LapsScheduler, LocalLaps
from tandem.core.config import (
    DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_WATERMARK, DEFAULT_WINDOW_S,
    PreemptionMode,
)
from tandem.core.stats import WindowedMean
from tandem.core.types import (
    COLOCATED, DECODE, PREFILL, FetchHistory, FirstToken, PrefillDone, PrefillTask,
    RoundDone, Seq, SeqState, SessionFailed, StepPlan, StepResult, Swap, SwapKind,
)
from tandem.policy.dllm_serve import Candidate, DllmServe, Phase, PhaseState
from tandem.policy.optimus.chunk import ChunkMode, ChunkSizer, ChunkSpec, SeqWindow, request_chunk
from tandem.policy.reorder import FCFS, Picker
from tandem.policy.routing import itl_chunk_tokens

NEW, PREFILLING, RUNNING, IDLE, EVICTED, FAILED, RELEASED, SWAPPED = (
    SeqState.NEW, SeqState.PREFILL, SeqState.RUNNING, SeqState.IDLE, SeqState.EVICTED, SeqState.FAILED,
    SeqState.RELEASED, SeqState.SWAPPED)


def _admission_order(seq: Seq) -> int:
    return seq.order


@dataclass(slots=True)
class WorkerConfig:
    """Scheduling knobs of one worker (vLLM names where they exist); defaults are SchedulerConfig's. Shells
    get one from tandem.core.factory.build_worker, never by hand."""

    role: str
    tp: int
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # sequences prefilling or decoding at once
    mix_decode_with_prefill: bool = False   # co-located chunked prefill: decodes ride along prefill chunks
    retain_s: float = 0.0                   # idle session KV is pinned this long after a round (Continuum TTL)
    watermark: float = DEFAULT_WATERMARK    # share of blocks an admitted prefill must leave free so sequences can
                                            # grow (vLLM's watermark); waived for a context that needs the rest
    window_s: float = DEFAULT_WINDOW_S      # windowed TTFT/ITL statistics
    decode_query_tokens: int = 1            # query tokens per decode step (1: AR; >1: multi-token steps)
    itl_chunk_beta: float | None = None     # decode worker: local prefills ride along the decodes in chunks whose
                                            # estimate fits itl_chunk_beta * the round's ITL SLO (None: prefill-first)
    dllm_block: int = 0                     # block-diffusion decoding: positions per block (0: autoregressive)
    dllm_prefill_share: float = 0.5         # elastic windows leave waiting prefills up to this share of the budget
    dllm_admission: str = ""                # dLLM-Serve mode (co-located diffusion workers): Refresh/Reuse phases
                                            # packed by "phase", "static" or "reserve" admission ("": Optimus windows)
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE   # how a running sequence gives up its KV
    swap_blocks: int = 0                    # host KV blocks for preemption by swap (falls back to recompute when full)


class WorkerCore:
    """One prefill, decode or co-located worker. Shells call events in, `schedule`, `on_step_done`, `drain`."""

    def __init__(self, wid: int, cfg: WorkerConfig, picker: Picker | None = None,
                 t_pre: Callable[[int, int], float] | None = None, laps: LapsScheduler | None = None,
                 local_laps: LocalLaps | None = None, chunker: ChunkSizer | None = None,
                 dllm: DllmServe | None = None) -> None:
        self.id = wid
        self.cfg = cfg
        self.role = cfg.role
        self.picker = picker or FCFS()
        self.t_pre = t_pre or (lambda h, n: 0.0)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size)
        self.capacity_tokens = cfg.num_blocks * cfg.block_size
        self.queue: list[PrefillTask] = []          # waiting prefill tasks, in picking order
        self.active: list[PrefillTask] = []         # admitted prefills (memory held), chunk by chunk
        self.seqs: dict[str, Seq] = {}              # session residency (decode / co-located)
        self.running: list[Seq] = []                # sequences decoding
        self.idle: dict[str, Seq] = {}              # resident between rounds, oldest first (LRU)
        self.pending_kv: list[PrefillTask] = []     # remote KV that arrived before memory was free
        self.swapped: list[Seq] = []                # preempted by swap, in admission order (resumed first to last)
        self.swap_blocks = cfg.swap_blocks if cfg.preemption_mode is PreemptionMode.SWAP else 0   # host KV blocks
        self.swap_free = self.swap_blocks
        self.swaps: list[Swap] = []                 # KV copies for the shell to carry out before its next forward
        self.preempted = {m: 0 for m in PreemptionMode}   # preemptions so far, by how they freed the KV
        self.ttft = WindowedMean(cfg.window_s)
        self.itl = WindowedMean(cfg.window_s)
        self.queued_est_s = 0.0                     # Σ estimated compute of queued tasks (AMPD Eq. 1-2)
        self.busy = False
        self._wake_s = math.inf                     # when a pinned idle session becomes evictable
        self.events: list = []
        self._order = 0
        self._ctx = 0                               # Σ num_tokens over running sequences
        self.watermark_blocks = int(cfg.watermark * cfg.num_blocks)
        self.steps = 0
        self.busy_s = 0.0
        self.busy_window = WindowedMean(cfg.window_s)   # step time within the window: utilisation
        self.laps = laps if cfg.role == PREFILL else None   # LAPS temporal disaggregation (prefill workers)
        self.local_laps = local_laps if cfg.role == DECODE else None   # AMPD+LAPS: AWD over local short prefills
        self.dllm = dllm if cfg.dllm_block else None       # dLLM-Serve: Refresh/Reuse phases, phase admission
        self._phase: dict[str, PhaseState] = {}             # dLLM-Serve: each running request's phase state
        self.last_phases: dict[str, Phase] = {}             # dLLM-Serve: the phase of each request of the last plan
        self.chunker = chunker if cfg.dllm_block and self.dllm is None else None  # Optimus: each step's window
        self._chunks: dict[str, ChunkSpec] = {}      # diffusion: the chunk each session's current round decodes with
        self._default_chunk = request_chunk(chunker.spec) if self.chunker is not None else None   # a round never told
        self._sat_out: dict[str, int] = {}           # diffusion: steps a running sequence has sat out in a row
        if cfg.dllm_admission:
            if self.dllm is None or self.dllm.mode != cfg.dllm_admission:
                raise ValueError(f"a dLLM-Serve worker ({cfg.dllm_admission!r} admission) needs its DllmServe "
                                 f"policy (tandem.core.factory.build_worker)")
            if cfg.role != COLOCATED:
                raise ValueError(f"dLLM-Serve admission runs on co-located workers (a request's first step is its "
                                 f"prefill and its first Refresh), not on a {cfg.role} worker")
        elif dllm is not None:
            raise ValueError("a DllmServe policy was given to a worker whose configuration has no dllm_admission")
        if self.dllm is not None:                  # sparse KV: a request of L positions keeps ⌈ρ·L⌉ of them, so the
            rho = self.dllm.phases.spec.retention   # longest sequence the pool holds is pool / ρ (what the
            self.capacity_tokens = int(self.capacity_tokens / rho + 1e-9)   # coordinator checks rounds against)
        if cfg.dllm_block and self.chunker is None and self.dllm is None:
            raise ValueError("a block-diffusion worker needs a ChunkSizer (tandem.core.factory.build_worker)")

    @property
    def wake_s(self) -> float:
        """When the shell should call schedule again although no event came: a pinned idle session becomes
        evictable, or an AWD batcher (LAPS) reaches its next decision."""
        w = self._wake_s
        if self.local_laps is not None and self.local_laps.wake_at_s < w:
            w = self.local_laps.wake_at_s
        return w

    @wake_s.setter
    def wake_s(self, value: float) -> None:
        self._wake_s = value

    # ---------------------------------------------------------------- events in
    def attach(self, sid: str) -> Seq:
        """Make this worker the home of session `sid` (AMPD binding)."""
        seq = self.seqs.get(sid)
        if seq is None:
            seq = self.seqs[sid] = Seq(sid)
        return seq

    def begin_round(self, sid: str, block_hashes: Sequence[int] = (), prompt_tokens: int = 0) -> int:
        """A new round of `sid` arrives: pin its KV and return how many history tokens are resident. A session
        with nothing resident first takes the longest cached prefix of its prompt (`block_hashes`: the chained
        hashes of the prompt's full blocks, `prompt_tokens` long) from the prefix cache, leaving at least one
        token to compute; those tokens then count as its history, wherever its prefill runs."""
        seq = self.attach(sid)
        self.idle.pop(sid, None)
        seq.state = PREFILLING
        if block_hashes and seq.num_tokens == 0 and not self.blocks.held(seq) and prompt_tokens > 1 \
                and self.dllm is None:                # bidirectional: a prompt's KV depends on the whole sequence
            usable = block_hashes[:(prompt_tokens - 1) // self.cfg.block_size]
            blocks = self.blocks.match_prefix(usable) if usable else ()
            B = self.cfg.dllm_block
            if B and blocks:                         # block-causal: only whole diffusion blocks of the prefix
                whole = len(blocks) * self.cfg.block_size // B * B
                blocks = blocks[:whole // self.cfg.block_size] if whole % self.cfg.block_size == 0 else ()
            if blocks:
                self.blocks.share(seq, blocks)
                seq.num_tokens = len(blocks) * self.cfg.block_size
                seq.cap = seq.num_tokens
        return seq.num_tokens

    def submit(self, task: PrefillTask, now: float) -> None:
        """Enqueue a prefill task routed to this worker."""
        task.worker = self.id
        if self.dllm is not None and not self._dllm_fits(task, now):
            return
        task.est_s = self.t_pre(task.first, task.work)
        if task.recompute:
            self.queue.insert(0, task)
        else:
            self.queue.append(task)
        self.queued_est_s += task.est_s
        if self.laps is not None:
            self.laps.add(task, now)
        elif self.local_laps is not None:
            self.local_laps.add(task, now)

    def run_local(self, task: PrefillTask, now: float) -> None:
        """A remote round's KV transfer failed or timed out: prefill it here (decode role) on top of the resident
        history, as a local task from the start."""
        if task.session_id not in self.seqs:
            return                                   # session ended meanwhile
        if task in self.pending_kv:
            self.pending_kv.remove(task)
        task.local, task.done, task.kv_ready, task.start_s, task.hist_compute = True, 0, True, None, 0
        self.submit(task, now)

    def on_history_fetched(self, task: PrefillTask, now: float) -> None:
        """The lazily read history KV of a remote task has arrived here."""
        task.kv_ready = True

    def on_delivered(self, task: PrefillTask, now: float) -> None:
        """A remote task's new KV reached its decode worker: free it here and count its TTFT."""
        self.blocks.free(task)
        self.ttft.add(now, now - task.enqueue_s)

    def on_kv_received(self, task: PrefillTask, now: float) -> None:
        """Incremental KV computed remotely has landed on this (decode) worker: start decoding."""
        seq = self.seqs.get(task.session_id)
        if seq is None:
            return                                   # session ended or failed meanwhile
        if not self._reserve(seq, seq.num_tokens + task.l_incr, now, preempt=False):
            if not self._never_fits(seq.num_tokens + task.l_incr + 1, task, now):
                self.pending_kv.append(task)         # waits, like a vLLM request, for memory to free
            return
        self._start_decoding(seq, task, now)

    def release(self, sid: str) -> None:
        """The session is over (or failed): free its KV and forget it."""
        seq = self.seqs.pop(sid, None)
        if seq is None:
            return
        self.idle.pop(sid, None)
        if seq.state is RUNNING:
            self.running.remove(seq)
            self._ctx -= seq.num_tokens
        elif seq.state is SWAPPED:                   # its host copy is dropped
            self.swapped.remove(seq)
            self.swap_free += seq.swapped_blocks
            seq.swapped_blocks = 0
            self.swaps.append(Swap(SwapKind.DROP, sid, ()))
        seq.state = RELEASED                         # a step in flight must not commit into it
        self._phase.pop(sid, None)
        self._chunks.pop(sid, None)
        kept = [t for t in self.queue if t.session_id != sid]
        if self.laps is not None:
            for t in [*self.queue, *self.active]:
                if t.session_id == sid:
                    self.laps.discard(t)
        elif self.local_laps is not None:
            for t in self.queue:
                if t.session_id == sid:
                    self.local_laps.discard(t)
        if len(kept) != len(self.queue):
            self.queue = kept
            self.queued_est_s = sum(t.est_s for t in kept)
        self.active = [t for t in self.active if t.session_id != sid]
        self.pending_kv = [t for t in self.pending_kv if t.session_id != sid]
        self.blocks.free(seq)

    def cancel(self, task: PrefillTask) -> None:
        """Drop a prefill task (its request was aborted) and, on a prefill worker, free its KV."""
        if task in self.queue:
            self.queue.remove(task)
            self.queued_est_s -= task.est_s
        if task in self.active:
            self.active.remove(task)
        if self.laps is not None:
            self.laps.discard(task)
        elif self.local_laps is not None:
            self.local_laps.discard(task)
        if self.role == PREFILL:
            self.blocks.free(task)

    # ---------------------------------------------------------------- scheduling
    def schedule(self, now: float) -> StepPlan | None:
        """Form the next step: admit prefills (picker order), then prefill chunks and/or decodes."""
        if self.dllm is not None:
            return self._schedule_phases(now)
        if self.swapped:
            self._swap_in(now)
        if self.pending_kv:
            self._retry_pending(now)
        laps = self.laps
        if laps is not None and laps.opts.split:
            plan = laps.schedule(self, now)
            self.wake_s = laps.wake_at_s if plan is None else math.inf
            return plan
        local = self.local_laps
        if local is not None:
            local.release(now)                       # AWD lets a batch of held short local prefills in
        if not self.swapped:                         # swapped-out sequences resume before new work starts (vLLM)
            self._admit(now)
        budget = self.cfg.max_num_batched_tokens
        plan = StepPlan(self.id)
        shape = plan.shape
        mix = self.cfg.mix_decode_with_prefill
        chunk_beta = self.cfg.itl_chunk_beta
        if self.role != PREFILL and self.running:
            ready = any(t.kv_ready for t in self.active)
            if chunk_beta is not None and ready:
                mix = True                           # Sarathi-style: the decodes go on beside the local prefill
            if mix or not ready:
                self._grow_running(now)
                if not self.running and not self.active and not self.swapped:
                    self._admit(now)                 # growth preempted everything: the freed pool goes to the queue
                if self.running:
                    plan.decode = list(self.running)
                    if self._sat_out:                # diffusion: those sitting this step out (a full budget)
                        plan.decode = [seq for seq in plan.decode if seq.query_tokens]
                    if self.cfg.decode_query_tokens == 1 and not self.cfg.dllm_block:
                        n = len(plan.decode)
                        shape.num_decode = n
                        shape.decode_ctx_tokens = self._ctx + n
                    elif self.cfg.dllm_block:        # diffusion windows: bidirectional rows over the cached keys
                        B = self.cfg.dllm_block
                        for seq in plan.decode:
                            q = seq.query_tokens     # plain block diffusion recomputes the block from its start;
                            # streaming reads every committed position's K/V but the ones it writes now
                            start = (seq.num_tokens - seq.num_tokens % B if self._whole(seq)
                                     else seq.num_tokens - seq.kv_pending - seq.kv_prompt)
                            shape.add_window(start, q)
                        n = shape.num_decode
                    else:                            # multi-token steps: every query position counts as a row
                        n, ctx = 0, 0
                        for seq in plan.decode:
                            q = seq.query_tokens
                            n += q
                            ctx += q * seq.num_tokens + q * (q + 1) // 2
                        shape.num_decode = n
                        shape.decode_ctx_tokens = ctx
                    budget -= n
                    if not mix:
                        return plan
        for t in self.active:
            if budget <= 0:
                break
            if not t.kv_ready:
                continue
            n = t.work - t.done
            if n > budget:
                n = budget
                if self.cfg.dllm_block:              # block-causal: a chunk ends on a block boundary (a query
                    n -= (t.first + t.done + n) % self.cfg.dllm_block   # sees all of its block)
                    if n <= 0:
                        break
            before = t.first + t.done
            if chunk_beta is not None and plan.decode:
                if plan.prefill:
                    break                            # one ITL-budget chunk a step
                if math.isfinite(t.itl_slo_s):
                    n = itl_chunk_tokens(self.t_pre, before, n, chunk_beta * t.itl_slo_s)
            plan.prefill.append((t, n))
            cost = n                                 # the tokens this chunk computes
            if self.chunker is not None and t.done + n == t.work:   # the prompt's last, partial block is computed
                cost -= (t.first + t.work) % self.cfg.dllm_block   # with the windows (Seq.kv_prompt), not here
            budget -= cost
            if cost > 0:
                shape.prefill_tokens += cost
                shape.prefill_attn_pairs += cost * (before + (cost + 1) / 2)
                shape.prefill_kv_read_tokens += before
                shape.num_prefill += 1
        if not plan.prefill and not plan.decode:
            if (self.pending_kv or self._admissible()) and self.role != PREFILL and not self.active and not self.running \
                    and self.wake_s == math.inf and self._unstick(now):
                return self.schedule(now)            # the freed histories let the queue in now
            return None
        if laps is not None:
            laps.pad_if_short(plan)
        elif local is not None:
            local.pad_if_short(plan)
        return plan

    # ---------------------------------------------------------------- dLLM-Serve phases
    def _dllm_fits(self, task: PrefillTask, now: float) -> bool:
        """dLLM-Serve mode: a request whose largest step exceeds the token budget, or whose KV buffer exceeds the
        pool, can never run here; its session fails with the reason (True: it can run)."""
        seq = self.seqs.get(task.session_id)
        prompt = (seq.num_tokens if seq is not None else 0) + task.l_incr
        phases = self.dllm.phases
        peak = phases.peak_tokens(prompt, task.output_tokens)
        if not self.dllm.admission.fits_alone(peak):
            reason = (f"a Refresh of {peak} query tokens (prompt {prompt} + generation {task.output_tokens}) exceeds "
                      f"the step's token budget, max_num_batched_tokens {self.cfg.max_num_batched_tokens}")
        elif self._kv_positions(phases.kv_tokens(prompt, task.output_tokens)) > self.cfg.num_blocks * self.cfg.block_size:
            reason = (f"KV exceeds the worker's capacity: a buffer of {phases.kv_tokens(prompt, task.output_tokens)} "
                      f"positions on a {self.role} worker of {self.cfg.num_blocks * self.cfg.block_size}")
        else:
            return True
        self.events.append(SessionFailed(task.session_id, self.id, now, reason))
        return False

    def _kv_positions(self, tokens: int) -> int:
        """Pool positions a buffer of `tokens` takes (whole KV blocks)."""
        bs = self.cfg.block_size
        return -(-tokens // bs) * bs

    def _schedule_phases(self, now: float) -> StepPlan | None:
        """dLLM-Serve mode: pack the running requests' phases (Refresh: the sequence length; Reuse: the active block)
        and the first steps of newly admitted requests under max_num_batched_tokens, as the DllmServe policy decides
        (tandem/policy/dllm_serve); an admitted request holds its fixed KV buffer until its round ends."""
        dllm = self.dllm
        phases = dllm.phases
        step = self.steps
        table = self._phase
        running = [Candidate(seq, phases.demand(st), phases.peak_tokens(st.prompt, st.gen), 0, st.last_run, st.order)
                   for seq in self.running for st in (table[seq.session_id],)]
        sel = dllm.admission.select(running, self._queued_candidates(), self.blocks.num_free * self.cfg.block_size)
        for seq in sel.deferred:
            st = table[seq.session_id]
            st.deferred += 1
            dllm.stats.deferrals += 1
            if st.deferred > dllm.stats.max_deferred:
                dllm.stats.max_deferred = st.deferred
        ran_before = bool(sel.run)
        admitted = []
        for t in sel.admit:
            seq = self._admit_phases(t, step, now)
            if seq is not None:
                admitted.append(seq)
        if admitted:
            dllm.stats.admitted += len(admitted)
            if ran_before:
                dllm.stats.admitted_while_running += len(admitted)
        batch = sel.run + admitted
        if not batch:
            return None
        plan = StepPlan(self.id)
        shape = plan.shape
        stats = dllm.stats
        phase_of = {}
        tokens = 0
        for seq in batch:
            st = table[seq.session_id]
            st.deferred = 0
            st.last_run = step
            ph = phases.phase(st)
            q = phases.demand(st)
            rows = phases.block_len(st)              # logits: the active block's positions (its candidates)
            seq.query_tokens = q
            seq.commit_cap = phases.left(st)
            seq.writes_kv = ph is Phase.REFRESH
            if ph.full_length:                       # the whole sequence, bidirectional: a prefill-like recompute
                shape.prefill_tokens += q
                shape.prefill_attn_pairs += q * q
                shape.num_prefill += rows
            else:                                    # the active block over the retained keys
                shape.add_window(phases.reuse_context(st), q)
            phase_of[seq.session_id] = ph
            stats.seq_steps[ph.value] += 1
            stats.phase_tokens[ph.value] += q
            tokens += q
        stats.steps += 1
        stats.tokens += tokens
        if tokens > stats.max_tokens:
            stats.max_tokens = tokens
        if len(self.running) > stats.max_running:
            stats.max_running = len(self.running)
        self.last_phases = phase_of
        plan.decode = batch
        return plan

    def _queued_candidates(self):
        """The queue's requests, FCFS, as admission reads them (lazily: admission stops at the first it refuses)."""
        phases = self.dllm.phases
        for i, t in enumerate(self.queue):
            seq = self.seqs.get(t.session_id)
            prompt = (seq.num_tokens if seq is not None else 0) + t.l_incr
            gen = t.output_tokens
            yield Candidate(t, phases.first_tokens(prompt, gen), phases.peak_tokens(prompt, gen),
                            self._kv_positions(phases.kv_tokens(prompt, gen)), order=i)

    def _admit_phases(self, t: PrefillTask, step: int, now: float) -> Seq | None:
        """Start a queued request: its KV buffer, its first step (this one), its phase state."""
        self.queue.remove(t)
        self.queued_est_s -= t.est_s
        seq = self.seqs.get(t.session_id)
        if seq is None:
            return None
        prompt = seq.num_tokens + t.l_incr
        phases = self.dllm.phases
        kv = phases.kv_tokens(prompt, t.output_tokens)
        if not self._reserve(seq, kv, now, preempt=False):   # admission checked the free pool
            raise RuntimeError(f"dLLM-Serve admission of {t.session_id!r}: {kv} KV positions not free")
        t.start_s = now
        self._start_decoding(seq, t, now)
        if seq.state is not RUNNING:
            return None
        self._phase[seq.session_id] = phases.new(prompt, t.output_tokens, seq.order, step)
        return seq

    def phase_of(self, sid: str) -> Phase | None:
        """dLLM-Serve mode: the phase the session's request ran in the last step planned (None: not in it)."""
        return self.last_phases.get(sid)

    def choose_chunk(self, sid: str, asked: ChunkSpec | None = None, reproducible: bool = False) -> ChunkSpec | None:
        """Optimus windows: decide the chunk session `sid`'s next round decodes with (`request_chunk`: the request's
        own, else the worker's; `auto` gives the whole block to a request that wants reproducible tokens, greedy or
        seeded) and keep it for that round's steps; None on a worker without windows (AR, dLLM-Serve phases)."""
        if self.chunker is None:
            return None
        spec = self._chunks[sid] = request_chunk(self.chunker.spec, asked, reproducible)
        return spec

    def chunk_of(self, sid: str) -> ChunkSpec | None:
        """The chunk session `sid` decodes with (None on a worker without windows)."""
        if self.chunker is None:
            return None
        return self._chunks.get(sid, self._default_chunk)

    def _whole(self, seq: Seq) -> bool:
        """Whether the sequence decodes by plain block diffusion (every step recomputes its whole block)."""
        return self._chunks.get(seq.session_id, self._default_chunk).mode is ChunkMode.BLOCK

    def dllm_stats(self) -> dict:
        """dLLM-Serve mode: the worker's phase and admission counters ({} in other modes)."""
        return self.dllm.stats.as_dict() if self.dllm is not None else {}

    def _admissible(self) -> bool:
        """Whether a queued task may be admitted now (not held by the local AWD batcher)."""
        local = self.local_laps
        if local is None or not len(local.short):
            return bool(self.queue)
        return any(not local.holds(t) for t in self.queue)

    def admit_task(self, t: PrefillTask, now: float) -> bool:
        """Admit one queued task of a prefill worker (LAPS picks which): hold memory for its history and new
        tokens, start reading its history; False when memory is short (it stays queued)."""
        if not self._reserve(t, t.l_hist + t.l_incr, now, preempt=False):
            self._never_fits(t.l_hist + t.l_incr, t, now)
            return False
        self.queue.remove(t)
        self.queued_est_s -= t.est_s
        t.start_s = now
        self.active.append(t)
        if t.first > 0:
            t.kv_ready = False
            self.events.append(FetchHistory(t, t.first))
        return True

    def _admit(self, now: float) -> None:
        budget = self.cfg.max_num_batched_tokens
        pending = sum(t.work - t.done for t in self.active)
        cap = self.cfg.max_num_seqs - len(self.running)
        local = self.local_laps
        while self.queue and pending < budget and len(self.active) < cap:
            if local is not None and len(local.short):   # tasks AWD still holds are not candidates
                cand = [t for t in self.queue if not local.holds(t)]
                if not cand:
                    break
                t = cand[self.picker.pick(cand, now)]
                i = self.queue.index(t)
            else:
                i = self.picker.pick(self.queue, now)
                t = self.queue[i]
            if self.role == PREFILL:
                owner, need = t, t.l_hist + t.l_incr
            else:
                owner = self.seqs.get(t.session_id)
                if owner is None:                    # released while queued
                    self.queue.pop(i)
                    self.queued_est_s -= t.est_s
                    continue
                if (t.block_hashes and not t.full_prefill and t.l_hist == 0 and owner.num_tokens == 0
                        and not self.blocks.held(owner)):
                    self._reuse_prefix(owner, t)
                need = owner.num_tokens + t.l_incr
            headroom = 0
            if self.role != PREFILL and -(-need // self.cfg.block_size) + self.watermark_blocks <= self.cfg.num_blocks:
                headroom = self.watermark_blocks     # room for the running sequences (and this one) to grow
            if not self._reserve(owner, need, now, preempt=False, headroom=headroom):
                self._never_fits(need, t, now)
                break
            self.queue.pop(i)
            self.queued_est_s -= t.est_s
            t.start_s = now
            self.active.append(t)
            pending += t.work
            if self.role == PREFILL and t.first > 0:
                t.kv_ready = False
                self.events.append(FetchHistory(t, t.first))

    def _reuse_prefix(self, seq: Seq, t: PrefillTask) -> None:
        """Take the cached blocks of the task's leading full blocks; at least one token is always computed."""
        bs = self.cfg.block_size
        usable = t.block_hashes[:(t.l_incr - 1) // bs]
        blocks = self.blocks.match_prefix(usable) if usable else ()
        if not blocks:
            return
        self.blocks.share(seq, blocks)
        n = len(blocks) * bs
        seq.num_tokens = n
        t.l_hist, t.l_incr, t.cached, t.hashed = n, t.l_incr - n, n, len(blocks)
        self.queued_est_s -= t.est_s
        t.est_s = self.t_pre(t.l_hist, t.l_incr)
        self.queued_est_s += t.est_s

    def _register_blocks(self, t: PrefillTask) -> None:
        """Publish the task's newly completed full blocks in the prefix cache."""
        full = min((t.first + t.done) // self.cfg.block_size, len(t.block_hashes))
        if full <= t.hashed:
            return
        owner = t if self.role == PREFILL else self.seqs.get(t.session_id)
        if owner is None or self.blocks.held(owner) < full:
            return
        for i in range(t.hashed, full):
            self.blocks.register(owner, i, t.block_hashes[i])
        t.hashed = full

    def _grow_running(self, now: float) -> None:
        """Every running sequence may write KV for its query tokens this step (one for AR, up to
        decode_query_tokens, never past its round's end); preempt by recompute if short."""
        if self.cfg.dllm_block:
            self._size_windows()
            short = any(self._kv_target(seq) > seq.cap for seq in self.running)
            if not short:
                return
            q_max = 0
        else:
            q_max = self.cfg.decode_query_tokens
        if q_max == 1:                               # AR: one token each (the hot path of the simulator)
            for seq in self.running:
                if seq.num_tokens + 1 > seq.cap:
                    break
            else:
                return
        elif q_max > 1:
            short = False
            for seq in self.running:
                q = seq.to_decode if seq.to_decode < q_max else q_max
                seq.query_tokens = seq.commit_cap = q = q if q > 0 else 1
                if seq.num_tokens + q > seq.cap:
                    short = True
            if not short:
                return
        for seq in list(self.running):
            grow = self._kv_target(seq)
            if seq.state is RUNNING and grow > seq.cap:
                if grow > self.capacity_tokens:      # outgrew the whole pool: no preemption helps
                    self.running.remove(seq)
                    self._ctx -= seq.num_tokens
                    self.blocks.free(seq)
                    seq.num_tokens, seq.cap, seq.state = 0, 0, FAILED
                    self.events.append(SessionFailed(
                        seq.session_id, self.id, now, f"KV exceeds the worker's capacity: "
                        f"{grow} tokens on a {self.role} worker of {self.capacity_tokens}"))
                    continue
                if not self._reserve(seq, grow, now, preempt=True):
                    self._preempt(seq, now)          # could not free enough: preempt itself

    def _kv_target(self, seq: Seq) -> int:
        """Positions whose KV slots a running sequence needs this step: its next tokens (AR, multi-token), or the
        whole active diffusion block up to max_tokens (a decoded position's K/V sit at its own position, which may
        lie anywhere in the block)."""
        B = self.cfg.dllm_block
        if not B:
            return seq.num_tokens + seq.commit_cap
        end = seq.num_tokens - seq.num_tokens % B + B
        limit = seq.num_tokens + seq.to_decode
        return end if end < limit else limit

    def _size_windows(self) -> None:
        """Block diffusion: this step's window per sequence. The chunk sizer picks each sequence's window within the
        token budget, less what waiting prefills keep of it (dllm_prefill_share of the budget at most: the diffusion
        engines Optimus builds on run prefills first, and windows that fill the budget would starve them); a window
        stays within the active block (blocks are aligned to absolute positions): min(c, masked positions left in
        the block) for a fixed chunk c, a size of its own for elastic, which it may commit, besides the K/V writes of
        the last commits and the prompt's leftover tokens it carries (outside c, taken out of the budget first);
        plain block diffusion (c = B) computes the whole block. When more prompts are ready than fit beside the smallest windows, the sizer is told the rows they fill:
        the windows then displace prompt rows, and it prices them so. When even windows of one position do not fit
        the budget (elastic; the carried rows fill it), or a fixed chunk's or the block's windows overflow it (the
        budget caps every step, as in vLLM; a fixed chunk leaves no share to waiting prefills), the sizer runs the
        first sequences that fit and the others sit the step out, those that sat out longest going first next time.
        Under elastic and auto each session decodes in the mode decided for its round (`choose_chunk`): a whole block
        or a fixed chunk rides in the elastic steps with its window pinned, priced with them."""
        B = self.cfg.dllm_block
        budget = self.cfg.max_num_batched_tokens
        admitted = ready = 0                         # prompt rows admitted; of those, the ones this step runs beside
        for t in self.active:                        # the windows (sized only when the step mixes, or when no
            left = t.work - t.done                   # prompt is ready)
            admitted += left
            if t.kv_ready:
                ready += left
        waiting = admitted + sum(t.work for t in self.queue)
        claim = min(waiting, int(self.cfg.dllm_prefill_share * budget))   # what waiting prefills keep of the step
        elastic = self.chunker.elastic
        sat = self._sat_out                          # longest sat out first, else in running order
        order = sorted(self.running, key=lambda q: -sat.get(q.session_id, 0)) if sat else self.running
        lefts = [self._masked_left(seq) for seq in order]
        wholes = [self._whole(seq) for seq in order]
        seqs = []
        for left, whole, seq in zip(lefts, wholes, order):
            if not elastic:                          # one mode for all: the sizer's own (the block carries nothing)
                seqs.append(SeqWindow(left, seq.kv_pending, seq.kv_prompt, seq.num_tokens, seq.tried))
            elif whole:                              # a request's block beside elastic windows: pinned, with its
                # decoded positions and prompt tokens, recomputed every step, as extra rows
                seqs.append(SeqWindow(left, seq.kv_pending, B - left, seq.num_tokens, seq.tried, B))
            else:                                    # elastic, or a request's fixed chunk (pinned)
                spec = self.chunk_of(seq.session_id)
                pin = spec.size if spec is not None and spec.mode is ChunkMode.FIXED else 0
                seqs.append(SeqWindow(left, seq.kv_pending, seq.kv_prompt, seq.num_tokens, seq.tried, pin))
        carried = 0                                  # rows riding with the windows: K/V writes, prompts' tails
        if elastic or not self.chunker.recomputes_block:
            carried = sum(s.pending + s.extra for s in seqs)
        full = budget - carried                      # the prompt rows that fill the step, when more are ready than
        # fit beside the smallest windows
        windows = self.chunker.plan(seqs, room=full - claim if elastic else full,
                                    prompts=full if 0 < full < ready + len(self.running) else 0).windows
        n = len(windows)
        if n < len(order) or sat or 0 in windows:
            self._sat_out = {seq.session_id: sat.get(seq.session_id, 0) + 1
                             for i, seq in enumerate(order) if i >= n or not windows[i]}
        for i, (left, whole, seq) in enumerate(zip(lefts, wholes, order)):
            pending = seq.kv_pending
            if i >= n or not windows[i]:             # sits this step out (the budget holds the others)
                seq.commit_cap = seq.query_tokens = 0
            elif whole:                              # the block, plus a completed block's first write
                seq.commit_cap = left
                seq.query_tokens = B + pending
            else:                                    # streaming: its window, besides the writes and the tail
                m = windows[i]
                seq.commit_cap = m
                seq.query_tokens = m + pending + seq.kv_prompt

    def _masked_left(self, seq: Seq) -> int:
        """Masked positions of a diffusion sequence's active block, at most its tokens still to decode: what a window
        may cover (the sizer prices it, N_commit learns by it)."""
        B = self.cfg.dllm_block
        return min(B - seq.num_tokens % B, seq.to_decode)

    def _reserve(self, owner, tokens: int, now: float, preempt: bool, headroom: int = 0) -> bool:
        """Ensure `owner` holds blocks for `tokens` with `headroom` blocks left free, evicting idle KV and,
        if allowed, preempting."""
        blocks = self.blocks
        need = blocks.extra_blocks(owner, tokens) + headroom
        if blocks.num_free < need and not self._evict_idle(need, now):
            if not preempt or not self._preempt_for(need, owner, now):
                return False
        blocks.grow(owner, tokens)
        if isinstance(owner, Seq):
            owner.cap = blocks.held(owner) * self.cfg.block_size
        return True

    def _evict_idle(self, need: int, now: float) -> bool:
        """Free idle sessions' KV, least recently used first, skipping pinned ones; True if enough."""
        blocks = self.blocks
        wake = math.inf
        for sid in list(self.idle):
            if blocks.num_free >= need:
                break
            seq = self.idle[sid]
            if seq.retain_until > now:
                wake = min(wake, seq.retain_until)
                continue
            del self.idle[sid]
            blocks.free(seq)
            seq.num_tokens, seq.cap, seq.state = 0, 0, EVICTED
        if blocks.num_free < need and wake < self.wake_s:
            self.wake_s = wake
        return blocks.num_free >= need

    def _preempt_for(self, need: int, keep, now: float) -> bool:
        """Preempt until `need` blocks are free (decode / co-located workers, which alone grow sequences):
        admitted prefills first (latest first), as vLLM's running list ends with them, then decoding
        sequences, latest admitted first. Never `keep`."""
        for t in reversed(list(self.active)):
            if self.blocks.num_free >= need:
                return True
            if self.seqs.get(t.session_id) is not keep:
                self._preempt_prefill(t, now)
        victims = sorted((s for s in self.running if s is not keep), key=lambda s: s.order, reverse=True)
        for seq in victims:
            if self.blocks.num_free >= need:
                break
            self._preempt(seq, now)
        return self.blocks.num_free >= need

    def _preempt_prefill(self, t: PrefillTask, now: float) -> None:
        """Stop an admitted local prefill and drop its session's KV: it restarts from token 0 when readmitted."""
        self.active.remove(t)
        seq = self.seqs.get(t.session_id)
        if seq is not None:
            self.blocks.free(seq)
            seq.num_tokens, seq.cap = 0, 0
            seq.preemptions += 1
        t.l_incr += t.l_hist
        t.l_hist, t.done, t.cached, t.hashed, t.start_s = 0, 0, 0, 0, None
        t.est_s = self.t_pre(0, t.l_incr)
        self.queue.insert(0, t)
        self.queued_est_s += t.est_s

    def _preempt(self, seq: Seq, now: float) -> None:
        """vLLM's preemption: by swap when the swap space has room for the sequence's blocks (its KV is copied to
        host memory and back, unchanged), else by recompute (drop the KV, re-prefill the whole context first)."""
        held = self.blocks.held(seq)
        if 0 < held <= self.swap_free:
            self._swap_out(seq, held)
            return
        self.preempted[PreemptionMode.RECOMPUTE] += 1
        self.running.remove(seq)
        self._ctx -= seq.num_tokens
        tokens = seq.num_tokens
        self.blocks.free(seq)
        seq.num_tokens, seq.cap, seq.state = 0, 0, PREFILLING
        seq.preemptions += 1
        task = PrefillTask(seq.session_id, -1, 0, tokens, now, decode_worker=self.id, recompute=True)
        self.submit(task, now)

    def _swap_out(self, seq: Seq, held: int) -> None:
        """Preempt by swap: the shell copies the sequence's `held` blocks to host memory before they are reused."""
        self.running.remove(seq)
        self._ctx -= seq.num_tokens
        self.swaps.append(Swap(SwapKind.OUT, seq.session_id, tuple(self.blocks.tables[seq])))
        self.blocks.free(seq)
        self.swap_free -= held
        seq.swapped_blocks, seq.cap, seq.state = held, 0, SWAPPED
        seq.preemptions += 1
        self.preempted[PreemptionMode.SWAP] += 1
        bisect.insort(self.swapped, seq, key=_admission_order)

    def _swap_in(self, now: float) -> None:
        """Resume swapped-out sequences, first admitted first, while the pool holds their blocks and the watermark
        (a sequence that needs more than the rest of the pool waives it)."""
        bs = self.cfg.block_size
        while self.swapped:
            seq = self.swapped[0]
            need = seq.swapped_blocks
            headroom = self.watermark_blocks if need + self.watermark_blocks <= self.cfg.num_blocks else 0
            if not self._reserve(seq, need * bs, now, preempt=False, headroom=headroom):
                return
            del self.swapped[0]
            self.swaps.append(Swap(SwapKind.IN, seq.session_id, tuple(self.blocks.tables[seq])))
            self.swap_free += need
            seq.swapped_blocks = 0
            seq.state = RUNNING
            self.running.append(seq)
            self._ctx += seq.num_tokens

    def take_swaps(self) -> list[Swap]:
        """The KV copies planned since the last call, in order; the shell carries them out before its next forward
        (a block a swap-out frees may already belong to another sequence in the plan)."""
        out, self.swaps = self.swaps, []
        return out

    def _never_fits(self, tokens: int, task: PrefillTask, now: float) -> bool:
        """Fail the task's session when its KV exceeds this worker's whole pool; True if it failed."""
        if tokens <= self.capacity_tokens:
            return False
        self.events.append(SessionFailed(
            task.session_id, self.id, now,
            f"KV exceeds the worker's capacity: {tokens} tokens on a {self.role} worker of {self.capacity_tokens}"))
        if task in self.queue:
            self.queue.remove(task)
            self.queued_est_s -= task.est_s
        return True

    def _retry_pending(self, now: float) -> None:
        still = []
        for task in self.pending_kv:
            seq = self.seqs.get(task.session_id)
            if seq is None:
                continue
            if self._reserve(seq, seq.num_tokens + task.l_incr, now, preempt=False):
                self._start_decoding(seq, task, now)
            else:
                still.append(task)
        self.pending_kv = still

    def _unstick(self, now: float) -> bool:
        """Nothing runs yet work waits for memory held by sessions waiting for their own prefill:
        drop those histories (their tasks recompute them; True), or fail the blocked session if even that
        is not enough."""
        freed = False
        for t in reversed(self.queue):
            seq = self.seqs.get(t.session_id)
            if t.l_hist > 0 and seq is not None and seq.num_tokens == t.l_hist and self.blocks.held(seq):
                if self.local_laps is not None:
                    self.local_laps.discard(t)           # a whole recompute now: no longer a short prefill
                self.blocks.free(seq)
                seq.num_tokens, seq.cap = 0, 0
                self.queued_est_s -= t.est_s
                t.l_incr += t.l_hist
                t.l_hist = 0
                t.est_s = self.t_pre(0, t.l_incr)
                self.queued_est_s += t.est_s
                freed = True
        if freed:
            return True
        waiting = {t.session_id for t in self.queue} | {t.session_id for t in self.pending_kv}
        if any(q.state is PREFILLING and sid not in waiting for sid, q in self.seqs.items()):
            return False                             # a remote prefill's KV is still on its way
        blocked = self.pending_kv[0] if self.pending_kv else self.queue[0]
        self.events.append(SessionFailed(
            blocked.session_id, self.id, now,
            f"KV memory exhausted: the {self.role} worker's {self.capacity_tokens} tokens are held by sessions "
            f"waiting for prefill; {blocked.l_hist + blocked.l_incr} more cannot be placed"))
        return False

    # ---------------------------------------------------------------- results
    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """Apply a finished step: advance prefills, commit each decoding sequence's committed tokens (0..its
        query tokens; all of them when the result does not say)."""
        self.steps += 1
        self.busy_s += result.elapsed_s
        self.busy_window.add(now, result.elapsed_s)
        stopped = result.finished
        active = self.active
        for t, n in plan.prefill:
            if t not in active:
                continue                             # cancelled or released while its chunk ran: nothing to do
            t.done += n
            if t.block_hashes:
                self._register_blocks(t)
            if t.done >= t.work:
                self.active.remove(t)
                if self.role == PREFILL:
                    self.events.append(PrefillDone(t, self.id, now))
                else:
                    seq = self.seqs.get(t.session_id)
                    if seq is not None:
                        if stopped and t.session_id in stopped and not t.recompute:
                            t.output_tokens = 1             # the first token already ended the round
                        self._start_decoding(seq, t, now)
        if plan.decode:
            if self.chunker is not None:             # a step of windows alone times them (the sizer's overhead)
                self.chunker.observe_step(None if plan.prefill else result.elapsed_s)
            if result.committed is None and self.cfg.decode_query_tokens == 1 and not self.cfg.dllm_block:
                self._commit_one_each(plan, stopped, now)
            else:
                self._commit(plan, result.committed, stopped, now)

    def _commit_one_each(self, plan: StepPlan, stopped, now: float) -> None:
        """AR steps: every decoding sequence committed one token (the simulator's hot path)."""
        itl_sum, n_tok = 0.0, 0
        finished = False
        for seq in plan.decode:
            if seq.state is not RUNNING:
                continue
            seq.num_tokens += 1
            gap = now - seq.last_token_s
            seq.itl_sum += gap
            seq.itl_count += 1
            if gap > seq.itl_max:
                seq.itl_max = gap
            itl_sum += gap
            n_tok += 1
            seq.last_token_s = now
            seq.to_decode -= 1
            if stopped and seq.session_id in stopped:
                seq.to_decode = 0
            if seq.to_decode <= 0:
                finished = True
        self._ctx += n_tok
        self.itl.add(now, itl_sum, n_tok)
        if finished:
            self._retire(now)

    def _retire(self, now: float) -> None:
        """Sequences whose round is complete leave the running set."""
        keep = []
        for seq in self.running:
            if seq.to_decode > 0:
                keep.append(seq)
            else:
                self._ctx -= seq.num_tokens
                self._finish_round(seq, now)
        self.running = keep

    def _commit(self, plan: StepPlan, committed: dict[str, int] | None, stopped, now: float) -> None:
        """Multi-token (or executor-reported) commits: 0..commit_cap tokens per decoding sequence."""
        itl_sum, n_tok = 0.0, 0
        finished = False
        chunker = self.chunker
        dllm = self.dllm
        seen: dict[tuple[int, int], list[int]] = {}  # (window, masked left in its block) -> commits (N_commit's)
        first = 0                                    # first tokens of diffusion rounds (TTFT, not ITL)
        for seq in plan.decode:
            if seq.state is not RUNNING:
                continue
            if committed is None:
                c = seq.commit_cap
            else:
                c = committed.get(seq.session_id, 0)
                if c < 0 or c > seq.commit_cap:
                    raise ValueError(f"session {seq.session_id!r} committed {c} tokens in a step that may commit "
                                     f"{seq.commit_cap}")
            if chunker is not None:
                chunker.count(c)
                if seq.to_decode >= seq.commit_cap > 0:   # not cut short by max_tokens: N_commit's evidence
                    seen.setdefault((seq.commit_cap, self._masked_left(seq), seq.tried), []).append(c)
            if c > seq.to_decode:
                c = seq.to_decode
            if dllm is not None:
                dllm.advance(self._phase[seq.session_id], c)
            if c > 0 and seq.first_due is not None:   # a diffusion round's first commit: its TTFT, no gap
                start, enqueued = seq.first_due
                seq.first_due = None
                self.events.append(FirstToken(seq.session_id, self.id, now, start))
                if enqueued is not None:
                    self.ttft.add(now, now - enqueued)
                seq.num_tokens += c
                seq.itl_count += c - 1           # committed with the first token: no gap of their own
                n_tok += c - 1
                first += 1
                seq.last_token_s = now
                seq.to_decode -= c
            elif c > 0:                          # each commit ends one gap; tokens committed together share it
                seq.num_tokens += c
                gap = now - seq.last_token_s
                seq.itl_sum += gap
                seq.itl_count += c
                if gap > seq.itl_max:
                    seq.itl_max = gap
                itl_sum += gap
                n_tok += c
                seq.last_token_s = now
                seq.to_decode -= c
            if chunker is not None:                  # what the next window writes (block_state.py)
                B = self.cfg.dllm_block
                if self._whole(seq):
                    seq.kv_pending = B if c > 0 and seq.num_tokens % B == 0 else 0
                else:
                    seq.kv_pending = c               # every window writes the last commits' K/V
                    if seq.num_tokens % B == 0:      # the prompt's tail rides with every window of its block
                        seq.kv_prompt = 0
                if seq.num_tokens % B == 0:          # a new block: nothing of it tried yet
                    seq.tried = 0
                elif seq.commit_cap:                 # the window covered the first commit_cap masked positions
                    seq.tried = max(seq.tried, seq.commit_cap) - c
            if stopped and seq.session_id in stopped:
                seq.to_decode = 0
            if seq.to_decode <= 0:
                finished = True
        self._ctx += n_tok + first
        self.itl.add(now, itl_sum, n_tok)
        for (window, left, tried), got in seen.items():
            chunker.observe(window, got, left, tried)
        if finished:
            self._retire(now)

    def _start_decoding(self, seq: Seq, task: PrefillTask, now: float) -> None:
        seq.num_tokens += task.l_incr
        if task.block_hashes and not task.local:      # KV computed remotely: cache its full blocks here too
            task.done = task.work
            self._register_blocks(task)
        if not task.recompute:
            start = task.start_s if task.start_s is not None else now
            if self.cfg.dllm_block:                  # a diffusion prefill samples nothing: the first commit is
                seq.to_decode = task.output_tokens   # the round's first token
                seq.first_due = (start, task.enqueue_s if task.local else None)
            else:
                self.events.append(FirstToken(seq.session_id, self.id, now, start))
                if task.local:
                    self.ttft.add(now, now - task.enqueue_s)
                seq.to_decode = task.output_tokens - 1
            seq.last_token_s = now
            seq.itl_sum, seq.itl_count, seq.itl_max = 0.0, 0, 0.0
        seq.cap = self.blocks.held(seq) * self.cfg.block_size
        if seq.to_decode <= 0:
            self._finish_round(seq, now)
            return
        seq.state = RUNNING
        seq.query_tokens = seq.commit_cap = 1
        seq.tried = 0
        if self.chunker is not None:                 # a prefill writes whole blocks: streaming computes the prompt's
            # leftover tokens with every window of their block, outside its chunk; after a recompute the active
            # block's decoded positions are written by the first window, outside it too
            left = seq.num_tokens % self.cfg.dllm_block if not self._whole(seq) else 0
            tail = seq.kv_prompt if left else 0
            seq.kv_pending, seq.kv_prompt = (left - tail, tail) if task.recompute else (0, left)
        self._order += 1
        seq.order = self._order
        self.running.append(seq)
        self._ctx += seq.num_tokens

    def _finish_round(self, seq: Seq, now: float) -> None:
        if self.chunker is not None:                 # the last block's K/V are not (all) written, nor final: the next
            B = self.cfg.dllm_block                  # round recomputes it with its prompt (SDAR's leftover tokens)
            seq.num_tokens = (seq.num_tokens - 1) // B * B
            seq.kv_pending = seq.kv_prompt = 0
        if self.dllm is not None:                    # dLLM-Serve: the request's buffer goes with it (a next round
            self._phase.pop(seq.session_id, None)    # recomputes everything in its first Refresh anyway)
            self.blocks.free(seq)
            seq.num_tokens, seq.cap = 0, 0
        seq.state = IDLE
        seq.retain_until = now + self.cfg.retain_s
        self.idle[seq.session_id] = seq
        self.events.append(RoundDone(seq.session_id, self.id, now, seq.itl_count + 1, seq.itl_sum, seq.itl_count,
                                     seq.itl_max, seq.preemptions))
        seq.preemptions = 0

    def drain(self) -> list:
        """Hand the events produced since the last call to the shell."""
        ev, self.events = self.events, []
        return ev

    # ---------------------------------------------------------------- published state
    def pending_prefill_s(self) -> float:
        """Estimated compute left in this worker's prefill queue and admitted prefills (AMPD Eq. 1-2 queue term)."""
        left = self.queued_est_s
        for t in self.active:
            left += t.est_s * (t.work - t.done) / t.work
        return left

    def pending_prefill_by_class(self) -> tuple[float, float]:
        """pending_prefill_s() split into LAPS's short and long classes (a worker without LAPS: the total twice)."""
        if self.laps is not None and self.laps.opts.split:
            return self.laps.queued_s()
        total = self.pending_prefill_s()
        return total, total

    def utilization(self, now: float) -> float:
        """Busy share of the last window (LAPS Alg. 2's u): step time ended within it over its length."""
        return min(1.0, self.busy_window.total(now) / self.cfg.window_s)

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage

    @property
    def swap_usage(self) -> float:
        """Fraction of the swap space holding preempted KV (vLLM's cpu_cache_usage_perc / 100; 0 without one)."""
        return 1.0 - self.swap_free / self.swap_blocks if self.swap_blocks else 0.0

    def has_work(self) -> bool:
        return bool(self.queue or self.active or self.running or self.pending_kv or self.swapped)
