"""The `chat-multiturn` workload (LAPS's multi-turn chat mix): calibration, sample fractions, ShareGPT pools,
determinism, arrivals, SLO, CLI/experiment wiring and the errors of a bad ShareGPT file."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tandem.cli.main import main
from tandem.workload.generators import (
    CHAT,
    CHAT_SLO,
    GENERATOR_NAMES,
    PAPER_SLOS,
    ChatSpec,
    rounds_mean,
    chat_calibration,
    chat_multiturn,
    default_slo,
    generate,
    mu_for_short_fraction,
    short_fraction,
)
from tandem.workload.session import SLO, WorkloadError, dump_sessions, load_sessions
from tandem.workload.traces import sharegpt_lengths, trace_path

N = 20_000
HEADER = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"


@pytest.fixture(scope="module")
def big():
    return generate("chat-multiturn", N, 2.0, seed=0)


@pytest.fixture(scope="module")
def sharegpt():
    return sharegpt_lengths()


def firsts(sessions):
    return np.array([s.rounds[0].input_tokens for s in sessions])


def laters(sessions):
    return np.array([r.input_tokens for s in sessions for r in s.rounds[1:]])


def write_csv(path, rows, header=HEADER):
    path.write_text(header + "".join(f"{a},{b},{a + b},{a / b:.3f}\n" for a, b in rows))
    return path


# --------------------------------------------------------------------------- calibration


def test_spec_carries_laps_targets_slo_and_a_rationale():
    """The constants are LAPS's: 63% / 81% of prompts under 256 tokens (Fig. 2), TTFT SLO 0.4 s (Fig. 7)."""
    assert (CHAT.short_tokens, CHAT.first_short_fraction, CHAT.later_short_fraction) == (256, 0.63, 0.81)
    assert (CHAT.mean_rounds, CHAT.rounds_shape, CHAT.max_rounds) == (2.0, 1.0, 16)
    assert CHAT_SLO == SLO(0.4, 0.1)
    assert "LMSYS" in CHAT.why and "ShareGPT" in CHAT.why
    assert "chat-multiturn" in GENERATOR_NAMES


def test_calibration_makes_the_population_fractions_and_mean_rounds_exact():
    """The solved lognormal puts exactly 81% of later inputs under 256, and the capped geometric averages 2 rounds."""
    cal = chat_calibration()
    mu = cal.mu_later
    assert mu == pytest.approx(math.log(255.5) - 1.5 * 0.8778962950512288, abs=1e-12)
    assert short_fraction(mu, CHAT.later_input_sigma, 256) == pytest.approx(0.81, abs=1e-12)
    assert math.exp(mu) == pytest.approx(68.47, abs=0.01)                 # median later input
    assert rounds_mean("negbin", cal.rounds_param, 1.0, 16) == pytest.approx(2.0, abs=1e-9)
    assert cal.rounds_param == pytest.approx(1.0, abs=1e-4)             # the cap at 16 trims almost nothing
    for frac, sigma in ((0.63, 0.7), (0.81, 2.0), (0.5, 1.0)):
        assert short_fraction(mu_for_short_fraction(frac, sigma, 256), sigma, 256) == pytest.approx(frac, abs=1e-12)


def test_rounded_clipped_lognormal_fraction_is_exact_by_enumeration():
    """short_fraction counts what rint + clip give: P(X < short - 0.5), checked against a 2M-draw sample."""
    rng = np.random.default_rng(3)
    mu, sigma = 4.0, 1.5
    x = np.clip(np.rint(np.exp(mu + sigma * rng.standard_normal(2_000_000))), 1, 8192)
    assert (x < 256).mean() == pytest.approx(short_fraction(mu, sigma, 256), abs=1.5e-3)


# --------------------------------------------------------------------------- the generated sample


def test_generated_fractions_under_256_match_laps_within_2_points(big):
    """LAPS Fig. 2 on a 20,000-session seeded sample: 63% of first prompts and 81% of later inputs < 256 tokens."""
    f, later = firsts(big), laters(big)
    assert len(f) == N and len(later) > 15_000
    assert abs((f < 256).mean() - 0.63) <= 0.02
    assert abs((later < 256).mean() - 0.81) <= 0.02
    assert (f < 256).mean() == pytest.approx(0.627, abs=1e-3)          # seed 0's exact sample (regression)
    assert (later < 256).mean() == pytest.approx(0.8091, abs=1e-3)


def test_first_prompts_and_outputs_are_sharegpt_lengths(big, sharegpt):
    """Round-0 prompts are ShareGPT prompt lengths (short ones < 256, the long tail >= 256); outputs ShareGPT's."""
    prefill, decode = sharegpt
    f = firsts(big)
    assert set(f[f < 256].tolist()) <= set(prefill[prefill < 256].tolist())
    assert set(f[f >= 256].tolist()) <= set(prefill[prefill >= 256].tolist())
    assert f.max() <= prefill.max() == 8141
    long_mean = prefill[prefill >= 256].mean()
    assert f[f >= 256].mean() == pytest.approx(long_mean, rel=0.03)      # the tail is ShareGPT's, unweighted
    outs = np.array([r.output_tokens for s in big for r in s.rounds])
    assert set(outs.tolist()) <= set(decode.tolist())
    assert outs.mean() == pytest.approx(decode.mean(), rel=0.02)        # 438.7
    assert outs.min() >= 1 and outs.max() <= 1024


def test_later_inputs_are_a_clipped_lognormal_of_median_68(big):
    """Later turns add a few dozen new tokens typically (median ~68), at least 1, at most later_input_max."""
    later = laters(big)
    assert later.min() >= 1 and later.max() <= CHAT.later_input_max
    assert np.median(later) == pytest.approx(68.5, abs=4)
    assert later.dtype.kind == "i"


def test_turns_average_two_geometric_and_capped(big):
    """Rounds: mean 2 (LMSYS), about half the conversations single-turn, never above the cap of 16."""
    r = np.array([len(s.rounds) for s in big])
    assert r.min() == 1 and r.max() <= 16
    assert r.mean() == pytest.approx(2.0, abs=0.05)
    assert (r == 1).mean() == pytest.approx(0.5, abs=0.02)
    assert (r == 2).mean() == pytest.approx(0.25, abs=0.02)


def test_think_time_between_turns_and_none_after_the_last(big):
    """The user's think time is each round's tool_s (median 20 s, in [1, 600] s); the last round has none."""
    gaps = np.array([r.tool_s for s in big for r in s.rounds[:-1]])
    assert all(s.rounds[-1].tool_s == 0.0 for s in big)
    assert gaps.min() >= 1.0 and gaps.max() <= 600.0
    assert np.median(gaps) == pytest.approx(20.0, rel=0.05)


def test_poisson_arrivals_at_the_rate(big):
    """Sessions arrive as a Poisson process at 2/s: increasing times, mean gap 0.5 s, exponential (CV 1)."""
    t = np.array([s.arrival_s for s in big])
    gaps = np.diff(np.concatenate(([0.0], t)))
    assert t[0] > 0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


def test_same_seed_same_sessions_and_prefixes_are_stable():
    """Reproducible: the same seed gives identical sessions; another seed others; session i does not depend on
    num_sessions, and the rate changes only arrival times."""
    a = generate("chat-multiturn", 300, 1.0, seed=5)
    assert a == generate("chat-multiturn", 300, 1.0, seed=5)
    assert a != generate("chat-multiturn", 300, 1.0, seed=6)
    assert generate("chat-multiturn", 40, 1.0, seed=5) == a[:40]
    fast = generate("chat-multiturn", 300, 4.0, seed=5)
    assert [s.rounds for s in fast] == [s.rounds for s in a]
    assert [s.arrival_s for s in fast] != [s.arrival_s for s in a]
    assert [s.session_id for s in a[:3]] == ["chat-multiturn-0", "chat-multiturn-1", "chat-multiturn-2"]
    assert chat_multiturn(300, 5, rate=1.0) == a


def test_sessions_round_trip_through_jsonl(tmp_path):
    """Generated chat sessions are valid trace lines: dump then load gives them back."""
    sessions = generate("chat-multiturn", 200, 1.0, 0, slo=CHAT_SLO)
    dump_sessions(sessions, tmp_path / "c.jsonl")
    assert load_sessions(tmp_path / "c.jsonl") == sessions


def test_slo_is_the_callers_and_defaults_to_laps_for_every_model():
    """generate() attaches only the SLO it is given; default_slo gives LAPS's 0.4 s TTFT for any model, AMPD's
    per-model SLOs unchanged."""
    assert all(s.slo is None for s in generate("chat-multiturn", 5, 1.0, 0))
    assert all(s.slo == SLO(0.3, 0.05) for s in generate("chat-multiturn", 5, 1.0, 0, slo=SLO(0.3, 0.05)))
    for model in ("llama-3.1-70b", "qwen3-32b", "any-model", ""):
        assert default_slo(model, "chat-multiturn") == SLO(0.4, 0.1)
    assert default_slo("llama-3.1-70b", "toolbench") is PAPER_SLOS[("llama-3.1-70b", "toolbench")]
    assert default_slo("llama-3.1-70b", "agentic-long") is None
    with pytest.raises(WorkloadError, match="slo must be an SLO or None"):
        generate("chat-multiturn", 5, 1.0, 0, slo=(0.4, 0.1))


def test_prefill_basis_does_not_apply_to_chat():
    """prefill_basis reinterprets AMPD's Table 1; chat-multiturn has no such table and ignores it."""
    assert generate("chat-multiturn", 20, 1.0, 0, prefill_basis="prompt") == generate("chat-multiturn", 20, 1.0, 0)


@pytest.mark.parametrize("kw,what", [
    ({"num_sessions": 0}, "num_sessions must be an integer >= 1"),
    ({"rate": 0.0}, "arrival rate must be > 0"),
    ({"seed": -1}, "seed must be an integer >= 0"),
])
def test_bad_arguments_are_workload_errors(kw, what):
    """Argument errors are the same WorkloadErrors as the other generators'."""
    args = {"name": "chat-multiturn", "num_sessions": 10, "rate": 1.0, "seed": 0, **kw}
    with pytest.raises(WorkloadError, match=what):
        generate(**args)


@pytest.mark.parametrize("kw,what", [
    ({"first_short_fraction": 1.0}, "first_short_fraction must lie in"),
    ({"later_short_fraction": 0.0}, "later_short_fraction must lie in"),
    ({"mean_rounds": 20.0}, "mean_rounds"),
    ({"later_input_sigma": 0.0}, "sigmas must be > 0"),
    ({"think_min_s": 30.0}, "think_min_s"),
    ({"short_tokens": 1}, "short_tokens"),
])
def test_bad_specs_are_refused(kw, what):
    """A ChatSpec that cannot be calibrated is refused when built, naming the field."""
    with pytest.raises(WorkloadError, match=what):
        ChatSpec(**kw)


def test_a_custom_spec_is_calibrated_to_its_own_fractions(tmp_path):
    """The fractions are parameters: a spec asking for 30% short first prompts and 50% short later inputs gets
    them, drawing only from its own lengths file."""
    rows = [(10, 5), (100, 50), (200, 70), (300, 80), (5000, 900)]
    path = write_csv(tmp_path / "small.csv", rows)
    spec = ChatSpec(first_short_fraction=0.3, later_short_fraction=0.5, lengths_file=str(path))
    s = chat_multiturn(20_000, 1, rate=1.0, spec=spec)
    f, later = firsts(s), laters(s)
    assert set(f.tolist()) <= {10, 100, 200, 300, 5000}
    assert {r.output_tokens for x in s for r in x.rounds} <= {5, 50, 70, 80, 900}
    assert abs((f < 256).mean() - 0.3) <= 0.02 and abs((later < 256).mean() - 0.5) <= 0.02
    assert (f == 300).sum() == pytest.approx((f == 5000).sum(), rel=0.1)   # uniform within the long part


# --------------------------------------------------------------------------- the ShareGPT file


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("name,content,what", [
    ("empty.csv", "", "empty file"),
    ("header.csv", "input,output\n1,2\n", ":1: expected header num_prefill_tokens,num_decode_tokens"),
    ("noint.csv", HEADER + "12,30,42,0.4\nabc,30,42,0.4\n", ":3: num_prefill_tokens must be an integer, got 'abc'"),
    ("zero.csv", HEADER + "12,0,12,0\n", ":2: num_decode_tokens must be >= 1, got 0"),
    ("short.csv", HEADER + "12\n", ":2: expected 2 fields, got 1"),
    ("norows.csv", HEADER, "no data rows"),
    ("nolong.csv", HEADER + "12,30,42,0.4\n200,30,230,6.6\n", "no num_prefill_tokens at or above 256"),
    ("noshort.csv", HEADER + "300,30,330,10\n", "no num_prefill_tokens below 256"),
    ("binary.csv", b"\xff\xfe\x00garbage", "cannot read"),
])
def test_a_malformed_lengths_file_is_a_one_line_workload_error(tmp_path, name, content, what):
    """A bad ShareGPT CSV fails with one line naming the file (and line, and what is wrong), never a traceback."""
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(WorkloadError) as e:
        chat_multiturn(5, 0, spec=ChatSpec(lengths_file=str(path)))
    msg = _one_line_error(e)
    assert str(path) in msg and what in msg


def test_a_missing_lengths_file_is_a_one_line_workload_error(tmp_path, monkeypatch):
    """A missing file (given, or the shipped one under TANDEM_TRACES_DIR) or a directory: one line naming it."""
    with pytest.raises(WorkloadError) as e:
        chat_multiturn(5, 0, spec=ChatSpec(lengths_file=str(tmp_path / "nope.csv")))
    assert "nope.csv: no such file" in _one_line_error(e)
    with pytest.raises(WorkloadError) as e:
        chat_multiturn(5, 0, spec=ChatSpec(lengths_file=str(tmp_path)))
    assert "is a directory" in _one_line_error(e)
    monkeypatch.setenv("TANDEM_TRACES_DIR", str(tmp_path))
    with pytest.raises(WorkloadError) as e:
        generate("chat-multiturn", 5, 1.0, 0)
    msg = _one_line_error(e)
    assert "sharegpt_8k_filtered_stats_llama2_tokenizer.csv" in msg and "not found" in msg


def test_the_shipped_file_is_read_in_place_and_once(sharegpt):
    """The default pools are the shipped trace's columns (30,731 rows), cached read-only per file version."""
    prefill, decode = sharegpt
    assert len(prefill) == len(decode) == 30_731
    assert sharegpt_lengths()[0] is prefill                            # cached
    assert not prefill.flags.writeable and not decode.flags.writeable
    assert chat_calibration().lengths_file == str(trace_path("sharegpt"))
    assert (prefill < 256).mean() == pytest.approx(0.1708, abs=1e-4)    # why reweighting is needed: 17% -> 63%


def test_an_edited_lengths_file_is_read_again(tmp_path):
    """The cache is keyed by the file's version: rewriting it changes what the generator draws."""
    path = write_csv(tmp_path / "l.csv", [(10, 5), (300, 7)])
    spec = ChatSpec(lengths_file=str(path))
    assert {r.output_tokens for s in chat_multiturn(50, 0, spec=spec) for r in s.rounds} <= {5, 7}
    write_csv(path, [(10, 11), (300, 13), (400, 17)])
    assert {r.output_tokens for s in chat_multiturn(50, 0, spec=spec) for r in s.rounds} <= {11, 13, 17}


# --------------------------------------------------------------------------- CLI and experiments


def test_cli_generate_attaches_laps_slo_for_any_model(tmp_path, capsys):
    """`tandem generate --workload chat-multiturn` writes the sessions with LAPS's SLO, whatever --model is."""
    out = tmp_path / "chat.jsonl"
    assert main(["generate", "--workload", "chat-multiturn", "--model", "qwen3-32b", "--sessions", "25",
                 "--rate", "3", "--seed", "4", "--out", str(out)]) == 0
    assert "wrote 25 sessions" in capsys.readouterr().out
    sessions = load_sessions(out)
    assert sessions == generate("chat-multiturn", 25, 3.0, 4, slo=SLO(0.4, 0.1))
    assert main(["generate", "--workload", "chat-multiturn", "--sessions", "5", "--slo-ttft", "0.25",
                 "--out", str(out)]) == 0
    assert all(s.slo == SLO(0.25, 0.1) for s in load_sessions(out))   # one flag completes the default


def test_cli_simulate_runs_chat_multiturn_with_its_slo(capsys):
    """`tandem simulate --workload chat-multiturn` generates, simulates and scores every session against 0.4 s."""
    rc = main(["simulate", "--workload", "chat-multiturn", "--model", "llama-3.1-70b", "--gpu", "h20",
               "--gpus", "8", "--deploy", "P:tp4x1,D:tp4x1", "--sessions", "12", "--rate", "2", "--json"])
    m = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert m["sessions_total"] == m["sessions_with_slo"] == 12
    assert m["sessions_completed"] + m["sessions_failed"] == 12


def test_cli_bad_lengths_file_is_one_error_line(tmp_path, monkeypatch, capsys):
    """Without the ShareGPT file the command fails with exit 2 and one `tandem: error:` line."""
    monkeypatch.setenv("TANDEM_TRACES_DIR", str(tmp_path))
    rc = main(["generate", "--workload", "chat-multiturn", "--sessions", "5", "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("tandem: error: ") and "not found" in err[0]


def test_experiments_accept_chat_multiturn_with_laps_slo():
    """An experiment can sweep chat-multiturn: the name validates, its SLO is LAPS's, and a cell runs."""
    from tandem.bench import experiment as ex

    spec = ex.ExperimentSpec(model="llama-3.1-70b", workloads=["chat-multiturn"], policies=["ampd"], rates=[1.0])
    ex.validate_spec(spec)
    assert ex.workload_slo(spec, "chat-multiturn") == SLO(0.4, 0.1)
    assert ex.workload_gpus(spec, "chat-multiturn") == ex.DEFAULT_GPUS
    assert ex.workload_slo(dataclasses.replace(spec, slos={"chat-multiturn": None}), "chat-multiturn") is None
    task = ex.Task("chat-multiturn", "ampd", "P:tp4x1,D:tp4x1", 1.0, 0, 6, 8, CHAT_SLO, "llama-3.1-70b", "h20")
    res = ex.run_task(task)
    assert res.error == "" and len(res.records) == 6
    assert all(r.slo == CHAT_SLO for r in res.records)


def test_plan_needs_no_slo_flags_for_chat_multiturn(capsys):
    """`tandem plan --workload chat-multiturn` plans against LAPS's SLO without --slo-ttft/--slo-itl."""
    rc = main(["plan", "--gpus", "8", "--workload", "chat-multiturn", "--sessions", "10", "--no-cache",
               "--no-progress"])
    out, err = capsys.readouterr()
    assert "give --slo-ttft" not in err
    assert "SLO TTFT 0.4 s, ITL 100 ms" in out
    # llama-3.1-70b on 8 H20s cannot prefill ShareGPT's long first prompts in 0.4 s: the planner says so in one line
    assert rc == 2 and err.startswith("tandem: error: no deployment of 8 x h20 meets the TTFT SLO 0.4 s")
    assert len(err.strip().splitlines()) == 1
