"""The tensor-parallel step predictions tp_cpu prints: which cost model prices which step, and how the engine's steps
are recorded. Protects the benchmark's comparison from pricing steps with a model the shells do not use."""
from types import SimpleNamespace

import pytest

from tandem.bench.tp_predict import StepRecord, error_pct, mean_predicted_s, nominal_step_s, record_steps
from tandem.perf.batch_shape import BatchShape
from tandem.runtime.costs import NOMINAL_FLOPS, NOMINAL_MEM_BPS, STEP_OVERHEAD_S, nominal_cost_model

PARAMS, LAYERS, HIDDEN, KVB = 30_000_000, 4, 256, 4096


def _step(chunks, decode_ctx, seconds=0.01) -> StepRecord:
    shape = BatchShape()
    for h, n in chunks:
        shape.add_prefill(h, n)
    for c in decode_ctx:
        shape.add_decode(c)
    return StepRecord(shape, tuple(chunks), seconds)


def test_nominal_step_is_chunks_t_pre_plus_decode_t_dec_with_work_divided_by_tp():
    """A mixed step on the runtime's nominal roofline: per-call overheads stay, compute and KV reads halve at tp2
    (no all-reduce term)."""
    cost = nominal_cost_model(PARAMS, LAYERS, HIDDEN, KVB, max_len=1024, tps=(1, 2))
    step = _step([(0, 100)], [200, 300])
    pre_work = (2 * PARAMS * 100 + 4 * LAYERS * HIDDEN * 100 * 50) / NOMINAL_FLOPS
    dec_work = 2 * PARAMS * 2 / NOMINAL_FLOPS + 500 * KVB / NOMINAL_MEM_BPS
    for tp in (1, 2):
        assert nominal_step_s(cost, step, tp) == pytest.approx(2 * STEP_OVERHEAD_S + (pre_work + dec_work) / tp,
                                                               rel=1e-3)
    assert nominal_step_s(cost, _step([], [100]), 1) == pytest.approx(cost.t_dec(1, 1, 100))


def test_profile_timer_means_over_the_recorded_steps():
    """A profile's step timer (the one it gives for the steps' degree) prices the recorded shapes; the mean is taken
    over the steps."""
    timer = SimpleNamespace(step_time=lambda s: 1e-3 * s.prefill_tokens + 2e-3 * s.num_decode)
    steps = [_step([(0, 10)], []), _step([], [5, 5])]
    assert mean_predicted_s(steps, timer=timer) == pytest.approx((10e-3 + 4e-3) / 2)
    with pytest.raises(ValueError, match="exactly one"):
        mean_predicted_s(steps)
    with pytest.raises(ValueError, match="no steps"):
        mean_predicted_s([], timer=timer)


def test_record_steps_keeps_shape_chunks_and_execute_seconds():
    """Each finished step with a model run is recorded (its shape copied, chunks as (history, new tokens), t2 - t1);
    a step without a plan is not, and the engine's own finish_step still runs."""
    finished = []
    engine = SimpleNamespace(finish_step=lambda prep, out: finished.append(out) or [out])
    steps = record_steps(engine)
    shape = BatchShape()
    shape.add_prefill(16, 32)
    task = SimpleNamespace(first=10, done=6)
    plan = SimpleNamespace(shape=shape, prefill=[(task, 32)])
    assert engine.finish_step(SimpleNamespace(plan=plan, runs=True, t1=1.0, t2=1.25), "a") == ["a"]
    assert engine.finish_step(SimpleNamespace(plan=None, runs=False, t1=2.0, t2=2.0), "b") == ["b"]
    shape.add_decode(7)                                   # the record holds a copy
    assert finished == ["a", "b"]
    assert len(steps) == 1
    assert steps[0].chunks == ((16, 32),) and steps[0].seconds == 0.25
    assert (steps[0].shape.prefill_tokens, steps[0].shape.num_decode) == (32, 0)


def test_error_pct_is_signed_share_of_the_measurement():
    """Negative: the model predicts a faster step than measured."""
    assert error_pct(5.0, 20.0) == -75.0
    assert error_pct(30.0, 20.0) == 50.0
