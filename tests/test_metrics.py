"""summarize(): exact values on hand-built session records."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.workload.metrics import session_attains, summarize
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import SLO

SLO_ = SLO(ttft_s=1.0, itl_s=0.05)


def rnd(index, arrival, ttft, *, out=11, itl=0.04, where="remote", kv=0.0, queue=0.1,
        finished=True, preempt=0, inp=100):
    """A round whose prefill starts `queue` after arrival, first token after `ttft`, then out-1 gaps of `itl`."""
    first = arrival + ttft
    gaps = max(out - 1, 0)
    return RoundRecord(
        index=index, arrival_s=arrival, input_tokens=inp, prefill_where=where,
        prefill_start_s=arrival + queue, first_token_s=first,
        finish_s=first + gaps * itl if finished else None, output_tokens=out,
        itl_sum_s=gaps * itl, itl_count=gaps, itl_max_s=itl if gaps else 0.0,
        kv_transfer_s=kv, preemptions=preempt,
    )


def sess(sid, rounds, *, slo=SLO_, failed=False, reason="", finish=None, num_rounds=None):
    last = rounds[-1].finish_s if rounds else None
    return SessionRecord(
        session_id=sid, arrival_s=rounds[0].arrival_s if rounds else 0.0, slo=slo,
        num_rounds=num_rounds if num_rounds is not None else len(rounds), rounds=rounds,
        finish_s=None if failed else (finish if finish is not None else last),
        failed=failed, fail_reason=reason,
    )


@pytest.fixture
def records():
    return [
        # s0: attains (both rounds TTFT<=1, ITL 0.04); round 1 prefilled locally.
        sess("s0", [rnd(0, 0.0, 0.5, kv=0.02), rnd(1, 5.0, 0.2, where="local")]),
        # s1: round 1 TTFT 1.5 > 1.0 -> session miss; round 0 ok, round 1 miss.
        sess("s1", [rnd(0, 1.0, 0.8, kv=0.04), rnd(1, 6.0, 1.5, where="local")]),
        # s2: TTFT fine but ITL 0.06 > 0.05 -> miss, both rounds miss.
        sess("s2", [rnd(0, 2.0, 0.3, itl=0.06, kv=0.06), rnd(1, 7.0, 0.3, itl=0.06)]),
        # s3: failed after round 0 (which attained on its own); 3 rounds planned.
        sess("s3", [rnd(0, 3.0, 0.4, preempt=2)], failed=True, reason="kv-oom", num_rounds=3),
        # s4: no SLO: excluded from attainment but in latency metrics.
        sess("s4", [rnd(0, 4.0, 0.6, out=1, where="local")], slo=None),
    ]


def test_session_and_round_attainment(records):
    m = summarize(records, sim_time_s=20.0)
    assert [session_attains(s) for s in records] == [True, False, False, False, False]
    assert m["sessions_with_slo"] == 4
    assert m["slo_attainment"] == pytest.approx(1 / 4)          # failed s3 counts as a miss
    # rounds of sessions with SLO: 2+2+2+3 = 9; ok: s0r0, s0r1, s1r0, s3r0 -> 4
    assert m["round_slo_attainment"] == pytest.approx(4 / 9)
    assert m["goodput_sessions_per_s"] == pytest.approx(1 / 20)


def test_failures_and_counts(records):
    m = summarize(records, sim_time_s=20.0)
    assert m["sessions_total"] == 5
    assert m["sessions_completed"] == 4
    assert m["sessions_failed"] == 1
    assert m["sessions_unfinished"] == 0
    assert m["fail_reasons"] == {"kv-oom": 1}
    assert m["rounds_total"] == 10
    assert m["rounds_completed"] == 8
    assert m["preemptions"] == 2


def test_ttft_percentiles(records):
    m = summarize(records, sim_time_s=20.0)
    init = [0.5, 0.8, 0.3, 0.4, 0.6]
    incr = [0.2, 1.5, 0.3]
    assert m["ttft_initial_mean_s"] == pytest.approx(np.mean(init))
    assert m["ttft_initial_p50_s"] == pytest.approx(0.5)
    assert m["ttft_initial_p95_s"] == pytest.approx(0.76)  # 0.6 + 0.8 * (0.8 - 0.6)
    assert m["ttft_initial_p99_s"] == pytest.approx(np.percentile(init, 99))
    assert m["ttft_incremental_mean_s"] == pytest.approx(np.mean(incr))
    assert m["ttft_incremental_p50_s"] == pytest.approx(0.3)
    assert m["ttft_incremental_p95_s"] == pytest.approx(0.3 + 0.9 * 1.2)
    assert m["ttft_p95_s"] == pytest.approx(np.percentile(init + incr, 95))


def test_itl_tpot_e2e_queue(records):
    m = summarize(records, sim_time_s=20.0)
    # gaps: s0 2x10x0.04, s1 2x10x0.04, s2 2x10x0.06, s3 10x0.04, s4 none
    assert m["itl_mean_s"] == pytest.approx((50 * 0.04 + 20 * 0.06) / 70)
    per_round = [0.04] * 5 + [0.06] * 2
    assert m["itl_p95_s"] == pytest.approx(np.percentile(per_round, 95))
    assert m["itl_max_s"] == pytest.approx(0.06)
    # TPOT over finished rounds with >= 2 tokens: 5 rounds at 0.04 (s3r0 finished too), 2 at 0.06
    assert m["tpot_mean_s"] == pytest.approx((5 * 0.04 + 2 * 0.06) / 7)
    e2e = [0.5 + 0.4, 0.2 + 0.4, 0.8 + 0.4, 1.5 + 0.4, 0.3 + 0.6, 0.3 + 0.6, 0.4 + 0.4, 0.6]
    assert m["e2e_mean_s"] == pytest.approx(np.mean(e2e))
    assert m["e2e_p95_s"] == pytest.approx(np.percentile(e2e, 95))
    assert m["queue_mean_s"] == pytest.approx(0.1)


def test_local_fraction_and_kv(records):
    m = summarize(records, sim_time_s=20.0)
    # prefilled rounds: 8; local: s0r1, s1r1, s4r0 -> 3; remote: 5
    assert m["local_prefill_fraction"] == pytest.approx(3 / 8)
    assert m["kv_transfer_mean_s"] == pytest.approx((0.02 + 0.04 + 0.06) / 8)
    assert m["kv_transfer_remote_mean_s"] == pytest.approx((0.02 + 0.04 + 0.06) / 5)


def test_colocated_counts_as_local():
    r = rnd(0, 0.0, 0.1, where="")
    m = summarize([sess("c", [r])], 1.0)
    assert m["local_prefill_fraction"] == 1.0
    r2 = rnd(0, 0.0, 0.1, where="colocated")
    assert summarize([sess("c", [r2])], 1.0)["local_prefill_fraction"] == 1.0


def test_throughput(records):
    m = summarize(records, sim_time_s=20.0)
    assert m["throughput_output_tokens_per_s"] == pytest.approx((7 * 11 + 1) / 20)
    assert m["throughput_input_tokens_per_s"] == pytest.approx(8 * 100 / 20)


def test_session_itl_is_gap_weighted():
    # round 0: 1 gap of 0.09, round 1: 9 gaps of 0.04 -> mean (0.09+0.36)/10 = 0.045 <= 0.05
    s = sess("w", [rnd(0, 0.0, 0.1, out=2, itl=0.09), rnd(1, 2.0, 0.1, out=10, itl=0.04)])
    assert session_attains(s)
    m = summarize([s], 3.0)
    assert m["slo_attainment"] == 1.0
    assert m["round_slo_attainment"] == 0.5          # round 0 alone has mean ITL 0.09


def test_unfinished_session_is_a_miss():
    s = sess("u", [rnd(0, 0.0, 0.1), rnd(1, 2.0, 0.1, finished=False)])
    s.finish_s = None
    m = summarize([s], 3.0)
    assert m["sessions_unfinished"] == 1
    assert m["slo_attainment"] == 0.0
    assert m["round_slo_attainment"] == 0.5


def test_missing_rounds_are_misses():
    s = sess("m", [rnd(0, 0.0, 0.1)], num_rounds=2)
    assert not session_attains(s)


def test_empty_is_none_and_json_ready():
    m = summarize([], 0.0)
    assert m["slo_attainment"] is None
    assert m["ttft_initial_p95_s"] is None
    assert m["itl_mean_s"] is None
    assert m["local_prefill_fraction"] is None
    assert m["goodput_sessions_per_s"] is None
    assert m["sessions_total"] == 0
    assert "null" in json.dumps(m)


def test_no_slo_sessions_excluded():
    m = summarize([sess("n", [rnd(0, 0.0, 0.1)], slo=None)], 1.0)
    assert m["slo_attainment"] is None and m["round_slo_attainment"] is None
    assert m["ttft_initial_mean_s"] == pytest.approx(0.1)


def test_values_are_plain_python(records):
    m = summarize(records, 20.0)
    for k, v in m.items():
        assert v is None or type(v) in (int, float, dict), (k, type(v))


def test_fail_reasons_are_counted_by_kind_before_the_colon():
    from tandem.workload.records import SessionRecord
    recs = [SessionRecord(f"s{i}", 0.0, None, 1, failed=True, finish_s=1.0,
                          fail_reason=f"context exceeds the model's maximum: round {i} needs {130000 + i} tokens")
            for i in range(3)]
    recs.append(SessionRecord("k", 0.0, None, 1, failed=True, finish_s=1.0, fail_reason="KV exceeds the worker's capacity: x"))
    assert summarize(recs, 1.0)["fail_reasons"] == {"KV exceeds the worker's capacity": 1,
                                                     "context exceeds the model's maximum": 3}


def test_records_round_trip_through_jsonl_with_derived_times(tmp_path):
    from tandem.workload.records import dump_records, load_records
    recs = [sess("a", [rnd(0, 0.0, 0.5), rnd(1, 3.0, 0.2, where="local", preempt=1)]),
            sess("b", [rnd(0, 1.0, 2.0, finished=False)], slo=None, failed=True, reason="KV exceeds the worker's capacity: x"),
            sess("c", [], num_rounds=2, failed=True, reason="worker lost")]
    path = tmp_path / "records.jsonl"
    dump_records(recs, path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [d["session_id"] for d in lines] == ["a", "b", "c"]
    r1 = lines[0]["rounds"][1]
    assert r1["ttft_s"] == pytest.approx(0.2) and r1["queue_s"] == pytest.approx(0.1)
    assert r1["itl_mean_s"] == pytest.approx(0.04) and r1["prefill_where"] == "local" and r1["preemptions"] == 1
    assert lines[1]["rounds"][0]["e2e_s"] is None and lines[1]["slo"] is None and not lines[1]["completed"]
    back = load_records(path)
    assert back == recs
    assert json.dumps(summarize(back, 10.0), sort_keys=True) == json.dumps(summarize(recs, 10.0), sort_keys=True)
