"""AMPD Eq. 5 with replica-aware, partner-aware coefficients, solved with HiGHS (scipy.optimize.milp).

Variables (T the feasible degrees, N the GPU budget):
    u[n,x] in {0,1}   the prefill kind is x replicas of tp n      (one per (n, x) with n x < N)
    v[m,y] in {0,1}   the decode kind is y replicas of tp m
    Z >= 0            the worst normalised P95 latency among the deployed worker kinds
with the degree indicators P[n] = sum_x u[n,x] and D[m] = sum_y v[m,y].

    minimise Z
    (C0)  sum u = 1,  sum v = 1                               one prefill and one decode kind
    (C1)  Z >= tau_pre[n,x | m] (u[n,x] + D[m] - 1)            for every (n, x) and decode degree m
    (C2)  Z >= tau_dec[m,y | n] (v[m,y] + P[n] - 1)            for every (m, y) and prefill degree n
    (C3)  sum n x u[n,x] + sum m y v[m,y] <= N                 the GPU budget
    (C4)  sum n x u + sum m y v >= sum (N + 1 - n) u[n,x]      no room left for another prefill replica
          sum n x u + sum m y v >= sum (N + 1 - m) v[m,y]      ... nor for another decode replica
    (cuts) u[n,x] + v[m,y] <= 1                               excluded (already ranked) deployments

(C1)/(C2) are AMPD's Z >= tau_pre(n), Z >= tau_dec(n) with two changes: the coefficient of a kind
depends on its replica count (x replicas share the load, so one tp-n replica's P95 is not a constant)
and on the degree of the other kind (AMPD routing runs prefills locally on decode workers, so the
other side changes each side's latency); the product with the indicator is linearised as
`tau (u + D - 1)`, which is tau when both are chosen and <= 0 otherwise. (C4) keeps only
deployments that use the budget (adding a replica never hurts); under it, for every feasible
point, y = floor((N - n x) / m) and x = floor((N - m y) / n), so tau_pre[n,x | m] and
tau_dec[m,y | n] are measured on one and the same deployment and the objective value of every
feasible point is exactly that deployment's simulated Z. See docs/planner.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from tandem.plan.space import Pair

BIG = 1e6
"""Stand-in for an infinite coefficient (a deployment that fails servable rounds)."""


@dataclass(slots=True)
class Coefficients:
    """tau_pre[(n, x, m)] and tau_dec[(m, y, n)]: normalised P95 TTFT and ITL (exact or lower bounds)."""

    budget: int
    pre: dict[tuple[int, int, int], float] = field(default_factory=dict)
    dec: dict[tuple[int, int, int], float] = field(default_factory=dict)

    def set_pair(self, p: Pair, ttft_norm: float, itl_norm: float) -> None:
        """Record the two coefficients measured on the maximal deployment `p`."""
        self.pre[p.n, p.x, p.m] = ttft_norm
        self.dec[p.m, p.y, p.n] = itl_norm

    def value(self, p: Pair) -> float:
        return max(self.pre.get((p.n, p.x, p.m), math.inf), self.dec.get((p.m, p.y, p.n), math.inf))


@dataclass(slots=True)
class Solution:
    pair: Pair
    z: float          # the MILP objective at this point (max of its two coefficients)


def _cap(t: float) -> float:
    return BIG if not math.isfinite(t) else min(t, BIG)


def solve_topk(coef: Coefficients, k: int, maximal: bool = True,
               exclude: list[Pair] | None = None) -> list[Solution]:
    """The k best deployments in order: solve, add a no-good cut on the optimum, solve again."""
    N = coef.budget
    pre_opts = sorted({(n, x) for (n, x, _m) in coef.pre})
    dec_opts = sorted({(m, y) for (m, y, _n) in coef.dec})
    if not pre_opts or not dec_opts:
        return []
    pre_deg = sorted({n for n, _ in pre_opts})
    dec_deg = sorted({m for m, _ in dec_opts})
    nu, nv = len(pre_opts), len(dec_opts)
    nz = nu + nv
    nvar = nz + 1
    gu = np.array([n * x for n, x in pre_opts], float)
    gv = np.array([m * y for m, y in dec_opts], float)

    rows, lo, hi = [], [], []

    def row() -> np.ndarray:
        return np.zeros(nvar)

    r = row(); r[:nu] = 1; rows.append(r); lo.append(1); hi.append(1)
    r = row(); r[nu:nz] = 1; rows.append(r); lo.append(1); hi.append(1)
    r = row(); r[:nu] = gu; r[nu:nz] = gv; rows.append(r); lo.append(-np.inf); hi.append(N)
    if maximal:
        r = row(); r[:nu] = gu - np.array([N + 1 - n for n, _ in pre_opts]); r[nu:nz] = gv
        rows.append(r); lo.append(0); hi.append(np.inf)
        r = row(); r[:nu] = gu; r[nu:nz] = gv - np.array([N + 1 - m for m, _ in dec_opts])
        rows.append(r); lo.append(0); hi.append(np.inf)
    dec_of = {m: [nu + j for j, (mm, _) in enumerate(dec_opts) if mm == m] for m in dec_deg}
    pre_of = {n: [i for i, (nn, _) in enumerate(pre_opts) if nn == n] for n in pre_deg}
    for i, (n, x) in enumerate(pre_opts):
        for m in dec_deg:
            t = coef.pre.get((n, x, m))
            r = row()
            r[i] = 1
            r[dec_of[m]] = 1
            if t is None:          # never measured with this partner degree: not a candidate
                rows.append(r); lo.append(-np.inf); hi.append(1)
                continue
            t = _cap(t)
            r *= t
            r[nz] = -1
            rows.append(r); lo.append(-np.inf); hi.append(t)
    for j, (m, y) in enumerate(dec_opts):
        for n in pre_deg:
            t = coef.dec.get((m, y, n))
            r = row()
            r[nu + j] = 1
            r[pre_of[n]] = 1
            if t is None:
                rows.append(r); lo.append(-np.inf); hi.append(1)
                continue
            t = _cap(t)
            r *= t
            r[nz] = -1
            rows.append(r); lo.append(-np.inf); hi.append(t)
    pidx = {o: i for i, o in enumerate(pre_opts)}
    didx = {o: nu + j for j, o in enumerate(dec_opts)}

    def cut(p: Pair) -> None:
        i, j = pidx.get((p.n, p.x)), didx.get((p.m, p.y))
        if i is None or j is None:
            return
        r = row(); r[i] = 1; r[j] = 1
        rows.append(r); lo.append(-np.inf); hi.append(1)

    for p in exclude or []:
        cut(p)
    c = np.zeros(nvar)
    c[nz] = 1
    integrality = np.ones(nvar)
    integrality[nz] = 0
    bounds = Bounds(np.zeros(nvar), np.r_[np.ones(nz), np.inf])
    out: list[Solution] = []
    for _ in range(k):
        res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
                   bounds=bounds, options={"mip_rel_gap": 0.0, "presolve": True})
        if res.status != 0 or res.x is None:
            break
        xs = res.x
        i = int(np.argmax(xs[:nu]))
        j = int(np.argmax(xs[nu:nz]))
        (n, x), (m, y) = pre_opts[i], dec_opts[j]
        p = Pair(n, x, m, y)
        out.append(Solution(p, coef.value(p)))
        cut(p)
    return out
