"""What a window leaves tried: the core counts the positions of a block that a window covered and left masked, and the
estimator keeps windows over them apart from windows over untried ones, with its optimism of their own kind."""
from __future__ import annotations

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, PrefillTask, RoundDone, StepResult
from tandem.policy.optimus import CommitEstimator
from tandem.policy.optimus.commit import OPTIMISM_WEIGHT, Tried


def test_the_estimator_keeps_windows_of_tried_positions_apart_from_untried_ones():
    """Protects the tiny model's bimodal rest windows: 20 untried positions commit all 20, 20 tried ones commit 1;
    pooled together they would both be priced at 10.5. Each kind is its own group, and its prior's optimistic
    pseudo-windows count the best mean of its own kind: 20 for untried windows, 1 for tried ones (not the 20 of the
    untried, which had a window sized per sequence over tried positions run again and again at the next size up).
    A kind never seen borrows the best of all: a window with some tried positions is priced at 20 until one is run."""
    est = CommitEstimator(32)
    est.observe(20, [20] * 20, 20, 0)
    est.observe(20, [1] * 20, 20, 20)
    assert est.estimate(20, 20, 0) == pytest.approx((400 + OPTIMISM_WEIGHT * 20) / (20 + OPTIMISM_WEIGHT))
    assert est.estimate(20, 20, 20) == 1.0
    assert est.estimate(16, 20, 20) == 1.0           # a size never run over tried positions: the best of its kind
    assert est.estimate(20, 20, 5) == 20.0           # some tried: none of its kind seen yet
    assert est._entry(20, 20, 5) == ("rest", 20, Tried.SOME)
    assert est._entry(8, 20, 8) == est._entry(8, 20, 30 - 10) == ("full", 8, 4, Tried.ALL)
    with pytest.raises(ValueError, match="0..20 of them tried"):
        est.observe(4, [1], 20, 21)
    with pytest.raises(ValueError, match="tried"):
        est.estimate(4, 20, -1)


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
