"""`tandem demo`'s runtime probe: the runtime block read off given probe records (no server), and the report's
sim+runtime rows and verdict line drawn from given records."""
from __future__ import annotations

import pytest

from tandem.bench.demo import PolicyRun
from tandem.bench.demo_report import comparison, footer, row_cells, verdict
from tandem.bench.demo_runtime import (PROBE_FIRST, Probe, decode_contexts, describe, probe_sessions,
                                       request_latency, runtime_block, step_gap, ttfts)
from tandem.workload.metrics import summarize
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import SLO, Round, Session

SLO_ = SLO(0.1, 0.01)


def _round(k: int, ttft: float, itl_mean: float, out: int = 4, where: str = "remote") -> RoundRecord:
    return RoundRecord(index=k, arrival_s=float(k), input_tokens=10, prefill_where=where, first_token_s=k + ttft,
                       finish_s=k + ttft + itl_mean * (out - 1), output_tokens=out, itl_sum_s=itl_mean * (out - 1),
                       itl_count=out - 1)


def _session(sid: str, rounds: list[RoundRecord]) -> SessionRecord:
    return SessionRecord(sid, 0.0, SLO_, len(rounds), 0, rounds, finish_s=float(len(rounds)))


def test_the_probe_is_two_rounds_per_size_in_two_passes_each_session_its_own_text():
    ps = probe_sessions()
    assert [s.rounds[0].input_tokens for s in ps] == list(PROBE_FIRST) * 2
    assert len({s.session_id for s in ps}) == len(ps) and all(len(s.rounds) == 2 for s in ps)


def test_decode_contexts_follow_the_history_of_each_round():
    s = Session("p", 0.0, [Round(10, 3), Round(5, 2)])
    # round 0: KV 10 then steps at 11, 12; round 1: history 13 + 5 new = 18, one step at 19
    assert decode_contexts(s) == [[11, 12], [19]]


def test_step_gap_is_the_median_round_itl_beyond_the_profiled_decode_step():
    sessions = [Session("a", 0.0, [Round(10, 4)]), Session("b", 0.0, [Round(10, 4)]), Session("c", 0.0, [Round(10, 4)])]
    recs = [_session("a", [_round(0, 0.05, 0.004)]), _session("b", [_round(0, 0.05, 0.005)]),
            _session("c", [_round(0, 0.05, 0.009)])]
    # profiled decode step 3 ms x the speed check's 1.0: gaps 1, 2, 6 ms -> 2 ms; at x1.5 (4.5 ms) the median is 0.5
    assert step_gap(recs, sessions, lambda c: 0.003) == pytest.approx(0.002)
    assert step_gap(recs, sessions, lambda c: 0.003, decode_factor=1.5) == pytest.approx(0.0005)
    assert step_gap(recs, sessions, lambda c: 0.02) == 0.0            # never negative
    assert step_gap([], sessions, lambda c: 0.003) == 0.0


def test_request_latency_is_the_median_measured_minus_simulated_ttft_over_shared_rounds():
    measured = {("a", 0): 0.030, ("a", 1): 0.040, ("b", 0): 0.050, ("c", 0): 1.0}
    simulated = {("a", 0): 0.010, ("a", 1): 0.015, ("b", 0): 0.020}
    assert request_latency(measured, simulated) == pytest.approx(0.025)     # 20, 25, 30 ms; ("c", 0) unmatched
    assert request_latency({("a", 0): 0.01}, {("a", 0): 0.02}) == 0.0
    assert request_latency({}, {}) == 0.0


def test_runtime_block_from_the_probe_cpu_itl_and_ttft_residual():
    sessions = [Session("a", 0.0, [Round(10, 4), Round(5, 4)])]
    recs = [_session("a", [_round(0, 0.030, 0.005), _round(1, 0.040, 0.005)])]
    # 0.5 s of CPU over 2 s of probe at an idle rate of 0.05 s/s: 0.4 s beyond it, over 8 tokens
    probe = Probe(recs, cpu_s=0.5, wall_s=2.0, idle_cpu_rate=0.05)
    seen = []

    def simulate(rt: dict) -> dict:
        seen.append(dict(rt))
        return {("a", 0): 0.020, ("a", 1): 0.026}

    rt = runtime_block(probe, sessions, lambda c: 0.003, {"decode": 1.0}, 2, simulate)
    assert rt["step_gap_s"] == pytest.approx(0.002) and rt["host_token_s"] == pytest.approx(0.05)
    assert rt["cores"] == 2 and rt["step_factor"] == {"prefill": 1.0, "decode": 1.0}
    assert rt["request_s"] == pytest.approx(0.012)               # residuals 10 and 14 ms
    assert seen[0]["request_s"] == 0.0                           # simulated without the latency it measures
    assert (rt["hop_s"], rt["output_s"], rt["msg_s"], rt["host_round_s"]) == (0.0, 0.0, 0.0, 0.0)
    assert describe(rt) == ("runtime measured on the idle server: request+response 12.0 ms a round, 2.00 ms between "
                            "steps, 50.00 ms of serving CPU a token on 2 core(s)")
    assert ttfts(recs) == {("a", 0): pytest.approx(0.030), ("a", 1): pytest.approx(0.040)}


def _run(policy: str, real: list[float], sim: list[float], sim_rt: list[float] | None,
         where: str = "remote") -> PolicyRun:
    r = [_session("s", [_round(k, t, 0.005) for k, t in enumerate(real)])]
    s = [_session("s", [_round(k, t, 0.004, where=where) for k, t in enumerate(sim)])]
    run = PolicyRun(policy, {**summarize(r, 3.0), "local_prefills": 0, "remote_prefills": len(real)}, r,
                    summarize(s, 3.0), s)
    if sim_rt is not None:
        srt = [_session("s", [_round(k, t, 0.005, where=where) for k, t in enumerate(sim_rt)])]
        run.simulated_rt, run.sim_rt_records = summarize(srt, 3.0), srt
    return run


def test_comparison_adds_the_sim_with_runtime_row_after_the_simulated_one():
    rows = comparison([_run("ampd", [0.05, 0.2], [0.02, 0.04], [0.04, 0.08]), _run("dynamo", [0.08], [0.02], None)])
    assert [(r["policy"], r["source"]) for r in rows] == [
        ("ampd", "measured"), ("ampd", "simulated"), ("ampd", "sim+runtime"), ("dynamo", "measured"),
        ("dynamo", "simulated")]
    assert row_cells(rows[2])[:4] == ["", "sim+runtime", "40.0 (-20%)", "80.0 (-60%)"]


def test_verdict_names_a_loose_slo_when_the_simulator_gives_both_policies_the_same_attainment():
    same = [_run("ampd", [0.05, 0.2], [0.02, 0.04], [0.04, 0.08]), _run("dynamo", [0.08, 0.05], [0.02, 0.04],
                                                                         [0.04, 0.09])]
    assert verdict(same) == (
        "round SLO attainment measured: ampd 50.0%, dynamo 100.0%; simulated, both 100.0%: at this SLO the "
        "simulator leaves ampd nothing to win over dynamo, so the measured gap is run-to-run variation (fresh "
        "workers, one run after the other, other jobs on the machine), not the policy")
    differ = [_run("ampd", [0.05, 0.2], [0.02, 0.04], [0.04, 0.08]),
              _run("dynamo", [0.08, 0.05], [0.02, 0.04], [0.04, 0.15])]      # 0.15 s misses the 0.1 s SLO
    assert verdict(differ) == ("round SLO attainment measured: ampd 50.0%, dynamo 100.0%; simulated ampd 100.0%, "
                               "dynamo 50.0%")
    no_runtime = [_run("ampd", [0.05], [0.2], None), _run("dynamo", [0.05], [0.05], None)]
    assert verdict(no_runtime).endswith("simulated ampd 0.0%, dynamo 100.0%")       # the profile-only rows
    assert verdict(same[:1]) is None


def test_footer_describes_both_simulations():
    runs = [_run("ampd", [0.05], [0.02], [0.04])]
    rt = {"request_s": 0.012, "step_gap_s": 0.002, "host_token_s": 0.001, "cores": 2}
    lines = footer("out", runs, type("P", (), {"runtime": None})(), rt)
    assert lines[1].startswith("simulated: engine steps and KV transfers priced from the profile alone")
    assert lines[2] == ("sim+runtime: the same with the runtime measured on the idle server: request+response "
                        "12.0 ms a round, 2.00 ms between steps, 1.00 ms of serving CPU a token on 2 core(s) (a probe "
                        "before the measured sessions; other jobs on the machine are in neither simulation)")
