"""LAPS Alg. 2: the lightweight instance-pressure controller moving prefill instances between the pools.

Sans-I/O: the shell calls step(now, signals) once per control period Δt with each instance's latest
signal; step returns the one Move to carry out (or None) and has already updated the membership.

Pressure of instance k: ψ_k = α·q_k + β·e_k − γ·u_k (queue backlog, SLA deviation, utilisation).
Both pools are scored with the same weights on the same signals, so their pressures share one scale
(the shell must report q and e in the same units for both pools, e.g. normalised backlog and TTFT
over SLO minus 1). A pool's pressure is a robust quantile (P90 by default) of its instances' ψ.

Hysteresis with signed pressures. Alg. 2 compares P_s > (1+τ)·P_l, which inverts when P_l < 0 (an
idle, utilised pool): (1+τ)·P_l is then *below* P_l and the hysteresis would help the move instead
of resisting it. This controller uses one rule for every sign: a pressure a exceeds b when
a − b > τ·|b|. For b >= 0 that is exactly a > (1+τ)·b; for b < 0 it is a > (1−τ)·b, i.e. a must
still beat b by the fraction τ of b's magnitude. For b = 0 any a > 0 exceeds it (as in Alg. 2).

Reversal guard (an addition to Alg. 2, on by default, `guard_reversal=False` for the paper's rule):
a move is made only if, re-scored on the same signals after the move, the opposite pool would not
exceed the other — P90 over small pools jumps when a member leaves, and without the guard a constant
load can make the controller move the same instance back and forth every cool-down. With the guard,
under constant signals every move goes the same way, so the pools reach a fixed point.

Reversal back-off (an addition too, `reversal_backoff=2.0` by default, 1.0 for the paper's rule): signals are not
constant in a closed loop — moving an instance changes the loads it is scored on — and when the balanced split
lies between two integer splits, the pools flip between them every cool-down. A move that undoes the previous one
therefore waits t_cool times backoff^k since the last move, k the reversals in a row including it (capped at
backoff^6); a move in the same direction as the previous one resets k. A limit cycle is damped geometrically, a
lasting shift of the mix (moves going one way) is followed at the plain cool-down.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from tandem.policy.checks import check_finite, check_int
from tandem.policy.laps.classify import PrefillClass

__all__ = ["InstanceSignal", "Move", "PoolController", "PressureConfig", "exceeds"]

MAX_BACKOFF_EXP = 6          # the longest wait before a reversal: t_cool * backoff^6


def exceeds(a: float, b: float, tau: float) -> bool:
    """Hysteresis test for signed pressures: a − b > τ·|b| (a > (1+τ)·b when b >= 0)."""
    return a - b > tau * abs(b)


@dataclass(frozen=True, slots=True)
class PressureConfig:
    """Alg. 2 knobs: pressure weights (α, β, γ), hysteresis τ, cool-down, minimum pool size, aggregator."""

    alpha: float = 1.0                 # weight of the queue backlog q
    beta: float = 1.0                  # weight of the SLA deviation e
    gamma: float = 1.0                 # weight of the utilisation u (subtracted)
    tau: float = 0.2                   # hysteresis: the donor must be exceeded by a fraction τ
    t_cool_s: float = 5.0              # no move within t_cool_s of the last one
    n_min: int = 1                     # neither pool drops below n_min instances
    aggregator_quantile: float = 0.9   # pool pressure = this quantile of instance pressures (P90)
    guard_reversal: bool = True        # skip a move that would immediately qualify the opposite move
    reversal_backoff: float = 2.0      # a move undoing the previous one waits t_cool * backoff^k (1: no back-off)

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "tau", "t_cool_s"):
            check_finite(name, getattr(self, name), 0)
        check_int("n_min", self.n_min, 0, "an int")
        q = self.aggregator_quantile
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise ValueError(f"aggregator_quantile must be in [0, 1], got {q!r}")
        if not isinstance(self.guard_reversal, bool):
            raise ValueError(f"guard_reversal must be a bool, got {self.guard_reversal!r}")
        check_finite("reversal_backoff", self.reversal_backoff, 1)


@dataclass(frozen=True, slots=True)
class InstanceSignal:
    """One instance's load in the last control period: queue backlog, SLA deviation, utilisation."""

    instance: int
    queue: float
    sla_deviation: float
    utilization: float

    def __post_init__(self) -> None:
        if isinstance(self.instance, bool) or not isinstance(self.instance, int):
            raise ValueError(f"instance must be an int, got {self.instance!r}")
        check_finite("queue", self.queue, 0)
        check_finite("utilization", self.utilization, 0)
        check_finite("sla_deviation", self.sla_deviation)


@dataclass(frozen=True, slots=True)
class Move:
    """One instance migrated between the pools at at_s."""

    instance: int
    from_pool: PrefillClass
    to_pool: PrefillClass
    at_s: float


class PoolController:
    """Alg. 2: moves at most one instance per step toward the more pressured pool, with cool-down and hysteresis."""

    def __init__(self, config: PressureConfig, short: Iterable[int], long: Iterable[int]) -> None:
        if not isinstance(config, PressureConfig):
            raise ValueError(f"config must be a PressureConfig, got {type(config).__name__}")
        pools = {PrefillClass.SHORT: set(short), PrefillClass.LONG: set(long)}
        for cls, members in pools.items():
            for k in members:
                if isinstance(k, bool) or not isinstance(k, int):
                    raise ValueError(f"{cls} pool: instance ids must be ints, got {k!r}")
            if len(members) < config.n_min:
                raise ValueError(f"{cls} pool has {len(members)} instances, fewer than n_min={config.n_min}")
        both = pools[PrefillClass.SHORT] & pools[PrefillClass.LONG]
        if both:
            raise ValueError(f"instances {sorted(both)} are in both pools")
        self.config = config
        self._pools = pools
        self._t_last = -math.inf
        self._last_to: PrefillClass | None = None     # the pool the previous move went to
        self._reversals = 0                           # moves in a row that undid the previous one

    def pools(self) -> dict[PrefillClass, frozenset[int]]:
        """Current membership of the SHORT and LONG pools."""
        return {cls: frozenset(m) for cls, m in self._pools.items()}

    def pressure(self, signal: InstanceSignal) -> float:
        """ψ = α·q + β·e − γ·u."""
        c = self.config
        return c.alpha * signal.queue + c.beta * signal.sla_deviation - c.gamma * signal.utilization

    def pool_pressure(self, signals: Iterable[InstanceSignal]) -> float:
        """The configured quantile of the instances' pressures (linear interpolation, as numpy.percentile)."""
        values = [self.pressure(s) for s in signals]
        if not values:
            raise ValueError("pool_pressure needs at least one signal")
        return float(np.quantile(values, self.config.aggregator_quantile))

    def step(self, now: float, signals: Mapping[int, InstanceSignal],
             by_class: Mapping[PrefillClass, Mapping[int, InstanceSignal]] | None = None) -> Move | None:
        """One control period (Alg. 2 body): maybe move one instance; returns the Move carried out.

        Signals of instances in neither pool are ignored; a pool with no signal makes no decision.
        The donor's instance with the lowest pressure moves (ties: lowest id), among those with a signal.
        `by_class` (optional): per class, each instance's signal counting only that class's queued work; a pool
        is then scored on its class's signals, and an empty pool (n_min 0) on its class's signals over every
        instance (they all serve it), so the class can win an instance back.
        """
        check_finite("now", now)
        for group in (signals, *(by_class or {}).values()):
            for k, s in group.items():
                if not isinstance(s, InstanceSignal) or s.instance != k:
                    raise ValueError(f"signals[{k!r}] must be the InstanceSignal of instance {k!r}, got {s!r}")
        psi = {cls: {k: self.pressure(s) for k, s in (by_class[cls] if by_class else signals).items()}
               for cls in PrefillClass}
        pressures = self._pool_pressures(self._pools, psi)
        if pressures is None or now - self._t_last < self.config.t_cool_s:
            return None
        c = self.config
        p_s, p_l = pressures[PrefillClass.SHORT], pressures[PrefillClass.LONG]
        if exceeds(p_s, p_l, c.tau) and len(self._pools[PrefillClass.LONG]) > c.n_min:
            donor, receiver = PrefillClass.LONG, PrefillClass.SHORT
        elif exceeds(p_l, p_s, c.tau) and len(self._pools[PrefillClass.SHORT]) > c.n_min:
            donor, receiver = PrefillClass.SHORT, PrefillClass.LONG
        else:
            return None
        reversal = self._last_to is donor
        if reversal:
            wait = c.t_cool_s * c.reversal_backoff ** min(self._reversals + 1, MAX_BACKOFF_EXP)
            if now - self._t_last < wait:
                return None
        candidates = [k for k in self._pools[donor] if k in psi[donor]]
        if not candidates:
            return None
        k = min(candidates, key=lambda i: (psi[donor][i], i))
        after = {donor: self._pools[donor] - {k}, receiver: self._pools[receiver] | {k}}
        if c.guard_reversal:
            moved = self._pool_pressures(after, psi)
            if moved is not None and exceeds(moved[donor], moved[receiver], c.tau):
                return None
        self._pools = after
        self._t_last = now
        self._reversals = self._reversals + 1 if reversal else 0
        self._last_to = receiver
        return Move(k, donor, receiver, float(now))

    def _pool_pressures(self, pools: Mapping[PrefillClass, set[int]],
                        psi: Mapping[PrefillClass, Mapping[int, float]]) -> dict[PrefillClass, float] | None:
        out = {}
        for cls, members in pools.items():
            values = [psi[cls][k] for k in members if k in psi[cls]] if members else list(psi[cls].values())
            if not values:
                return None
            out[cls] = float(np.quantile(values, self.config.aggregator_quantile))
        return out
