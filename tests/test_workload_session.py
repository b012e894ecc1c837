"""The session JSONL format: parsing, validation messages (FILE:LINE), round trips, speed."""
from __future__ import annotations

import json
import time

import pytest

from tandem.workload.session import (
    SLO,
    Round,
    Session,
    WorkloadError,
    dump_sessions,
    load_sessions,
    parse_session,
    session_to_dict,
)

GOOD = {"session_id": "s0", "arrival_s": 1.5, "rounds": [{"input_tokens": 10, "output_tokens": 2}]}


def write_lines(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


def full_session(sid="gaia-17", arrival=12.5):
    return Session(
        session_id=sid, arrival_s=arrival,
        rounds=[Round(6120, 410, 2.4, [1, 2, 3]), Round(930, 380, 0.8, [1, 2, 3, 4]), Round(1210, 520, 0.0, [9])],
        slo=SLO(1.5, 0.035), block_size=512, model="qwen3-32b",
        messages=[{"role": "user", "content": "hi"}], extra={"source": "unit-test", "tags": [1, 2]},
    )


def test_architecture_example_parses_to_expected_session():
    obj = {"session_id": "gaia-17", "arrival_s": 12.5, "slo": {"ttft_s": 1.5, "itl_s": 0.035},
           "rounds": [{"input_tokens": 6120, "output_tokens": 410, "tool_s": 2.4},
                      {"input_tokens": 930, "output_tokens": 380, "tool_s": 0.8},
                      {"input_tokens": 1210, "output_tokens": 520}]}
    s = parse_session(obj, "x:1")
    assert s == Session("gaia-17", 12.5, [Round(6120, 410, 2.4), Round(930, 380, 0.8), Round(1210, 520, 0.0)],
                        SLO(1.5, 0.035))
    assert s.total_tokens == 6120 + 410 + 930 + 380 + 1210 + 520
    assert isinstance(s.arrival_s, float) and isinstance(s.rounds[2].tool_s, float)


def test_round_trip_dump_then_load_is_identity(tmp_path):
    sessions = [full_session("a", 3.0), Session("b", 0.0, [Round(1, 1)]), full_session("c", 7.25)]
    path = tmp_path / "rt.jsonl"
    dump_sessions(sessions, path)
    loaded = load_sessions(path)
    assert loaded == sorted(sessions, key=lambda s: s.arrival_s)
    dump_sessions(loaded, tmp_path / "rt2.jsonl")
    assert load_sessions(tmp_path / "rt2.jsonl") == loaded
    first_line = json.loads(path.read_text().splitlines()[0])
    assert first_line["session_id"] == "a"  # dump keeps the given order; only loading sorts


def test_session_to_dict_omits_defaults_and_merges_extra():
    assert session_to_dict(Session("b", 0.0, [Round(1, 1)])) == {
        "session_id": "b", "arrival_s": 0.0, "rounds": [{"input_tokens": 1, "output_tokens": 1}]}
    d = session_to_dict(full_session())
    assert d["source"] == "unit-test" and d["block_size"] == 512 and d["rounds"][0]["hash_ids"] == [1, 2, 3]
    assert "tool_s" not in d["rounds"][2]


def test_unknown_top_level_keys_are_kept_in_extra():
    s = parse_session({**GOOD, "dataset": "gaia", "level": 3}, "x:1")
    assert s.extra == {"dataset": "gaia", "level": 3}
    assert parse_session(GOOD, "x:1").extra == {}


def test_sessions_sorted_by_arrival_stably(tmp_path):
    lines = [{**GOOD, "session_id": sid, "arrival_s": t} for sid, t in
             [("late", 5.0), ("tie-1", 1.0), ("early", 0.0), ("tie-2", 1.0)]]
    got = [s.session_id for s in load_sessions(write_lines(tmp_path, lines))]
    assert got == ["early", "tie-1", "tie-2", "late"]


def test_blank_lines_are_skipped_and_line_numbers_still_count_them(tmp_path):
    path = write_lines(tmp_path, ["", json.dumps(GOOD), "   ", "", json.dumps({**GOOD, "session_id": "x", "rounds": []})])
    with pytest.raises(WorkloadError, match=r":5: rounds is empty"):
        load_sessions(path)
    path = write_lines(tmp_path, ["", json.dumps(GOOD), "  "])
    assert [s.session_id for s in load_sessions(path)] == ["s0"]


def r(**kw):
    return {**GOOD, "rounds": [{"input_tokens": 10, "output_tokens": 2, **kw}]}


BAD_LINES = [
    ([1, 2], "a session must be a JSON object"),
    ({"arrival_s": 0, "rounds": GOOD["rounds"]}, "session_id is missing"),
    ({**GOOD, "session_id": 7}, "session_id must be a non-empty string, got int 7"),
    ({**GOOD, "session_id": ""}, "session_id must be a non-empty string"),
    ({"session_id": "a", "rounds": GOOD["rounds"]}, "arrival_s is missing"),
    ({**GOOD, "arrival_s": -1}, "arrival_s must be >= 0, got -1"),
    ({**GOOD, "arrival_s": "3"}, "arrival_s must be a number, got str \"3\""),
    ({**GOOD, "arrival_s": True}, "arrival_s must be a number, got bool True"),
    ("NaN-arrival", "arrival_s must be finite"),
    ({"session_id": "a", "arrival_s": 0}, "rounds is missing"),
    ({**GOOD, "rounds": {}}, "rounds must be a list"),
    ({**GOOD, "rounds": []}, "rounds is empty (a session needs at least one round)"),
    ({**GOOD, "rounds": [5]}, "rounds[0] must be an object, got int 5"),
    ({**GOOD, "rounds": [{"output_tokens": 2}]}, "rounds[0].input_tokens is missing"),
    ({**GOOD, "rounds": [{"input_tokens": 2}]}, "rounds[0].output_tokens is missing"),
    (r(input_tokens=1.5), "rounds[0].input_tokens must be an integer, got float 1.5"),
    (r(input_tokens=0), "rounds[0].input_tokens must be >= 1, got 0"),
    ({**GOOD, "rounds": [GOOD["rounds"][0], {"input_tokens": -1, "output_tokens": 1}]},
     "rounds[1].input_tokens must be >= 0, got -1"),
    (r(output_tokens=0), "rounds[0].output_tokens must be >= 1, got 0"),
    (r(output_tokens=True), "rounds[0].output_tokens must be an integer, got bool True"),
    (r(tool_s=-0.5), "rounds[0].tool_s must be >= 0, got -0.5"),
    ("Infinity-tool", "rounds[0].tool_s must be finite, got inf"),
    (r(tool_s="1"), "rounds[0].tool_s must be a number"),
    (r(tools_s=1.0), "rounds[0] has unknown key 'tools_s'"),
    ({**r(hash_ids=[1, 2]), "block_size": 512, "rounds": [{"input_tokens": 1, "output_tokens": 1, "hash_ids": 3}]},
     "rounds[0].hash_ids must be a list of integers"),
    ({**r(hash_ids=[1, "x"]), "block_size": 512}, "rounds[0].hash_ids[1] must be an integer, got str \"x\""),
    (r(hash_ids=[1, 2]), "block_size is required when rounds carry hash_ids"),
    ({**GOOD, "block_size": 0}, "block_size must be >= 1, got 0"),
    ({**GOOD, "block_size": 16.0}, "block_size must be an integer"),
    ({**GOOD, "slo": 1.0}, "slo must be an object with ttft_s and itl_s"),
    ({**GOOD, "slo": {"ttft_s": 1.0}}, "slo.itl_s is missing"),
    ({**GOOD, "slo": {"ttft_s": 0, "itl_s": 0.1}}, "slo.ttft_s must be > 0, got 0"),
    ({**GOOD, "slo": {"ttft_s": 1, "itl_s": -0.1}}, "slo.itl_s must be > 0"),
    ({**GOOD, "slo": {"ttft_s": 1, "itl_s": 0.1, "tpot_s": 1}}, "slo has unknown key 'tpot_s'"),
    ({**GOOD, "model": 3}, "model must be a string"),
    ({**GOOD, "messages": "hello"}, "messages must be a list"),
]
RAW = {
    "NaN-arrival": '{"session_id": "a", "arrival_s": NaN, "rounds": [{"input_tokens": 1, "output_tokens": 1}]}',
    "Infinity-tool": '{"session_id": "a", "arrival_s": 0, "rounds": [{"input_tokens": 1, "output_tokens": 1, '
                     '"tool_s": Infinity}]}',
}


@pytest.mark.parametrize("bad,what", BAD_LINES, ids=[w for _, w in BAD_LINES])
def test_bad_line_reports_file_and_line_number(tmp_path, bad, what):
    line = RAW[bad] if isinstance(bad, str) else json.dumps(bad)
    path = write_lines(tmp_path, [{**GOOD, "session_id": "ok"}, "", line])
    with pytest.raises(WorkloadError) as e:
        load_sessions(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: "), msg
    assert what in msg, msg
    assert "\n" not in msg


def test_malformed_json_reports_line_and_column(tmp_path):
    path = write_lines(tmp_path, [GOOD, '{"session_id": "b", "arrival_s": 0,'])
    with pytest.raises(WorkloadError, match=r"t\.jsonl:2: malformed JSON: .*\(column \d+\)"):
        load_sessions(path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["zero-bytes", "only-blank-lines"])
def test_empty_file_is_an_error(tmp_path, text):
    path = tmp_path / "e.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=r"e\.jsonl: empty trace \(no sessions\)"):
        load_sessions(path)


def test_duplicate_session_id_names_both_lines(tmp_path):
    path = write_lines(tmp_path, [GOOD, {**GOOD, "session_id": "other"}, {**GOOD, "arrival_s": 9.0}])
    with pytest.raises(WorkloadError, match=r"t\.jsonl:3: duplicate session_id 's0' \(first seen at line 1\)"):
        load_sessions(path)


def test_missing_file_and_directory_and_non_utf8_are_workload_errors(tmp_path):
    with pytest.raises(WorkloadError, match="no such file"):
        load_sessions(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="is a directory"):
        load_sessions(tmp_path)
    bad = tmp_path / "bin.jsonl"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load_sessions(bad)


def test_parse_session_prefixes_errors_with_where():
    with pytest.raises(WorkloadError, match=r"^gen:#4: rounds\[0\]\.output_tokens must be >= 1, got 0$"):
        parse_session(r(output_tokens=0), "gen:#4")


def test_later_rounds_may_append_zero_tokens():
    s = parse_session({**GOOD, "rounds": [{"input_tokens": 5, "output_tokens": 1},
                                          {"input_tokens": 0, "output_tokens": 3}]}, "x")
    assert [x.input_tokens for x in s.rounds] == [5, 0]


def test_dump_refuses_invalid_sessions_and_duplicates(tmp_path):
    with pytest.raises(WorkloadError, match=r"rounds\[0\]\.output_tokens must be >= 1"):
        dump_sessions([Session("a", 0.0, [Round(3, 0)])], tmp_path / "x.jsonl")
    with pytest.raises(WorkloadError, match="arrival_s must be finite"):
        dump_sessions([Session("a", float("nan"), [Round(3, 1)])], tmp_path / "x.jsonl")
    with pytest.raises(WorkloadError, match="duplicate session_id 'a'"):
        dump_sessions([Session("a", 0.0, [Round(3, 1)])] * 2, tmp_path / "x.jsonl")
    with pytest.raises(WorkloadError, match="empty trace"):
        dump_sessions([], tmp_path / "x.jsonl")
    with pytest.raises(WorkloadError, match="collides"):
        dump_sessions([Session("a", 0.0, [Round(3, 1)], extra={"rounds": 1})], tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()


def test_ten_thousand_sessions_load_fast(tmp_path):
    """Validation must cost a small multiple of bare json.loads (a quadratic slip would show); absolute cap too."""
    rounds = [{"input_tokens": 700, "output_tokens": 50, "tool_s": 1.25}] * 4
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(10_000):
            f.write(json.dumps({"session_id": f"s{i}", "arrival_s": i * 0.1, "slo": {"ttft_s": 1, "itl_s": 0.05},
                                "rounds": rounds}) + "\n")

    def best_of_three(fn):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return min(times), out

    bare, _ = best_of_three(lambda: [json.loads(x) for x in path.read_text().splitlines()])
    elapsed, sessions = best_of_three(lambda: load_sessions(path))
    assert len(sessions) == 10_000 and sessions[-1].session_id == "s9999"
    assert elapsed < 8 * bare + 0.2, f"load {elapsed:.2f}s vs bare json {bare:.2f}s"
    assert elapsed < 5.0, f"loading 10k sessions took {elapsed:.2f}s"
