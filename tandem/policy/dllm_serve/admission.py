"""dLLM-Serve §4.4: phase-multiplexed admission under a query-token budget, and the request-level baselines.

Query tokens are the currency: every step packs the running requests' phases (a Refresh costs its sequence length,
a Reuse its active block) and the first steps of newly admitted requests into one batch of at most
`max_num_batched_tokens` tokens (the invariant holds in every mode, by construction: a request is packed only if it
fits what is left).

`phase` (dLLM-Serve's Phase-Multiplexed Greedy Scheduler):

1. The running requests are packed least recently run first, then in admission order (FCFS): in the ordinary
   step every running request ran the step before, so this is FCFS; a request that did not fit waits a step and
   goes first the next. A request that does not fit what is left is *deferred* (it keeps its phase: a deferred
   Refresh is still a Refresh), and packing goes on with the requests behind it, so the Reuse steps still fill the
   batch.
2. Only when no running request was deferred, the budget left admits queued requests greedily in FCFS order, each
   costing its first step (a full-length one), while it fits, its KV buffer fits the free pool and a sequence slot
   is free; the first that does not fit stops admission (no queued request overtakes another).

When several running requests want a Refresh at once beyond the budget (dLLM-Serve §7's "future resource
conflicts" of greedy admission), the oldest go first and the others wait a step. Starvation bound, from the order
above (every request's step fits the budget on its own, which admission checks): the first request of the order
always runs; a request deferred at step t ranks, at t + 1, behind only requests also deferred at t (every request
that ran at t, and every request admitted at t, ranks behind it), and the first of the order runs every step, so
**a request deferred at step t runs by step t + m_t, m_t the number of requests deferred at step t** (≤ running − 1 <
max_num_seqs). A queued request at the head of the queue is admitted at the first step in which nothing is deferred
and its first step, its KV and a slot fit; since nothing overtakes it, the running set only drains while it waits,
and with at least one token committed per step run, **it is admitted within R + 1 steps of reaching the head, R the
tokens the running requests still had to generate then** (each step the order's first request runs and commits).

Baselines (request-level scheduling: a request is provisioned for its Refresh peak, P + G, for its whole life):

- `static` (Fast-dLLM-like static batching): when nothing runs, a batch is formed FCFS from the queue while the
  peaks sum within the budget (and the KV buffers and slots fit): the largest batch that fits; it runs to
  completion before the next batch is formed.
- `reserve` (request-level continuous batching, as dInfer's dynamic batching): a queued request is admitted at any
  step while the running requests' peaks plus its own stay within the budget.

Sans-I/O: `Admission.select` reads views of the running and queued requests and returns which run and how many of
the queue's head are admitted; the worker core (tandem/core/worker.py) carries it out.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tandem.policy.checks import check_int
from tandem.policy.dllm_serve.phases import Phase, PhaseSchedule, PhaseSpec, PhaseState


class AdmissionMode(StrEnum):
    """How a dLLM-Serve worker admits and packs requests."""

    PHASE = "phase"        # dLLM-Serve: phase-level packing, admission into the Reuse headroom
    STATIC = "static"      # static batches reserving each request's Refresh peak, run to completion (Fast-dLLM)
    RESERVE = "reserve"    # continuous request-level admission reserving each request's Refresh peak (dInfer)


def parse_admission(value: str | AdmissionMode) -> AdmissionMode:
    """`phase`, `static` or `reserve` as an AdmissionMode; ValueError otherwise."""
    try:
        return AdmissionMode(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"dllm_admission is one of {', '.join(m.value for m in AdmissionMode)}, "
                         f"got {value!r}") from None


@dataclass(slots=True)
class Candidate:
    """A running or queued request as admission reads it."""

    key: Any
    tokens: int                 # query tokens of its next step
    peak: int                   # its largest step: its whole sequence at the end of generation
    kv: int = 0                 # KV positions its buffer takes (queued requests; in the pool's units)
    last_run: int = -1          # the last step it ran in (running requests)
    order: int = 0              # admission order (running) / queue order (queued)


@dataclass(slots=True)
class Selection:
    """One step's decision."""

    run: list = field(default_factory=list)         # running requests' keys that run, in packing order
    deferred: list = field(default_factory=list)    # running requests' keys that wait this step
    admit: list = field(default_factory=list)       # queued requests' keys admitted (their first step runs now)
    tokens: int = 0                                 # query tokens packed: Σ over `run` and `admit`


class Admission:
    """Packs one step under the token budget and admits queued requests (see the module doc for the policies)."""

    def __init__(self, mode: AdmissionMode | str, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.mode = parse_admission(mode)
        check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        check_int("max_num_seqs", max_num_seqs, 1)
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    def fits_alone(self, peak: int) -> bool:
        """Whether a request whose largest step is `peak` query tokens can ever run here."""
        return peak <= self.budget

    def select(self, running: Sequence[Candidate], queue: Iterable[Candidate], free_kv: int) -> Selection:
        """This step's packing: which running requests run (the others wait) and which of the queue's head are
        admitted. `queue` is read lazily, in FCFS order, up to the first request that is not admitted."""
        budget = self.budget
        sel = Selection()
        mode = self.mode
        order = sorted(running, key=lambda c: (c.last_run, c.order)) if mode is AdmissionMode.PHASE else running
        used = 0
        for c in order:
            if used + c.tokens <= budget:
                sel.run.append(c.key)
                used += c.tokens
            else:
                sel.deferred.append(c.key)
        seats = self.max_num_seqs - len(running)
        admit = False
        if mode is AdmissionMode.PHASE:
            admit = not sel.deferred
        elif mode is AdmissionMode.STATIC:
            admit = not running
        else:
            admit = True
        if admit:
            reserved = sum(c.peak for c in running)       # request-level modes: the running requests' peaks
            for q in queue:
                if seats <= 0 or q.kv > free_kv or used + q.tokens > budget:
                    break
                if mode is not AdmissionMode.PHASE:
                    if reserved + q.peak > budget:
                        break
                    reserved += q.peak
                sel.admit.append(q.key)
                used += q.tokens
                free_kv -= q.kv
                seats -= 1
        sel.tokens = used
        return sel


COUNTERS = tuple([f"seq_steps_{p.value}" for p in Phase] + [f"tokens_{p.value}" for p in Phase]
                 + ["steps", "admitted_running", "admitted_idle", "deferrals"])    # DllmServeStats.counters()


@dataclass(slots=True)
class DllmServeStats:
    """Counters of a dLLM-Serve worker (what /metrics and the simulator's report show)."""

    steps: int = 0                                  # steps run
    tokens: int = 0                                 # query tokens packed, all steps
    max_tokens: int = 0                             # the largest packed batch
    seq_steps: dict = field(default_factory=lambda: {p.value: 0 for p in Phase})     # sequence-steps by phase
    phase_tokens: dict = field(default_factory=lambda: {p.value: 0 for p in Phase})  # query tokens by phase
    admitted: int = 0
    admitted_while_running: int = 0                 # admitted into a step that also ran earlier requests
    deferrals: int = 0                              # sequence-steps a running request waited
    max_deferred: int = 0                           # the longest run of consecutive steps one request waited
    max_running: int = 0
    commits: dict = field(default_factory=dict)     # sequence-steps that committed k tokens

    def counters(self) -> dict[str, int]:
        """Flat cumulative counters (COUNTERS, what /metrics exports): sequence-steps and query tokens by phase,
        steps, admissions into a running batch (the Reuse headroom) and into an idle one, deferrals."""
        out = {f"seq_steps_{p.value}": int(self.seq_steps.get(p.value, 0)) for p in Phase}
        out.update({f"tokens_{p.value}": int(self.phase_tokens.get(p.value, 0)) for p in Phase})
        out.update(steps=self.steps, admitted_running=self.admitted_while_running,
                   admitted_idle=self.admitted - self.admitted_while_running, deferrals=self.deferrals)
        return out

    def as_dict(self) -> dict:
        return {"steps": self.steps, "tokens": self.tokens, "max_tokens": self.max_tokens,
                "mean_tokens": self.tokens / self.steps if self.steps else 0.0,
                "seq_steps": dict(self.seq_steps), "phase_tokens": dict(self.phase_tokens),
                "admitted": self.admitted, "admitted_while_running": self.admitted_while_running,
                "deferrals": self.deferrals, "max_deferred": self.max_deferred, "max_running": self.max_running,
                "commits": dict(sorted(self.commits.items()))}


class DllmServe:
    """The dLLM-Serve mode of a diffusion worker: its phase schedule, its admission policy and their counters.
    Built by tandem.core.factory.build_worker from the scheduler configuration."""

    def __init__(self, spec: PhaseSpec, admission: Admission) -> None:
        self.phases = PhaseSchedule(spec)
        self.admission = admission
        self.stats = DllmServeStats()

    @property
    def mode(self) -> AdmissionMode:
        return self.admission.mode

    def advance(self, st: PhaseState, committed: int) -> None:
        """A request committed `committed` positions in the step it ran."""
        self.phases.advance(st, committed)
        c = self.stats.commits
        c[committed] = c.get(committed, 0) + 1


__all__ = ["COUNTERS", "Admission", "AdmissionMode", "Candidate", "DllmServe", "DllmServeStats", "Selection",
           "parse_admission"]
