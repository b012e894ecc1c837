"""Loaders of the shared public traces: row counts, known values, timestamps, error paths."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.workload import traces
from tandem.workload.session import WorkloadError, dump_sessions, load_sessions
from tandem.workload.traces import (
    load_azure,
    load_mooncake,
    load_sharegpt,
    load_trace,
    trace_path,
    traces_dir,
)

ROWS = {"azure-conv": 19_366, "azure-code": 8_819, "mooncake": 3_993, "sharegpt": 30_731}


@pytest.fixture(scope="module")
def loaded():
    return {name: load_trace(name) for name in ROWS}


@pytest.mark.parametrize("name", ROWS)
def test_trace_row_counts_match_readme(loaded, name):
    sessions = loaded[name]
    assert len(sessions) == ROWS[name]
    assert all(len(s.rounds) == 1 for s in sessions)
    assert len({s.session_id for s in sessions}) == ROWS[name]
    assert sessions[0].session_id == f"{name}-0"


@pytest.mark.parametrize("name", ROWS)
def test_trace_arrivals_start_at_zero_or_later_and_never_go_back(loaded, name):
    t = np.array([s.arrival_s for s in loaded[name]])
    assert t[0] >= 0.0 and np.all(np.diff(t) >= 0)
    assert all(s.rounds[0].input_tokens >= 1 and s.rounds[0].output_tokens >= 1 for s in loaded[name])


def test_azure_conv_first_rows_and_seven_digit_fractional_seconds(loaded):
    s = loaded["azure-conv"]
    assert (s[0].arrival_s, s[0].rounds[0].input_tokens, s[0].rounds[0].output_tokens) == (0.0, 374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900, all seven fractional digits kept
    assert s[1].arrival_s == pytest.approx(4.3145790, abs=1e-9)
    assert (s[1].rounds[0].input_tokens, s[1].rounds[0].output_tokens) == (396, 109)
    assert s[-1].arrival_s == pytest.approx(3501.721937, abs=1e-6)  # one hour, as the README says


def test_azure_code_first_rows(loaded):
    s = loaded["azure-code"]
    assert (s[0].rounds[0].input_tokens, s[0].rounds[0].output_tokens) == (4808, 10)
    assert s[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert s[-1].arrival_s == pytest.approx(3435.948056, abs=1e-6)


def test_mooncake_first_row_ms_to_seconds_and_hash_ids_kept(loaded):
    s = loaded["mooncake"]
    first = s[0]
    assert (first.arrival_s, first.rounds[0].input_tokens, first.rounds[0].output_tokens) == (0.0, 40160, 6)
    assert first.block_size == 512
    assert first.rounds[0].hash_ids[:3] == [0, 1, 2] and len(first.rounds[0].hash_ids) == 79
    assert s[2].arrival_s == pytest.approx(0.040)  # timestamp 40 ms
    assert s[-1].arrival_s == pytest.approx(1022.025)
    assert all(len(x.rounds[0].hash_ids) == math.ceil(x.rounds[0].input_tokens / 512) for x in s)


def test_sharegpt_lengths_with_seeded_poisson_arrivals(loaded):
    s = loaded["sharegpt"]
    assert (s[0].rounds[0].input_tokens, s[0].rounds[0].output_tokens) == (74, 918)
    assert (s[1].rounds[0].input_tokens, s[1].rounds[0].output_tokens) == (290, 905)
    assert len(s) / s[-1].arrival_s == pytest.approx(1.0, rel=0.03)  # default rate 1/s
    again = load_sharegpt(limit=100)
    assert [x.arrival_s for x in again] == [x.arrival_s for x in s[:100]]
    fast = load_sharegpt(limit=5000, rate=20.0, seed=3)
    assert len(fast) / fast[-1].arrival_s == pytest.approx(20.0, rel=0.05)
    assert [x.arrival_s for x in load_sharegpt(limit=10, seed=4)] != [x.arrival_s for x in again[:10]]


def test_limit_takes_the_first_rows():
    assert [s.rounds[0].input_tokens for s in load_azure("conv", limit=2)] == [374, 396]
    assert len(load_mooncake(limit=7)) == 7
    assert len(load_trace("azure-code", limit=1)) == 1


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_bad_limit_is_a_workload_error(bad):
    with pytest.raises(WorkloadError, match="limit must be None or an integer >= 1"):
        load_azure("conv", limit=bad)


def test_load_trace_rejects_unknown_names_and_options():
    with pytest.raises(WorkloadError, match="unknown trace 'azure'.*azure-conv, azure-code, mooncake, sharegpt"):
        load_trace("azure")
    with pytest.raises(WorkloadError, match="takes options limit; got unknown rate"):
        load_trace("mooncake", rate=2.0)
    with pytest.raises(WorkloadError, match="kind must be 'conv' or 'code'"):
        load_azure("chat")
    with pytest.raises(WorkloadError, match="arrival rate must be > 0"):
        load_sharegpt(limit=5, rate=0)


def test_traces_dir_honours_env_var_and_reports_missing_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_TRACES_DIR", raising=False)
    assert (traces_dir() / "README.md").is_file()
    monkeypatch.setenv("TANDEM_TRACES_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(WorkloadError, match="TANDEM_TRACES_DIR=.*is not a directory"):
        traces_dir()
    monkeypatch.setenv("TANDEM_TRACES_DIR", str(tmp_path))
    assert traces_dir() == tmp_path
    with pytest.raises(WorkloadError, match="trace file .*mooncake_synthetic_trace.jsonl not found"):
        load_mooncake()


def test_traces_dir_without_env_or_shared_folder_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("TANDEM_TRACES_DIR", raising=False)
    fake = tmp_path / "repo" / "tandem" / "workload" / "traces.py"
    monkeypatch.setattr(traces, "__file__", str(fake))
    with pytest.raises(WorkloadError, match="not found; set TANDEM_TRACES_DIR"):
        traces_dir()


def _fake_dir(monkeypatch, tmp_path, name, text):
    monkeypatch.setenv("TANDEM_TRACES_DIR", str(tmp_path))
    (tmp_path / traces.TRACE_FILES[name]).write_text(text)


def test_malformed_azure_row_reports_line(monkeypatch, tmp_path):
    _fake_dir(monkeypatch, tmp_path, "azure-conv",
              "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
              "2023-11-16 18:15:47.0000000,abc,44\n")
    with pytest.raises(WorkloadError, match=r"AzureLLMInferenceTrace_conv_2023\.csv:3: ContextTokens must be an integer"):
        load_azure("conv")
    _fake_dir(monkeypatch, tmp_path, "azure-conv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,0\n")
    with pytest.raises(WorkloadError, match=r":2: GeneratedTokens must be >= 1, got 0"):
        load_azure("conv")
    _fake_dir(monkeypatch, tmp_path, "azure-conv", "time,in,out\n1,2,3\n")
    with pytest.raises(WorkloadError, match=r":1: expected header TIMESTAMP,ContextTokens,GeneratedTokens"):
        load_azure("conv")
    _fake_dir(monkeypatch, tmp_path, "azure-conv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(WorkloadError, match="unparsable TIMESTAMP"):
        load_azure("conv")


def test_malformed_mooncake_line_reports_line(monkeypatch, tmp_path):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    _fake_dir(monkeypatch, tmp_path, "mooncake", good + "\n{oops\n")
    with pytest.raises(WorkloadError, match=r"mooncake_synthetic_trace\.jsonl:2: malformed JSON"):
        load_mooncake()
    _fake_dir(monkeypatch, tmp_path, "mooncake", good + '\n{"timestamp": 5}\n')
    with pytest.raises(WorkloadError, match=r":2: missing field 'input_length'"):
        load_mooncake()
    _fake_dir(monkeypatch, tmp_path, "mooncake", good.replace('"output_length": 1', '"output_length": 0'))
    with pytest.raises(WorkloadError, match=r":1: need timestamp >= 0, input_length >= 1, output_length >= 1"):
        load_mooncake()


def test_trace_sessions_round_trip_through_the_jsonl_format(loaded, tmp_path):
    path = tmp_path / "mooncake.jsonl"
    dump_sessions(loaded["mooncake"][:200], path)
    assert load_sessions(path) == loaded["mooncake"][:200]


def test_trace_path_names_the_file():
    assert trace_path("azure-code").name == "AzureLLMInferenceTrace_code_2023.csv"
