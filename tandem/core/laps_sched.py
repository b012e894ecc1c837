"""LAPS temporal disaggregation on one prefill worker: each step runs short prefills or a long one, never both.

Short prefills (fewer new tokens than the class threshold) wait in an AWD batcher (LAPS Alg. 1, policy/laps/awd.py),
which dispatches a batch when its depth, deadlines, head-of-line wait or window say so; the batch runs as one step,
padded to the smallest captured (length, batch) bucket when graphs are on (a CUDA graph per bucket in the engine;
`BatchShape.graph` and the padded shape in the simulator). Long prefills wait in FCFS order; one at a time is
advanced by chunks of C_l tokens. When both a dispatched short batch and a long chunk can run, the one whose
earliest deadline comes first runs (SLA-first; ties and no deadlines: the earlier enqueued), so neither class
starves while deadlines are finite.

With `split` off (the ablation "CUDA graphs only") the worker keeps its chunked FCFS scheduling; a step made only
of whole short prefills that fits a bucket runs padded as a graph.

Sans-I/O like the rest of the core: PrefillHost calls in with `now`; AWD's next poll time becomes the worker's wake_s.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from tandem.core.types import BatchShape, PrefillTask, StepPlan
from tandem.policy.laps.awd import AWDBatcher, AWDConfig, ShortRequest
from tandem.policy.laps.buckets import Bucket, BucketGrid
from tandem.policy.laps.classify import LengthClassifier, PrefillClass


class PrefillHost(Protocol):
    """What LAPS reads and calls of its prefill worker (tandem.core.worker.WorkerCore)."""

    id: int
    queue: list[PrefillTask]
    active: list[PrefillTask]

    def admit_task(self, t: PrefillTask, now: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class LapsOptions:
    """What a LAPS prefill worker is built with (from the PolicySpec's laps_* knobs and the scheduler's budget)."""

    threshold: int = 256                    # SHORT below this many new tokens
    split: bool = True                      # separate short/long queues (temporal disaggregation)
    graphs: bool = True                     # short batches padded to a bucket and run as a graph
    long_chunk: int = 2048                  # C_l
    batch_budget_tokens: int = 2048         # largest short batch, padded tokens (AWD's memory budget)
    awd: AWDConfig = AWDConfig()
    grid: BucketGrid = BucketGrid()


@dataclass(slots=True)
class LapsStats:
    """Counters the shells publish (/metrics) and reports read."""

    short_steps: int = 0
    long_steps: int = 0
    graph_steps: int = 0                    # short steps run in a captured bucket (bucket hits)
    eager_short_steps: int = 0              # short steps no bucket held
    padded_tokens: int = 0                  # padding computed by graph steps
    short_requests: int = 0
    long_requests: int = 0


class LapsScheduler:
    """The LAPS state of one prefill worker: AWD over short tasks, FCFS long tasks, the batch being run."""

    def __init__(self, opts: LapsOptions, t_pre: Callable[[int, int], float]) -> None:
        self.opts = opts
        self.classifier = LengthClassifier(opts.threshold)
        self.t_pre = t_pre
        self.awd = AWDBatcher(opts.awd, opts.grid, self._service, opts.batch_budget_tokens)
        self._tasks: dict[str, PrefillTask] = {}    # AWD key -> queued short task
        self._keys: dict[int, str] = {}             # id(task) -> AWD key
        self._n = 0
        self.long: deque[PrefillTask] = deque()     # queued long tasks, FCFS
        self.batch: list[PrefillTask] = []          # the dispatched short batch (admitted; runs when its KV is read)
        self.bucket: Bucket | None = None
        self.long_active: PrefillTask | None = None
        self.wake_at_s = math.inf                   # AWD's next decision time while it waits
        self.last_now = -math.inf
        self.stats = LapsStats()

    def gauges(self, now: float) -> tuple[int, int, float, int]:
        """What the worker publishes: short and long prefills waiting, AWD's window W(now) and target depth D."""
        try:
            window = self.awd.window(max(now, self.last_now))
        except ValueError:                           # a service estimate the batcher refuses: report the learned W
            window = self.awd.learned_window_s
        return len(self.awd), len(self.long), window, self.awd.depth_target

    def queued_s(self) -> tuple[float, float]:
        """Estimated prefill seconds of the short and long work not yet computed here (Alg. 2's per-class q)."""
        def left(t: PrefillTask) -> float:
            return t.est_s * (t.l_incr - t.done) / t.l_incr if t.l_incr else 0.0
        short = sum(t.est_s for t in self._tasks.values()) + sum(left(t) for t in self.batch)
        long = sum(t.est_s for t in self.long) + (left(self.long_active) if self.long_active is not None else 0.0)
        return short, long

    def _service(self, lengths) -> float:
        """Ŝ: one step over the batch's tokens (the weights are read once for the whole batch), padded to its
        bucket when it runs in one."""
        tokens = int(sum(lengths))
        if self.opts.graphs:
            bucket = self.opts.grid.nearest(list(lengths), self.opts.batch_budget_tokens)
            if bucket is not None:
                tokens = bucket.padded_tokens
        return self.t_pre(0, tokens)

    # ---------------------------------------------------------------- queue
    def classify(self, task: PrefillTask) -> PrefillClass:
        return self.classifier.classify(task.l_incr, task.l_hist)

    def add(self, task: PrefillTask, now: float) -> None:
        """A task was submitted to the worker (it is also in the worker's queue, for its accounting)."""
        self._tick(now)
        if not self.opts.split:
            return
        if self.classify(task) is PrefillClass.SHORT:
            self._enqueue_short(task, now)
            self.stats.short_requests += 1
        else:
            self.long.append(task)
            self.stats.long_requests += 1

    def discard(self, task: PrefillTask) -> None:
        """The task left the worker (cancelled, its session released): forget it wherever it is."""
        key = self._keys.pop(id(task), None)
        if key is not None and self._tasks.pop(key, None) is not None:
            self.awd.cancel(key, self.last_now)
        if task in self.long:
            self.long.remove(task)
        if task in self.batch:
            self.batch.remove(task)
        if self.long_active is task:
            self.long_active = None

    def _tick(self, now: float) -> None:
        if now > self.last_now:
            self.last_now = now

    # ---------------------------------------------------------------- steps
    def schedule(self, core: PrefillHost, now: float) -> StepPlan | None:
        """The next step of a prefill worker in temporal mode (split on), or None (wake_at_s: when to ask again)."""
        self._tick(now)
        self.wake_at_s = math.inf
        active = core.active
        self.batch = [t for t in self.batch if t in active]
        if self.long_active is not None and self.long_active not in active:
            self.long_active = None
        if not self.batch and len(self.awd):
            d = self.awd.poll(now)
            if d.dispatched:
                tasks = [self._take(r.key) for r in d.batch]
                self.batch = [t for t in tasks if core.admit_task(t, now)]
                for t in tasks:
                    if t not in self.batch and t in core.queue:    # no memory now: queued again, waits anew
                        self._enqueue_short(t, now)
                self.bucket = d.bucket if self.opts.graphs and len(self.batch) == len(tasks) else None
                if self.batch and self.opts.graphs and self.bucket is None:
                    self.bucket = self.opts.grid.nearest([t.l_incr for t in self.batch], self.opts.batch_budget_tokens)
            elif d.wake_at_s is not None:
                self.wake_at_s = d.wake_at_s
        while self.long_active is None and self.long:
            t = self.long[0]
            if t not in core.queue:                  # gone meanwhile
                self.long.popleft()
                continue
            if not core.admit_task(t, now):
                break
            self.long.popleft()
            self.long_active = t
        short_ok = bool(self.batch) and all(t.kv_ready for t in self.batch)
        long_ok = self.long_active is not None and self.long_active.kv_ready
        if short_ok and long_ok:
            s_key = min((t.enqueue_s + t.ttft_slo_s, t.enqueue_s) for t in self.batch)
            la = self.long_active
            short_ok = s_key <= (la.enqueue_s + la.ttft_slo_s, la.enqueue_s)
            long_ok = not short_ok
        if short_ok:
            return self._short_step(core)
        if long_ok:
            return self._long_step(core)
        return None

    def _take(self, key: str) -> PrefillTask:
        t = self._tasks.pop(key)
        self._keys.pop(id(t), None)
        return t

    def _enqueue_short(self, task: PrefillTask, now: float) -> None:
        """Into the AWD batcher under a fresh key, due at enqueue + TTFT SLO."""
        self._n += 1
        key = f"t{self._n}"
        self._tasks[key], self._keys[id(task)] = task, key
        self.awd.on_arrival(ShortRequest(key, task.l_incr, task.enqueue_s, task.enqueue_s + task.ttft_slo_s), now)

    def _short_step(self, core: PrefillHost) -> StepPlan:
        plan = StepPlan(core.id)
        for t in self.batch:
            plan.prefill.append((t, t.l_incr - t.done))
        self.stats.short_steps += 1
        if self.bucket is not None:
            self.stats.graph_steps += 1
            self.stats.padded_tokens += pad_shape(plan, self.bucket)
        else:
            self.stats.eager_short_steps += 1
            fill_shape(plan)
        return plan

    def _long_step(self, core: PrefillHost) -> StepPlan:
        t = self.long_active
        plan = StepPlan(core.id)
        plan.prefill.append((t, min(self.opts.long_chunk, t.l_incr - t.done)))
        fill_shape(plan)
        self.stats.long_steps += 1
        return plan

    def pad_if_short(self, plan: StepPlan) -> None:
        """Split off: a step of whole short prefills that a bucket holds runs padded as a graph."""
        if not self.opts.graphs or not plan.prefill or plan.decode:
            return
        lengths = []
        for t, n in plan.prefill:
            if t.done != 0 or n != t.l_incr or self.classify(t) is not PrefillClass.SHORT:
                return
            lengths.append(n)
        bucket = self.opts.grid.nearest(lengths, self.opts.batch_budget_tokens)
        if bucket is None:
            return
        plan.shape = BatchShape()
        self.stats.short_steps += 1
        self.stats.graph_steps += 1
        self.stats.padded_tokens += pad_shape(plan, bucket)


def fill_shape(plan: StepPlan) -> None:
    """The unpadded shape of a prefill-only plan."""
    for t, n in plan.prefill:
        plan.shape.add_prefill(t.l_hist + t.done, n)


def pad_shape(plan: StepPlan, bucket: Bucket) -> int:
    """The shape of a plan run in `bucket`'s graph: every row padded to bucket.tokens, the batch to bucket.batch
    (padding rows attend only to themselves); returns the padding tokens."""
    s = plan.shape
    T, B = bucket.tokens, bucket.batch
    real = 0
    for t, n in plan.prefill:
        before = t.l_hist + t.done
        s.prefill_attn_pairs += T * (before + (T + 1) / 2)
        s.prefill_kv_read_tokens += before
        real += n
    s.prefill_attn_pairs += (B - len(plan.prefill)) * T * (T + 1) / 2
    s.prefill_tokens = T * B
    s.num_prefill = B
    s.graph = True
    return T * B - real


def laps_options(threshold: int | None, split: bool, graphs: bool, long_chunk: int | None,
                 budget: int) -> LapsOptions:
    """LapsOptions from a policy's knobs and the worker's token budget (C_l and the batch budget default to it)."""
    return LapsOptions(threshold=threshold or 256, split=split, graphs=graphs, long_chunk=long_chunk or budget,
                       batch_budget_tokens=budget)


__all__ = ["LapsOptions", "LapsScheduler", "LapsStats", "fill_shape", "laps_options", "pad_shape"]
