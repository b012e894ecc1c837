"""Synthetic AMPD workloads: Table 1 means, determinism, arrival process, distributions' shape, paper constants."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tandem.workload.arrivals import poisson_arrivals, with_arrivals
from tandem.workload.generators import (
    AGENTIC_LONG,
    PAPER_GPUS,
    PAPER_SLOS,
    WORKLOADS,
    agentic_long,
    generate,
    input_means,
    lognormal_mu_for_mean,
    paper_slo,
)
from tandem.workload.session import SLO, Round, Session, WorkloadError, dump_sessions, load_sessions

TABLE_1 = {  # AMPD Table 1: rounds, prefill length, decode length
    "toolbench": (3.96, 703.79, 50.39),
    "gaia": (11.32, 6161.02, 528.76),
    "hotpotqa": (3, 1569.8, 80.03),
    "dureader": (3, 3081.23, 150.10),
}


@pytest.fixture(scope="module")
def big():
    return {name: generate(name, 20_000, 2.0, seed=11) for name in TABLE_1}


def new_tokens(sessions):
    """Each round's input_tokens: what the round prefills."""
    return [r.input_tokens for s in sessions for r in s.rounds]


def prompts(sessions):
    """Each round's whole prompt: every earlier input and output of its session plus its own input."""
    out = []
    for s in sessions:
        history = 0
        for r in s.rounds:
            out.append(history + r.input_tokens)
            history += r.input_tokens + r.output_tokens
    return out


def stats(sessions, prefill=new_tokens):
    """(rounds per session, mean prefill length per round, mean output per round): what AMPD Table 1 reports."""
    rounds = [r for s in sessions for r in s.rounds]
    return (len(rounds) / len(sessions), np.mean(prefill(sessions)),
            np.mean([r.output_tokens for r in rounds]))


def test_specs_carry_table_1_means_exactly():
    for name, (rounds, prefill, decode) in TABLE_1.items():
        spec = WORKLOADS[name]
        assert (spec.mean_rounds, spec.mean_prefill_tokens, spec.mean_output_tokens) == (rounds, prefill, decode)
        assert spec.prefill_basis == "input"
    assert set(WORKLOADS) == set(TABLE_1)


@pytest.mark.parametrize("name", TABLE_1)
def test_table_1_means_within_two_percent(big, name):
    rounds, prefill, decode = stats(big[name])
    want = TABLE_1[name]
    assert rounds == pytest.approx(want[0], rel=0.02)
    assert prefill == pytest.approx(want[1], rel=0.02)
    assert decode == pytest.approx(want[2], rel=0.02)


def test_prompt_basis_solves_later_round_inputs_in_closed_form_for_fixed_rounds():
    # 3 rounds, f = 1: prompts sum to 6m + 3o over 3 rounds, so m = (3 * 1569.8 - 3 * 80.03) / 6
    first, later = input_means(dataclasses.replace(WORKLOADS["hotpotqa"], prefill_basis="prompt"))
    assert later == pytest.approx((3 * 1569.8 - 3 * 80.03) / 6, abs=1e-9) and first == later


@pytest.mark.parametrize("name", TABLE_1)
def test_prompt_basis_makes_each_rounds_whole_prompt_match_table_1(name):
    sessions = generate(name, 20_000, 2.0, seed=11, prefill_basis="prompt")
    assert stats(sessions, prompts) == pytest.approx(TABLE_1[name], rel=0.02)
    first, later = input_means(dataclasses.replace(WORKLOADS[name], prefill_basis="prompt"))
    assert np.mean(new_tokens(sessions)) < TABLE_1[name][1]  # the history is part of every later prompt
    assert first == pytest.approx(WORKLOADS[name].input_first_factor * later)


def test_bad_prefill_basis_and_unreachable_prompt_means_are_refused():
    with pytest.raises(WorkloadError, match="prefill_basis must be one of input, prompt"):
        dataclasses.replace(WORKLOADS["toolbench"], prefill_basis="history")
    spec = dataclasses.replace(WORKLOADS["hotpotqa"], mean_prefill_tokens=60.0, prefill_basis="prompt")  # outputs: 80
    with pytest.raises(WorkloadError, match="outputs alone make the mean prompt exceed 60.0"):
        generate(spec, 10, 1.0, seed=0)


@pytest.mark.parametrize("name", ["toolbench", "hotpotqa", "dureader"])
def test_table_1_means_hold_for_other_seeds_at_5000_sessions(name):
    for seed in (1, 2):
        got = stats(generate(name, 5_000, 1.0, seed))
        assert got == pytest.approx(TABLE_1[name], rel=0.02)


@pytest.mark.parametrize("name", TABLE_1)
def test_all_lengths_are_integers_at_least_one_and_within_caps(big, name):
    spec = WORKLOADS[name]
    for s in big[name][:3000]:
        assert 1 <= len(s.rounds) <= spec.max_rounds
        for r in s.rounds:
            assert type(r.input_tokens) is int and 1 <= r.input_tokens <= spec.input_max
            assert type(r.output_tokens) is int and 1 <= r.output_tokens <= spec.output_max


@pytest.mark.parametrize("name", ["hotpotqa", "dureader"])
def test_rag_workloads_have_exactly_three_rounds_and_short_retrieval_gaps(big, name):
    sessions = big[name]
    assert {len(s.rounds) for s in sessions} == {3}
    gaps = np.array([r.tool_s for s in sessions for r in s.rounds[:-1]])
    assert 0.3 <= np.median(gaps) <= 1.0
    assert gaps.max() <= WORKLOADS[name].tool_max_s


@pytest.mark.parametrize("name", TABLE_1)
def test_tool_gaps_follow_spec_median_and_last_round_has_none(big, name):
    spec = WORKLOADS[name]
    sessions = big[name]
    assert all(s.rounds[-1].tool_s == 0.0 for s in sessions)
    gaps = np.array([r.tool_s for s in sessions for r in s.rounds[:-1]])
    assert np.median(gaps) == pytest.approx(spec.tool_median_s, rel=0.05)
    assert gaps.min() >= spec.tool_min_s and gaps.max() <= spec.tool_max_s


def test_toolbench_first_round_is_longer_than_later_rounds(big):
    firsts = np.mean([s.rounds[0].input_tokens for s in big["toolbench"]])
    later = np.mean([r.input_tokens for s in big["toolbench"] for r in s.rounds[1:]])
    assert firsts / later == pytest.approx(WORKLOADS["toolbench"].input_first_factor, rel=0.05)


def test_gaia_has_heavy_tails_in_rounds_and_tool_time(big):
    rounds = np.array([len(s.rounds) for s in big["gaia"]])
    assert np.percentile(rounds, 99) >= 3 * 11.32
    assert rounds.min() == 1
    gaps = np.array([r.tool_s for s in big["gaia"] for r in s.rounds[:-1]])
    assert np.median(gaps) >= 3.0 and np.percentile(gaps, 99) >= 30.0
    tb = np.array([r.tool_s for s in big["toolbench"] for r in s.rounds[:-1]])
    assert np.median(tb) == pytest.approx(1.0, rel=0.05)


def test_same_seed_is_identical_and_different_seed_differs():
    assert generate("gaia", 200, 1.0, 5) == generate("gaia", 200, 1.0, 5)
    assert generate("gaia", 200, 1.0, 5) != generate("gaia", 200, 1.0, 6)
    assert agentic_long(3, 1) == agentic_long(3, 1)
    assert agentic_long(3, 1) != agentic_long(3, 2)


def test_fewer_sessions_or_other_rate_keep_each_sessions_content():
    many = generate("toolbench", 500, 1.0, 9)
    assert generate("toolbench", 50, 1.0, 9) == many[:50]
    faster = generate("toolbench", 50, 10.0, 9)
    assert [s.rounds for s in faster] == [s.rounds for s in many[:50]]
    assert faster[-1].arrival_s < many[49].arrival_s


def test_session_ids_arrivals_and_slo():
    slo = SLO(1.5, 0.035)
    sessions = generate("toolbench", 20, 2.0, 0, slo=slo)
    assert [s.session_id for s in sessions][17] == "toolbench-17"
    assert all(s.slo == slo for s in sessions)
    t = [s.arrival_s for s in sessions]
    assert t == sorted(t) and t[0] > 0
    assert generate("hotpotqa", 2, 1.0, 0)[0].slo is None


def test_generated_sessions_round_trip_through_jsonl(tmp_path):
    sessions = generate("gaia", 300, 1.0, 0, slo=PAPER_SLOS[("qwen3-32b", "gaia")])
    dump_sessions(sessions, tmp_path / "g.jsonl")
    assert load_sessions(tmp_path / "g.jsonl") == sessions


def test_unknown_workload_lists_valid_names():
    with pytest.raises(WorkloadError, match="unknown workload 'swebench'.*toolbench, gaia, hotpotqa, dureader, agentic-long"):
        generate("swebench", 10, 1.0, 0)


@pytest.mark.parametrize("kw,what", [
    ({"num_sessions": 0}, "num_sessions must be an integer >= 1"),
    ({"num_sessions": 2.5}, "num_sessions must be an integer >= 1"),
    ({"rate": 0.0}, "arrival rate must be > 0"),
    ({"rate": float("inf")}, "arrival rate must be > 0"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"seed": "x"}, "seed must be an integer >= 0"),
    ({"slo": (1.0, 0.1)}, "slo must be an SLO or None"),
])
def test_bad_generator_arguments_are_workload_errors(kw, what):
    args = {"name": "hotpotqa", "num_sessions": 10, "rate": 1.0, "seed": 0, **kw}
    with pytest.raises(WorkloadError, match=what):
        generate(**args)


def test_invalid_custom_spec_is_rejected_and_valid_one_generates():
    with pytest.raises(WorkloadError, match="rounds_shape must be > 0 exactly when rounds_dist is 'negbin'"):
        dataclasses.replace(WORKLOADS["gaia"], rounds_shape=None)
    with pytest.raises(WorkloadError, match="fixed rounds need an integer mean_rounds"):
        dataclasses.replace(WORKLOADS["hotpotqa"], mean_rounds=2.5)
    custom = dataclasses.replace(WORKLOADS["hotpotqa"], name="rag5", mean_rounds=5, max_rounds=5)
    sessions = generate(custom, 10, 1.0, 0)
    assert {len(s.rounds) for s in sessions} == {5} and sessions[3].session_id == "rag5-3"


def test_lognormal_calibration_hits_mean_of_clipped_rounded_draws():
    mu = lognormal_mu_for_mean(50.0, 1.0, 200)  # clipping at 200 cuts a visible part of the tail
    x = np.clip(np.rint(np.exp(mu + np.random.default_rng(0).standard_normal(2_000_000))), 1, 200)
    assert x.mean() == pytest.approx(50.0, rel=0.003)


def test_paper_slos_match_ampd_figure_4():
    want = {
        "qwen3-32b": {"toolbench": (0.35, 0.040), "gaia": (1.0, 0.035), "hotpotqa": (0.45, 0.030),
                      "dureader": (1.2, 0.040)},
        "llama-3.1-70b": {"toolbench": (1.0, 0.050), "gaia": (1.5, 0.035), "hotpotqa": (2.5, 0.045),
                          "dureader": (5.0, 0.050)},
        "mixtral-8x7b": {"toolbench": (0.13, 0.030), "gaia": (0.35, 0.020), "hotpotqa": (0.15, 0.025),
                         "dureader": (0.30, 0.050)},
    }
    got = {(m, w): (s.ttft_s, s.itl_s) for (m, w), s in PAPER_SLOS.items()}
    assert got == {(m, w): v for m, d in want.items() for w, v in d.items()}
    assert paper_slo("mixtral-8x7b", "gaia") == SLO(0.35, 0.020)
    with pytest.raises(WorkloadError, match="no paper SLO for model 'gpt-4'"):
        paper_slo("gpt-4", "gaia")
    assert PAPER_GPUS == {"toolbench": 8, "hotpotqa": 8, "dureader": 16, "gaia": 32}


def test_poisson_arrivals_mean_rate_within_three_percent():
    t = poisson_arrivals(20_000, 4.0, np.random.default_rng(0))
    assert len(t) / t[-1] == pytest.approx(4.0, rel=0.03)
    gaps = np.diff(t)
    assert np.all(gaps >= 0) and np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential
    assert poisson_arrivals(5, 1.0, np.random.default_rng(0), start=100.0)[0] > 100.0
    assert poisson_arrivals(0, 1.0, np.random.default_rng(0)).size == 0


def test_generated_arrival_rate_within_three_percent(big):
    s = big["toolbench"]
    assert len(s) / s[-1].arrival_s == pytest.approx(2.0, rel=0.03)


def test_with_arrivals_retimes_copies_and_rejects_bad_rate():
    base = [Session(f"s{i}", 0.0, [Round(5, 1)]) for i in range(20_000)]
    timed = with_arrivals(base, 8.0, seed=1)
    assert len(timed) / timed[-1].arrival_s == pytest.approx(8.0, rel=0.03)
    assert base[0].arrival_s == 0.0 and timed[0] is not base[0]
    assert [s.session_id for s in timed[:3]] == ["s0", "s1", "s2"]
    assert with_arrivals(base[:5], 8.0, 1) == timed[:5]
    for bad in (0, -1.0, float("nan"), "fast"):
        with pytest.raises(WorkloadError, match="arrival rate"):
            with_arrivals(base[:5], bad, 1)


def test_agentic_long_has_hundreds_of_rounds_200k_contexts_and_hour_long_gaps():
    sessions = generate("agentic-long", 40, 0.1, 7)
    assert sessions[0].session_id == "agentic-long-0"
    rounds = [len(s.rounds) for s in sessions]
    assert min(rounds) >= 100 and max(rounds) <= 400 and max(rounds) - min(rounds) > 100
    contexts = [s.total_tokens for s in sessions]
    assert max(contexts) <= 200_000 * 1.01
    assert max(contexts) >= 150_000
    gaps = np.array([r.tool_s for s in sessions for r in s.rounds[:-1]])
    assert gaps.min() >= 1.0 and gaps.max() <= 3 * 3600.0
    assert gaps.min() < 10.0 and gaps.max() > 3600.0  # seconds to hours
    assert np.median(np.log(gaps)) == pytest.approx(np.log(3 * 3600.0) / 2, abs=0.3)  # log-uniform
    assert all(s.rounds[-1].tool_s == 0.0 for s in sessions)
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for s in sessions for r in s.rounds)
    assert AGENTIC_LONG.context_max_tokens == 200_000
