"""What a window leaves tried: the estimator keeps tried windows apart, BlockValue learns what tried and untried
positions cost to finish, and elastic charges a window the untried positions it may leave tried."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, PrefillTask, RoundDone, StepResult
from tandem.policy.optimus import ChunkSizer, ChunkSpec, CommitEstimator, SeqWindow
from tandem.policy.optimus.commit import OPTIMISM_WEIGHT, Tried
from tandem.policy.optimus.value import MAX_PENALTY, MIN_TRANSITIONS, BlockValue


def test_the_estimator_keeps_windows_of_tried_positions_apart_from_untried_ones():
    """Protects the tiny model's bimodal rest windows: 20 untried positions commit all 20, 20 tried ones commit 1;
    pooled together they would both be priced at 10.5. Each kind is its own group (its prior counts the optimistic
    pseudo-windows at the best mean, 20)."""
    est = CommitEstimator(32)
    est.observe(20, [20] * 20, 20, 0)
    est.observe(20, [1] * 20, 20, 20)
    assert est.estimate(20, 20, 0) == pytest.approx((400 + OPTIMISM_WEIGHT * 20) / (20 + OPTIMISM_WEIGHT))
    assert est.estimate(20, 20, 20) == pytest.approx((20 + OPTIMISM_WEIGHT * 20) / (20 + OPTIMISM_WEIGHT))
    assert est._entry(20, 20, 5) == ("rest", 20, Tried.SOME)
    assert est._entry(8, 20, 8) == est._entry(8, 20, 30 - 10) == ("full", 8, 4, Tried.ALL)
    with pytest.raises(ValueError, match="0..20 of them tried"):
        est.observe(4, [1], 20, 21)
    with pytest.raises(ValueError, match="tried"):
        est.estimate(4, 20, -1)


def test_the_block_value_recovers_what_untried_and_tried_positions_cost():
    """Protects the LSTD fit: transitions of a chain where an untried position costs 2 s to finish and a tried one
    3 s (each window commits at least half of its untried positions, so every step costs > 0) give back a = 2, b = 3
    and λ = 1 - 2/3."""
    rng = random.Random(3)
    v = BlockValue()
    for _ in range(400):
        left, tried = rng.randint(2, 32), 0
        while left:
            m = rng.randint(1, left)
            reach = max(tried, m)
            u = reach - tried
            k = rng.randint(max(1, -(-u // 2)), m)
            v.observe(m, left, tried, [k], 3.0 * k - 1.0 * u)
            left, tried = left - k, reach - k
            if left == 0:
                tried = 0
    a, b = v.coefs
    assert a == pytest.approx(2.0) and b == pytest.approx(3.0)
    assert v.penalty() == pytest.approx(1 - 2 / 3)


def test_the_block_value_keeps_optimus_rule_until_it_has_seen_enough():
    """Protects the start and the bounds: λ = 0 (c* by commits alone) before MIN_TRANSITIONS transitions, and a fit
    where untried positions cost nothing is capped at MAX_PENALTY."""
    v = BlockValue()
    v.observe(1, 1, 1, [1] * (MIN_TRANSITIONS - 1), 1.0)   # tried positions finished for 1 s each
    assert v.coefs is None and v.penalty() == 0.0
    v.observe(4, 8, 0, [4] * 50, 0.001)                # untried ones for next to nothing
    assert v.penalty() == MAX_PENALTY
    for bad in ((0, 4, 0, [0], 1.0), (4, 3, 0, [1], 1.0), (2, 4, 5, [1], 1.0), (2, 4, 0, [3], 1.0),
                (2, 4, 0, [1], -1.0), (2, 4, 0, [1], float("nan")), (2, 4, 0, [1.5], 1.0)):
        with pytest.raises(ValueError):
            v.observe(*bad)


def _sizer(penalty: float) -> ChunkSizer:
    """Elastic on a block of 32 whose fresh windows of c commit: 1, 2, 4 and 8 all of them, 16 ten, 32 twenty-
    eight; a step costs 10 ms plus 1 ms a row; λ fixed at `penalty`."""
    s = ChunkSizer(ChunkSpec(), 32, lambda rows, seqs, ctx, sampled, prefill: 0.010 + 0.001 * (rows + prefill))
    for c, k in ((1, 1), (2, 2), (4, 4), (8, 8), (16, 10), (32, 28)):
        s.observe(c, [k] * 100, 32, 0)
    s.value = SimpleNamespace(penalty=lambda: penalty, observe=lambda *a: None)
    return s


def test_elastic_charges_a_window_the_untried_positions_it_leaves_tried():
    """Protects the cost of what a step leaves: four fresh blocks; chunk 32 commits 112 in 138 ms (812/s) against
    chunk 8's 32 in 42 ms (762/s), so by commits alone (λ = 0, Optimus's rule) it runs 32; charging λ = 0.5 a
    position left tried, 32 makes (112 - 0.5·128)/0.138 = 348/s and 8 makes (32 - 0.5·32)/0.042 = 381/s: it runs 8.
    Windows over tried positions only are not charged: with every position tried, never-run windows look as good
    as the best (all of 16 commit: 64 in 74 ms) and λ changes nothing."""
    fresh = [SeqWindow(32)] * 4
    assert _sizer(0.0).choose(fresh) == 32
    assert _sizer(0.5).choose(fresh) == 8
    tried = [SeqWindow(32, tried=32)] * 4
    assert _sizer(0.0).choose(tried) == _sizer(0.5).choose(tried) == 16


def test_a_step_priced_below_its_windows_of_one_still_charges_its_windows_a_cost_of_zero_or_more():
    """Protects the value's inputs against a latency that falls with rows (a fitted regime may start lower than the
    one before it): the per-row share is floored at 0, so the sequences' costs stay >= 0 and the step is learnt from,
    not refused."""
    s = ChunkSizer(ChunkSpec(), 32, lambda rows, seqs, ctx, sampled, prefill: 0.010 if rows < 64 else 0.004,
                   warmup=0)
    c, n = s.plan([SeqWindow(32)] * 4)               # nothing seen: one commit each; 16 is the first window at 4 ms
    assert (c, n) == (16, 4) and s._share[1] == 0.0 and s._share[0] > 0
    s.observe(c, [10] * 4, 32, 0)
    assert s.value.transitions == 4


def test_a_round_that_stops_with_tried_positions_starts_the_next_one_untried():
    """Protects Seq.tried across rounds: a stop rule ends a round while its window left a position tried; the next
    round's prompt is prefilled anew (its block's masked positions are new ones), so its first window has none tried.
    A 3-token prompt, chunk 2, block 8: the second window commits 1 of 2 and the round stops there."""
    w = build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(dllm_block_length=8, dllm_chunk="2"),
                     t_pre=lambda h, n: 0.01)
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 3, 0.0, output_tokens=10, decode_worker=0, worker=0), 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(1.0), 1.0)
    w.on_step_done(w.schedule(1.0), StepResult(1.0, {"s": 2}), 2.0)
    plan = w.schedule(2.0)
    (seq,) = plan.decode
    w.on_step_done(plan, StepResult(1.0, {"s": 1}, frozenset({"s"})), 3.0)
    assert seq.tried == 1 and any(isinstance(e, RoundDone) for e in w.drain())
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 5, 4, 3.0, output_tokens=6, decode_worker=0, worker=0), 3.0)
    plan = w.schedule(3.0)
    while not plan.decode:
        w.on_step_done(plan, StepResult(1.0), 4.0)
        plan = w.schedule(4.0)
    assert plan.decode[0] is seq and seq.tried == 0
