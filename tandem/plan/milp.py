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

`solve_topk` solves this model exactly by enumerating its feasible points (under (C3)-(C5) they are the maximal
deployments whose two coefficients are known, a few hundred at most) and `solve_topk_highs` by HiGHS
(scipy.optimize.milp, imported on first use: ~0.3 s); both give the same top k (tests/test_plan.py), the first
without importing scipy.optimize when every run of a plan comes from the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

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
    """The k best deployments of the MILP in order, by enumerating its feasible points: the maximal deployments
    (n, x, m, y = floor((N - n x) / m) >= 1) with both coefficients known and not excluded, ranked by
    Z = max(tau_pre, tau_dec) (infinite and larger coefficients capped at BIG, as for HiGHS), ties by fewer GPUs
    then the deployment string. Without `maximal`, HiGHS solves the model (its feasible set is then larger)."""
    if not maximal:
        return solve_topk_highs(coef, k, maximal, exclude)
    N = coef.budget
    cut = set(exclude or ())
    feasible: list[tuple[float, int, str, Pair]] = []
    for (n, x, m), t_pre in coef.pre.items():
        p = Pair(n, x, m, (N - n * x) // m)
        if p.y < 1 or not p.maximal(N) or p in cut:
            continue
        t_dec = coef.dec.get((m, p.y, n))
        if t_dec is not None:
            feasible.append((max(_cap(t_pre), _cap(t_dec)), p.gpus, p.deploy, p))
    feasible.sort(key=lambda f: f[:3])
    return [Solution(p, coef.value(p)) for *_, p in feasible[:k]]


def solve_topk_highs(coef: Coefficients, k: int, maximal: bool = True,
                     exclude: list[Pair] | None = None) -> list[Solution]:
    """The k best deployments in order by HiGHS: solve, add a no-good cut on the optimum, solve again."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    N = coef.budget
    a_keys = sorted(coef.pre)          # (n, x, m)
    b_keys = sorted(coef.dec)          # (m, y, n)
    d_keys = sorted({(n, m) for n, _x, m in a_keys} & {(n, m) for m, _y, n in b_keys})
    if not d_keys:
        return []
    na, nb, nd = len(a_keys), len(b_keys), len(d_keys)
    ia = {key: i for i, key in enumerate(a_keys)}
    ib = {key: na + j for j, key in enumerate(b_keys)}
    idl = {key: na + nb + t for t, key in enumerate(d_keys)}
    iz = na + nb + nd
    nvar = iz + 1
    rows: list[dict[int, float]] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(coefs: dict[int, float], low: float, high: float) -> None:
        rows.append(coefs)
        lo.append(low)
        hi.append(high)

    add({idl[d]: 1.0 for d in d_keys}, 1, 1)                       # (C0) one degree pair
    for (n, m) in d_keys:                                          # (C0) one replica count per kind
        r = {ia[key]: 1.0 for key in a_keys if key[0] == n and key[2] == m}
        r[idl[n, m]] = -1.0
        add(r, 0, 0)
        r = {ib[key]: 1.0 for key in b_keys if key[0] == m and key[2] == n}
        r[idl[n, m]] = -1.0
        add(r, 0, 0)
    for key in a_keys:                                             # kinds whose degree pair has no partner
        if (key[0], key[2]) not in idl:
            add({ia[key]: 1.0}, 0, 0)
    for key in b_keys:
        if (key[2], key[0]) not in idl:
            add({ib[key]: 1.0}, 0, 0)
    r = {ia[key]: _cap(coef.pre[key]) for key in a_keys}          # (C1)
    r[iz] = -1.0
    add(r, -np.inf, 0)
    r = {ib[key]: _cap(coef.dec[key]) for key in b_keys}          # (C2)
    r[iz] = -1.0
    add(r, -np.inf, 0)
    gpus = {ia[(n, x, m)]: float(n * x) for (n, x, m) in a_keys}
    gpus.update({ib[(m, y, n)]: float(m * y) for (m, y, n) in b_keys})
    add(gpus, -np.inf, N)                                          # (C3)
    if maximal:                                                    # (C4) no room for another replica
        r = dict(gpus)
        for (n, m) in d_keys:
            r[idl[n, m]] = -float(N + 1 - min(n, m))
        add(r, 0, np.inf)
        # (C5) implied by (C3)-(C4), stated to tighten the relaxation: with prefill kind (n, x) and
        # decode degree m, the decode kind is y = floor((N - n x) / m) replicas
        for (n, x, m) in a_keys:
            p = Pair(n, x, m, (N - n * x) // m)
            j = ib.get((m, p.y, n))
            if p.y >= 1 and p.maximal(N) and j is not None:
                add({ia[(n, x, m)]: 1.0, j: -1.0}, 0, 0)
            else:
                add({ia[(n, x, m)]: 1.0}, 0, 0)

    def cut(p: Pair) -> None:
        i, j = ia.get((p.n, p.x, p.m)), ib.get((p.m, p.y, p.n))
        if i is not None and j is not None:
            add({i: 1.0, j: 1.0}, -np.inf, 1)

    for p in exclude or []:
        cut(p)
    c = np.zeros(nvar)
    c[iz] = 1
    integrality = np.ones(nvar)
    integrality[iz] = 0
    bounds = Bounds(np.zeros(nvar), np.r_[np.ones(iz), np.inf])
    out: list[Solution] = []
    for _ in range(k):
        data, ri, ci = [], [], []
        for t, rr in enumerate(rows):
            for col, v in rr.items():
                ri.append(t)
                ci.append(col)
                data.append(v)
        A = csr_array((data, (ri, ci)), shape=(len(rows), nvar))
        res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
                   bounds=bounds, options={"mip_rel_gap": 0.0})
        if res.status != 0 or res.x is None:
            break
        xs = res.x
        (n, x, m) = a_keys[int(np.argmax(xs[:na]))]
        (_m, y, _n) = b_keys[int(np.argmax(xs[na:na + nb]))]
        p = Pair(n, x, m, y)
        out.append(Solution(p, coef.value(p)))
        cut(p)
    return out
