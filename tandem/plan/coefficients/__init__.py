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
from tandem.plan.coefficients.cache import CACHE_VERSION, RunCache, code_hash, default_cache_dir
from tandem.plan.coefficients.evaluator import Evaluator, Stats, share
from tandem.plan.coefficients.measurement import Measurement
from tandem.plan.coefficients.objective import INF, needed_above, objective, p95
from tandem.plan.coefficients.simulate import simulate_one
from tandem.plan.coefficients.workload import SimSpec, Workload, sessions_hash

__all__ = ["CACHE_VERSION", "INF", "Evaluator", "Measurement", "RunCache", "SimSpec", "Stats", "Workload",
           "code_hash", "default_cache_dir", "needed_above", "objective", "p95", "sessions_hash", "share",
           "simulate_one"]
