"""AMPD's T_pre / T_dec / T_kv fitted to the roofline: accuracy, speed, persistence."""
import time

import numpy as np
import pytest

from tandem.perf import (AMPDCostModel, ParallelismError, Roofline, dec_features, kv_transfer_time,
                         pre_features)


@pytest.fixture(scope="module")
def cm():
    return AMPDCostModel.from_roofline("llama-3.1-70b", "h20", tps=(1, 2, 4, 8))


def _held_out(seed, model, max_ctx):
    rng = np.random.default_rng(seed)
    for _ in range(400):
        l_incr = int(np.exp(rng.uniform(0, np.log(60000))))
        l_hist = 0 if rng.random() < 0.3 else int(np.exp(rng.uniform(np.log(100), np.log(60000))))
        if l_incr + l_hist <= max_ctx:
            yield l_hist, l_incr


@pytest.mark.parametrize("model, gpu", [("llama-3.1-70b", "h20"), ("qwen3-32b", "h100"), ("mixtral-8x7b", "h20")])
def test_t_pre_predicts_roofline_within_10pct_median_on_held_out_points(model, gpu):
    cm = AMPDCostModel.from_roofline(model, gpu)
    for tp in cm.tps:
        r = Roofline(model, gpu, tp)
        errs = [abs(cm.t_pre(h, n, tp) - r.prefill_time(h, n)) / r.prefill_time(h, n)
                for h, n in _held_out(tp, model, r.model.max_context)]
        assert np.median(errs) < 0.10, (tp, np.median(errs))


@pytest.mark.parametrize("model, gpu", [("llama-3.1-70b", "h20"), ("qwen3-32b", "h100"), ("mixtral-8x7b", "h20")])
def test_t_dec_predicts_roofline_within_10pct_median_on_held_out_points(model, gpu):
    cm = AMPDCostModel.from_roofline(model, gpu)
    rng = np.random.default_rng(7)
    for tp in cm.tps:
        r = Roofline(model, gpu, tp)
        errs = []
        for _ in range(300):
            b = int(np.exp(rng.uniform(0, np.log(300))))
            ctx = b * int(np.exp(rng.uniform(np.log(200), np.log(8000))))
            errs.append(abs(cm.t_dec(b, tp, ctx) - r.decode_time(b, ctx)) / r.decode_time(b, ctx))
        assert np.median(errs) < 0.10, (tp, np.median(errs))


def test_t_kv_is_the_roofline_alpha_beta(cm):
    for src, dst, same in [(4, 8, False), (8, 4, True), (1, 1, False)]:
        for tokens in (1, 3000, 100000):
            assert cm.t_kv(tokens, src, dst, same) == pytest.approx(
                kv_transfer_time("llama-3.1-70b", "h20", tokens, src, dst, same), rel=1e-9)
    assert cm.t_kv(0, 4, 8) == 0.0


def test_t_dec_defaults_context_to_batch_times_typical_ctx(cm):
    assert cm.t_dec(16, 4) == cm.t_dec(16, 4, 16 * cm.typical_ctx)
    assert cm.t_dec(0, 4) == 0.0 and cm.t_pre(1000, 0, 4) == 0.0


def test_cost_functions_are_monotone_in_work(cm):
    for tp in cm.tps:
        assert cm.t_pre(0, 1000, tp) < cm.t_pre(0, 4000, tp) < cm.t_pre(0, 16000, tp)
        assert cm.t_pre(0, 2000, tp) < cm.t_pre(30000, 2000, tp)
        assert cm.t_dec(8, tp, 8000) < cm.t_dec(64, tp, 64000)


def test_unfitted_tp_raises_parallelism_error(cm):
    with pytest.raises(ParallelismError, match="tp16"):
        cm.t_pre(0, 100, 16)
    with pytest.raises(ParallelismError):
        cm.t_kv(100, 4, 16)


def test_from_roofline_is_fast_and_cached():
    import scipy.optimize  # noqa: F401  (the fits import it on first use; the import is not the fit's time)

    from tandem.perf.ampd_cost import from_roofline_cached
    from_roofline_cached.cache_clear()
    t0 = time.perf_counter()
    a = AMPDCostModel.from_roofline("qwen2.5-32b", "a100-80g")
    assert time.perf_counter() - t0 < 0.5
    assert AMPDCostModel.from_roofline("Qwen2.5-32B", "A100-80G") is a


def test_default_tps_skip_degrees_the_heads_do_not_divide():
    assert AMPDCostModel.from_roofline("qwen2.5-7b", "h20").tps == (1, 2, 4)


def test_cost_queries_are_cheap(cm):
    t0 = time.perf_counter()
    for i in range(20000):
        cm.t_pre(i, 500 + i % 700, 4)
        cm.t_dec(32, 4, 64000)
    assert (time.perf_counter() - t0) / 20000 < 20e-6


def test_json_round_trip_preserves_predictions(cm, tmp_path):
    p = tmp_path / "cost.json"
    cm.to_json(p)
    back = AMPDCostModel.from_json(p)
    assert back.tps == cm.tps and back.typical_ctx == cm.typical_ctx and back.meta == cm.meta
    for tp in cm.tps:
        assert back.t_pre(1234, 567, tp) == cm.t_pre(1234, 567, tp)
        assert back.t_dec(33, tp, 70000) == cm.t_dec(33, tp, 70000)
    assert back.t_kv(3000, 4, 8, False) == cm.t_kv(3000, 4, 8, False)


def test_from_samples_fits_measurements_generically():
    # Synthetic "measurements" from a known alpha-beta law: the profiler path.
    pts = [(h, n) for h in (0, 1000, 8000) for n in (16, 64, 256, 1024, 4096)]
    pre_X = [pre_features(h, n) for h, n in pts]
    pre_y = [0.01 + 2e-5 * n + 1e-9 * f[2] + 1e-7 * h for (h, n), f in zip(pts, pre_X)]
    dec_X = [dec_features(b, b * 1000) for b in (1, 2, 4, 8, 16, 32, 64)]
    dec_y = [0.02 + 1e-4 * x[1] + 1e-8 * x[2] for x in dec_X]
    cm = AMPDCostModel.from_samples({2: (pre_X, pre_y)}, {2: (dec_X, dec_y)},
                                    {(2, 2, False): ([(1.0, 10.0), (1.0, 1000.0)], [1e-3 + 1e-6 * 10, 1e-3 + 1e-6 * 1000])})
    assert cm.t_pre(1000, 256, 2) == pytest.approx(0.01 + 2e-5 * 256 + 1e-9 * (256 * 1000 + 256 ** 2 / 2) + 1e-4, rel=1e-6)
    assert cm.t_dec(8, 2, 8000) == pytest.approx(0.02 + 8e-4 + 8e-5, rel=1e-6)
    assert cm.t_kv(500, 2, 2) == pytest.approx(1e-3 + 5e-4, rel=1e-6)
    assert cm.meta["source"] == "samples" and max(cm.meta["fit_error"].values()) < 1e-6


def test_routing_costs_of_overlapping_degree_sets_share_each_degrees_fits():
    """A planner builds the routing costs of many degree combinations: each degree is fitted once, and a model built
    from shared fits equals one fitted from its samples afresh."""
    from tandem.perf.ampd_cost import from_timers, roofline_dec_samples, roofline_pre_samples

    r4, r8 = Roofline("llama-3.1-70b", "h20", 4), Roofline("llama-3.1-70b", "h20", 8)
    both, alone = from_timers({4: r4, 8: r8}), from_timers({8: r8})
    assert both.pre[8] is alone.pre[8] and both.dec[8] is alone.dec[8]
    fresh = AMPDCostModel.from_samples({8: roofline_pre_samples(r8)}, {8: roofline_dec_samples(r8)})
    assert alone.pre[8].to_dict() == fresh.pre[8].to_dict()
    assert alone.dec[8].to_dict() == fresh.dec[8].to_dict()
    assert alone.meta["fit_error"]["pre/tp8"] == fresh.meta["fit_error"]["pre/tp8"]
    assert sorted(both.kv) == ["4-4-net", "4-4-node", "4-8-net", "4-8-node", "8-4-net", "8-4-node", "8-8-net",
                               "8-8-node"]
