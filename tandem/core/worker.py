"""A worker's sans-I/O core: events in, each round's life (prefill, first token, commits, idle), published
statistics. Its KV residency (tandem/core/residency.py) holds the pool; its step planner, one per mode and picked
by tandem.core.factory, forms the steps."""
from __future__ import annotations

import math
from operator import attrgetter
from typing import Callable, Sequence

from tandem.core.chunked_planner import ChunkedPlanner, StepPlanner
from tandem.core.config import WorkerConfig
from tandem.core.laps_sched import LapsScheduler, LocalLaps
from tandem.core.residency import KVResidency
from tandem.core.stats import WindowedMean
from tandem.core.types import (
    COLOCATED, DECODE, PREFILL, FirstToken, PrefillDone, PrefillTask, RoundDone, Seq, SeqState, StepPlan, StepResult,
    Swap,
)
from tandem.policy.dllm_serve import DllmServe, Phase
from tandem.policy.optimus.chunk import ChunkSizer, ChunkSpec
from tandem.policy.reorder import FCFS, Picker

RUNNING = SeqState.RUNNING
CommitHook = Callable[["WorkerCore", Seq, int, int], None]


class WorkerCore:
    """One prefill, decode or co-located worker. Shells call events in, `schedule`, `on_step_done`, `drain`."""

    def __init__(self, wid: int, cfg: WorkerConfig, picker: Picker | None = None,
                 t_pre: Callable[[int, int], float] | None = None, laps: LapsScheduler | None = None,
                 local_laps: LocalLaps | None = None, chunker: ChunkSizer | None = None,
                 dllm: DllmServe | None = None, planner: StepPlanner | None = None) -> None:
        self.id = wid
        self.cfg = cfg
        self.role = cfg.role
        self.picker = picker or FCFS()
        self.t_pre = t_pre or (lambda h, n: 0.0)
        self.queue: list[PrefillTask] = []          # waiting prefill tasks, in picking order
        self.active: list[PrefillTask] = []         # admitted prefills (memory held), chunk by chunk
        self.seqs: dict[str, Seq] = {}              # session residency (decode / co-located)
        self.running: list[Seq] = []                # sequences decoding
        self.pending_kv: list[PrefillTask] = []     # remote KV that arrived before memory was free
        self.ttft = WindowedMean(cfg.window_s)
        self.itl = WindowedMean(cfg.window_s)
        self.queued_est_s = 0.0                     # Σ estimated compute of queued tasks (AMPD Eq. 1-2)
        self.busy = False
        self._wake_s = math.inf                     # when a pinned idle session becomes evictable
        self.events: list = []
        self.admitted = 0                           # sequences started decoding so far (their admission order)
        self.ctx_tokens = 0                         # Σ num_tokens over running sequences
        self.steps = 0
        self.busy_s = 0.0
        self.busy_window = WindowedMean(cfg.window_s)   # step time within the window: utilisation
        self.laps = laps if cfg.role == PREFILL else None   # LAPS temporal disaggregation (prefill workers)
        self.local_laps = local_laps if cfg.role == DECODE else None   # AMPD+LAPS: AWD over local short prefills
        self.dllm = dllm if cfg.dllm_block else None       # dLLM-Serve: Refresh/Reuse phases, phase admission
        self.chunker = chunker if cfg.dllm_block and self.dllm is None else None  # Optimus: each step's window
        if cfg.dllm_admission:
            if self.dllm is None or self.dllm.mode != cfg.dllm_admission:
                raise ValueError(f"a dLLM-Serve worker ({cfg.dllm_admission!r} admission) needs its DllmServe "
                                 f"policy (tandem.core.factory.build_worker)")
            if cfg.role != COLOCATED:
                raise ValueError(f"dLLM-Serve admission runs on co-located workers (a request's first step is its "
                                 f"prefill and its first Refresh), not on a {cfg.role} worker")
        elif dllm is not None:
            raise ValueError("a DllmServe policy was given to a worker whose configuration has no dllm_admission")
        if cfg.dllm_block and self.chunker is None and self.dllm is None:
            raise ValueError("a block-diffusion worker needs a ChunkSizer (tandem.core.factory.build_worker)")
        if planner is None and (cfg.dllm_block or self.laps is not None and self.laps.opts.split):
            raise ValueError("a diffusion or LAPS worker needs its step planner (tandem.core.factory.build_worker)")
        self.planner: StepPlanner = planner or ChunkedPlanner()
        self.kv = KVResidency(self, cfg, self.dllm.phases.spec.retention if self.dllm is not None else 1.0)
        self.blocks = self.kv.blocks

    @property
    def wake_s(self) -> float:
        """When the shell should call schedule again although no event came: a pinned idle session becomes
        evictable, or an AWD batcher (LAPS) reaches its next decision."""
        w = self._wake_s
        if self.local_laps is not None:
            w = min(w, self.local_laps.wake_at_s)
        return w if self.kv.tier is None else min(w, self.kv.tier.wake_at)

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

    def begin_round(self, sid: str, block_hashes: Sequence[int] = (), prompt_tokens: int = 0,
                    now: float | None = None) -> int:
        """A new round of `sid` arrives: pin its KV and return how many history tokens are resident. A session
        with nothing resident first takes the longest cached prefix of its prompt (`block_hashes`: the chained
        hashes of the prompt's full blocks, `prompt_tokens` long) from the prefix cache, leaving at least one
        token to compute; those tokens then count as its history, wherever its prefill runs. With a host tier
        (`now`: the arrival time, else the tier's last), KV offloaded there is loaded back or recomputed."""
        seq = self.attach(sid)
        self.kv.idle.pop(sid, None)
        tier = self.kv.tier
        if tier is not None:
            tier.begin_round(seq, tier.now if now is None else now)
        seq.state = SeqState.PREFILL
        if block_hashes and seq.num_tokens == 0 and not self.blocks.held(seq) and prompt_tokens > 1 \
                and self.dllm is None:                # bidirectional: a prompt's KV depends on the whole sequence
            self.kv.take_cached_prefix(seq, block_hashes, prompt_tokens, now)
        return seq.num_tokens

    def submit(self, task: PrefillTask, now: float) -> None:
        """Enqueue a prefill task routed to this worker."""
        task.worker = self.id
        if not self.planner.admits(self, task, now):
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

    def dequeue(self, task: PrefillTask) -> None:
        """Take a task out of the queue (admitted, failed, or its session gone)."""
        self.queue.remove(task)
        self.queued_est_s -= task.est_s

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
        if not self.kv.reserve(seq, seq.num_tokens + task.l_incr, now, preempt=False):
            if not self.kv.never_fits(seq.num_tokens + task.l_incr + 1, task, now):
                self.pending_kv.append(task)         # waits, like a vLLM request, for memory to free
            return
        self.start_decoding(seq, task, now)

    def release(self, sid: str) -> None:
        """The session is over (or failed): free its KV and forget it."""
        seq = self.seqs.pop(sid, None)
        if seq is None:
            return
        if seq.state is RUNNING:
            self.stop_running(seq)
        self.kv.release(seq)
        seq.state = SeqState.RELEASED                # a step in flight must not commit into it
        self.planner.forget(sid)
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
            self.dequeue(task)
        if task in self.active:
            self.active.remove(task)
        if self.laps is not None:
            self.laps.discard(task)
        elif self.local_laps is not None:
            self.local_laps.discard(task)
        if self.role == PREFILL:
            self.blocks.free(task)

    # ---------------------------------------------------------------- steps
    def schedule(self, now: float) -> StepPlan | None:
        """Form the next step (the mode's step planner decides what it holds); None when nothing can run now. A host
        tier first decides for idle sessions and starts due prefetches."""
        if self.kv.tier is not None:
            self.kv.tier.tick(now)
        return self.planner.plan(self, now)

    def admit_task(self, t: PrefillTask, now: float) -> bool:
        """Admit one queued task of a prefill worker (LAPS picks which); False when memory is short."""
        return self.kv.admit_task(t, now)

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """Apply a finished step: advance prefills, commit each decoding sequence's committed tokens (0..its
        query tokens; all of them when the result does not say)."""
        count_step(self, result.elapsed_s, now)
        stopped = result.finished
        active = self.active
        for t, n in plan.prefill:
            if t not in active:
                continue                             # cancelled or released while its chunk ran: nothing to do
            t.done += n
            if t.block_hashes:
                self.kv.register_blocks(t, now)
            if t.done >= t.work:
                self.active.remove(t)
                if self.role == PREFILL:
                    self.events.append(PrefillDone(t, self.id, now))
                else:
                    seq = self.seqs.get(t.session_id)
                    if seq is not None:
                        if stopped and t.session_id in stopped and not t.recompute:
                            t.output_tokens = 1             # the first token already ended the round
                        self.start_decoding(seq, t, now)
        if plan.decode:
            self.planner.commit(self, plan, result, now)

    def commit(self, plan: StepPlan, committed: dict[str, int] | None, stopped, now: float,
               hook: CommitHook | None = None) -> None:
        """Multi-token (or executor-reported) commits: 0..commit_cap tokens per decoding sequence; `hook`, the
        planner's, sees each commit before it is counted."""
        itl_sum, n_tok = 0.0, 0
        finished = False
        first = 0                                    # first tokens of diffusion rounds (TTFT, not ITL)
        if committed is None and hook is None and not stopped:
            commit_caps(self, plan.decode, now)      # the common step: every running sequence commits its cap
            return
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
            asked = c
            if c > seq.to_decode:
                c = seq.to_decode
            if hook is not None:
                hook(self, seq, asked, c)
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
            if stopped and seq.session_id in stopped:
                seq.to_decode = 0
            if seq.to_decode <= 0:
                finished = True
        self.ctx_tokens += n_tok + first
        self.itl.add(now, itl_sum, n_tok)
        if finished:
            self._retire(now)

    # ---------------------------------------------------------------- a round's life
    def start_decoding(self, seq: Seq, task: PrefillTask, now: float) -> None:
        """The round's prefill is done (here or remotely, its KV landed): its first token, then decoding."""
        seq.num_tokens += task.l_incr
        if task.block_hashes and not task.local:      # KV computed remotely: cache its full blocks here too
            task.done = task.work
            self.kv.register_blocks(task, now)
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
        seq.query_tokens = seq.commit_cap = 1
        seq.tried = 0
        self.planner.started(self, seq, task)
        self.admitted += 1
        seq.order = self.admitted
        self.resume(seq)

    def resume(self, seq: Seq) -> None:
        """The sequence (re)joins the running set."""
        seq.state = RUNNING
        self.running.append(seq)
        self.ctx_tokens += seq.num_tokens

    def stop_running(self, seq: Seq) -> None:
        """The sequence leaves the running set (preempted, failed or released)."""
        self.running.remove(seq)
        self.ctx_tokens -= seq.num_tokens

    def _retire(self, now: float) -> None:
        """Sequences whose round is complete leave the running set."""
        keep = []
        for seq in self.running:
            if seq.to_decode > 0:
                keep.append(seq)
            else:
                self.ctx_tokens -= seq.num_tokens
                self._finish_round(seq, now)
        self.running = keep

    def _finish_round(self, seq: Seq, now: float) -> None:
        self.planner.finished(self, seq)
        self.kv.retain(seq, now)
        self.events.append(RoundDone(seq.session_id, self.id, now, seq.itl_count + 1, seq.itl_sum, seq.itl_count,
                                     seq.itl_max, seq.preemptions))
        seq.preemptions = 0

    def drain(self) -> list:
        """Hand the events produced since the last call to the shell."""
        ev, self.events = self.events, []
        return ev

    # ---------------------------------------------------------------- diffusion modes
    def choose_chunk(self, sid: str, asked: ChunkSpec | None = None, reproducible: bool = False) -> ChunkSpec | None:
        """Optimus windows: decide and keep the chunk session `sid`'s next round decodes with (request_chunk); None on
        a worker without windows (AR, dLLM-Serve phases)."""
        return self.planner.choose_chunk(sid, asked, reproducible)

    def chunk_of(self, sid: str) -> ChunkSpec | None:
        """The chunk session `sid` decodes with (None on a worker without windows)."""
        return self.planner.chunk_of(sid)

    def phase_of(self, sid: str) -> Phase | None:
        """dLLM-Serve mode: the phase the session's request ran in the last step planned (None: not in it)."""
        return self.planner.phase_of(sid)

    def dllm_stats(self) -> dict:
        """dLLM-Serve mode: the worker's phase and admission counters ({} in other modes)."""
        return self.dllm.stats.as_dict() if self.dllm is not None else {}

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

    # read through C-level getters: the shells ask for these at every step
    capacity_tokens = property(attrgetter("kv.capacity_tokens"), doc="The longest sequence the KV pool holds.")
    swapped = property(attrgetter("kv.swapped"), doc="Sequences preempted by swap, their KV in host memory.")
    swaps = property(attrgetter("kv.swaps"), doc="The KV copies planned and not yet taken (take_swaps).")
    kv_usage = property(attrgetter("blocks.usage"), doc="Share of the KV pool's blocks in use.")
    swap_usage = property(attrgetter("kv.swap_usage"), doc="Share of the swap space holding preempted KV.")

    def take_swaps(self) -> list[Swap]:
        """The KV copies planned since the last call, in order, for the shell to carry out before its next forward."""
        return self.kv.take_swaps()

    def expire(self, sid: str) -> None:
        """An idle session's TTL ran out: its GPU copy goes; a host-tier copy stays (no tier: released)."""
        seq = self.seqs.get(sid)
        ok = self.kv.tier is not None and seq is not None and seq.state in (SeqState.IDLE, SeqState.OFFLOADED)
        self.kv.tier.expire(seq) if ok else self.release(sid)

    def expect_return(self, sid: str, tool_s: float, now: float) -> None:
        """The coordinator knows how long the session's tool call takes (its next round's expected return)."""
        if self.kv.tier is not None:
            self.kv.tier.expect_return(sid, tool_s, now)

    def has_work(self) -> bool:
        return bool(self.queue or self.active or self.running or self.pending_kv or self.kv.swapped)


def count_step(core: WorkerCore, elapsed_s: float, now: float) -> None:
    """A finished step's share of the worker's statistics: its count, busy time and utilisation window."""
    core.steps += 1
    core.busy_s += elapsed_s
    core.busy_window.add(now, elapsed_s)


def commit_caps(core: WorkerCore, decode: list[Seq], now: float) -> None:
    """WorkerCore.commit when every decoding sequence commits its cap and no stop rule ended a round (the
    simulator's hot path): the same updates in the same order, without the per-sequence checks it does not need."""
    itl_sum, n_tok, first = 0.0, 0, 0
    finished = False
    for seq in decode:
        if seq.state is not RUNNING:
            continue
        c = seq.commit_cap
        left = seq.to_decode
        if c > left:
            c = left
        if c > 0:
            if seq.first_due is not None:            # a diffusion round's first commit: its TTFT, no gap
                start, enqueued = seq.first_due
                seq.first_due = None
                core.events.append(FirstToken(seq.session_id, core.id, now, start))
                if enqueued is not None:
                    core.ttft.add(now, now - enqueued)
                seq.num_tokens += c
                seq.itl_count += c - 1
                n_tok += c - 1
                first += 1
            else:
                seq.num_tokens += c
                gap = now - seq.last_token_s
                seq.itl_sum += gap
                seq.itl_count += c
                if gap > seq.itl_max:
                    seq.itl_max = gap
                itl_sum += gap
                n_tok += c
            seq.last_token_s = now
            seq.to_decode = left = left - c
        if left <= 0:
            finished = True
    core.ctx_tokens += n_tok + first
    core.itl.add(now, itl_sum, n_tok)
    if finished:
        core._retire(now)


def steady_decoder(core: WorkerCore) -> bool:
    """Whether `core` may ever take `decode_step_done`'s shortcut: a decode or co-located worker of the plain
    autoregressive planner, one token a step, without LAPS or a host tier (their hooks run at every step)."""
    return (type(core.planner) is ChunkedPlanner and core.role != PREFILL and core.cfg.decode_query_tokens == 1
            and core.laps is None and core.local_laps is None and core.kv.tier is None)


def decode_step_done(core: WorkerCore, plan: StepPlan, elapsed_s: float, now: float) -> StepPlan | None:
    """A decode-only step of a `steady_decoder` ended, every sequence committing its token and no stop rule firing:
    apply it (what `on_step_done` does) and, when nothing but those commits changed the worker (no round ended,
    nothing queued, pending, swapped or short of a block), return the step `schedule` would form next: `plan` itself,
    refilled with the same sequences one token further. None: the step is applied and the caller schedules as usual.
    The simulator's commonest event, taken without the admission and dispatch layers that have nothing to do in it."""
    count_step(core, elapsed_s, now)
    commit_caps(core, plan.decode, now)
    if core.events or not core.planner.refill(core, plan):
        return None                              # a round ended, or the planner has more to do than decode
    return plan


__all__ = ["WorkerConfig", "WorkerCore", "commit_caps", "decode_step_done", "steady_decoder"]
