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

from tandem.core.types import PrefillTask, StepPlan
from tandem.perf.batch_shape import BatchShape
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


class ShortBatcher:
    """Short prefill tasks waiting in an AWD batcher (LAPS Alg. 1), dispatched as one batch with its bucket: the
    short queue of a LAPS prefill worker and of a decode worker's local prefills alike."""

    def __init__(self, opts: LapsOptions, t_pre: Callable[[int, int], float]) -> None:
        self.opts = opts
        self.t_pre = t_pre
        self.awd = AWDBatcher(opts.awd, opts.grid, self._service, opts.batch_budget_tokens)
        self._tasks: dict[str, PrefillTask] = {}    # AWD key -> queued short task
        self._keys: dict[int, str] = {}             # id(task) -> AWD key
        self._n = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def holds(self, task: PrefillTask) -> bool:
        """Whether `task` waits here (not yet dispatched)."""
        return id(task) in self._keys

    def add(self, task: PrefillTask, now: float) -> None:
        """Into the AWD batcher under a fresh key, due at enqueue + TTFT SLO."""
        self._n += 1
        key = f"t{self._n}"
        self._tasks[key], self._keys[id(task)] = task, key
        self.awd.on_arrival(ShortRequest(key, task.work, task.enqueue_s, task.enqueue_s + task.ttft_slo_s), now)

    def discard(self, task: PrefillTask, now: float) -> bool:
        """Forget a waiting task (cancelled, released, or no longer short); True if it was waiting here."""
        key = self._keys.pop(id(task), None)
        if key is None or self._tasks.pop(key, None) is None:
            return False
        self.awd.cancel(key, now)
        return True

    def poll(self, now: float) -> tuple[list[PrefillTask], Bucket | None, float | None]:
        """AWD's decision at `now`: the dispatched tasks (oldest first) and their bucket (None: no bucket holds
        them, or graphs are off), or no tasks and when to poll again (None: nothing waits)."""
        d = self.awd.poll(now)
        if not d.dispatched:
            return [], None, d.wake_at_s
        tasks = []
        for r in d.batch:
            t = self._tasks.pop(r.key)
            self._keys.pop(id(t), None)
            tasks.append(t)
        return tasks, d.bucket if self.opts.graphs else None, None

    def waiting_s(self) -> float:
        """Estimated prefill seconds of the waiting tasks."""
        return sum(t.est_s for t in self._tasks.values())

    def window(self, now: float) -> float:
        """AWD's window W(now) (the learned W when the service estimate is refused)."""
        try:
            return self.awd.window(now)
        except ValueError:
            return self.awd.learned_window_s

    def _service(self, lengths) -> float:
        """Ŝ: one step over the batch's tokens (the weights are read once for the whole batch), padded to its
        bucket when it runs in one."""
        tokens = int(sum(lengths))
        if self.opts.graphs:
            bucket = self.opts.grid.nearest(list(lengths), self.opts.batch_budget_tokens)
            if bucket is not None:
                tokens = bucket.padded_tokens
        return self.t_pre(0, tokens)


class LapsScheduler:
    """The LAPS state of one prefill worker: AWD over short tasks, FCFS long tasks, the batch being run."""

    def __init__(self, opts: LapsOptions, t_pre: Callable[[int, int], float]) -> None:
        self.opts = opts
        self.classifier = LengthClassifier(opts.threshold)
        self.short = ShortBatcher(opts, t_pre)
        self.long: deque[PrefillTask] = deque()     # queued long tasks, FCFS
        self.batch: list[PrefillTask] = []          # the dispatched short batch (admitted; runs when its KV is read)
        self.bucket: Bucket | None = None
        self.long_active: PrefillTask | None = None
        self.wake_at_s = math.inf                   # AWD's next decision time while it waits
        self.last_now = -math.inf
        self.stats = LapsStats()

    @property
    def awd(self) -> AWDBatcher:
        return self.short.awd

    def gauges(self, now: float) -> tuple[int, int, float, int]:
        """What the worker publishes: short and long prefills waiting, AWD's window W(now) and target depth D."""
        return len(self.short), len(self.long), self.short.window(max(now, self.last_now)), self.awd.depth_target

    def queued_s(self) -> tuple[float, float]:
        """Estimated prefill seconds of the short and long work not yet computed here (Alg. 2's per-class q)."""
        def left(t: PrefillTask) -> float:
            return t.est_s * (t.work - t.done) / t.work if t.work else 0.0
        short = self.short.waiting_s() + sum(left(t) for t in self.batch)
        long = sum(t.est_s for t in self.long) + (left(self.long_active) if self.long_active is not None else 0.0)
        return short, long

    # ---------------------------------------------------------------- queue
    def classify(self, task: PrefillTask) -> PrefillClass:
        return self.classifier.classify(task.work, task.first)

    def add(self, task: PrefillTask, now: float) -> None:
        """A task was submitted to the worker (it is also in the worker's queue, for its accounting)."""
        self._tick(now)
        if not self.opts.split:
            return
        if self.classify(task) is PrefillClass.SHORT:
            self.short.add(task, now)
            self.stats.short_requests += 1
        else:
            self.long.append(task)
            self.stats.long_requests += 1

    def discard(self, task: PrefillTask) -> None:
        """The task left the worker (cancelled, its session released): forget it wherever it is."""
        self.short.discard(task, self.last_now)
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
        if not self.batch and len(self.short):
            tasks, bucket, wake = self.short.poll(now)
            self.batch = [t for t in tasks if core.admit_task(t, now)]
            for t in tasks:
                if t not in self.batch and t in core.queue:    # no memory now: queued again, waits anew
                    self.short.add(t, now)
            self.bucket = bucket if len(self.batch) == len(tasks) else None
            if self.batch and self.opts.graphs and self.bucket is None:
                self.bucket = self.opts.grid.nearest([t.work for t in self.batch], self.opts.batch_budget_tokens)
            if wake is not None:
                self.wake_at_s = wake
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

    def _short_step(self, core: PrefillHost) -> StepPlan:
        plan = StepPlan(core.id)
        for t in self.batch:
            plan.prefill.append((t, t.work - t.done))
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
        plan.prefill.append((t, min(self.opts.long_chunk, t.work - t.done)))
        fill_shape(plan)
        self.stats.long_steps += 1
        return plan

    def pad_if_short(self, plan: StepPlan) -> None:
        """Split off: a step of whole short prefills that a bucket holds runs padded as a graph."""
        pad_whole_shorts(plan, self.classifier, self.opts, self.stats)


class LocalLaps:
    """AMPD+LAPS on a decode worker: its short local prefills wait in AWD and run as one batch (padded to a
    bucket with graphs on), so a burst of local re-prefills pauses the worker's decodes once, not once each.

    The worker keeps every task in its own queue; a task held here is not admitted until AWD dispatches it.
    Long prefills and recomputes of preempted sequences are never held."""

    def __init__(self, opts: LapsOptions, t_pre: Callable[[int, int], float]) -> None:
        self.opts = opts
        self.classifier = LengthClassifier(opts.threshold)
        self.short = ShortBatcher(opts, t_pre)
        self.wake_at_s = math.inf                   # AWD's next decision time while it holds tasks
        self.last_now = -math.inf
        self.stats = LapsStats()

    def add(self, task: PrefillTask, now: float) -> None:
        """A local task was submitted to the worker: hold it in AWD when short."""
        self.last_now = max(self.last_now, now)
        if task.recompute:
            return
        if self.classifier.classify(task.work, task.first) is PrefillClass.SHORT:
            self.short.add(task, now)
            self.stats.short_requests += 1
        else:
            self.stats.long_requests += 1

    def holds(self, task: PrefillTask) -> bool:
        return self.short.holds(task)

    def discard(self, task: PrefillTask) -> None:
        """The task left the worker or stopped being short (its history was dropped): release it."""
        self.short.discard(task, self.last_now)

    def release(self, now: float) -> list[PrefillTask]:
        """AWD's decision at `now`: the batch it dispatches (to be admitted), or none and wake_at_s set."""
        self.last_now = max(self.last_now, now)
        self.wake_at_s = math.inf
        out: list[PrefillTask] = []
        while len(self.short):                       # every batch due now, then when the next one is
            tasks, _, wake = self.short.poll(now)
            if not tasks:
                self.wake_at_s = wake if wake is not None else math.inf
                break
            out += tasks
        return out

    def gauges(self, now: float) -> tuple[int, int, float, int]:
        """As LapsScheduler.gauges: short prefills held, no long queue, AWD's window and target depth."""
        return len(self.short), 0, self.short.window(max(now, self.last_now)), self.short.awd.depth_target

    def pad_if_short(self, plan: StepPlan) -> None:
        """A prefill-only step of whole short prefills that a bucket holds runs padded as a graph."""
        pad_whole_shorts(plan, self.classifier, self.opts, self.stats)


def pad_whole_shorts(plan: StepPlan, classifier: LengthClassifier, opts: LapsOptions, stats: LapsStats) -> None:
    """With graphs on, pad a prefill-only step made of whole short prefills to the smallest bucket that holds it
    (counted in `stats`); any other step is left as it is."""
    if not opts.graphs or not plan.prefill or plan.decode:
        return
    lengths = []
    for t, n in plan.prefill:
        if t.done != 0 or n != t.work or classifier.classify(t.work, t.first) is not PrefillClass.SHORT:
            return
        lengths.append(n)
    bucket = opts.grid.nearest(lengths, opts.batch_budget_tokens)
    if bucket is None:
        return
    plan.shape = BatchShape()
    stats.short_steps += 1
    stats.graph_steps += 1
    stats.padded_tokens += pad_shape(plan, bucket)


def fill_shape(plan: StepPlan) -> None:
    """The unpadded shape of a prefill-only plan."""
    for t, n in plan.prefill:
        plan.shape.add_prefill(t.first + t.done, n)


def pad_shape(plan: StepPlan, bucket: Bucket) -> int:
    """The shape of a plan run in `bucket`'s graph: every row padded to bucket.tokens, the batch to bucket.batch
    (padding rows attend only to themselves); returns the padding tokens."""
    s = plan.shape
    T, B = bucket.tokens, bucket.batch
    real = 0
    for t, n in plan.prefill:
        before = t.first + t.done
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


__all__ = ["LapsOptions", "LapsScheduler", "LapsStats", "LocalLaps", "ShortBatcher", "fill_shape", "laps_options",
           "pad_shape", "pad_whole_shorts"]
