"""benchmarks/optimus_sim.py: the capacity rule, the systems' configs, one run per kind, and a tiny report."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "optimus_sim.py"
spec = importlib.util.spec_from_file_location("optimus_sim", SCRIPT)
om = importlib.util.module_from_spec(spec)
sys.modules["optimus_sim"] = om                     # dataclasses resolve their module by name
spec.loader.exec_module(om)


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


def test_a_tiny_report_is_written(tmp_path):
    """Protects the script end to end on one model and GPU: every run completes its sessions, the report files exist,
    and results.json's headline carries the ratios the table prints."""
    assert om.main(["--models", "sdar-8b", "--gpus", "a100-80g", "--quick", "--sessions", "24", "--arrival-span", "1",
                    "--jobs", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(r["failed"] == 0 for r in data["runs"])
    (head,) = data["headline"]
    assert head["model"] == "sdar-8b" and head["throughput_vs_bd32"] > 0
    for name in ("table.md", "fig8.png", "fig10.png"):
        assert (tmp_path / name).stat().st_size > 0
