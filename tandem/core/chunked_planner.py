"""The step planner protocol, and the autoregressive planner: chunked prefill beside decodes (co-located mixed or
prefill-first, prefill-only, decode-only, AMPD's ITL-budget chunks of a decode worker's local prefills), with LAPS's
AWD release of held short prefills and graph buckets for steps of whole short prefills."""
from __future__ import annotations

import math
from typing import Protocol

from tandem.core.residency import WorkerHost
from tandem.core.types import PREFILL, PrefillTask, Seq, StepPlan, StepResult
from tandem.policy.dllm_serve import Phase
from tandem.policy.optimus.chunk import ChunkSpec
from tandem.policy.routing import itl_chunk_tokens


class StepPlanner(Protocol):
    """How a worker core of one mode forms its steps and applies their results (tandem.core.factory picks it); the
    hooks do nothing unless a mode has something of its own to do."""

    def plan(self, core: WorkerHost, now: float) -> StepPlan | None:
        """Form the next step (None: nothing can run now)."""
        ...

    def commit(self, core: WorkerHost, plan: StepPlan, result: StepResult, now: float) -> None:
        """Apply the committed tokens of a step's decodes."""
        core.commit(plan, result.committed, result.finished, now)

    def admits(self, core: WorkerHost, task: PrefillTask, now: float) -> bool:
        """Whether a submitted task may ever run here (False: its session failed, with the reason)."""
        return True

    def started(self, core: WorkerHost, seq: Seq, task: PrefillTask) -> None:
        """A sequence starts decoding its round after `task`'s prefill."""

    def finished(self, core: WorkerHost, seq: Seq) -> None:
        """A sequence's round is over (before it goes idle)."""

    def forget(self, sid: str) -> None:
        """The session ended: drop what this planner keeps of it."""

    def choose_chunk(self, sid: str, asked: ChunkSpec | None = None, reproducible: bool = False) -> ChunkSpec | None:
        """The chunk a diffusion round decodes with (None: no windows in this mode)."""
        return None

    def chunk_of(self, sid: str) -> ChunkSpec | None:
        """The chunk session `sid` decodes with (None: no windows in this mode)."""
        return None

    def phase_of(self, sid: str) -> Phase | None:
        """The dLLM-Serve phase of the session's request in the last step planned (None: no phases in this mode)."""
        return None


class ChunkedPlanner(StepPlanner):
    """Autoregressive steps: admit prefills (picker order), then prefill chunks and/or decodes. The other modes'
    planners derive from it and keep its hooks where they have nothing of their own to do."""

    def plan(self, core: WorkerHost, now: float) -> StepPlan | None:
        kv, cfg = core.kv, core.cfg
        if kv.swapped:
            kv.swap_in(now)
        if core.pending_kv:
            kv.retry_pending(now)
        if core.local_laps is not None:
            core.local_laps.release(now)             # AWD lets a batch of held short local prefills in
        if not kv.swapped:                           # swapped-out sequences resume before new work starts (vLLM)
            kv.admit(now)
        budget = cfg.max_num_batched_tokens
        plan = StepPlan(core.id)
        mix = cfg.mix_decode_with_prefill
        chunk_beta = cfg.itl_chunk_beta
        if core.role != PREFILL and core.running:
            active = core.active
            ready = any(t.kv_ready for t in active) if active else False
            if chunk_beta is not None and ready:
                mix = True                           # Sarathi-style: the decodes go on beside the local prefill
            if mix or not ready:
                self.grow(core, now)
                if not core.running and not core.active and not kv.swapped:
                    kv.admit(now)                    # growth preempted everything: the freed pool goes to the queue
                if core.running:
                    budget -= self.decode(core, plan)
                    if not mix:
                        return plan
        shape = plan.shape
        for t in core.active:
            if budget <= 0:
                break
            if not t.kv_ready:
                continue
            n = t.work - t.done
            if n > budget:
                n = self.cut(core, t, budget)
                if n <= 0:
                    break
            before = t.first + t.done
            if chunk_beta is not None and plan.decode:
                if plan.prefill:
                    break                            # one ITL-budget chunk a step
                if math.isfinite(t.itl_slo_s):
                    n = itl_chunk_tokens(core.t_pre, before, n, chunk_beta * t.itl_slo_s)
            plan.prefill.append((t, n))
            cost = self.cost(core, t, n)                   # the tokens this chunk computes
            budget -= cost
            if cost > 0:
                shape.add_prefill(before, cost)
        if not plan.prefill and not plan.decode:
            if (core.pending_kv or self._admissible(core)) and core.role != PREFILL and not core.active \
                    and not core.running and core.wake_s == math.inf and kv.unstick(now):
                return self.plan(core, now)          # the freed histories let the queue in now
            return None
        shorts = core.laps if core.laps is not None else core.local_laps
        if shorts is not None:
            shorts.pad_if_short(plan)
        return plan

    @staticmethod
    def _admissible(core: WorkerHost) -> bool:
        """Whether a queued task may be admitted now (not held by the local AWD batcher)."""
        local = core.local_laps
        if local is None or not len(local.short):
            return bool(core.queue)
        return any(not local.holds(t) for t in core.queue)

    def grow(self, core: WorkerHost, now: float) -> None:
        """Every running sequence may write KV for its query tokens this step (one for AR, up to
        decode_query_tokens, never past its round's end); preempt if short."""
        q_max = core.cfg.decode_query_tokens
        if q_max == 1:                               # AR: one token each (the hot path of the simulator)
            if self.room_for_a_token(core):
                return
        else:
            short = False
            for seq in core.running:
                q = seq.to_decode if seq.to_decode < q_max else q_max
                seq.query_tokens = seq.commit_cap = q = q if q > 0 else 1
                if seq.num_tokens + q > seq.cap:
                    short = True
            if not short:
                return
        core.kv.grow(now)

    @staticmethod
    def room_for_a_token(core: WorkerHost) -> bool:
        """Whether every running sequence's blocks hold one more token (an AR step needs no growth)."""
        for seq in core.running:
            if seq.num_tokens + 1 > seq.cap:
                return False
        return True

    def refill(self, core: WorkerHost, plan: StepPlan) -> bool:
        """Refill `plan`, a decode-only step just applied, as the step `plan()` would form next when only its decodes
        changed the worker: nothing queued, active, pending or swapped, and every running sequence's blocks hold its
        next token (AR, one token a step). False, with `plan` untouched: the full pass must run."""
        kv = core.kv
        if core.queue or core.active or core.pending_kv or kv.swapped or kv.swaps or not core.running \
                or not self.room_for_a_token(core):
            return False
        self.decode(core, plan)                      # the same sequences again, one token further
        return True

    def decode(self, core: WorkerHost, plan: StepPlan) -> int:
        """Put the running sequences in the step; returns the query rows they take of its budget."""
        plan.decode = list(core.running)
        shape = plan.shape
        if core.cfg.decode_query_tokens == 1:
            n = len(plan.decode)
            shape.num_decode = n
            shape.decode_ctx_tokens = core.ctx_tokens + n
            return n
        n, ctx = 0, 0                                # multi-token steps: every query position counts as a row
        for seq in plan.decode:
            q = seq.query_tokens
            n += q
            ctx += q * seq.num_tokens + q * (q + 1) // 2
        shape.num_decode = n
        shape.decode_ctx_tokens = ctx
        return n

    def cut(self, core: WorkerHost, t: PrefillTask, budget: int) -> int:
        """The tokens of a prefill chunk cut to what is left of the step's budget."""
        return budget

    def cost(self, core: WorkerHost, t: PrefillTask, n: int) -> int:
        """The tokens a prefill chunk of `n` computes in this step."""
        return n


__all__ = ["ChunkedPlanner", "StepPlanner"]
