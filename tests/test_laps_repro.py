"""tandem.bench.laps_repro and its report on a tiny grid: the cells run, the metrics follow from the records, the
seeds' means and the headline follow from the cells, the report is written; benchmarks/laps_repro.py's command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench import laps_repro as lr
from tandem.bench.laps_report import headline_md, table_md, write_report
from tandem.sim.cluster import SimConfig, simulate

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "laps_repro.py"
META = {"command": "python benchmarks/laps_repro.py", "machine": "m", "date": "d", "wall_s": 1.0, "commit": "c"}

TINY = lr.Grid(models=("qwen2.5-7b",), instances=(2,), concurrency=(3,), policies=("sglang-pd", "laps"),
               clients=(lr.Client.PREFILL,), seeds=(0,), decode_workers=1,
               sessions_per_client=((lr.Client.CHAT, 2), (lr.Client.PREFILL, 4)),
               min_sessions=((lr.Client.CHAT, 1), (lr.Client.PREFILL, 1)))


def run_script(argv: list[str]) -> subprocess.CompletedProcess:
    """benchmarks/laps_repro.py in its own process, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)


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
    res = simulate(sessions, SimConfig(model="qwen2.5-7b", gpu="h200", gpus=3, deploy="P:tp1x2,D:tp1x1",
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


def test_seeds_are_averaged_and_counts_summed():
    """Protects aggregate(): one row per cell without its seed, metrics the seeds' mean, counts their sum."""
    base = {"model": "m", "instances": 1, "client": "chat", "concurrency": 4, "policy": "laps", "deploy": "d",
            "slo_ttft_s": 0.4, "sessions_failed": 0, "preemptions": 1, "wall_s": 1.0}
    metrics = dict.fromkeys(lr.AVERAGED)
    rows = [{**base, **metrics, "seed": 0, "sessions": 10, "rounds": 30, "ttft_mean_s": 0.1, "rounds_per_s": 2.0},
            {**base, **metrics, "seed": 1, "sessions": 12, "rounds": 36, "ttft_mean_s": 0.3, "rounds_per_s": None}]
    (a,) = lr.aggregate(rows)
    assert a["seeds"] == [0, 1] and (a["sessions"], a["rounds"], a["preemptions"]) == (22, 66, 2)
    assert a["ttft_mean_s"] == pytest.approx(0.2) and a["rounds_per_s"] == 2.0 and a["itl_mean_s"] is None


def test_the_report_holds_the_headline_and_every_cell(tmp_path):
    """Protects the report: every (concurrency, policy) cell is run and written, the headline compares LAPS at the
    largest concurrency with the baselines as relative changes, and the markdown rows carry those numbers."""
    grid = lr.Grid(models=("qwen2.5-7b",), instances=(2,), concurrency=(2, 3),
                   policies=("sglang-pd", "sglang-pd-router", "laps"), clients=(lr.Client.PREFILL,), seeds=(0,),
                   decode_workers=1, sessions_per_client=tuple((c, 3) for c in lr.Client),
                   min_sessions=tuple((c, 1) for c in lr.Client))
    rows = lr.run_grid(grid, 1, progress=False)
    assert [(r["concurrency"], r["policy"]) for r in rows] == [
        (2, "sglang-pd"), (2, "sglang-pd-router"), (2, "laps"), (3, "sglang-pd"), (3, "sglang-pd-router"), (3, "laps")]
    out = tmp_path / "laps"
    result = write_report(rows, grid, out, META)
    assert result["files"] == ["results.json", "table.md", "fig6_prefill.png", "fig7_prefill.png"]
    assert all((out / f).stat().st_size > 0 for f in result["files"])
    assert json.loads((out / "results.json").read_text())["headline"] == result["headline"]
    assert len(result["cells"]) == 6 and result["runs"] == rows
    (head,) = result["headline"]
    assert (head["model"], head["instances"], head["client"], head["concurrency"]) == ("qwen2.5-7b", 2, "prefill", 3)
    laps, pd = head["laps"], head["sglang-pd"]
    assert head["vs_pd"]["ttft_mean_rel"] == pytest.approx(laps["ttft_mean_s"] / pd["ttft_mean_s"] - 1)
    assert head["vs_router"]["slo_violation_points"] == pytest.approx(
        laps["slo_violation_rate"] - head["sglang-pd-router"]["slo_violation_rate"])
    assert "vs_vllm_pd" not in head                                    # vllm-pd is not in the grid
    md = headline_md(result["headline"])
    assert (f"| laps | {100 * laps['slo_violation_rate']:.1f}% | {1e3 * laps['ttft_mean_s']:.0f} | "
            f"{1e3 * laps['ttft_p90_s']:.0f} | {laps['rounds_per_s']:.2f} |") in md
    assert f"| SGLang PD (round robin) | {100 * head['vs_pd']['slo_violation_points']:+.1f} |" in md
    table = (out / "table.md").read_text()
    assert table == table_md(result["cells"], grid, result["headline"], META) and md in table
    cell = lr.find_cell(result["cells"], concurrency=2, policy="sglang-pd")
    assert f"| sglang-pd | {cell['rounds_per_s']:.2f} | {1e3 * cell['ttft_mean_s']:.0f} |" in table


def test_the_script_runs_a_narrowed_grid_and_rejects_an_unknown_policy(tmp_path):
    """Protects the command line: the narrowing flags make the grid, the report lands in --out; a policy outside
    the presets is an argument error (exit 2) before anything runs."""
    out = tmp_path / "laps"
    p = run_script(["--out", str(out), "--models", "qwen2.5-7b", "--instances", "2", "--concurrency", "3",
                    "--policies", "sglang-pd,laps", "--clients", "prefill", "--seeds", "0", "--decode-workers", "1",
                    "--sessions-per-client", "3", "--jobs", "1", "--no-progress", "--no-plots"])
    assert p.returncode == 0, p.stderr
    res = json.loads((out / "results.json").read_text())
    assert [(c["concurrency"], c["policy"], c["sessions"]) for c in res["cells"]] == [(3, "sglang-pd", 9),
                                                                                   (3, "laps", 9)]
    assert res["files"] == ["results.json", "table.md"]
    assert p.stdout.splitlines()[-1].startswith(f"report: {out}/ (results.json, table.md) — 2 simulations in ")
    bad = run_script(["--out", str(tmp_path / "bad"), "--policies", "nope", "--no-progress"])
    assert bad.returncode == 2 and "unknown policy 'nope'" in bad.stderr and not (tmp_path / "bad").exists()
