"""AMPD Alg. 1 and the baseline routers on hand-built cluster states."""
import math
import random

from tandem.core.types import PrefillTask
from tandem.policy.routing import AdaptiveRouter, LeastCostRemoteRouter, LocalRouter, local_cost, remote_cost


class FakeView:
    """A cluster of prefill workers 0..n-1 and decode worker 9 with set statistics and costs."""

    def __init__(self, ttft, itl, queued, t_pre=0.2, t_kv=0.01, cap=10**9):
        self.ttft, self.itl, self.queued = ttft, itl, queued
        self._t_pre, self._t_kv, self.cap = t_pre, t_kv, cap

    def prefill_workers(self):
        return list(self.ttft)

    def windowed_ttft(self, w, now):
        return self.ttft[w]

    def windowed_itl(self, w, now):
        return self.itl

    def queued_prefill_s(self, w):
        return self.queued.get(w, 0.0)

    def t_pre(self, w, h, n):
        return self._t_pre

    def t_kv(self, tokens, src, dst):
        return self._t_kv

    def can_hold(self, w, tokens):
        return tokens <= self.cap


def task(l_hist=1000, l_incr=500, ttft=1.0, itl=0.05, now=0.0):
    return PrefillTask("s", 1, l_hist, l_incr, now, ttft_slo_s=ttft, itl_slo_s=itl, decode_worker=9)


def test_window_router_picks_local_when_every_prefill_worker_is_slow_and_decode_has_itl_slack():
    view = FakeView(ttft={0: 0.95, 1: 2.0}, itl=0.040, queued={})
    r = AdaptiveRouter(random.Random(0), alpha=0.9, beta=0.85, slack="window")
    assert r.route(task(), view, 0.0) == 9          # 0.95 > 0.9*1.0 and 2.0 > 0.9; 0.040 <= 0.85*0.05


def test_window_router_picks_a_prefill_worker_with_ttft_slack():
    view = FakeView(ttft={0: 2.0, 1: 0.5}, itl=0.0, queued={})
    r = AdaptiveRouter(random.Random(0), slack="window")
    assert r.route(task(), view, 0.0) == 1


def test_window_router_falls_back_to_cheapest_when_no_slack_anywhere():
    # ITL 0.045 > 0.85*0.05: no decode slack; local cost 0.2+3.0 vs remote 0.2+0.02+q
    view = FakeView(ttft={0: 5.0, 1: 5.0}, itl=0.045, queued={9: 3.0, 0: 1.0, 1: 0.5})
    r = AdaptiveRouter(random.Random(0), slack="window")
    assert r.route(task(), view, 0.0) == 1
    view.queued = {9: 0.1, 0: 1.0, 1: 0.5}
    assert r.route(task(), view, 0.0) == 9


def test_predicted_router_uses_eq2_estimate_including_time_already_waited():
    view = FakeView(ttft={0: 0.0}, itl=1.0, queued={0: 0.5})
    r = AdaptiveRouter(random.Random(0), slack="predicted")
    t = task(now=0.0)
    assert remote_cost(t, 0, view) == 0.2 + 0.01 + 0.01 + 0.5
    assert r.route(t, view, 0.0) == 0               # 0.72 <= 0.9
    assert r.route(t, view, 0.3) == 9               # waited 0.3: 1.02 > 0.9 -> cheapest is local (0.2)


def test_predicted_router_goes_local_on_itl_slack_only_if_local_estimate_meets_ttft():
    view = FakeView(ttft={0: 0.0}, itl=0.01, queued={0: 5.0, 9: 2.0})
    r = AdaptiveRouter(random.Random(0), slack="predicted")
    t = task()
    assert local_cost(t, view) == 2.2
    # remote 5.22 > 0.9; local on ITL slack would take 2.2 > 1.0, so line 9 compares: local 2.2 < 5.22
    assert r.route(t, view, 0.0) == 9
    view.queued = {0: 5.0, 9: 0.1}
    assert r.route(t, view, 0.0) == 9


def test_random_order_of_prefill_workers_spreads_tasks_among_those_with_slack():
    view = FakeView(ttft={0: 0.1, 1: 0.1, 2: 0.1}, itl=0.0, queued={})
    r = AdaptiveRouter(random.Random(1), slack="window")
    picks = {r.route(task(), view, 0.0) for _ in range(50)}
    assert picks == {0, 1, 2}


def test_remote_only_ablation_never_routes_local():
    view = FakeView(ttft={0: 9.0}, itl=0.0, queued={0: 9.0})
    r = AdaptiveRouter(random.Random(0), allow_local=False)
    assert r.route(task(), view, 0.0) == 0


def test_prefill_workers_that_cannot_hold_the_context_are_skipped():
    view = FakeView(ttft={0: 0.0}, itl=1.0, queued={}, cap=1000)
    assert AdaptiveRouter(random.Random(0)).route(task(l_hist=900, l_incr=500), view, 0.0) == 9
    assert LeastCostRemoteRouter().route(task(l_hist=900, l_incr=500), view, 0.0) == 9


def test_dynamo_router_picks_least_estimated_remote_cost():
    view = FakeView(ttft={0: 0.0, 1: 0.0}, itl=0.0, queued={0: 1.0, 1: 0.2})
    assert LeastCostRemoteRouter().route(task(), view, 0.0) == 1


def test_colocated_router_is_always_local():
    view = FakeView(ttft={}, itl=9.0, queued={})
    assert LocalRouter().route(task(), view, 0.0) == 9


def test_no_slo_means_any_prefill_worker_has_slack():
    view = FakeView(ttft={0: 100.0}, itl=1.0, queued={0: 100.0})
    assert AdaptiveRouter(random.Random(0)).route(task(ttft=math.inf, itl=math.inf), view, 0.0) == 0
