"""Experiment sweeps: deployment candidates, the search, improvement summaries, written reports."""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from tandem.bench import experiment as ex
from tandem.bench.experiment import (ExperimentError, ExperimentSpec, Task, TaskResult, deployment_candidates, pool,
                                     preset, reference_rate, relative_improvement, run_experiment, sweep)
from tandem.core.deploy import parse_deploy
from tandem.workload.records import RoundRecord, SessionRecord
from tandem.workload.session import SLO

HAS_SIM = importlib.util.find_spec("tandem.sim.cluster") is not None
needs_sim = pytest.mark.skipif(not HAS_SIM, reason="tandem.sim.cluster is not available yet")


# --------------------------------------------------------------------------- candidates


def test_candidates_llama70b_h20_8gpus():
    dis = deployment_candidates("llama-3.1-70b", "h20", 8, colocated=False)
    assert dis == ["P:tp2x2,D:tp2x2", "P:tp4x1,D:tp4x1", "P:tp2x2,D:tp4x1", "P:tp4x1,D:tp2x2",
                   "P:tp2x1,D:tp2x3", "P:tp2x3,D:tp2x1"]          # tp1 cannot hold 141 GB of weights
    assert deployment_candidates("llama-3.1-70b", "h20", 8, colocated=True) == ["C:tp2x4", "C:tp4x2", "C:tp8x1"]


@pytest.mark.parametrize("model,gpus", [("qwen3-32b", 8), ("qwen3-32b", 32), ("llama-3.1-70b", 16),
                                        ("mixtral-8x7b", 32)])
def test_candidates_use_all_gpus_fit_and_are_capped(model, gpus):
    for colocated in (False, True):
        cands = deployment_candidates(model, "h20", gpus, colocated, cap=12)
        assert 1 <= len(cands) <= 12 and len(set(cands)) == len(cands)
        for c in cands:
            dep = parse_deploy(c)
            assert dep.gpus == gpus and dep.disaggregated == (not colocated)
            ex.check_fits(model, "h20", c)


def test_candidates_cover_parallelism_pairs_before_unbalanced_splits():
    cands = deployment_candidates("llama-3.1-70b", "h20", 32, colocated=False, cap=12)
    pairs = {tuple(g.tp for g in parse_deploy(c).groups) for c in cands}
    assert pairs == {(a, b) for a in (2, 4, 8) for b in (2, 4, 8)}
    assert cands[0] == "P:tp2x8,D:tp2x8"
    # the extra three are the next coarse splits (multiples of 32/8 = 4 prefill GPUs) with more decode
    assert cands[9:] == ["P:tp2x6,D:tp2x10", "P:tp4x3,D:tp4x5", "P:tp8x1,D:tp8x3"]


def test_nothing_fits_gives_no_candidates():
    assert deployment_candidates("llama-3.1-70b", "rtx4090", 1, colocated=True) == []


# --------------------------------------------------------------------------- spec helpers


def test_reference_rate_is_upper_median():
    assert reference_rate(ExperimentSpec(rates=[2.4, 0.8, 1.6])) == 1.6
    assert reference_rate(ExperimentSpec(rates=[0.8, 1.2, 1.6, 2.0])) == 1.6
    assert reference_rate(ExperimentSpec(rates=[1.0], reference_rate=3.0)) == 3.0


def test_presets():
    assert set(ex.PRESETS) == {"demo", "paper", "ablation"}
    paper = ex.PRESETS["paper"]
    assert paper.rates == [0.8, 1.2, 1.6, 2.0, 2.4] and len(paper.workloads) == 4
    assert set(paper.policies) == {"ampd", "dynamo", "vllm", "continuum"}
    abl = ex.PRESETS["ablation"]
    assert abl.workloads == ["dureader", "gaia"] and abl.rates == [2.0]
    assert set(abl.policies) == {"ampd", "ampd-no-pr", "ampd-no-ar-pr"}
    demo = preset("demo", sessions=7, workloads=None)
    assert demo.sessions == 7 and demo.workloads == ["toolbench", "hotpotqa"]
    assert ex.PRESETS["demo"].sessions == 60                  # the preset itself is untouched
    with pytest.raises(ExperimentError):
        preset("nope")


def test_workload_defaults_follow_the_paper():
    spec = ExperimentSpec(model="llama-3.1-70b", gpus={"toolbench": 4}, slos={"gaia": None})
    assert ex.workload_gpus(spec, "dureader") == 16 and ex.workload_gpus(spec, "toolbench") == 4
    assert ex.workload_gpus(spec, "agentic-long") == ex.DEFAULT_GPUS
    assert ex.workload_slo(spec, "toolbench") == SLO(1.0, 0.05)
    assert ex.workload_slo(spec, "gaia") is None


# --------------------------------------------------------------------------- improvement


def _cell(w, r, p, att):
    return {"workload": w, "rate": r, "policy": p, "slo_attainment": att}


def test_relative_improvement():
    cells = [_cell("a", 1, "ampd", 0.6), _cell("a", 1, "dynamo", 0.3),     # +100%
             _cell("a", 2, "ampd", 0.2), _cell("a", 2, "dynamo", 0.4),     # -50%
             _cell("b", 1, "ampd", 0.5), _cell("b", 1, "dynamo", 0.0),     # baseline 0: counted, no ratio
             _cell("b", 2, "ampd", None), _cell("b", 2, "dynamo", 0.1)]    # missing: skipped
    imp = relative_improvement(cells, "dynamo")
    assert imp["cells"] == 3 and imp["cells_baseline_positive"] == 2
    assert imp["mean_relative_improvement"] == pytest.approx(0.25)
    assert imp["max_relative_improvement"] == pytest.approx(1.0)
    assert imp["cells_ampd_at_least_baseline"] == 2
    assert "67.29" in imp["paper"]
    assert relative_improvement(cells, "vllm") is None


# --------------------------------------------------------------------------- search with a fake simulator


def _records(att: float, ttft: float, n: int = 10) -> list[SessionRecord]:
    slo = SLO(1.0, 0.05)
    out = []
    for i in range(n):
        t = ttft if i < round(att * n) else 1.5 + ttft      # misses keep the TTFT order for ties
        r = RoundRecord(0, float(i), 100, prefill_where="remote", prefill_start_s=float(i), first_token_s=i + t,
                        finish_s=i + t + 0.3, output_tokens=11, itl_sum_s=0.3, itl_count=10, itl_max_s=0.03)
        out.append(SessionRecord(f"s{i}", float(i), slo, 1, rounds=[r], finish_s=i + t + 0.3))
    return out


@pytest.fixture
def fake_sim(monkeypatch):
    """run_task stand-in: attainment by deployment, ties broken by TTFT; counts calls."""
    quality = {"P:tp2x2,D:tp2x2": (0.5, 0.9), "P:tp4x1,D:tp4x1": (0.8, 0.7), "P:tp2x2,D:tp4x1": (0.8, 0.4),
               "C:tp2x4": (0.2, 0.5), "C:tp4x2": (0.3, 0.5), "C:tp8x1": (0.3, 0.6)}
    calls: list[Task] = []

    def run_task(task: Task) -> TaskResult:
        calls.append(task)
        att, ttft = quality.get(task.deploy, (0.0, 0.9))
        att = max(att - 0.1 * task.rate, 0.0)
        return TaskResult(task, records=_records(att, ttft), sim_time_s=20.0, wall_s=0.01, events=5,
                          deployment=task.deploy)

    monkeypatch.setattr(pool, "run_task", run_task)
    monkeypatch.setattr(sweep, "validate_spec", lambda spec: None)
    return calls


def test_search_picks_best_and_reuses_reference_run(fake_sim, tmp_path):
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd", "ampd-no-pr", "vllm"], rates=[1.0, 2.0],
                          sessions=10, share_deploy={"ampd-no-pr": "ampd"}, search_all_rates=False)
    res = run_experiment(spec, tmp_path, progress=False)
    chosen = {d["policy"]: d for d in res["deployments"]}
    # P:tp4x1,D:tp4x1 and P:tp2x2,D:tp4x1 tie on attainment; the lower TTFT p95 wins
    assert chosen["ampd"]["deploy"] == "P:tp2x2,D:tp4x1" and chosen["ampd"]["source"] == "search"
    assert chosen["ampd-no-pr"]["deploy"] == "P:tp2x2,D:tp4x1" and chosen["ampd-no-pr"]["source"] == "shared:ampd"
    assert chosen["vllm"]["deploy"] == "C:tp4x2"            # tie at 0.3 -> lower TTFT p95
    assert res["reference_rate"] == 2.0
    # search: 6 + 3 candidates at 2.0; runs: ampd 1.0 (2.0 reused), vllm 1.0, ampd-no-pr 1.0 and 2.0
    assert len(fake_sim) == 9 + 1 + 1 + 2
    assert len(res["cells"]) == 6
    cell = next(c for c in res["cells"] if c["policy"] == "ampd" and c["rate"] == 1.0)
    assert cell["slo_attainment"] == pytest.approx(0.7)
    assert cell["slo_ttft_s"] == 1.0 and cell["deploy"] == "P:tp2x2,D:tp4x1"
    for name in ("results.json", "table.md", "table.txt", "summary.md", "slo_vs_rate.png", "ablation.png"):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["cells"]) == 6 and saved["improvement"]["vllm"]["cells"] == 2


def test_fixed_deploys_skip_the_search(fake_sim, tmp_path):
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd", "vllm"], rates=[1.0], sessions=10,
                          seeds=[0, 1], deploys={"ampd": "P:tp4x1,D:tp4x1", "toolbench/vllm": "C:tp8x1"})
    res = run_experiment(spec, tmp_path, progress=False)
    assert [d["source"] for d in res["deployments"]] == ["fixed", "fixed"]
    assert len(fake_sim) == 4                                 # 2 policies x 1 rate x 2 seeds
    cell = res["cells"][0]
    assert cell["sessions_total"] == 20 and len(cell["slo_attainment_by_seed"]) == 2
    assert not (tmp_path / "ablation.png").exists()


def test_policy_wide_fixed_deploy_only_for_matching_gpu_count(fake_sim, tmp_path):
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd"], rates=[1.0], sessions=10,
                          gpus={"toolbench": 16}, deploys={"ampd": "P:tp4x1,D:tp4x1"})
    res = run_experiment(spec, tmp_path, progress=False)
    assert res["deployments"][0]["source"] == "search"
    assert parse_deploy(res["deployments"][0]["deploy"]).gpus == 16


def test_failed_candidates_are_skipped(monkeypatch, fake_sim, tmp_path):
    real = pool.run_task

    def flaky(task):
        if task.deploy == "P:tp2x2,D:tp4x1":
            return TaskResult(task, error="ConfigError: nope")
        return real(task)
    monkeypatch.setattr(pool, "run_task", flaky)
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd"], rates=[1.0], sessions=10)
    res = run_experiment(spec, tmp_path, progress=False)
    d = res["deployments"][0]
    assert d["deploy"] == "P:tp4x1,D:tp4x1"
    assert any(c.get("error") for c in d["candidates"])


# --------------------------------------------------------------------------- with the real simulator


@needs_sim
def test_validate_spec_rejects_bad_input():
    for bad in (dict(workloads=["nope"]), dict(policies=["nope"]), dict(rates=[0.0]), dict(rates=[]),
                dict(sessions=0), dict(jobs=0), dict(sim={"no_such_knob": 1}), dict(seeds=[-1]),
                dict(share_deploy={"vllm": "ampd"}, policies=["ampd", "vllm"])):
        with pytest.raises(ExperimentError):
            ex.validate_spec(ExperimentSpec(**bad))


@needs_sim
def test_tiny_real_experiment_in_two_processes(tmp_path):
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd", "vllm"], rates=[0.5, 1.0], sessions=4,
                          max_candidates=2, jobs=2)
    res = run_experiment(spec, tmp_path, progress=False)
    assert len(res["cells"]) == 4
    for c in res["cells"]:
        assert c["sessions_completed"] + c["sessions_failed"] == 4
        assert c["events"] > 0
    assert all(len(d["candidates"]) == 2 for d in res["deployments"])
    assert (tmp_path / "slo_vs_rate.png").stat().st_size > 1000


@needs_sim
def test_tiny_real_ablation(tmp_path):
    spec = dataclasses.replace(ex.PRESETS["ablation"], workloads=["dureader"], sessions=3, max_candidates=1)
    res = run_experiment(spec, tmp_path, progress=False)
    deploys = {d["deploy"] for d in res["deployments"]}
    assert len(deploys) == 1                                  # the variants run on AMPD's deployment
    assert (tmp_path / "ablation.png").is_file()
    assert set(res["improvement"]) == {"ampd-no-pr", "ampd-no-ar-pr"}


def test_search_over_all_rates_scores_mean_attainment_and_reuses_every_winner_run(fake_sim, tmp_path):
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd", "vllm"], rates=[1.0, 2.0], sessions=10)
    res = run_experiment(spec, tmp_path, progress=False)
    chosen = {d["policy"]: d["deploy"] for d in res["deployments"]}
    assert chosen == {"ampd": "P:tp2x2,D:tp4x1", "vllm": "C:tp4x2"}
    # every candidate at both rates (6 + 3) x 2, and nothing re-run afterwards
    assert len(fake_sim) == (6 + 3) * 2
    cand = next(c for d in res["deployments"] if d["policy"] == "ampd" for c in d["candidates"]
                if c["deploy"] == "P:tp2x2,D:tp4x1")
    assert cand["slo_attainment"] == pytest.approx((0.7 + 0.6) / 2)


def test_deploy_per_rate_gives_each_rate_its_own_best_candidate_and_shares_it(monkeypatch, tmp_path):
    # P:tp4x1,D:tp4x1 is best at low load, P:tp2x2,D:tp4x1 at high load; the others never win
    def run_task(task: Task) -> TaskResult:
        att = {"P:tp4x1,D:tp4x1": 0.9 if task.rate < 1.5 else 0.2, "P:tp2x2,D:tp4x1": 0.6}.get(task.deploy, 0.1)
        assert task.prefill_basis == "prompt"
        return TaskResult(task, records=_records(att, 0.5), sim_time_s=20.0, wall_s=0.01, events=5,
                          deployment=task.deploy)

    monkeypatch.setattr(pool, "run_task", run_task)
    monkeypatch.setattr(sweep, "validate_spec", lambda spec: None)
    spec = ExperimentSpec(workloads=["toolbench"], policies=["ampd", "ampd-no-pr"], rates=[1.0, 2.0], sessions=10,
                          share_deploy={"ampd-no-pr": "ampd"}, deploy_per_rate=True, prefill_basis="prompt")
    res = run_experiment(spec, tmp_path, progress=False)
    by = {(c["policy"], c["rate"]): (c["deploy"], c["slo_attainment"]) for c in res["cells"]}
    assert by["ampd", 1.0] == ("P:tp4x1,D:tp4x1", pytest.approx(0.9))
    assert by["ampd", 2.0] == ("P:tp2x2,D:tp4x1", pytest.approx(0.6))
    assert by["ampd-no-pr", 1.0][0] == "P:tp4x1,D:tp4x1" and by["ampd-no-pr", 2.0][0] == "P:tp2x2,D:tp4x1"
    d = next(d for d in res["deployments"] if d["policy"] == "ampd")
    assert d["deploy_by_rate"] == {"1": "P:tp4x1,D:tp4x1", "2": "P:tp2x2,D:tp4x1"}
    summary = (tmp_path / "summary.md").read_text()
    assert "1: P:tp4x1,D:tp4x1; 2: P:tp2x2,D:tp4x1" in summary and "read as: prompt" in summary
    # the report names its step costs: the spec's simulator settings, else the default (derived for the H20)
    from tandem.perf.measured.source import available
    if available():
        assert "- step costs: derived (vllm, h20 from h100_sxm)" in summary
    res = run_experiment(dataclasses.replace(spec, sim={"cost_model": "roofline"}), tmp_path / "roof", progress=False)
    assert "- step costs: roofline" in (tmp_path / "roof" / "summary.md").read_text()


@needs_sim
def test_validate_spec_rejects_bad_prefill_basis_and_per_rate_without_all_rates():
    with pytest.raises(ExperimentError, match="prefill_basis must be one of input, prompt"):
        ex.validate_spec(ExperimentSpec(prefill_basis="history"))
    with pytest.raises(ExperimentError, match="deploy_per_rate needs search_all_rates"):
        ex.validate_spec(ExperimentSpec(deploy_per_rate=True, search_all_rates=False))
