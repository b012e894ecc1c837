"""tandem.bench.optimus_sim and its report: the capacity rule, the systems' configs, the runs planned, the headline's
ratios, a tiny report; benchmarks/optimus_sim.py's command line end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench import optimus_sim as om
from tandem.bench.optimus_report import write_report

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "optimus_sim.py"
META = {"command": "python benchmarks/optimus_sim.py", "machine": "m", "date": "d", "wall_s": 1.0, "commit": "c"}


def row(rate, tpot, ttft=0.1):
    return {"rate": rate, "tpot_p90_s": tpot, "ttft_p90_s": ttft}


def test_capacity_is_where_the_worse_of_tpot_and_ttft_crosses_its_bound():
    """Protects the capacity rule: TPOT 40 -> 60 ms between 2 and 4 req/s crosses 50 ms at 3.0; a TTFT that reaches
    the 5 s bound first (2.5 -> 7.5 s, ratio 0.5 -> 1.5) crosses at 3.0 as well; within both everywhere: the last
    rate (a lower bound); over at the first rate: None."""
    assert om.capacity([row(2, 0.040), row(4, 0.060)]) == pytest.approx(3.0)
    assert om.capacity([row(2, 0.010, 2.5), row(4, 0.020, 7.5)]) == pytest.approx(3.0)
    assert om.capacity([row(1, 0.01), row(8, 0.02)]) == 8
    assert om.capacity([row(1, 0.09), row(8, 0.2)]) is None


def test_each_system_maps_to_its_model_and_chunk():
    """Protects the comparison: AR runs the base model without diffusion; bd32 plain block diffusion; cN a fixed
    window; elastic Optimus; all in blocks of 32 on the diffusion model."""
    ar = om.sim_config(om.Run("sdar-8b", "a100-80g", "ar", rate=1.0))
    assert (ar.model, ar.dllm_block_length) == ("qwen3-8b", 0)
    assert om.sim_config(om.Run("llada2.0-16b", "h100", "ar", batch=4)).model == "ling-2.0-16b"
    for system, chunk in (("bd32", "block"), ("c8", "8"), ("elastic", "elastic")):
        cfg = om.sim_config(om.Run("sdar-8b", "a100-80g", system, batch=2))
        assert (cfg.model, cfg.dllm_block_length, cfg.dllm_chunk, cfg.concurrency) == ("sdar-8b", 32, chunk, 2)


def test_runs_are_sized_by_clients_and_arrival_span_largest_batch_first():
    """Protects the run plan: closed loops send max(per_client x b, closed) requests, a rate point max(fewest,
    rate x span) capped at MAX_OPEN_REQUESTS; every system once per point; the largest batch runs first."""
    runs = om.plan_runs(["sdar-8b"], ["a100-80g"], (1, 64), (1, 100), per_client=4, closed=32, fewest=50, span_s=10,
                        cost_model="roofline")
    assert len(runs) == 4 * len(om.SYSTEMS) and {r.cost_model for r in runs} == {"roofline"}
    assert [(r.batch, r.sessions) for r in runs[:len(om.SYSTEMS)]] == [(64, 256)] * len(om.SYSTEMS)
    assert [r.system for r in runs[:len(om.SYSTEMS)]] == list(om.SYSTEMS)
    assert {(r.batch, r.rate, r.sessions) for r in runs} == {(64, None, 256), (1, None, 32), (None, 1, 50),
                                                              (None, 100, 1000)}
    big = om.plan_runs(["sdar-8b"], ["h100"], (), (128,))
    assert {r.sessions for r in big} == {om.MAX_OPEN_REQUESTS}


def test_the_headline_ratios_follow_from_the_rows():
    """Protects summarize(): elastic's throughput over AR and BD32 is the geometric mean over batch sizes, the
    capacities follow the capacity rule, the best fixed chunk is the highest capacity among cN."""
    def at(system, batch=None, rate=None, thr=None, tpot=None):
        return {"model": "sdar-8b", "gpu": "a100-80g", "system": system, "batch": batch, "rate": rate,
                "output_tokens_per_s": thr, "tpot_p90_s": tpot, "ttft_p90_s": 0.1}
    rows = [at("ar", 1, thr=100), at("ar", 2, thr=200), at("bd32", 1, thr=200), at("bd32", 2, thr=200),
            at("elastic", 1, thr=400), at("elastic", 2, thr=800),
            at("ar", rate=1, tpot=0.04), at("ar", rate=2, tpot=0.06), at("bd32", rate=1, tpot=0.02),
            at("bd32", rate=2, tpot=0.03), at("elastic", rate=1, tpot=0.02), at("elastic", rate=2, tpot=0.03),
            at("c4", rate=1, tpot=0.04), at("c4", rate=2, tpot=0.06), at("c8", rate=1, tpot=0.06)]
    (h,) = om.summarize(rows, ["sdar-8b"], ["a100-80g"])
    assert h["throughput_vs_ar"] == pytest.approx(4.0) and h["throughput_vs_bd32"] == pytest.approx(8 ** 0.5)
    assert h["capacity"] == {"ar": pytest.approx(1.5), "bd32": 2, "c4": pytest.approx(1.5), "c8": None,
                             "c16": None, "c32": None, "elastic": 2, "elastic-paper": None}
    assert h["best_fixed"] == "c4" and h["elastic_vs_best_fixed"] == pytest.approx(1 / 3)
    assert h["capacity_vs_ar"] == pytest.approx(4 / 3) and h["capacity_vs_bd32"] == 1.0


def test_a_tiny_report_holds_every_run(tmp_path):
    """Protects the report: every run completes its sessions, the table's rows are the runs' numbers, results.json
    holds the headline and the runs, and both plots are written."""
    runs = om.plan_runs(["sdar-8b"], ["a100-80g"], (1, 8), (1, 4), per_client=2, closed=8, fewest=8, span_s=2)
    rows = [om.simulate_run(r) for r in runs]
    assert all(r["failed"] == 0 for r in rows) and sum(r["sessions"] for r in rows) == sum(r.sessions for r in runs)
    heads = om.summarize(rows, ["sdar-8b"], ["a100-80g"])
    assert write_report(rows, heads, META, (1, 8), (1, 4), tmp_path) == ["fig8.png", "fig10.png"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data == {"meta": META, "headline": heads, "runs": rows}
    md = (tmp_path / "table.md").read_text()
    thr = {(r["system"], r["batch"]): r["output_tokens_per_s"] for r in rows if r["batch"]}
    assert f"| elastic | {thr['elastic', 1]:.0f} | {thr['elastic', 8]:.0f} |" in md
    assert f"| sdar-8b | a100-80g | {heads[0]['throughput_vs_ar']:.2f}x | {heads[0]['throughput_vs_bd32']:.2f}x |" in md
    for name in ("fig8.png", "fig10.png"):
        assert (tmp_path / name).stat().st_size > 0


def run_script(argv: list[str]) -> subprocess.CompletedProcess:
    """benchmarks/optimus_sim.py in its own process, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=env)


def test_the_script_runs_the_quick_grid_and_rejects_an_unknown_model(tmp_path):
    """Protects the command line: --quick is SDAR-8B on an A100 at batch sizes 1, 8, 64 and rates 1, 4, 8, 16 (every
    system at each: 56 runs); a model that is not a diffusion model is an argument error (exit 2)."""
    p = run_script(["--quick", "--sessions", "24", "--arrival-span", "1", "--jobs", "1", "--no-progress",
                    "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["runs"]) == 56 and all(r["failed"] == 0 for r in data["runs"])
    assert {(r["batch"], r["rate"]) for r in data["runs"]} == {(1, None), (8, None), (64, None), (None, 1),
                                                                (None, 4), (None, 8), (None, 16)}
    (head,) = data["headline"]
    assert (head["model"], head["gpu"]) == ("sdar-8b", "a100-80g") and head["throughput_vs_bd32"] > 0
    assert p.stdout.startswith(f"report: {tmp_path}/ (table.md, results.json, fig8.png, fig10.png) — 56 simulations")
    bad = run_script(["--models", "qwen3-8b", "--out", str(tmp_path / "bad")])
    assert bad.returncode == 2 and "unknown diffusion model 'qwen3-8b'" in bad.stderr
