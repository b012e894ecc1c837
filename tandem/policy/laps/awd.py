"""LAPS Adaptive Wait-Depth batching of short prefills (Alg. 1, §3.2 SLA-constrained and deadline-free modes).

Sans-I/O: the shell calls on_arrival(req, now) as short prefills arrive and poll(now) whenever the
executor can take a batch and at the latest at the wake_at_s of the last WAITING decision. Every
time is an argument; nothing here reads a clock.

Batch timer. The batch being formed belongs to the queue head (the oldest queued request); its timer
starts when the head was enqueued, so the window bounds the head's total wait. When a batch becomes
current (a request arrives to an empty queue, or a dispatch or cancel leaves a new head), its window
W = window(now) is computed once (the "decision epoch" of §3.2) and the batch closes at
head_enqueue + W. A head that had already waited longer than that closes at once.

Batch formation ("bucket-first", Alg. 1 line 5): the head always goes first; the other queued
requests are ranked by (distance between their captured-length index and the head's, their length
index, deadline, arrival order) — same bucket first, then the nearer bucket with the shorter one
first, so the batch's padded length grows as little as possible; within a bucket the earlier deadline
first (SLA-first), then FCFS. Requests are added in that order while the batch has fewer than D
requests and the real tokens stay within the memory budget (a request that does not fit is skipped
and marks the batch full). A head larger than the budget still goes, alone. The batch never holds
more than D requests. The formed batch does not depend on `now`, only on the queue, D and the budget.

Dispatch triggers, checked in this order (the first that holds is the reported reason):
  DEPTH_REACHED   the batch holds D requests, or a queued request was skipped for memory (full);
  TOKEN_TARGET    deadline-free token-max mode: real tokens of the batch >= token_target;
  SLACK           now >= min_i DDL_i − Ŝ − σ over every queued request i (a superset of the paper's
                  B ∪ {next}: a request that cannot join this batch starts after it, so waiting
                  can only hurt it), Ŝ = service_estimate(the batch poll would dispatch);
  HEAD_WAIT       now >= head_enqueue + t_max;
  WINDOW_EXPIRED  now >= head_enqueue + W.
Otherwise WAITING with wake_at_s = min(head_enqueue + W, head_enqueue + t_max, min_i DDL_i − Ŝ − σ):
exactly the earliest time a trigger fires if nothing else happens, computed with the same
expressions as the triggers, so a poll at wake_at_s dispatches.

Guarantees (Ŝ as above; exact, no tolerance):
  - the head is dispatched by poll(now) for every now >= head_enqueue + min(w_max, t_max);
  - poll(now) dispatches (a batch containing the head, which is ahead of every queued request)
    whenever some queued request i has now >= DDL_i − Ŝ − σ;
  - hence, polled at every wake_at_s and again at once after each dispatch, and with a constant Ŝ,
    every request r is dispatched by min(max(h_r, e_r + min(w_max, t_max)), max(e_r, DDL_r − Ŝ − σ)),
    e_r its enqueue time and h_r the time it became the head.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tandem.policy.checks import check_finite, check_int
from tandem.policy.laps.buckets import Bucket, BucketGrid

__all__ = ["AWDBatcher", "AWDConfig", "Decision", "DispatchReason", "ShortRequest"]


def _clip(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


@dataclass(frozen=True, slots=True)
class AWDConfig:
    """AWD knobs: window bounds, slack σ, SLA margin δ, head-of-line cap, rate estimator, token target."""

    w_min_s: float = 0.0            # W_min: shortest batching window
    w_max_s: float = 0.02           # W_max: longest batching window
    sigma_s: float = 0.005          # σ: dispatch once some request's slack DDL − (t + Ŝ) <= σ
    delta_s: float = 0.002          # δ: safety margin of the SLA window W_SLA
    t_max_s: float = 0.05           # T_max: dispatch once the head has waited this long
    epsilon_rate: float = 1e-3      # ε: floor of the arrival-rate estimate in W_GR (requests/s)
    rate_halflife_s: float = 1.0    # half-life of the exponentially decayed arrival-rate estimate
    token_target: int | None = None  # M_s: deadline-free token-max mode dispatches at tok(B) >= M_s

    def __post_init__(self) -> None:
        for name in ("w_min_s", "w_max_s", "sigma_s", "delta_s", "t_max_s"):
            check_finite(name, getattr(self, name), 0)
        if self.w_min_s > self.w_max_s:
            raise ValueError(f"w_min_s ({self.w_min_s}) must not exceed w_max_s ({self.w_max_s})")
        for name in ("epsilon_rate", "rate_halflife_s"):
            check_finite(name, getattr(self, name), 0)
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        check_int("token_target", self.token_target, 1, "an int", optional=True)


@dataclass(frozen=True, slots=True)
class ShortRequest:
    """A queued short prefill: its new tokens and absolute deadline (inf: none).

    arrival_s is carried for the caller (TTFT accounting); the batcher times waits from on_arrival's now.
    """

    key: str
    tokens: int
    arrival_s: float
    deadline_s: float = math.inf

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"key must be a non-empty str, got {self.key!r}")
        check_int("tokens", self.tokens, 1, "an int")
        check_finite("arrival_s", self.arrival_s)
        d = self.deadline_s
        if isinstance(d, bool) or not isinstance(d, (int, float)) or math.isnan(d) or d == -math.inf:
            raise ValueError(f"deadline_s must be a finite number or +inf, got {d!r}")


class DispatchReason(StrEnum):
    """Why poll dispatched (or did not)."""

    DEPTH_REACHED = "depth_reached"    # D requests, or the memory budget admits no more queued requests
    TOKEN_TARGET = "token_target"      # deadline-free mode: tok(B) >= token_target
    SLACK = "slack"                    # some request's slack DDL − (now + Ŝ) <= σ
    HEAD_WAIT = "head_wait"            # the head waited t_max
    WINDOW_EXPIRED = "window_expired"  # the head waited the batch's window W
    WAITING = "waiting"                # no dispatch; poll again at wake_at_s at the latest
    EMPTY = "empty"                    # nothing queued


@dataclass(frozen=True, slots=True)
class Decision:
    """poll's answer: a batch (and its captured bucket, None: standard kernel) or when to poll again."""

    batch: tuple[ShortRequest, ...] | None
    bucket: Bucket | None
    wake_at_s: float | None
    reason: DispatchReason

    @property
    def dispatched(self) -> bool:
        """Whether this decision dispatches a batch."""
        return self.batch is not None


@dataclass(slots=True)
class _Queued:
    req: ShortRequest
    enqueued_s: float
    seq: int
    length_index: int


@dataclass(slots=True)
class _Formed:
    members: list[_Queued]
    full: bool
    lengths: list[int] = field(default_factory=list)


class AWDBatcher:
    """Adaptive Wait-Depth batcher of one short-prefill queue (LAPS Alg. 1 and §3.2), sans-I/O."""

    def __init__(self, config: AWDConfig, grid: BucketGrid, service_estimate: Callable[[Sequence[int]], float],
                 mem_budget_tokens: int | None = None) -> None:
        if not isinstance(config, AWDConfig):
            raise ValueError(f"config must be an AWDConfig, got {type(config).__name__}")
        if not isinstance(grid, BucketGrid):
            raise ValueError(f"grid must be a BucketGrid, got {type(grid).__name__}")
        if not callable(service_estimate):
            raise ValueError("service_estimate must be callable (request lengths -> seconds)")
        self.config = config
        self.grid = grid
        self._estimate = service_estimate
        self._queue: list[_Queued] = []
        self._keys: set[str] = set()
        self._seq = 0
        self._now = -math.inf
        self._lambda = math.log(2) / config.rate_halflife_s
        self._rate_mass = 0.0           # Σ_k exp(−λ (t_rate − a_k)) over arrivals a_k
        self._rate_t = -math.inf
        self._budget: int | None = None
        self._depth_cap = 1
        self._depth = 1
        self._window = config.w_max_s   # Alg. 1's learned W (clip of the last fill time)
        self._close_at: float | None = None
        self._formed: _Formed | None = None
        self.set_mem_budget(mem_budget_tokens)
        self._depth = self._depth_cap

    # --- state -------------------------------------------------------------------------------
    @property
    def depth_target(self) -> int:
        """D: the batch depth AWD currently waits for."""
        return self._depth

    @property
    def depth_cap(self) -> int:
        """Upper bound of D: the largest captured batch with a bucket within the memory budget (>= 1)."""
        return self._depth_cap

    @property
    def learned_window_s(self) -> float:
        """Alg. 1's adaptive W: the clipped time the last batch took to reach D (w_max until one did).

        Reported, not used in decisions: §3.2 recomputes the window every epoch from W_SLA and W_GR,
        which supersedes it. (Taking it into the minimum degenerates: a depth-1 batch "fills" in 0 s,
        so W would drop to w_min and every later window close at once.)
        """
        return self._window

    @property
    def close_at_s(self) -> float | None:
        """When the current batch's window ends (head enqueue + W); None when nothing is queued."""
        return self._close_at if self._queue else None

    @property
    def mem_budget_tokens(self) -> int | None:
        """The memory budget in tokens (None: unlimited)."""
        return self._budget

    @property
    def queued(self) -> tuple[ShortRequest, ...]:
        """Queued requests, oldest (the head) first."""
        return tuple(q.req for q in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    # --- events ------------------------------------------------------------------------------
    def on_arrival(self, req: ShortRequest, now: float) -> None:
        """Enqueue a short prefill at `now` and count it in the arrival-rate estimate."""
        if not isinstance(req, ShortRequest):
            raise ValueError(f"req must be a ShortRequest, got {type(req).__name__}")
        if req.key in self._keys:
            raise ValueError(f"request {req.key!r} is already queued")
        self._advance(now)
        saved = (self._rate_mass, self._rate_t)
        self._rate_mass = self._rate_mass * self._decay(now) + 1.0
        self._rate_t = now
        was_empty = not self._queue
        self._queue.append(_Queued(req, now, self._seq, self.grid.length_index(req.tokens)))
        self._seq += 1
        self._keys.add(req.key)
        self._formed = None
        if was_empty:
            try:
                self._start_batch(now)
            except ValueError:              # a bad service estimate: leave the batcher as it was
                self._queue.clear()
                self._keys.discard(req.key)
                self._rate_mass, self._rate_t = saved
                self._formed = None
                raise

    def cancel(self, key: str, now: float) -> bool:
        """Drop a queued request (client gone); False when it is not queued."""
        self._advance(now)
        for i, q in enumerate(self._queue):
            if q.req.key == key:
                del self._queue[i]
                self._keys.discard(key)
                self._formed = None
                if i == 0 and self._queue:
                    self._start_batch(now)
                return True
        return False

    def set_mem_budget(self, mem_budget_tokens: int | None) -> None:
        """Change the memory budget (tokens; None: unlimited) and re-derive D's upper bound from it."""
        check_int("mem_budget_tokens", mem_budget_tokens, 0, "an int", optional=True)
        self._budget = mem_budget_tokens
        self._depth_cap = max(1, self.grid.max_depth(mem_budget_tokens))
        self._depth = min(self._depth, self._depth_cap)
        self._formed = None

    def on_dispatch(self, depth: int, fill_time_s: float) -> None:
        """Alg. 1 adaptation after a batch of `depth` requests that took fill_time_s to reach that depth.

        d >= D: W <- clip(τ, [w_min, w_max]) (see learned_window_s), and D grows to the next captured
        batch size (an addition to Alg. 1, whose D can only fall: without it one light-load spell
        would pin D at 1 for good);
        d < D: D <- d. D stays within [1, depth_cap]. poll() calls this itself for the batches it
        dispatches; call it directly only to feed batches formed elsewhere (replay, tests).
        """
        check_int("depth", depth, 1, "an int")
        check_finite("fill_time_s", fill_time_s, 0)
        if depth >= self._depth:
            self._window = _clip(fill_time_s, self.config.w_min_s, self.config.w_max_s)
            larger = [b for b in self.grid.batches if b > self._depth]
            if larger:
                self._depth = larger[0]
        else:
            self._depth = depth
        self._depth = max(1, min(self._depth, self._depth_cap))
        self._formed = None

    # --- queries -----------------------------------------------------------------------------
    def rate(self, now: float) -> float:
        """Estimated short arrival rate r̂_s (requests/s) at `now`.

        r̂(t) = λ Σ_k exp(−λ(t − a_k)) over past arrivals a_k, λ = ln 2 / rate_halflife_s: each arrival
        counts with a weight halving every half-life, and for Poisson arrivals of rate r the sum's
        expectation is r/λ, so r̂ is an unbiased estimate that decays when arrivals stop.
        """
        self._check_query_time(now)
        return self._lambda * self._rate_mass * self._decay(now)

    def window(self, now: float) -> float:
        """W(t) = clip(min(W_SLA, W_GR), [w_min, w_max]) (§3.2): the window of a batch made current at `now`.

        W_SLA = max(0, min_i(DDL_i − now − Ŝ) − δ) over queued requests (inf without deadlines);
        W_GR = max(0, D − depth)/max(r̂_s, ε), depth = the size of the batch poll would form;
        Ŝ = service_estimate(the batch poll would form).
        """
        self._check_query_time(now)
        cfg = self.config
        w_sla = math.inf
        depth = 0
        if self._queue:
            formed = self._form()
            depth = len(formed.members)
            ddl = min(q.req.deadline_s for q in self._queue)
            if ddl < math.inf:
                w_sla = max(0.0, ddl - now - self._service(formed.lengths) - cfg.delta_s)
        w_gr = max(0, self._depth - depth) / max(self.rate(now), cfg.epsilon_rate)
        return _clip(min(w_sla, w_gr), cfg.w_min_s, cfg.w_max_s)

    # --- the decision ------------------------------------------------------------------------
    def poll(self, now: float) -> Decision:
        """Dispatch the current batch if a trigger holds at `now`, else say when to poll again."""
        self._advance(now)
        if not self._queue:
            return Decision(None, None, None, DispatchReason.EMPTY)
        cfg = self.config
        formed = self._form()
        lengths = formed.lengths
        s_hat = self._service(lengths)
        head_at = self._queue[0].enqueued_s
        slack_at = min(q.req.deadline_s for q in self._queue) - s_hat - cfg.sigma_s
        wait_cap_at = head_at + cfg.t_max_s
        close_at = self._close_at
        if formed.full:
            reason = DispatchReason.DEPTH_REACHED
        elif cfg.token_target is not None and sum(lengths) >= cfg.token_target:
            reason = DispatchReason.TOKEN_TARGET
        elif now >= slack_at:
            reason = DispatchReason.SLACK
        elif now >= wait_cap_at:
            reason = DispatchReason.HEAD_WAIT
        elif now >= close_at:
            reason = DispatchReason.WINDOW_EXPIRED
        else:
            return Decision(None, None, min(slack_at, wait_cap_at, close_at), DispatchReason.WAITING)

        taken = {id(m) for m in formed.members}
        self._queue = [q for q in self._queue if id(q) not in taken]
        for m in formed.members:
            self._keys.discard(m.req.key)
        self._formed = None
        fill = max(m.enqueued_s for m in formed.members) - head_at
        self.on_dispatch(len(formed.members), fill)
        if self._queue:
            self._start_batch(now)
        bucket = self.grid.nearest(lengths, self._budget)
        return Decision(tuple(m.req for m in formed.members), bucket, None, reason)

    # --- internals ---------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        check_finite("now", now)
        if now < self._now:
            raise ValueError(f"time went backwards: now={now!r} after {self._now!r}")
        self._now = now

    def _check_query_time(self, now: float) -> None:
        check_finite("now", now)
        if now < self._now:
            raise ValueError(f"time went backwards: now={now!r} after {self._now!r}")

    def _decay(self, now: float) -> float:
        if self._rate_mass == 0.0:
            return 0.0
        return math.exp(-self._lambda * (now - self._rate_t))

    def _service(self, lengths: Sequence[int]) -> float:
        s = self._estimate(tuple(lengths))
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ValueError(f"service_estimate returned {s!r}; it must return finite seconds >= 0")
        return float(s)

    def _start_batch(self, now: float) -> None:
        self._close_at = self._queue[0].enqueued_s + self.window(now)

    def _form(self) -> _Formed:
        if self._formed is not None:
            return self._formed
        head = self._queue[0]
        hi = head.length_index
        ranked = sorted(self._queue[1:], key=lambda q: (abs(q.length_index - hi), q.length_index,
                                                        q.req.deadline_s, q.seq))
        members, tokens, full = [head], head.req.tokens, False
        for q in ranked:
            if len(members) >= self._depth:
                break
            if self._budget is not None and tokens + q.req.tokens > self._budget:
                full = True
                continue
            members.append(q)
            tokens += q.req.tokens
        full = full or len(members) >= self._depth
        self._formed = _Formed(members, full, [m.req.tokens for m in members])
        return self._formed
