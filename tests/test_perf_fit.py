"""Piecewise alpha-beta fitting: exact recovery, segment choice, non-negativity, serialisation."""
import json

import numpy as np
import pytest

from tandem.perf import PiecewiseLinear, fit


def _truth(x):
    # key feature x[1]; breakpoint at 100: alpha 2 + 0.5 x below, alpha 10 + 0.3 x + 0.01 z above
    return 2 + 0.5 * x[1] + 0.0 * x[2] if x[1] < 100 else 10 + 0.3 * x[1] + 0.01 * x[2]


def _data(seed=0, n=200):
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 400, n).astype(float)
    z = rng.uniform(0, 1000, n)
    X = np.column_stack([np.ones(n), k, z])
    return X, np.array([_truth(x) for x in X])


def test_fit_recovers_known_piecewise_function_exactly_with_given_breakpoints():
    X, y = _data()
    f = fit(X, y, key=1, breakpoints=[100.0])
    assert f.breakpoints == [100.0]
    np.testing.assert_allclose(f.coefs[0], [2, 0.5, 0], atol=1e-9)
    np.testing.assert_allclose(f.coefs[1], [10, 0.3, 0.01], atol=1e-9)
    assert f.median_rel_error(X, y) < 1e-12


def test_fit_finds_the_breakpoint_when_given_a_segment_count():
    X, y = _data(1)
    f = fit(X, y, key=1, breakpoints=2)
    assert len(f.breakpoints) == 1
    keys = X[:, 1]
    assert keys[keys < 100].max() < f.breakpoints[0] <= 100  # separates the same samples as 100
    Xt, yt = _data(2)
    assert f.median_rel_error(Xt, yt) < 1e-9


def test_fit_uses_fewer_segments_when_one_suffices():
    X, _ = _data(3)
    y = X @ np.array([1.0, 0.2, 0.003])
    f = fit(X, y, key=1, breakpoints=3)
    assert f.segments == 1
    np.testing.assert_allclose(f.coefs[0], [1.0, 0.2, 0.003], rtol=1e-9)


def test_fit_coefficients_are_non_negative():
    rng = np.random.default_rng(4)
    X = np.column_stack([np.ones(100), rng.uniform(1, 10, 100)])
    y = 5 - 0.3 * X[:, 1]  # decreasing: unconstrained LS would give a negative slope
    f = fit(X, y, key=1, breakpoints=1)
    assert all(c >= 0 for row in f.coefs for c in row)


def test_predict_pure_python_matches_vectorised_and_uses_upper_segment_at_breakpoint():
    f = PiecewiseLinear(key=1, breakpoints=[10.0], coefs=[[1.0, 1.0], [100.0, 0.0]])
    assert f.predict([1.0, 9.999]) == pytest.approx(10.999)
    assert f.predict([1.0, 10.0]) == 100.0
    X = np.array([[1.0, 3.0], [1.0, 30.0]])
    np.testing.assert_allclose(f.predict_many(X), [f.predict(x) for x in X])


def test_empty_segment_borrows_neighbour_coefficients():
    X = np.column_stack([np.ones(10), np.arange(1, 11, dtype=float)])
    y = 1 + 2 * X[:, 1]
    f = fit(X, y, key=1, breakpoints=[100.0])
    assert f.coefs[1] == f.coefs[0]


def test_to_dict_from_dict_json_round_trip():
    X, y = _data(5)
    f = fit(X, y, key=1, breakpoints=3)
    g = PiecewiseLinear.from_dict(json.loads(json.dumps(f.to_dict())))
    assert g == f
    for x in X[:20]:
        assert g.predict(x) == f.predict(x)


def test_from_dict_rejects_inconsistent_segments():
    with pytest.raises(ValueError, match="breakpoints"):
        PiecewiseLinear.from_dict({"key": 0, "breakpoints": [1.0], "coefs": [[1.0]]})


# --- tandem.perf.nonneg: the one non-negative least-squares solve behind every fit ----------------------------

_A = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
_B = np.array([3.0, 2.0, 1.0])  # unconstrained fit is 4 - x (a negative slope): the bound holds the slope at 0


def test_nonneg_lstsq_clamps_a_negative_coefficient_and_reports_its_residual():
    from tandem.perf.nonneg import nonneg_lstsq
    x, sq = nonneg_lstsq(_A, _B)
    np.testing.assert_allclose(x, [2.0, 0.0], atol=1e-12)
    assert sq == pytest.approx(2.0, abs=1e-12)


def test_nonneg_lstsq_answers_when_nnls_gives_up(monkeypatch):
    """scipy's nnls raising 'Maximum number of iterations reached' (seen on noisy profiles in CI) is not a crash."""
    from tandem.perf import nonneg

    def give_up(*args, **kwargs):
        raise RuntimeError("Maximum number of iterations reached.")

    monkeypatch.setattr(nonneg, "nnls", give_up)
    x, sq = nonneg.nonneg_lstsq(_A, _B)
    np.testing.assert_allclose(x, [2.0, 0.0], atol=1e-9)
    assert sq == pytest.approx(2.0, abs=1e-9)
    X, y = _data()  # and a whole piecewise fit still recovers the truth through the fallback
    f = fit(X, y, key=1, breakpoints=[100.0])
    np.testing.assert_allclose(f.coefs[1], [10, 0.3, 0.01], atol=1e-7)


def test_nonneg_lstsq_computes_the_residual_from_its_answer(monkeypatch):
    """A solver that misreports its residual (scipy 1.15 can say 0.0) does not reach the breakpoint search."""
    from tandem.perf import nonneg
    monkeypatch.setattr(nonneg, "nnls", lambda a, b, maxiter: (np.array([2.0, 0.0]), 0.0))
    assert nonneg.nonneg_lstsq(_A, _B)[1] == pytest.approx(2.0, abs=1e-12)


@pytest.mark.parametrize("a,b", [(np.ones((3, 2)), np.ones(2)), (np.ones(3), np.ones(3)),
                                 (np.array([[1.0, np.nan]]), np.ones(1))])
def test_nonneg_lstsq_refuses_bad_shapes_and_non_finite_values(a, b):
    from tandem.perf.nonneg import nonneg_lstsq
    with pytest.raises(ValueError, match="nonneg_lstsq needs"):
        nonneg_lstsq(a, b)
