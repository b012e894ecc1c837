"""The dLLM-Serve step planner of a co-located diffusion worker: the running requests' Refresh/Reuse phases and the
first steps of newly admitted requests, packed under max_num_batched_tokens as the DllmServe policy decides
(tandem/policy/dllm_serve); an admitted request holds its fixed KV buffer until its round ends."""
from __future__ import annotations

from typing import Iterator

from tandem.core.chunked_planner import ChunkedPlanner
from tandem.core.residency import WorkerHost
from tandem.core.types import PrefillTask, Seq, SeqState, SessionFailed, StepPlan, StepResult
from tandem.policy.dllm_serve import Candidate, DllmServe, Phase, PhaseState


class PhasePlanner(ChunkedPlanner):
    """dLLM-Serve phases: each step the admission policy picks which running requests run and which queued ones
    start; a request runs its phase's query tokens (Refresh: the sequence; Reuse: the active block)."""

    def __init__(self, dllm: DllmServe) -> None:
        self.dllm = dllm
        self.phases: dict[str, PhaseState] = {}     # each running request's phase state
        self.last_phases: dict[str, Phase] = {}     # the phase of each request of the last plan

    def phase_of(self, sid: str) -> Phase | None:
        return self.last_phases.get(sid)

    def forget(self, sid: str) -> None:
        self.phases.pop(sid, None)

    @staticmethod
    def _kv_positions(core: WorkerHost, tokens: int) -> int:
        """Pool positions a buffer of `tokens` takes (whole KV blocks)."""
        bs = core.cfg.block_size
        return -(-tokens // bs) * bs

    def admits(self, core: WorkerHost, task: PrefillTask, now: float) -> bool:
        """A request whose largest step exceeds the token budget, or whose KV buffer exceeds the pool, can never run
        here; its session fails with the reason."""
        cfg = core.cfg
        seq = core.seqs.get(task.session_id)
        prompt = (seq.num_tokens if seq is not None else 0) + task.l_incr
        phases = self.dllm.phases
        peak = phases.peak_tokens(prompt, task.output_tokens)
        if not self.dllm.admission.fits_alone(peak):
            reason = (f"a Refresh of {peak} query tokens (prompt {prompt} + generation {task.output_tokens}) exceeds "
                      f"the step's token budget, max_num_batched_tokens {cfg.max_num_batched_tokens}")
        elif self._kv_positions(core, phases.kv_tokens(prompt, task.output_tokens)) > cfg.num_blocks * cfg.block_size:
            reason = (f"KV exceeds the worker's capacity: a buffer of {phases.kv_tokens(prompt, task.output_tokens)} "
                      f"positions on a {core.role} worker of {cfg.num_blocks * cfg.block_size}")
        else:
            return True
        core.events.append(SessionFailed(task.session_id, core.id, now, reason))
        return False

    def plan(self, core: WorkerHost, now: float) -> StepPlan | None:
        """Pack the running requests' phases and the first steps of the requests admission lets in."""
        dllm = self.dllm
        phases = dllm.phases
        step = core.steps
        table = self.phases
        running = [Candidate(seq, phases.demand(st), phases.peak_tokens(st.prompt, st.gen), 0, st.last_run, st.order)
                   for seq in core.running for st in (table[seq.session_id],)]
        sel = dllm.admission.select(running, self._queued(core), core.kv.blocks.num_free * core.cfg.block_size)
        for seq in sel.deferred:
            st = table[seq.session_id]
            st.deferred += 1
            dllm.stats.deferrals += 1
            if st.deferred > dllm.stats.max_deferred:
                dllm.stats.max_deferred = st.deferred
        ran_before = bool(sel.run)
        admitted = []
        for t in sel.admit:
            seq = self._admit(core, t, step, now)
            if seq is not None:
                admitted.append(seq)
        if admitted:
            dllm.stats.admitted += len(admitted)
            if ran_before:
                dllm.stats.admitted_while_running += len(admitted)
        batch = sel.run + admitted
        if not batch:
            return None
        plan = StepPlan(core.id)
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
        if len(core.running) > stats.max_running:
            stats.max_running = len(core.running)
        self.last_phases = phase_of
        plan.decode = batch
        return plan

    def _queued(self, core: WorkerHost) -> Iterator[Candidate]:
        """The queue's requests, FCFS, as admission reads them (lazily: admission stops at the first it refuses)."""
        phases = self.dllm.phases
        for i, t in enumerate(core.queue):
            seq = core.seqs.get(t.session_id)
            prompt = (seq.num_tokens if seq is not None else 0) + t.l_incr
            gen = t.output_tokens
            yield Candidate(t, phases.first_tokens(prompt, gen), phases.peak_tokens(prompt, gen),
                            self._kv_positions(core, phases.kv_tokens(prompt, gen)), order=i)

    def _admit(self, core: WorkerHost, t: PrefillTask, step: int, now: float) -> Seq | None:
        """Start a queued request: its KV buffer, its first step (this one), its phase state."""
        core.dequeue(t)
        seq = core.seqs.get(t.session_id)
        if seq is None:
            return None
        prompt = seq.num_tokens + t.l_incr
        phases = self.dllm.phases
        kv = phases.kv_tokens(prompt, t.output_tokens)
        if not core.kv.reserve(seq, kv, now, preempt=False):   # admission checked the free pool
            raise RuntimeError(f"dLLM-Serve admission of {t.session_id!r}: {kv} KV positions not free")
        t.start_s = now
        core.start_decoding(seq, t, now)
        if seq.state is not SeqState.RUNNING:
            return None
        self.phases[seq.session_id] = phases.new(prompt, t.output_tokens, seq.order, step)
        return seq

    def commit(self, core: WorkerHost, plan: StepPlan, result: StepResult, now: float) -> None:
        """Commit the requests' tokens; each advances its phase state."""
        core.commit(plan, result.committed, result.finished, now, self.committed)

    def committed(self, core: WorkerHost, seq: Seq, asked: int, c: int) -> None:
        """One request's commit of `c` tokens (once cut to its round's end) advances its phase state."""
        self.dllm.advance(self.phases[seq.session_id], c)

    def finished(self, core: WorkerHost, seq: Seq) -> None:
        """The request's buffer goes with it (a next round recomputes everything in its first Refresh anyway)."""
        self.phases.pop(seq.session_id, None)
        core.kv.drop(seq)


__all__ = ["PhasePlanner"]
