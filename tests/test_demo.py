"""`tandem demo`: the rate and SLO derived from a profile (the calibration rule) and the side-by-side table and PNG
drawn from given records, with no live server."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tandem.bench.demo import DemoPlan, PolicyRun, demo_threads, plan_demo
from tandem.bench.demo_calibration import calibrate, round_costs
from tandem.bench.demo_profile import (SIDECAR_VERSION, SPEED_POINTS, MachineKey, cache_verdict, profile_path,
                                       sidecar_path, speed_verdict)
from tandem.bench.demo_report import comparison, header, markdown_table, row_cells, write_outputs
from tandem.perf.ampd_cost import AMPDCostModel
from tandem.perf.fit import PiecewiseLinear
from tandem.workload.metrics import summarize
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import SLO, Round, Session


def _cost() -> AMPDCostModel:
    """T_pre = 1 ms + 10 us per new token, T_dec = 2 ms a step, T_kv = 0.5 ms a transfer (0 for no tokens)."""
    return AMPDCostModel(pre={1: PiecewiseLinear(1, [], [[1e-3, 1e-5, 0.0, 0.0]])},
                         dec={1: PiecewiseLinear(1, [], [[2e-3, 0.0, 0.0]])},
                         kv={"1-1-node": PiecewiseLinear(1, [], [[5e-4, 0.0]])})


SESSIONS = [Session("a", 0.0, [Round(100, 3, 0.1), Round(50, 2)]), Session("b", 0.0, [Round(300, 1)])]


def test_round_costs_price_each_round_alone_on_the_remote_path():
    a = round_costs(SESSIONS[0], _cost())
    # round 0: prefill 1 + 1 ms; decode 2 steps after the first token; TTFT no history to move + prefill + KV back
    # 0.5 ms + one 2 ms step; round 1 (history 103 tokens): its history moves out too
    assert [x for r in a for x in (r.prefill_s, r.decode_s, r.ttft_s, r.itl_s)] == pytest.approx(
        [0.002, 0.004, 0.0045, 0.002, 0.0015, 0.002, 0.0045, 0.002])


def test_calibration_rule_rate_and_slo_from_the_profile_costs():
    cal = calibrate(SESSIONS, _cost(), load=0.65, slo_factor=4.0)
    # per session: prefill (3.5 + 4) / 2 = 3.75 ms, decode (6 + 0) / 2 = 3 ms -> the prefill worker bounds it
    assert cal.prefill_s == pytest.approx(0.00375) and cal.decode_s == pytest.approx(0.003)
    assert cal.capacity == pytest.approx(1 / 0.00375) and cal.rate == pytest.approx(0.65 / 0.00375)
    # p90 of the unloaded TTFTs (4.5, 4.5, 6.5 ms) = 6.1 ms, of the ITLs 2 ms; x4
    assert cal.unloaded_ttft_s == pytest.approx(0.0061) and cal.unloaded_itl_s == pytest.approx(0.002)
    assert (cal.slo.ttft_s, cal.slo.itl_s) == pytest.approx((0.0244, 0.008))
    assert cal.describe()[0].startswith("rate 173.33 sessions/s = 0.65 x the 266.67/s")
    assert "the prefill worker bounds it" in cal.describe()[0]
    assert cal.describe()[1].startswith("SLO TTFT 24 ms, ITL 8.0 ms = 4 x the profiled unloaded p90")


def test_calibration_on_cores_that_cannot_step_both_workers_at_once_adds_their_work():
    # one step at a time (taskset -c 0, or two threads a worker on two cores): capacity 1 / (3.75 + 3) ms
    cal = calibrate(SESSIONS, _cost(), load=0.65, slo_factor=4.0, parallel=1)
    assert cal.parallel == 1 and cal.capacity == pytest.approx(1 / 0.00675)
    assert cal.rate == pytest.approx(0.65 / 0.00675)
    assert (cal.slo.ttft_s, cal.slo.itl_s) == pytest.approx((0.0244, 0.008))    # unloaded latencies unchanged
    assert "the two workers share the cores one step at a time" in cal.describe()[0]
    assert calibrate(SESSIONS, _cost(), parallel=8).capacity == pytest.approx(1 / 0.00375)


def test_calibration_rejects_a_load_outside_0_1_and_no_sessions():
    with pytest.raises(ValueError, match="load"):
        calibrate(SESSIONS, _cost(), load=1.5)
    with pytest.raises(ValueError, match="at least one session"):
        calibrate([], _cost())
    with pytest.raises(ValueError, match="parallel"):
        calibrate(SESSIONS, _cost(), parallel=0)


def test_plan_takes_the_calibrated_rate_and_slo_unless_given():
    prof = SimpleNamespace(ampd=_cost())
    plan = plan_demo(prof, num_sessions=5, scale=0.5, max_tokens_cap=16, baseline="dynamo")
    assert plan.rate == plan.calibration.rate and plan.slo == plan.calibration.slo
    assert plan.policies == ("ampd", "dynamo") and not plan.rate_given and not plan.slo_given
    assert all(s.slo == plan.slo for s in plan.sessions)
    assert all(r.output_tokens <= 16 for s in plan.sessions for r in s.rounds)
    given = plan_demo(prof, num_sessions=5, rate=2.0, slo_itl_s=0.05, baseline="ampd")
    assert given.rate == 2.0 and given.rate_given and given.slo_given and given.policies == ("ampd",)
    assert given.slo == SLO(plan.slo.ttft_s, 0.05)
    # the same token counts at either rate: only the arrivals follow it
    assert [[r.input_tokens for r in s.rounds] for s in given.sessions] == \
        [[r.input_tokens for r in s.rounds] for s in plan.sessions]


KEY = MachineKey("Xeon", 2, 1, "2.13.0")


def test_threads_follow_the_flag_then_omp_num_threads_and_each_machine_key_has_its_profile():
    assert demo_threads(3, {"OMP_NUM_THREADS": "2"}) == 3
    assert demo_threads(None, {"OMP_NUM_THREADS": "2"}) == 2
    assert demo_threads(None, {"OMP_NUM_THREADS": "x"}) == 1 and demo_threads(None, {}) == 1
    assert profile_path("m", KEY).as_posix() == "m/profile-quick-1t-2c.json"
    assert profile_path("m", MachineKey("Xeon", 1, 2, "2.13.0")).as_posix() == "m/profile-quick-2t-1c.json"
    assert sidecar_path(profile_path("m", KEY)).as_posix() == "m/profile-quick-1t-2c.speed.json"
    # worker steps the cores run at once: cores over threads per worker, at least one
    assert (KEY.parallel, MachineKey("x", 1, 1, "t").parallel, MachineKey("x", 2, 2, "t").parallel) == (2, 1, 1)


def _sidecar(**over) -> dict:
    return {"version": SIDECAR_VERSION, "key": {"cpu": "Xeon", "cores": 2, "threads": 1, "torch": "2.13.0"},
            "profile_sha256": "abc", "seconds": [0.01] * len(SPEED_POINTS), **over}


def test_a_cached_profile_is_used_only_with_its_machine_key_and_speed_baseline():
    assert cache_verdict(_sidecar(), KEY, "abc") is None
    assert cache_verdict(None, KEY, "abc") == "no speed baseline kept beside it"
    assert cache_verdict(_sidecar(), KEY, "def") == "the profile changed since its speed baseline was timed"
    assert cache_verdict(_sidecar(), MachineKey("Xeon", 1, 1, "2.13.0"), "abc") == \
        "the machine changed: cores 2 -> 1"
    assert cache_verdict(_sidecar(), MachineKey("EPYC", 2, 1, "2.14.0"), "abc") == \
        "the machine changed: cpu 'Xeon' -> 'EPYC', torch '2.13.0' -> '2.14.0'"
    assert cache_verdict(_sidecar(seconds=[0.01]), KEY, "abc") == \
        "its speed baseline is not one positive time per checked step"


def test_speed_check_keeps_the_profile_within_the_tolerance_and_calls_a_changed_machine_stale():
    kinds = ["prefill", "prefill", "decode", "decode"]
    same = speed_verdict([1.0, 2.0, 1.0, 1.0], [1.1, 2.0, 0.9, 1.0], kinds, tolerance=1.25)
    # medians of now/baseline per kind: prefill (1.1, 1.0) -> 1.05, decode (0.9, 1.0) -> 0.95
    assert (same.prefill, same.decode) == pytest.approx((1.05, 0.95)) and not same.stale
    assert same.describe() == ("speed check: prefill steps x1.05, decode steps x0.95 of their time after profiling "
                               "(within x1.25 either way: profile kept)")
    slower = speed_verdict([1.0, 2.0, 1.0, 1.0], [1.0, 2.0, 1.5, 1.4], kinds, tolerance=1.25)
    assert slower.decode == pytest.approx(1.45) and slower.stale
    assert speed_verdict([1.0, 1.0], [0.7, 0.7], ["prefill", "decode"], 1.25).stale     # faster counts too
    with pytest.raises(ValueError, match="> 0"):
        speed_verdict([0.0], [1.0], ["decode"])


SLO_ = SLO(0.1, 0.01)


def _rec(sid: str, ttfts: list[float], where: list[str] | None = None, history: int = 0) -> SessionRecord:
    rounds = []
    for k, t in enumerate(ttfts):
        r = RoundRecord(index=k, arrival_s=float(k), input_tokens=10, history_tokens=history if k else 0,
                        prefill_where=where[k] if where else "", first_token_s=k + t, finish_s=k + t + 0.02,
                        output_tokens=3, itl_sum_s=0.01, itl_count=2)
        rounds.append(r)
    return SessionRecord(sid, 0.0, SLO_, len(ttfts), 0, rounds, finish_s=float(len(ttfts)))


def _run(policy: str, real_ttfts: list[float], sim_ttfts: list[float], local: int, remote: int) -> PolicyRun:
    real = [_rec("s", real_ttfts, history=20)]
    sim = [_rec("s", sim_ttfts, ["local"] * local + ["remote"] * remote, history=20)]
    measured = {**summarize(real, 3.0), "local_prefills": local, "remote_prefills": remote}
    return PolicyRun(policy, measured, real, summarize(sim, 3.0), sim)


def test_comparison_rows_pair_each_measured_row_with_the_simulated_one_and_the_difference():
    runs = [_run("ampd", [0.05, 0.2], [0.04, 0.09], 1, 1), _run("dynamo", [0.08, 0.3], [0.08, 0.15], 0, 2)]
    rows = comparison(runs)
    assert [(r["policy"], r["source"]) for r in rows] == [("ampd", "measured"), ("ampd", "simulated"),
                                                         ("dynamo", "measured"), ("dynamo", "simulated")]
    real, sim = rows[0]["figures"], rows[1]["figures"]
    assert real["ttft_initial_mean_s"] == pytest.approx(0.05) and real["ttft_incremental_mean_s"] == pytest.approx(0.2)
    assert real["round_slo_attainment"] == 0.5 and sim["round_slo_attainment"] == 1.0   # 0.2 s > the 0.1 s SLO
    assert real["local_remote"] == (1, 1) and real["cached_tokens"] == 20
    d = rows[1]["diff"]
    assert d["ttft_initial_mean_s"] == pytest.approx(-20.0) and d["ttft_incremental_mean_s"] == pytest.approx(-55.0)
    assert d["round_slo_attainment"] == pytest.approx(50.0) and d["local_remote"] == pytest.approx(0.0)
    assert d["cached_tokens"] == pytest.approx(0.0)
    assert row_cells(rows[1]) == ["", "simulated", "40.0 (-20%)", "90.0 (-55%)", "5.0 (+0%)", "100.0% (+50 pp)",
                                  "1/1 (+0 pp)", "20 (+0%)"]
    assert row_cells(rows[2])[:2] == ["dynamo", "measured"]
    md = markdown_table(rows).splitlines()
    assert md[0].startswith("| policy | run | TTFT init ms") and len(md) == 6


def test_outputs_table_png_and_results_from_given_records(tmp_path):
    runs = [_run("ampd", [0.05, 0.2], [0.04, 0.09], 1, 1), _run("dynamo", [0.08, 0.3], [0.08, 0.15], 0, 2)]
    plan = DemoPlan("toolbench", [Session("s", 0.0, [Round(10, 3)], SLO_)], 1.5, SLO_,
                    calibrate(SESSIONS, _cost()), ("ampd", "dynamo"), 0.5, 16, 0)
    res = write_outputs(tmp_path / "demo", plan, runs)
    png = tmp_path / "demo" / "ttft.png"
    assert res["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = (tmp_path / "demo" / "table.md").read_text()
    assert "| ampd | measured | 50.0 | 200.0 | 5.0 | 50.0% | 1/1 | 20 |" in table
    saved = json.loads((tmp_path / "demo" / "results.json").read_text())
    assert saved["rate"] == 1.5 and [r["policy"] for r in saved["runs"]] == ["ampd", "dynamo"]
    assert saved["runs"][1]["deployment"] == "P:tp1x1,D:tp1x1"
    assert sorted(p.name for p in (tmp_path / "demo").glob("records-*.jsonl")) == [
        "records-ampd-simulated.jsonl", "records-ampd.jsonl", "records-dynamo-simulated.jsonl", "records-dynamo.jsonl"]


def test_header_prints_the_derived_rate_and_slo_and_calls_out_a_noisy_profile():
    plan = DemoPlan("toolbench", list(SESSIONS), 173.0, SLO(0.0244, 0.008), calibrate(SESSIONS, _cost(), 0.65, 4.0),
                    ("ampd", "dynamo"), 0.5, 16, 0)
    prof = SimpleNamespace(device_name="cpu", device={"threads": 1, "cores": 2}, heldout_error={"median": 0.04},
                           options={"load_avg_before": 6.2})
    text = header(plan, "m", "m/p.json", prof, 1, (1.0, 2.0, 3.0)).splitlines()
    assert text[2].startswith("  rate 173.33 sessions/s = 0.65 x") and text[3].startswith("  SLO TTFT 24 ms")
    assert text[4] == "  load average 1.00 2.00 3.00 over 2 cores (other jobs slow the live runs, not the simulation)"
    slow = DemoPlan("toolbench", [Session("a", 0.0, [Round(10, 1)]), Session("b", 95.0, [Round(10, 1)])], 0.02,
                    SLO(0.0244, 0.008), calibrate(SESSIONS, _cost(), 0.65, 4.0), ("ampd", "dynamo"), 0.5, 16, 0)
    assert header(slow, "m", "m/p.json", prof, 1).splitlines()[3] == (
        "  at this rate the sessions arrive over 95 s for each policy: the machine profiled slow (see the load "
        "average below); Ctrl-C and --rate, or a quieter machine, shorten it")
    prof.heldout_error = {"median": 0.5}
    noisy = header(plan, "m", "m/p.json", prof, 1).splitlines()
    assert noisy[2] == ("  the profile predicts its held-out steps 50% off (made at load average 6.2): the rate and "
                        "SLO below are as rough; delete m/p.json to profile again on a quieter machine")


class _Timer:
    """A stand-in for the speed check's step timer: the times it returns, in turn."""

    calls: list[list[float]] = []

    def __init__(self, model, threads) -> None:
        pass

    def times(self) -> list[float]:
        return _Timer.calls.pop(0)


class _Profile:
    def __init__(self, n: int) -> None:
        self.n = n

    def to_json(self, path) -> None:
        path.write_text(json.dumps({"profile": self.n}))


def test_ensure_profile_profiles_once_keeps_it_while_as_fast_and_again_when_slower(tmp_path, monkeypatch):
    import tandem.engine.profiling as profiling
    from tandem.bench import demo_profile

    made = []
    monkeypatch.setattr(profiling, "profile", lambda model, opt: made.append(opt) or _Profile(len(made)))
    monkeypatch.setattr(demo_profile, "StepTimer", _Timer)
    logs: list[str] = []
    n = len(SPEED_POINTS)
    _Timer.calls = [[0.01] * n]                                  # the baseline just after the first profile
    first = demo_profile.ensure_profile(tmp_path, 1, 4096, logs.append)
    assert len(made) == 1 and made[0].quick and made[0].threads == 1 and first.speed is None
    assert first.notes == ["profiled now (none cached for this machine)"]
    assert json.loads(sidecar_path(first.path).read_text())["seconds"] == [0.01] * n
    _Timer.calls = [[0.011] * n]                                 # 10% slower: kept
    kept = demo_profile.ensure_profile(tmp_path, 1, 4096, logs.append)
    assert len(made) == 1 and kept.speed is not None and not kept.speed.stale
    assert kept.notes[0].startswith("speed check: prefill steps x1.10, decode steps x1.10")
    _Timer.calls = [[0.02] * n, [0.02] * n]                      # twice as slow: profiled again, a new baseline
    again = demo_profile.ensure_profile(tmp_path, 1, 4096, logs.append)
    assert len(made) == 2 and again.speed is None
    assert again.notes[-1] == "profiled now (the speed check found the machine's speed changed)"
    assert json.loads(sidecar_path(again.path).read_text())["seconds"] == [0.02] * n
    assert len(logs) == 2 and "the speed check found the machine's speed changed" in logs[1]
