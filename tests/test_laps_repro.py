"""benchmarks/laps_repro.py on a tiny grid: the cells run, the metrics follow from the records, the report is written."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "laps_repro.py"
spec = importlib.util.spec_from_file_location("laps_repro", SCRIPT)
lr = importlib.util.module_from_spec(spec)
sys.modules["laps_repro"] = lr                      # dataclasses resolve their module by name
spec.loader.exec_module(lr)

TINY = lr.Grid(models=("qwen2.5-7b",), instances=(2,), concurrency=(3,), policies=("sglang-pd", "laps"),
               clients=(lr.Client.PREFILL,), seeds=(0,), decode_workers=1,
               sessions_per_client=((lr.Client.CHAT, 2), (lr.Client.PREFILL, 4)),
               min_sessions=((lr.Client.CHAT, 1), (lr.Client.PREFILL, 1)))


def test_client_sessions_drop_think_time_and_prefill_clients_ask_one_token():
    chat = lr.client_sessions(lr.Client.CHAT, 5, 0)
    pre = lr.client_sessions(lr.Client.PREFILL, 5, 0)
    assert all(r.tool_s == 0.0 for s in chat + pre for r in s.rounds)
    assert all(r.output_tokens == 1 for s in pre for r in s.rounds)
    assert [r.input_tokens for s in chat for r in s.rounds] == [r.input_tokens for s in pre for r in s.rounds]
    assert any(r.output_tokens > 1 for s in chat for r in s.rounds)
    assert all(s.slo is not None and s.slo.ttft_s == 0.4 for s in chat)


def test_one_cell_metrics_match_its_records():
    cell = lr.Cell("qwen2.5-7b", 2, lr.Client.PREFILL, 3, "laps", 0)
    row = lr.run_cell(cell, TINY)
    assert row["deploy"] == "P:tp1x2,D:tp1x1" and row["sessions"] == 12 and row["sessions_failed"] == 0
    n = TINY.sessions(lr.Client.PREFILL, 3)
    sessions = lr.client_sessions(lr.Client.PREFILL, n, 0)
    res = lr.simulate(sessions, lr.SimConfig(model="qwen2.5-7b", gpu="h200", gpus=3, deploy="P:tp1x2,D:tp1x1",
                                             policy="laps", concurrency=3))
    ttft = [rr.ttft_s for r in res.records for rr in r.rounds]
    assert row["rounds"] == len(ttft) == sum(len(s.rounds) for s in sessions)
    assert row["ttft_mean_s"] == pytest.approx(sum(ttft) / len(ttft))
    assert row["slo_violation_rate"] == pytest.approx(sum(t > 0.4 for t in ttft) / len(ttft))
    window = max(r.arrival_s for r in res.records)
    assert row["window_s"] == window
    done = sum(1 for r in res.records for rr in r.rounds if rr.finish_s <= window)
    assert row["rounds_per_s"] == pytest.approx(done / window)
    assert row["graph_step_share"] is not None and row["itl_mean_s"] is None   # one token: no gaps


def test_main_writes_the_report(tmp_path, capsys):
    out = tmp_path / "laps"
    argv = ["--out", str(out), "--models", "qwen2.5-7b", "--instances", "2", "--concurrency", "2,3",
            "--policies", "sglang-pd,sglang-pd-router,laps", "--clients", "prefill", "--seeds", "0",
            "--decode-workers", "1", "--sessions-per-client", "3", "--jobs", "1", "--no-progress"]
    assert lr.main(argv) == 0
    files = {p.name for p in out.iterdir()}
    assert {"results.json", "table.md", "fig6_prefill.png", "fig7_prefill.png"} <= files
    res = json.loads((out / "results.json").read_text())
    assert len(res["cells"]) == 6 and len(res["runs"]) == 6
    (head,) = res["headline"]
    assert head["concurrency"] == 3 and head["instances"] == 2 and set(head) >= {"vs_pd", "vs_router"}
    laps, pd = head["laps"], head["sglang-pd"]
    assert head["vs_pd"]["ttft_mean_rel"] == pytest.approx(laps["ttft_mean_s"] / pd["ttft_mean_s"] - 1)
    text = (out / "table.md").read_text()
    assert "## Headline\n" in text and "concurrency 3" in text
    assert "report:" in capsys.readouterr().out


def test_main_rejects_unknown_policy(tmp_path):
    with pytest.raises(SystemExit):
        lr.main(["--out", str(tmp_path), "--policies", "nope", "--no-progress"])
