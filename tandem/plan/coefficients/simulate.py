"""One simulator run of a deployment, stopping early once the rounds known so far prove Z > cutoff."""
from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Sequence

from tandem.plan.coefficients.measurement import Measurement
from tandem.plan.coefficients.objective import INF, Info, info_for, needed_above, objective
from tandem.plan.coefficients.workload import SimSpec
from tandem.workload.session import Session


class _Stop(Exception):
    """Raised inside the event loop once Z > cutoff is proven."""


class _Tracker:
    """Progress hook of the event loop: counts rounds above cutoff x SLO as their latencies become final."""

    def __init__(self, coord, loop, info: Info, cutoff: float):
        self.coord, self.loop, self.info, self.cutoff = coord, loop, info, cutoff
        self.need_t, self.need_i = needed_above(info.n_ttft), needed_above(info.n_itl)
        self.above_t = self.above_i = 0
        self.open: list[list] = []
        self.next = 0

    def __call__(self, _done: int) -> None:
        recs = self.coord.records
        while self.next < len(recs):
            self.open.append([recs[self.next], 0, 0])
            self.next += 1
        cut, now, keep = self.cutoff, self.loop.now, []
        for ent in self.open:
            rec, kt, ki = ent
            servable, has_itl, slo_t, slo_i = self.info.by_id[rec.session_id]
            rounds = rec.rounds
            while kt < servable and kt < len(rounds):
                r = rounds[kt]
                if r.first_token_s is not None:
                    if r.first_token_s - r.arrival_s > cut * slo_t:
                        self.above_t += 1
                elif now - r.arrival_s > cut * slo_t:
                    self.above_t += 1          # still waiting, already later than the threshold
                else:
                    break
                kt += 1
            while ki < servable and ki < len(rounds) and rounds[ki].finish_s is not None:
                r = rounds[ki]
                if has_itl[ki] and r.itl_count > 0 and r.itl_sum_s / r.itl_count > cut * slo_i:
                    self.above_i += 1
                ki += 1
            if rec.failed:
                self.above_t += servable - kt      # rounds that will never get a first token
                self.above_i += sum(has_itl[ki:servable])
            elif rec.finish_s is None:
                ent[1], ent[2] = kt, ki
                keep.append(ent)
        self.open = keep
        if self.above_t >= self.need_t or self.above_i >= self.need_i:
            raise _Stop


@contextlib.contextmanager
def _no_gc():
    """No cyclic garbage collection during a run: a run allocates many long-lived objects (events, records, block
    tables), so the collector's passes cost up to a third of its time and free nothing until the run ends;
    the collector is back on (if it was) when the run ends, whatever its outcome."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def simulate_one(sessions: Sequence[Session], workload_key: str, spec: SimSpec, deploy: str, gpus: int,
                 cutoff: float = INF) -> Measurement:
    """Simulate `deploy` on `gpus` GPUs over `sessions`; stop early once Z > cutoff is proven."""
    from tandem.perf.models import get_model
    from tandem.sim.cluster import SimConfig

    info = info_for(sessions, workload_key, get_model(spec.model).max_context)
    cfg = SimConfig(model=spec.model, gpu=spec.gpu, gpus=gpus, deploy=deploy, policy=spec.policy, seed=spec.seed,
                    **dict(spec.sim))
    with _no_gc():      # the run's objects are dropped before the collector is back: it never walks them alive
        return _measure(cfg, deploy, sessions, info, cutoff)


def _measure(cfg, deploy: str, sessions: Sequence[Session], info: Info, cutoff: float) -> Measurement:
    """One run of `cfg` over `sessions` and its measurement (a lower bound when it stopped at `cutoff`)."""
    from tandem.sim.cluster import build
    from tandem.workload.metrics import summarize

    coord, _workers, loop = build(cfg)
    t0 = time.perf_counter()
    if math.isfinite(cutoff):
        loop.progress = _Tracker(coord, loop, info, cutoff)
    try:
        loop.run(list(sessions))
    except _Stop:
        return Measurement(deploy, exact=False, z=cutoff, events=loop.events, wall_s=time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    tn, itn, tr, itr = objective(coord.records, info)
    m = summarize(coord.records, loop.now)
    return Measurement(deploy, exact=True, z=max(tn, itn), ttft_norm=tn, itl_norm=itn, ttft_p95_s=tr,
                       itl_p95_s=itr, slo_attainment=m["slo_attainment"], round_slo_attainment=m["round_slo_attainment"],
                       local_prefill_fraction=m["local_prefill_fraction"], sessions_failed=m["sessions_failed"],
                       events=loop.events, wall_s=wall)


def warm(spec: SimSpec, deploys: Sequence[str], gpus: int) -> None:
    """Build, in this process, the step timers and routing costs that `deploys` need (the cost layer caches them per
    process): a process pool forked afterwards inherits them instead of each process reading the tables again."""
    from tandem.core.deploy import parse_deploy
    from tandem.sim.cluster import SimConfig, build

    seen: set[frozenset] = set()
    for d in deploys:
        groups = frozenset((g.tp, g.ep) for g in parse_deploy(d, gpus).groups)
        if groups in seen:
            continue
        seen.add(groups)
        with _no_gc():
            build(SimConfig(model=spec.model, gpu=spec.gpu, gpus=gpus, deploy=d, policy=spec.policy, seed=spec.seed,
                            **dict(spec.sim)))
