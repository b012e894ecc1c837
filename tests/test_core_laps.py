"""LAPS in the cores, driven by hand: a prefill worker's temporal disaggregation (AWD short batches padded to graph
buckets, long prefills in C_l chunks, one class per step, SLA-first between classes, the AWD wake-up), the
ablations (no graphs, no split), the pool router of spatial mode, the SGLang-like routers, and the roofline's
eager-launch bound that graph steps escape. Expected numbers are worked out in the comments."""
from __future__ import annotations

import math
import random

import pytest

from tandem.core.factory import build_worker, make_router, resolve_policy
from tandem.core.types import DECODE, PREFILL, FetchHistory, PrefillDone, PrefillTask, StepResult
from tandem.core.worker import WorkerConfig, WorkerCore
from tandem.perf.batch_shape import BatchShape
from tandem.perf.roofline import Roofline
from tandem.policy.laps.classify import LengthClassifier, PrefillClass
from tandem.policy.laps.pools import PooledRouter
from tandem.policy.laps.pressure import PressureConfig
from tandem.policy.routing import (
    LeastCostRemoteRouter, LeastLoadRouter, RoundRobinRouter, itl_chunk_tokens, local_cost,
)

INF = math.inf


def laps_worker(policy: str = "laps", **over):
    """A prefill worker of `policy` (budget 2048: C_l 2048, batches up to 2048 padded tokens), 1 ms per token
    of estimated prefill."""
    spec = resolve_policy(policy, **over)
    return build_worker(0, PREFILL, 1, 10_000, spec, t_pre=lambda h, n: 0.001 * n)


def task(sid: str, l_incr: int, now: float = 0.0, l_hist: int = 0, slo: float = INF) -> PrefillTask:
    return PrefillTask(sid, 0, l_hist, l_incr, now, ttft_slo_s=slo, decode_worker=9)


def run(core, now: float, elapsed: float = 0.01):
    """Schedule at `now`, finish after `elapsed`; returns (plan, events)."""
    plan = core.schedule(now)
    assert plan is not None, "expected a step"
    core.on_step_done(plan, StepResult(elapsed), now + elapsed)
    return plan, core.drain()


def sids(plan) -> list[tuple[str, int]]:
    return [(t.session_id, n) for t, n in plan.prefill]


# ---------------------------------------------------------------------------- temporal mode
def test_a_lone_short_prefill_waits_for_the_awd_window_then_runs_in_its_bucket():
    """Protects AWD on the worker: no deadline, so the window is W_max (20 ms) and the worker asks to be woken then;
    at 20 ms the 50-token prefill runs alone, padded to the (64, 1) bucket as a graph."""
    w = laps_worker()
    w.submit(task("a", 50), 0.0)
    assert w.schedule(0.0) is None
    assert w.wake_s == pytest.approx(0.02)
    assert w.schedule(0.019) is None
    plan, events = run(w, 0.02)
    assert sids(plan) == [("a", 50)]
    s = plan.shape
    assert (s.prefill_tokens, s.num_prefill, s.graph) == (64, 1, True)
    assert s.prefill_attn_pairs == 64 * 65 / 2
    assert [type(e) for e in events] == [PrefillDone]
    assert w.laps.stats.graph_steps == 1 and w.laps.stats.padded_tokens == 14
    assert not w.has_work()


def test_short_prefills_arriving_together_run_as_one_padded_batch():
    """Protects bucket-first batching: 20, 30 and 100 tokens form one step in the (128, 4) bucket: 512 tokens,
    4 rows (one of them padding), attention over 128-token rows only."""
    w = laps_worker()
    for sid, n in (("a", 20), ("b", 30), ("c", 100)):
        w.submit(task(sid, n), 0.0)
    assert w.schedule(0.0) is None
    plan, _ = run(w, w.wake_s)
    assert sorted(sids(plan)) == [("a", 20), ("b", 30), ("c", 100)]
    s = plan.shape
    assert (s.prefill_tokens, s.num_prefill, s.graph) == (512, 4, True)
    assert s.prefill_attn_pairs == 4 * 128 * 129 / 2
    assert w.laps.stats.padded_tokens == 512 - 150


def test_a_long_prefill_advances_in_chunks_of_c_l_and_never_shares_a_step_with_short_ones():
    """Protects class exclusivity and C_l: 5000 tokens run as 2048 + 2048 + 904 (C_l defaults to the budget);
    a short prefill arriving meanwhile runs in a step of its own, its padded shape only."""
    w = laps_worker()
    w.submit(task("L", 5000), 0.0)
    p1, _ = run(w, 0.0, 0.5)
    assert sids(p1) == [("L", 2048)] and not p1.shape.graph and p1.shape.prefill_tokens == 2048
    w.submit(task("s", 40, 0.1), 0.1)
    p2, _ = run(w, 0.5, 0.5)       # the short batch is due (its window closed at 0.12), but with no deadline
    # anywhere SLA-first falls back to enqueue order, and the long one was enqueued first
    assert sids(p2) == [("L", 2048)]
    p3, ev3 = run(w, 1.0, 0.3)
    assert sids(p3) == [("L", 904)] and [type(e) for e in ev3] == [PrefillDone]
    p4, _ = run(w, 1.3)
    assert sids(p4) == [("s", 40)] and p4.shape.prefill_tokens == 64 and p4.shape.graph
    assert (w.laps.stats.long_steps, w.laps.stats.short_steps) == (3, 1)


def test_sla_first_runs_the_class_whose_earliest_deadline_comes_first():
    """Protects SLA-first between the classes: a short prefill due at 0.4 s goes before a long one due at 10 s
    even though the long one came first; with the deadlines the other way round the long chunk goes first."""
    w = laps_worker()
    w.submit(task("L", 3000, 0.0, slo=10.0), 0.0)
    w.submit(task("s", 40, 0.0, slo=0.4), 0.0)
    # AWD: deadline 0.4 − Ŝ 0.04 − σ 0.005 = 0.355 > W_max, so the window (20 ms) closes first
    assert w.schedule(0.0).prefill[0][0].session_id == "L"       # the short batch is not dispatched yet
    w2 = laps_worker()
    w2.submit(task("L", 3000, 0.0, slo=10.0), 0.0)
    w2.submit(task("s", 40, 0.0, slo=0.4), 0.0)
    w2.laps.awd.poll(0.0)                                         # nothing to dispatch at 0
    plan, _ = run(w2, 0.02)                                       # window expired: both classes can run
    assert sids(plan) == [("s", 40)]
    w3 = laps_worker()
    w3.submit(task("L", 3000, 0.0, slo=0.3), 0.0)
    w3.submit(task("s", 40, 0.0, slo=5.0), 0.0)
    w3.laps.awd.poll(0.0)
    plan, _ = run(w3, 0.02)
    assert sids(plan) == [("L", 2048)]


def test_a_short_re_prefill_reads_its_history_before_its_batch_runs():
    """Protects the history read of remote re-prefills: at dispatch the worker asks for the 300 history tokens
    (FetchHistory) and runs nothing until they arrived; then the step attends over them (pairs 64·(300 + 65/2))."""
    w = laps_worker()
    t = task("a", 50, l_hist=300)
    w.submit(t, 0.0)
    assert w.schedule(0.0) is None
    assert w.schedule(0.02) is None
    assert [type(e) for e in w.drain()] == [FetchHistory]
    w.on_history_fetched(t, 0.03)
    plan, _ = run(w, 0.03)
    assert sids(plan) == [("a", 50)]
    assert plan.shape.prefill_attn_pairs == 64 * (300 + 65 / 2) and plan.shape.prefill_kv_read_tokens == 300


def test_a_cancelled_short_prefill_never_runs_and_leaves_nothing_queued():
    """Protects cancel inside AWD (the coordinator cancels a remote prefill whose round was aborted): the batcher
    forgets the task, the other still runs alone; cancelling a long one queued behind it leaves nothing."""
    w = laps_worker()
    a, b, c = task("a", 50), task("b", 60), task("L", 900)
    for t in (a, b, c):
        w.submit(t, 0.0)
    w.cancel(a)
    assert len(w.laps.awd) == 1
    plan, _ = run(w, 0.0)
    assert sids(plan) == [("L", 900)]
    w.submit(c2 := task("L2", 900), 0.1)
    w.cancel(c2)
    plan, _ = run(w, 0.5)
    assert sids(plan) == [("b", 60)]
    assert len(w.laps.awd) == 0 and not w.has_work() and not w.laps.long
    assert w.schedule(1.0) is None


def test_without_graphs_short_batches_run_unpadded():
    """Protects the ablation 'disaggregation only': AWD still batches, the shape is the real tokens, eager."""
    w = laps_worker("laps-no-graph")
    w.submit(task("a", 20), 0.0)
    w.submit(task("b", 30), 0.0)
    w.schedule(0.0)
    plan, _ = run(w, w.wake_s)
    assert (plan.shape.prefill_tokens, plan.shape.num_prefill, plan.shape.graph) == (50, 2, False)
    assert w.laps.stats.eager_short_steps == 1 and w.laps.stats.graph_steps == 0


def test_without_split_a_step_of_whole_short_prefills_runs_padded_and_a_mixed_one_does_not():
    """Protects the ablation 'CUDA graphs only': one chunked FCFS queue; 20 + 30 tokens run at once in the
    (32, 2) bucket; a step that also holds a long chunk runs unpadded."""
    w = laps_worker("laps-no-split")
    w.submit(task("a", 20), 0.0)
    w.submit(task("b", 30), 0.0)
    plan, _ = run(w, 0.0)
    assert sids(plan) == [("a", 20), ("b", 30)]
    assert (plan.shape.prefill_tokens, plan.shape.num_prefill, plan.shape.graph) == (64, 2, True)
    w.submit(task("c", 20), 1.0)
    w.submit(task("L", 1000), 1.0)
    plan, _ = run(w, 1.0)
    assert sids(plan) == [("c", 20), ("L", 1000)]
    assert (plan.shape.prefill_tokens, plan.shape.graph) == (1020, False)


def test_the_factory_gives_laps_only_to_prefill_workers_of_laps_policies():
    """Protects the one construction path: a LAPS policy's prefill worker schedules by LAPS, its decode worker and
    every worker of another policy do not."""
    assert laps_worker().laps is not None
    assert build_worker(1, "decode", 1, 100, "laps").laps is None
    assert build_worker(0, PREFILL, 1, 100, "sglang-pd").laps is None
    assert build_worker(0, PREFILL, 1, 100, "ampd+laps").laps is not None
    w = build_worker(0, PREFILL, 1, 100, resolve_policy("laps", laps_long_chunk=512, laps_length_threshold=128))
    assert (w.laps.opts.long_chunk, w.laps.opts.threshold) == (512, 128)
    with pytest.raises(ValueError, match="laps_long_chunk"):
        resolve_policy("laps", laps_long_chunk=0)
    with pytest.raises(ValueError, match="laps_pools"):
        resolve_policy("vllm", laps_pools=True)


# ---------------------------------------------------------------------------- routers
class View:
    """Prefill workers with set queues, TTFT means and utilisations; decode worker 9."""

    def __init__(self, workers, queued=None, ttft=None, util=None):
        self.workers = list(workers)
        self.queued, self.ttft, self.util = queued or {}, ttft or {}, util or {}

    def prefill_workers(self):
        return self.workers

    def windowed_ttft(self, w, now):
        return self.ttft.get(w, 0.0)

    def windowed_itl(self, w, now):
        return 0.0

    def queued_prefill_s(self, w):
        return self.queued.get(w, 0.0)

    def utilization(self, w, now):
        return self.util.get(w, 0.0)

    def t_pre(self, w, h, n):
        return 0.001 * n

    def t_kv(self, tokens, src, dst):
        return 0.0

    def can_hold(self, w, tokens):
        return True


def test_round_robin_takes_the_prefill_workers_in_turn_and_least_load_the_least_queued():
    """Protects the SGLang-like routers: RR cycles 0, 1, 2, 0 whatever the load; least-load takes 2 (0.1 s queued),
    then the lowest id among equals."""
    rr = RoundRobinRouter()
    view = View([2, 0, 1], queued={0: 5.0, 1: 0.1, 2: 3.0})
    assert [rr.route(task("s", 10), view, 0.0) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoadRouter()
    assert ll.route(task("s", 10), view, 0.0) == 1
    assert ll.route(task("s", 10), View([3, 1]), 0.0) == 1


def test_pools_split_the_prefill_workers_and_each_class_goes_to_its_own():
    """Protects spatial mode's routing: 4 prefill workers -> short pool {0, 1}, long pool {2, 3}; within a pool the
    least-cost worker (1: less queued; 3: less queued); one prefill worker -> no pools."""
    r = PooledRouter(LeastCostRemoteRouter(), LengthClassifier(256), PressureConfig(t_cool_s=5.0), period_s=1.0)
    view = View([0, 1, 2, 3], queued={0: 0.5, 1: 0.1, 2: 0.4, 3: 0.2})
    assert r.route(task("s", 100), view, 0.0) == 1
    assert r.route(task("l", 300), view, 0.0) == 3
    assert {k: sorted(v) for k, v in r.pools().items()} == {PrefillClass.SHORT: [0, 1], PrefillClass.LONG: [2, 3]}
    single = PooledRouter(LeastCostRemoteRouter(), LengthClassifier(256))
    assert single.route(task("l", 300), View([5]), 0.0) == 5 and single.pools() is None


def test_the_controller_moves_a_long_worker_to_the_pressed_short_pool_once_per_cool_down():
    """Protects Alg. 2 in the router: pools {0, 1, 2} short and {3, 4, 5} long; the short pool's P90 pressure
    (queue 3 s / SLO 1 s + TTFT 2x SLO − 1, minus utilisation 1) beats the idle long pool's (−1 − 0.2), so worker 3
    (the long pool's least pressed, lowest id) moves at the first control step; within
    the 5 s cool-down nothing else moves, whatever the load; a lost worker leaves its pool, and the pool left empty
    takes one from the other."""
    r = PooledRouter(LeastCostRemoteRouter(), LengthClassifier(256), PressureConfig(t_cool_s=5.0), period_s=1.0)
    view = View([0, 1, 2, 3, 4, 5], queued={0: 3.0, 1: 3.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0},
                ttft={0: 2.0, 1: 2.0, 2: 0.2}, util={0: 1.0, 1: 1.0, 2: 1.0, 3: 0.2, 4: 0.2, 5: 0.2})
    r.route(task("s", 10, slo=1.0), view, 0.0)
    assert [(m.instance, m.from_pool, m.to_pool, m.at_s) for m in r.moves] == [
        (3, PrefillClass.LONG, PrefillClass.SHORT, 0.0)]
    for t in (1.0, 2.0, 4.9):
        r.route(task("s", 10, slo=1.0), view, t)
    assert len(r.moves) == 1
    view.workers = [0, 1, 2, 4, 5]                                    # worker 3 is lost
    r.route(task("s", 10, slo=1.0), view, 4.95)
    assert sorted(r.pools()[PrefillClass.SHORT]) == [0, 1, 2] and sorted(r.pools()[PrefillClass.LONG]) == [4, 5]
    view.workers = [0, 1, 2]                                          # the whole long pool is lost
    assert r.route(task("l", 500, slo=1.0), view, 4.96) == 2
    assert sorted(r.pools()[PrefillClass.LONG]) == [2]


def test_make_router_wraps_pooled_policies_only():
    """Protects the factory: laps and ampd+laps route within pools, sglang-pd and ampd do not."""
    rng = random.Random(0)
    assert isinstance(make_router(resolve_policy("laps"), rng), PooledRouter)
    assert isinstance(make_router(resolve_policy("ampd+laps"), rng), PooledRouter)
    assert isinstance(make_router(resolve_policy("sglang-pd"), rng), RoundRobinRouter)
    assert isinstance(make_router(resolve_policy("sglang-pd-router"), rng), LeastLoadRouter)
    assert not isinstance(make_router(resolve_policy("ampd"), rng), PooledRouter)


# ---------------------------------------------------------------------------- cost model
def test_an_eager_prefill_step_waits_for_its_kernel_launches_and_a_graph_step_does_not():
    """Protects the roofline's launch bound: Qwen2.5-7B (28 layers) on an H200, one 8-token prefill: the GPU work
    (about 3.9 ms of weight streaming) is above 28 x 60 us = 1.68 ms, so graph and eager agree; on the H100's
    faster-than-launch case, a decode step never pays launches. With the GPU time below the launch bound (a tiny
    shape on a model of 64 layers at tp8), the eager step takes the launch time and the graph step does not."""
    r7 = Roofline("qwen2.5-7b", "h200", 1)
    eager, graph = BatchShape(8, 36.0, 0, 1), BatchShape(8, 36.0, 0, 1, graph=True)
    assert r7.step_time(eager) == r7.step_time(graph)
    r32 = Roofline("qwen2.5-32b", "h200", 8)
    b = r32.breakdown(BatchShape(8, 36.0, 0, 1))
    assert b["bound"] == "launch" and b["launch"] == pytest.approx(64 * 60e-6)
    gb = r32.breakdown(BatchShape(8, 36.0, 0, 1, graph=True))
    assert gb["launch"] == 0.0 and gb["total"] < b["total"]
    assert b["total"] - gb["total"] == pytest.approx(64 * 60e-6 - max(gb["compute"], gb["memory"]))
    assert r32.breakdown(BatchShape(num_decode=1, decode_ctx_tokens=100))["launch"] == 0.0


# ---------------------------------------------------------------------------- AMPD+LAPS: chunked local prefill
def linear_t_pre(h: int, n: int) -> float:
    """10 ms a step plus 1 ms a token."""
    return 0.01 + 0.001 * n


def test_the_itl_chunk_is_the_largest_whose_estimate_fits_the_budget():
    """Protects the chunk sizing: 10 ms + 1 ms/token within 50 ms is 40 tokens; what is left when it fits; never
    below 16 tokens, whatever the budget."""
    assert itl_chunk_tokens(linear_t_pre, 0, 1000, 0.05) == 40
    assert itl_chunk_tokens(linear_t_pre, 0, 35, 0.05) == 35
    assert itl_chunk_tokens(linear_t_pre, 0, 1000, 0.001) == 16
    assert itl_chunk_tokens(linear_t_pre, 0, 10, 0.001) == 10


def test_a_decode_worker_with_itl_chunks_keeps_decoding_beside_its_local_prefill():
    """Protects the Sarathi-style local path: with beta 0.5 and a 100 ms ITL SLO, a 100-token local prefill runs as
    40 + 40 + 20 tokens, each beside the running decode; prefill-first (no beta) runs it alone in one step."""
    chunked = WorkerCore(0, WorkerConfig(role=DECODE, tp=1, num_blocks=64, block_size=16, itl_chunk_beta=0.5),
                         t_pre=linear_t_pre)
    first = WorkerCore(0, WorkerConfig(role=DECODE, tp=1, num_blocks=64, block_size=16), t_pre=linear_t_pre)
    for core in (chunked, first):
        core.begin_round("a")
        core.submit(PrefillTask("a", 0, 0, 4, 0.0, output_tokens=50, itl_slo_s=0.1), 0.0)
        run(core, 0.0)
        core.begin_round("b")
        core.submit(PrefillTask("b", 0, 0, 100, 1.0, output_tokens=5, itl_slo_s=0.1), 1.0)
    got = []
    for k in range(3):
        plan, _ = run(chunked, 1.0 + k)
        got.append(([(t.session_id, n) for t, n in plan.prefill], [s.session_id for s in plan.decode]))
    assert got == [([("b", 40)], ["a"]), ([("b", 40)], ["a"]), ([("b", 20)], ["a"])]
    plan, _ = run(first, 1.0)
    assert ([(t.session_id, n) for t, n in plan.prefill], plan.decode) == ([("b", 100)], [])


def test_the_router_prices_the_chunked_local_path_by_its_chunks():
    """Protects Eq. 1 for the chunked local path: 100 tokens in 40 + 40 + 20 cost 50 + 50 + 30 ms (plus the queue),
    against 110 ms prefill-first."""
    class V(View):
        def t_pre(self, w, h, n):
            return linear_t_pre(h, n)
    view = V([0], queued={9: 0.5})
    t = task("b", 100)
    assert local_cost(t, view) == pytest.approx(0.11 + 0.5)
    assert local_cost(t, view, 0.05) == pytest.approx(0.13 + 0.5)


def test_ampd_laps_chunked_is_built_with_the_chunked_local_path_on_decode_workers_only():
    """Protects the factory: the decode worker gets beta as its ITL-chunk factor, the prefill worker none, and the
    router prices local prefills by chunks."""
    spec = resolve_policy("ampd+laps-chunked")
    assert build_worker(1, DECODE, 1, 100, spec).cfg.itl_chunk_beta == spec.beta == 0.85
    assert build_worker(0, PREFILL, 1, 100, spec).cfg.itl_chunk_beta is None
    assert build_worker(1, DECODE, 1, 100, "ampd+laps").cfg.itl_chunk_beta is None
    router = make_router(spec, random.Random(0))
    assert router.inner.local_chunked and not make_router(resolve_policy("ampd"), random.Random(0)).local_chunked


def test_the_class_threshold_is_the_policys_else_the_cost_models_boundary_else_256():
    """Protects the threshold's default: a set laps_length_threshold wins; without it the boundary the shell's cost
    model gives (here 200) classifies in the workers and the router alike; without either, LAPS's 256."""
    spec = resolve_policy("laps")
    assert build_worker(0, PREFILL, 1, 100, spec, boundary=200).laps.opts.threshold == 200
    assert make_router(spec, random.Random(0), 200).classifier.threshold == 200
    assert build_worker(0, PREFILL, 1, 100, spec).laps.opts.threshold == 256
    fixed = resolve_policy("laps", laps_length_threshold=128)
    assert build_worker(0, PREFILL, 1, 100, fixed, boundary=200).laps.opts.threshold == 128
    assert make_router(fixed, random.Random(0), 200).classifier.threshold == 128


def test_the_roofline_boundary_is_where_a_prefill_step_turns_compute_bound():
    """Protects L_m on the roofline: Qwen2.5-32B on one H200 is memory-bound (weights streamed) at 202 new tokens
    and compute-bound from 203; history makes re-prefills compute-bound sooner (L_m(10000) < L_m(0))."""
    r = Roofline("qwen2.5-32b", "h200", 1)
    lm = r.prefill_boundary()
    below, at = r.breakdown(BatchShape(lm - 1, (lm - 1) * lm / 2, 0, 1)), r.breakdown(BatchShape(lm, lm * (lm + 1) / 2, 0, 1))
    assert below["compute"] < below["memory"] and at["compute"] >= at["memory"]
    assert lm == 203
    assert r.prefill_boundary(10_000) < lm



# ---------------------------------------------------------------------------- AMPD+LAPS: AWD on local prefills
def local_worker(policy: str = "ampd+laps") -> WorkerCore:
    """A decode worker of `policy` with session "a" decoding (50 tokens to go), 1 ms per token of prefill; a's
    prefill is long (300 tokens), so AWD has seen no batch yet (its depth target is still the largest)."""
    core = build_worker(1, DECODE, 1, 1000, policy, t_pre=lambda h, n: 0.001 * n)
    core.begin_round("a")
    core.submit(PrefillTask("a", 0, 0, 300, 0.0, output_tokens=50, decode_worker=1), 0.0)
    run(core, 0.0)
    return core


def local_task(sid: str, l_incr: int, now: float, slo: float = INF) -> PrefillTask:
    return PrefillTask(sid, 0, 0, l_incr, now, ttft_slo_s=slo, output_tokens=5, decode_worker=1)


def test_a_decode_workers_short_local_prefills_wait_in_awd_and_then_pause_its_decodes_once():
    """Protects AWD on the local path (ampd+laps): two short local prefills arriving at 1.0 s wait AWD's window
    (W_max 20 ms, no deadline) while "a" keeps decoding, then run together in one prefill-first step padded to the
    (32, 2) bucket; without local AWD they run at once, unpadded."""
    w = local_worker()
    for sid, n in (("b", 20), ("c", 30)):
        w.begin_round(sid)
        w.submit(local_task(sid, n, 1.0), 1.0)
    plan, _ = run(w, 1.0)
    assert (sids(plan), [s.session_id for s in plan.decode]) == ([], ["a"])
    assert w.wake_s == pytest.approx(1.02)
    plan, _ = run(w, 1.01)
    assert (sids(plan), [s.session_id for s in plan.decode]) == ([], ["a"])
    plan, events = run(w, 1.02)
    assert (sorted(sids(plan)), plan.decode) == ([("b", 20), ("c", 30)], [])
    s = plan.shape
    assert (s.prefill_tokens, s.num_prefill, s.graph) == (64, 2, True)
    assert w.local_laps.stats.graph_steps == 1 and w.local_laps.stats.padded_tokens == 14
    assert sorted(e.session_id for e in events) == ["b", "c"]           # their first tokens
    assert w.wake_s == INF and len(w.local_laps.short) == 0

    plain = local_worker("ampd+laps-no-local-awd")
    assert plain.local_laps is None
    for sid, n in (("b", 20), ("c", 30)):
        plain.begin_round(sid)
        plain.submit(local_task(sid, n, 1.0), 1.0)
    plan, _ = run(plain, 1.0)
    assert (sids(plan), plan.decode, plan.shape.graph) == ([("b", 20), ("c", 30)], [], False)


def test_a_short_local_prefill_without_slack_and_a_long_one_are_not_held():
    """Protects the deadline bound and the class split on the local path: a 20-token prefill due 30 ms after its
    arrival has no slack (30 ms < Ŝ 32 ms of its padded bucket + σ 5 ms), so it runs at once; a 300-token one is
    long (threshold 256) and is never held."""
    w = local_worker()
    w.begin_round("b")
    w.submit(local_task("b", 20, 1.0, slo=0.03), 1.0)
    plan, _ = run(w, 1.0)
    assert (sids(plan), plan.decode) == ([("b", 20)], [])
    w.begin_round("c")
    w.submit(local_task("c", 300, 2.0), 2.0)
    plan, _ = run(w, 2.0)
    assert sids(plan) == [("c", 300)]
    assert w.local_laps.stats.long_requests == 2 and w.local_laps.stats.short_requests == 1


def test_a_held_local_prefill_of_a_released_session_leaves_nothing_behind():
    """Protects release on the local path: the session's held task leaves AWD and the queue, so the worker neither
    waits for AWD any more nor runs it."""
    w = local_worker()
    w.begin_round("b")
    w.submit(local_task("b", 20, 1.0), 1.0)
    plan, _ = run(w, 1.0)
    assert sids(plan) == [] and w.wake_s == pytest.approx(1.02)
    w.release("b")
    assert len(w.local_laps.short) == 0 and w.queue == []
    plan, _ = run(w, 1.02)
    assert (sids(plan), [s.session_id for s in plan.decode]) == ([], ["a"])
    assert w.wake_s == INF


def test_an_idle_decode_worker_holding_a_local_prefill_asks_to_be_woken_at_awds_decision():
    """Protects the wake-up on the local path: with nothing decoding, schedule returns no step and wake_s is the end
    of AWD's window (so the shells poll then), not a memory deadlock to unstick."""
    w = build_worker(1, DECODE, 1, 1000, "ampd+laps", t_pre=lambda h, n: 0.001 * n)
    w.begin_round("b")
    w.submit(local_task("b", 20, 5.0), 5.0)
    assert w.schedule(5.0) is None and w.wake_s == pytest.approx(5.02)
    assert not [e for e in w.drain() if type(e).__name__ == "SessionFailed"]
    plan, _ = run(w, 5.02)
    assert sids(plan) == [("b", 20)] and plan.shape.graph


def test_the_factory_gives_local_awd_to_decode_workers_of_ampd_laps_only():
    """Protects the one construction path: ampd+laps's decode workers hold short local prefills in AWD; its prefill
    workers, its ablation without local AWD, the chunked variant and other policies do not; the knob is refused where
    it cannot apply."""
    assert build_worker(1, DECODE, 1, 100, "ampd+laps").local_laps is not None
    assert build_worker(0, PREFILL, 1, 100, "ampd+laps").local_laps is None
    for name in ("ampd+laps-no-local-awd", "ampd+laps-chunked", "ampd", "laps"):
        assert build_worker(1, DECODE, 1, 100, name).local_laps is None
    w = build_worker(1, DECODE, 1, 100, resolve_policy("ampd+laps", laps_length_threshold=64))
    assert w.local_laps.opts.threshold == 64
    for name, over in (("ampd", {}), ("ampd+laps", {"local_chunked": True}), ("vllm", {})):
        with pytest.raises(ValueError, match="laps_local_awd"):
            resolve_policy(name, laps_local_awd=True, **over)
