"""dLLM-Serve in the simulator: the analytic memory model of a diffusion worker
(tandem/perf/dllm_memory.py) against hand-computed numbers for LLaDA-8B, the catalogue entry, the simulator's
knobs (KV pool and token budget from the memory model, LLaDA's one-token-a-step commits) and the simulate flags."""
from __future__ import annotations

import json

import pytest

from tandem.cli.main import main
from tandem.perf.dllm import stretch_model
from tandem.perf.dllm_memory import DllmMemory
from tandem.perf.errors import DoesNotFitError
from tandem.perf.models import get_model
from tandem.sim.cluster import ConfigError, SimConfig, build, dllm_serve_summary, simulate
from tandem.sim.commit import StretchCommit
from tandem.workload.session import Round, Session

GIB = 1 << 30
KV_PER_TOKEN = 2 * 32 * 32 * 128 * 2               # K and V, 32 layers, 32 KV heads of 128, bf16: 0.5 MiB


def test_llada_8b_is_in_the_catalogue_from_its_config_json():
    """GSAI-ML/LLaDA-8B-Instruct: 32 layers, d_model 4096, 32 heads = 32 KV heads of 128, MLP 12288, vocab 126464,
    untied. Per layer 4 x 4096² (attention) + 3 x 4096 x 12288 (MLP) + 2 x 4096 (norms) = 218,112,000; x 32 + 4096
    (final norm) + 2 x 126464 x 4096 (embedding and LM head) = 8,015,581,184 parameters."""
    m = get_model("GSAI-ML/LLaDA-8B-Instruct")
    assert m is get_model("llada-8b") is get_model("llada")
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab) == \
        (32, 4096, 32, 32, 128, 12288, 126464)
    assert m.params == 8_015_581_184
    assert m.kv_bytes_per_token == KV_PER_TOKEN == 524_288


def test_the_memory_model_against_hand_computed_numbers_on_an_rtx_4090():
    """24 GiB x 0.9 = 23,192,823,398.4 B; weights 2 x 8,015,581,184 = 16,031,162,368 B; left for KV and
    activations 7,161,661,030.4 B = 6.67 GiB (dLLM-Serve §6.1: "less than 7GB"). At T = 4000 query tokens:
    the body's peak 4000 x 2 x (2 x 4096 + 3 x 12288) = 360,448,000; the logit phase, monolithic, 4000 x 4096 x 2
    + 4000 x 126464 x 6 = 3,067,904,000; with max_num_logits 2048, 32,768,000 + 2048 x 126464 x 6 = 1,586,757,632.
    Pool with the cap: 7,161,661,030.4 - 1.1 x 1,586,757,632 = 5,416,227,635.2 B = 10,330 positions of 0.5 MiB;
    monolithic 3,786,966,630.4 B = 7,223. A request of 400 + 256 at ρ = 0.5 keeps 328 positions."""
    mem = DllmMemory("llada-8b", "rtx4090")
    assert mem.budget_bytes == pytest.approx(23_192_823_398.4)
    assert mem.weights_bytes == 16_031_162_368
    assert mem.left_after_weights_bytes == pytest.approx(7_161_661_030.4)
    assert mem.left_after_weights_bytes < 7 * GIB
    assert mem.body_bytes(4000) == 360_448_000
    assert mem.activation_peak(4000) == 3_067_904_000
    assert mem.activation_peak(4000, 2048) == 1_586_757_632
    assert mem.activation_peak(100, 2048) == mem.activation_peak(100)      # a cap above the rows changes nothing
    assert mem.kv_pool_bytes(4000, 2048) == pytest.approx(5_416_227_635.2)
    assert mem.kv_pool_tokens(4000, 2048) == 10_330
    assert mem.kv_pool_tokens(4000) == 7_223
    assert mem.request_kv_positions(656, 0.5) == 328 and mem.request_kv_bytes(656, 0.5) == 328 * KV_PER_TOKEN
    with pytest.raises(DoesNotFitError, match="nothing left for KV"):
        mem.kv_pool_tokens(16384)                 # 16384 x 126464 x 6 B of logits alone: 11.6 GiB


def test_the_feasible_budget_is_where_the_peak_and_the_reserved_kv_fill_memory():
    """Request-level batching reserving each request's peak: T query tokens need the monolithic peak of T plus ρ·T
    positions of KV. ~1.37 MB a token at ρ = 1 on 6.67 GiB: 5,235 tokens; the L40S (43.2 GiB budget) 22,189."""
    for gpu, rho, logits, want in (("rtx4090", 1.0, None, 5235), ("l40s", 1.0, None, 22189)):
        mem = DllmMemory("llada-8b", gpu)
        t = mem.feasible_batched_tokens(logits, rho)
        assert t == want
        assert mem.kv_pool_bytes(t, logits) >= rho * t * KV_PER_TOKEN
        assert mem.kv_pool_bytes(t + 1, logits) < rho * (t + 1) * KV_PER_TOKEN
    assert DllmMemory("llama-3.1-70b", "rtx4090").feasible_batched_tokens() == 0


def sessions(n=24, prompt=300, gen=64, gap=0.05):
    return [Session(f"s{i}", i * gap, [Round(prompt + 7 * i, gen)]) for i in range(n)]


def cfg(admission, **kw):
    base = dict(dllm_block_length=32, dllm_admission=admission)
    base.update(kw)
    return SimConfig("llada-8b", "rtx4090", 1, "C:tp1x1", "vllm", **base)


def test_the_simulator_sizes_the_pool_and_budget_from_the_memory_model():
    """phase at 4000 tokens, 2048 logits: the 10,330-position pool in 16-token blocks (10,320); static with `auto`:
    the feasible 5,235 tokens and what their monolithic peak leaves (at least 5,235 positions: 5,232 in blocks)."""
    _, workers, _ = build(cfg("phase", colocated_max_num_batched_tokens=4000, max_num_logits=2048))
    assert (workers[0].cfg.max_num_batched_tokens, workers[0].capacity_tokens) == (4000, 10_320)
    _, workers, _ = build(cfg("static", colocated_max_num_batched_tokens=0))
    assert (workers[0].cfg.max_num_batched_tokens, workers[0].capacity_tokens) == (5235, 5232)


def test_a_simulated_run_packs_within_the_budget_and_llada_commits_one_token_a_step():
    """Every session completes in every mode; the packed batch never exceeds the budget; LLaDA-8B's fixed schedule
    commits exactly one token a step; the static baseline defers nothing and runs fewer requests at once than the
    phase-multiplexed worker with the logit cap and ρ = 0.5 (its pool and budget are smaller)."""
    out = {}
    for mode, kw in (("static", dict(colocated_max_num_batched_tokens=0, dllm_delay_step=0)),
                     ("phase", dict(colocated_max_num_batched_tokens=4000, max_num_logits=2048,
                                    dllm_kv_retention=0.5))):
        res = simulate(sessions(), cfg(mode, **kw))
        assert all(r.completed for r in res.records)
        s = dllm_serve_summary(res.workers)
        assert s["dllm_batch_tokens_max"] <= s["dllm_max_num_batched_tokens"]
        assert res.workers[0]["dllm"]["tokens_per_step"] == 1.0
        out[mode] = s
    assert out["static"]["dllm_deferrals"] == 0
    assert out["static"]["dllm_max_running"] < out["phase"]["dllm_max_running"]
    assert 0 < out["phase"]["dllm_refresh_share"] < 1


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="co-located"):
        build(SimConfig("llada-8b", "rtx4090", 2, "P:tp1x1,D:tp1x1", "dynamo", dllm_block_length=32,
                        dllm_admission="phase"))
    with pytest.raises(ConfigError, match="nothing left for KV"):
        build(cfg("phase", colocated_max_num_batched_tokens=20000))
    with pytest.raises(ConfigError, match="max_num_logits"):
        build(cfg("phase", max_num_logits=0))
    with pytest.raises(ConfigError, match="needs a block-diffusion model"):
        build(SimConfig("llada-8b", "rtx4090", 1, "C:tp1x1", "vllm", dllm_admission="phase"))


def test_one_token_a_step_is_the_stretch_model_with_no_stretch():
    commit = StretchCommit(stretch_model(1.0, 0.0), seed=3)
    assert {commit.stretch(f"s{i % 7}") for i in range(500)} == {1}
    m = stretch_model(2.51, 4.19)
    assert m.mean(32) == pytest.approx(2.51, rel=1e-6)


def test_simulate_flags(capsys):
    base = ["simulate", "--workload", "azure-conv", "--sessions", "20", "--rate", "0.5", "--override-arrivals",
            "--model", "llada-8b", "--gpu", "rtx4090", "--deploy", "C:tp1x1", "--policy", "vllm"]
    rc = main(base + ["--dllm-block-length", "32", "--dllm-admission", "phase", "--max-num-logits", "2048",
                      "--dllm-kv-retention", "0.5", "--max-num-batched-tokens", "4000", "--dllm-delay-step", "0",
                      "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["dllm_max_num_batched_tokens"], out["dllm_kv_pool_tokens"]) == (4000, 10320)
    assert out["dllm_batch_tokens_max"] <= 4000 and out["dllm_tokens_per_step"] == 1.0
    rc = main(base + ["--dllm-block-length", "32", "--dllm-admission", "static", "--max-num-batched-tokens", "auto"])
    text = capsys.readouterr().out
    assert rc == 0 and "dLLM-Serve token budget" in text and "5235" in text
    assert main(base + ["--dllm-admission", "phase"]) == 2
    assert "needs a block-diffusion model" in capsys.readouterr().err
    assert main(base + ["--max-num-batched-tokens", "auto"]) == 2
    assert "give --dllm-admission" in capsys.readouterr().err
    assert main(base + ["--dllm-block-length", "32", "--dllm-admission", "phase", "--dllm-kv-retention", "1.5"]) == 2
    assert main(base + ["--dllm-block-length", "32", "--dllm-admission", "phase", "--dllm-commits", "2"]) == 2
