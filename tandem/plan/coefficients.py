"""Simulated latency coefficients of the planner: one simulator run per deployment, cached, in parallel.

The objective of a deployment (docs/planner.md) comes from one run of the real simulator
(`tandem.sim.cluster`, AMPD routing and prefill reordering by default) over the planner's sessions:

    T = P95 over servable rounds of TTFT / TTFT SLO          (the prefill kind's latency)
    I = P95 over servable rounds with >= 2 output tokens of round mean ITL / ITL SLO   (the decode kind's)
    Z = max(T, I)                                            (AMPD Eq. 5: the worst P95 among worker kinds)

A round is *servable* when its context fits the model's maximum context (no deployment can serve
the others; the coordinator fails them the same way on every deployment). A servable round that
never produced a first token, or never finished, because its session failed on this deployment
(e.g. KV that no worker can hold) counts as an infinite latency, so losing sessions never looks fast.
With one SLO for all sessions and no failures, T x SLO and I x SLO are exactly the `ttft_p95_s` and
`itl_p95_s` that `tandem simulate` prints for the same deployment and sessions.

Early stop: a run given a `cutoff` ends as soon as the rounds already known prove Z > cutoff
(enough rounds above cutoff x SLO that the 95th percentile must be too); the result is then a lower
bound, not a measurement. The planner uses the k-th best Z found so far as the cutoff, so runs of
deployments that cannot enter the top k stop early; this never changes which deployments are best.

Results are cached in memory and on disk (one JSON file per run under `cache_dir`), keyed on the
model, GPU, policy, seed, simulator settings, deployment, a hash of the sessions (arrival times,
rounds, SLOs) and a hash of the simulator's source code, so a changed simulator never serves stale runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tandem.workload.session import Session

CACHE_VERSION = 1
INF = float("inf")


def default_cache_dir() -> Path:
    """~/.cache/tandem/plan (or $XDG_CACHE_HOME/tandem/plan)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "plan"


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class SimSpec:
    """Everything a run needs besides the sessions and the deployment."""

    model: str
    gpu: str
    policy: str = "ampd"
    seed: int = 0
    sim: tuple[tuple[str, object], ...] = ()   # extra SimConfig fields


@dataclass(slots=True)
class Workload:
    """The sessions every deployment is simulated on, and a content hash of them."""

    sessions: list[Session]
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            self.key = sessions_hash(self.sessions)

    def stretched(self, factor: float) -> "Workload":
        """The same sessions with every arrival time multiplied by `factor` (rate divided by it)."""
        if factor == 1:
            return self
        return Workload([dataclasses.replace(s, arrival_s=s.arrival_s * factor) for s in self.sessions])


def sessions_hash(sessions: Sequence[Session]) -> str:
    """SHA-256 of what the simulator reads from the sessions."""
    h = hashlib.sha256()
    for s in sessions:
        slo = None if s.slo is None else (s.slo.ttft_s, s.slo.itl_s)
        rounds = [(r.input_tokens, r.output_tokens, r.tool_s, r.hash_ids) for r in s.rounds]
        h.update(repr((s.session_id, s.arrival_s, slo, s.block_size, rounds)).encode())
    return h.hexdigest()


@dataclass(slots=True)
class _Info:
    """Per-session facts the objective needs: servable rounds, which have ITL samples, the SLO."""

    by_id: dict[str, tuple[int, tuple[bool, ...], float, float]]
    n_ttft: int
    n_itl: int


def _info(sessions: Sequence[Session], max_context: int) -> _Info:
    by_id, n_t, n_i = {}, 0, 0
    for s in sessions:
        ctx, servable = 0, 0
        for r in s.rounds:
            ctx += r.input_tokens + r.output_tokens
            if ctx > max_context:
                break
            servable += 1
        has_itl = tuple(r.output_tokens >= 2 for r in s.rounds[:servable])
        if s.slo is None:
            raise ValueError(f"session {s.session_id!r} has no SLO; the planner needs one per session")
        by_id[s.session_id] = (servable, has_itl, s.slo.ttft_s, s.slo.itl_s)
        n_t += servable
        n_i += sum(has_itl)
    return _Info(by_id, n_t, n_i)


def p95(values: list[float]) -> float:
    """numpy's default (linear) 95th percentile, infinite values allowed; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = 0.95 * (len(s) - 1)
    i = math.floor(pos)
    f = pos - i
    if i + 1 >= len(s) or f == 0:
        return s[i]
    if math.isinf(s[i + 1]):
        return INF
    return s[i] + f * (s[i + 1] - s[i])


def needed_above(n: int) -> int:
    """Samples above v that prove the linear 95th percentile of n samples exceeds v."""
    return n - math.floor(0.95 * (n - 1)) if n > 0 else 1


# --------------------------------------------------------------------------- measurement


@dataclass(slots=True)
class Measurement:
    """One simulated deployment: its objective and what the plan reports beside it."""

    deploy: str
    exact: bool                      # False: the run stopped early, `z` is a lower bound (the cutoff)
    z: float                         # max(ttft_norm, itl_norm)
    ttft_norm: float | None = None   # P95 of TTFT / TTFT SLO
    itl_norm: float | None = None    # P95 of round mean ITL / ITL SLO
    ttft_p95_s: float | None = None  # P95 TTFT, seconds (same rounds)
    itl_p95_s: float | None = None   # P95 round mean ITL, seconds
    slo_attainment: float | None = None
    round_slo_attainment: float | None = None
    local_prefill_fraction: float | None = None
    sessions_failed: int = 0
    events: int = 0
    wall_s: float = 0.0
    cached: bool = False

    @property
    def bottleneck(self) -> str:
        """'prefill' when TTFT sets Z, 'decode' when ITL does."""
        if self.ttft_norm is None or self.itl_norm is None:
            return "?"
        return "prefill" if self.ttft_norm >= self.itl_norm else "decode"

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def objective(records, info: _Info) -> tuple[float, float, float, float]:
    """(ttft_norm, itl_norm, ttft_p95_s, itl_p95_s) of finished session records (module docstring)."""
    tn, tr, itn, itr = [], [], [], []
    for rec in records:
        servable, has_itl, slo_t, slo_i = info.by_id[rec.session_id]
        rounds = rec.rounds
        for k in range(servable):
            r = rounds[k] if k < len(rounds) else None
            ttft = None if r is None else r.ttft_s
            if ttft is None:
                tn.append(INF)
                tr.append(INF)
            else:
                tn.append(ttft / slo_t)
                tr.append(ttft)
            if has_itl[k]:
                if r is not None and r.finish_s is not None and r.itl_count > 0:
                    itl = r.itl_sum_s / r.itl_count
                    itn.append(itl / slo_i)
                    itr.append(itl)
                else:
                    itn.append(INF)
                    itr.append(INF)
    return p95(tn), p95(itn), p95(tr), p95(itr)


class _Stop(Exception):
    """Raised inside the event loop once Z > cutoff is proven."""


class _Tracker:
    """Progress hook of the event loop: counts rounds above cutoff x SLO as their latencies become final."""

    def __init__(self, coord, loop, info: _Info, cutoff: float):
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


_INFOS: dict[tuple[str, int], _Info] = {}


def _info_for(sessions: Sequence[Session], workload_key: str, max_context: int) -> _Info:
    key = (workload_key, max_context)
    info = _INFOS.get(key)
    if info is None:
        if len(_INFOS) > 16:
            _INFOS.clear()
        info = _INFOS[key] = _info(sessions, max_context)
    return info


def simulate_one(sessions: Sequence[Session], workload_key: str, spec: SimSpec, deploy: str, gpus: int,
                 cutoff: float = INF) -> Measurement:
    """Simulate `deploy` on `gpus` GPUs over `sessions`; stop early once Z > cutoff is proven."""
    from tandem.perf.models import get_model
    from tandem.sim.cluster import SimConfig, build
    from tandem.workload.metrics import summarize

    info = _info_for(sessions, workload_key, get_model(spec.model).max_context)
    cfg = SimConfig(model=spec.model, gpu=spec.gpu, gpus=gpus, deploy=deploy, policy=spec.policy, seed=spec.seed,
                    **dict(spec.sim))
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
    return Measurement(deploy, exact=True, z=max(tn, itn), ttft_norm=tn, itl_norm=itn, ttft_p95_s=tr, itl_p95_s=itr,
                       slo_attainment=m["slo_attainment"], round_slo_attainment=m["round_slo_attainment"],
                       local_prefill_fraction=m["local_prefill_fraction"], sessions_failed=m["sessions_failed"],
                       events=loop.events, wall_s=wall)


_SHARED: dict[str, Sequence[Session]] = {}
"""Workloads registered before a process pool starts; forked workers inherit them, so tasks carry a key only."""


def share(workload: Workload) -> None:
    """Make `workload` available to process pools created from now on without sending it with every task."""
    if len(_SHARED) > 8:
        _SHARED.clear()
    _SHARED[workload.key] = workload.sessions


def _task(args) -> Measurement:
    sessions, key, *rest = args
    if sessions is None:
        sessions = _SHARED[key]
    return simulate_one(sessions, key, *rest)


def _ignore_sigint() -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# --------------------------------------------------------------------------- cache


@lru_cache(maxsize=1)
def code_hash() -> str:
    """Hash of the sources whose behaviour a cached run depends on."""
    import tandem
    root = Path(tandem.__file__).resolve().parent
    h = hashlib.sha256(str(CACHE_VERSION).encode())
    for sub in ("core", "perf", "policy", "sim", "workload"):
        for p in sorted((root / sub).glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    h.update((root / "plan" / "coefficients.py").read_bytes())
    return h.hexdigest()[:16]


class RunCache:
    """Measurements by run key, in memory and (unless `directory` is None) as JSON files on disk."""

    def __init__(self, directory: str | os.PathLike | None):
        self.dir = Path(directory) if directory is not None else None
        self.mem: dict[str, Measurement] = {}

    def key(self, spec: SimSpec, workload_key: str, deploy: str) -> str:
        text = json.dumps({"v": CACHE_VERSION, "code": code_hash(), "model": spec.model, "gpu": spec.gpu,
                           "policy": spec.policy, "seed": spec.seed, "sim": [list(kv) for kv in spec.sim],
                           "workload": workload_key, "deploy": deploy}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.json"

    def get(self, key: str) -> Measurement | None:
        m = self.mem.get(key)
        if m is None and self.dir is not None:
            try:
                m = Measurement.from_dict(json.loads(self._path(key).read_text()))
            except (OSError, ValueError, TypeError):
                return None
            self.mem[key] = m
        return m

    def put(self, key: str, m: Measurement) -> None:
        old = self.get(key)
        if old is not None and (old.exact or (not m.exact and old.z >= m.z)):
            return
        self.mem[key] = m
        if self.dir is None:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(dataclasses.replace(m, cached=False).to_dict()))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only or full cache never stops planning


def _usable(m: Measurement | None, cutoff: float) -> Measurement | None:
    """A cached measurement answers a request when it is exact, or a bound at least as high as the cutoff."""
    if m is None:
        return None
    if m.exact or m.z >= cutoff:
        return dataclasses.replace(m, cached=True)
    return None


# --------------------------------------------------------------------------- evaluator


@dataclass(slots=True)
class Stats:
    requested: int = 0
    simulated: int = 0
    stopped_early: int = 0
    cached: int = 0
    sim_wall_s: float = 0.0


@dataclass
class Evaluator:
    """Runs deployments through the simulator, from cache when possible, in `jobs` processes."""

    spec: SimSpec
    jobs: int = 1
    cache: RunCache = field(default_factory=lambda: RunCache(None))
    on_done: Callable[[Measurement], None] | None = None
    stats: Stats = field(default_factory=Stats)
    _pool: ProcessPoolExecutor | None = None
    _inherited: frozenset = frozenset()

    def evaluate(self, workload: Workload, deploys: Iterable[str], gpus: int,
                 cutoff: Callable[[], float] = lambda: INF,
                 on_result: Callable[[Measurement], None] | None = None) -> dict[str, Measurement]:
        """Measure every deployment; each run gets the cutoff current when it starts."""
        todo = list(dict.fromkeys(deploys))
        out: dict[str, Measurement] = {}

        def finish(d: str, key: str, m: Measurement) -> None:
            out[d] = m
            if not m.cached:
                self.cache.put(key, m)
                self.stats.simulated += 1
                self.stats.stopped_early += not m.exact
                self.stats.sim_wall_s += m.wall_s
            else:
                self.stats.cached += 1
            if on_result is not None:
                on_result(m)
            if self.on_done is not None:
                self.on_done(m)

        self.stats.requested += len(todo)
        queue = []
        for d in todo:   # cached answers first: they tighten the cutoff for the runs that follow
            key = self.cache.key(self.spec, workload.key, d)
            hit = _usable(self.cache.get(key), cutoff())
            if hit is not None:
                finish(d, key, hit)
            else:
                queue.append((d, key))
        if not queue:
            return out
        if self.jobs <= 1 or len(queue) == 1:
            for d, key in queue:
                c = cutoff()
                hit = _usable(self.cache.get(key), c)
                finish(d, key, hit if hit is not None else
                       simulate_one(workload.sessions, workload.key, self.spec, d, gpus, c))
            return out
        pool = self._get_pool()
        running: dict = {}
        pos = 0
        try:
            while pos < len(queue) or running:
                while pos < len(queue) and len(running) < self.jobs:
                    d, key = queue[pos]
                    pos += 1
                    c = cutoff()
                    hit = _usable(self.cache.get(key), c)
                    if hit is not None:
                        finish(d, key, hit)
                        continue
                    sessions = None if workload.key in self._inherited else workload.sessions
                    fut = pool.submit(_task, (sessions, workload.key, self.spec, d, gpus, c))
                    running[fut] = (d, key)
                if not running:
                    continue
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    d, key = running.pop(fut)
                    finish(d, key, fut.result())
        except BaseException:
            self.close(cancel=True)
            raise
        return out

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing as mp
            ctx = mp.get_context()
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=ctx, initializer=_ignore_sigint)
            self._inherited = frozenset(_SHARED) if ctx.get_start_method() == "fork" else frozenset()
        return self._pool

    def close(self, cancel: bool = False) -> None:
        if self._pool is not None:
            if cancel:
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    proc.terminate()
            self._pool.shutdown(wait=not cancel, cancel_futures=cancel)
            self._pool = None

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)
