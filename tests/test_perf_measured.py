"""The measured cost model: table lookups, interpolation, derived GPUs, fp8, and the fallback without the package."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tandem.perf.costs import choose_cost_model, step_timer
from tandem.perf.measured import source
from tandem.perf.measured.derive import derived_tables, donor_of
from tandem.perf.measured.grid import LogGrid
from tandem.perf.measured.ops import op_tables
from tandem.perf.measured.step import MeasuredStep
from tandem.perf.models import get_model
from tandem.perf.batch_shape import BatchShape
from tandem.perf.roofline import kv_capacity_tokens

pytestmark = pytest.mark.skipif(not source.available(), reason="aiconfigurator-core is not installed")


def test_a_log_grid_returns_its_values_on_the_grid_and_scales_at_constant_utilisation_past_it():
    g = LogGrid.from_points([np.array([1, 2, 4, 1, 2, 4])], np.array([1.0, 2.0, 8.0, 3.0, 2.5, 9.0]), (1.0,))
    # duplicates keep the fastest measurement
    assert g(np.array([1.0, 2.0, 4.0])).tolist() == pytest.approx([1.0, 2.0, 8.0])
    # halfway in log space between 2 (2.0) and 4 (8.0): the geometric mean
    assert float(g(np.sqrt(8.0))) == pytest.approx(4.0)
    # past the last value, latency grows with the axis (exponent 1): 16 is 4x the last measured 4
    assert float(g(16.0)) == pytest.approx(32.0)
    # below the first value, the first value
    assert float(g(0.5)) == pytest.approx(1.0)


def test_a_hole_is_filled_from_its_neighbour_at_constant_utilisation():
    g = LogGrid.from_points([np.array([1, 1, 2]), np.array([1, 2, 1])], np.array([1.0, 2.0, 3.0]), (1.0, 1.0))
    # (2, 2) was never measured: from (2, 1) = 3.0 doubled along the second axis, or (1, 2) = 2.0 doubled
    assert float(g(2.0, 2.0)) in (pytest.approx(6.0), pytest.approx(4.0))


def test_a_gemm_lookup_on_a_measured_shape_is_the_fastest_kernel_measured_for_it():
    ops = op_tables("h100_sxm", "vllm")
    ref = source.find_table("h100_sxm", "gemm", "vllm", "gemm_perf.parquet")
    c = source.read_columns(ref.path, ("gemm_dtype", "m", "n", "k", "latency"))
    sel = (c["gemm_dtype"] == "fp8_block") & (c["m"] == 64) & (c["n"] == 8192) & (c["k"] == 8192)
    assert sel.sum() >= 1
    assert float(ops.gemm("fp8_block")(64, 8192, 8192)) == pytest.approx(c["latency"][sel].min() * 1e-3)
    assert ref.version == "0.24.0"          # the newest vLLM version present


def test_measured_steps_grow_with_their_work_and_decode_is_cheaper_than_prefill():
    s = MeasuredStep("llama-3.1-8b", "h200", 1, "vllm")
    d1, d64 = s.step_time(BatchShape(num_decode=1, decode_ctx_tokens=4096)), \
        s.step_time(BatchShape(num_decode=64, decode_ctx_tokens=64 * 4096))
    p = s.step_time(BatchShape(8192, 8192 * 8193 / 2, 0, 1))
    assert 0 < d1 < d64 < p
    assert s.step_time(BatchShape()) == 0.0
    assert str(s.label) == "measured (vllm, h200_sxm)"


def test_gpus_without_tables_are_derived_from_the_nearest_of_their_architecture_and_labelled_so():
    from tandem.perf.hardware import get_gpu

    assert donor_of(get_gpu("h20")).name == "h100"
    assert donor_of(get_gpu("rtx4090")).name == "l40s"
    s = MeasuredStep("llama-3.1-8b", "h20", 1, "vllm")
    assert str(s.label) == "derived (vllm, h20 from h100_sxm)"
    # a large bf16 GEMM is compute-bound on both: derived time = H100's x the ratio of the bf16 peaks
    d, h = derived_tables("h100", "h20", "vllm").gemm("bfloat16"), op_tables("h100_sxm", "vllm").gemm("bfloat16")
    assert float(d(8192, 8192, 8192)) == pytest.approx(float(h(8192, 8192, 8192)) * 989.4 / 148.0)


def test_fp8_halves_weights_and_kv_and_prices_fp8_gemms():
    bf = get_model("llama-3.1-70b")
    f8 = bf.with_precision("fp8", "fp8")
    assert f8.kv_bytes_per_token * 2 == bf.kv_bytes_per_token
    assert f8.weight_bytes < 0.55 * bf.weight_bytes
    assert kv_capacity_tokens(f8, "h100", 4) > 2 * kv_capacity_tokens(bf, "h100", 4)
    shape = BatchShape(4096, 4096 * 4097 / 2, 0, 1)
    assert MeasuredStep(f8, "h100", 4).step_time(shape) < MeasuredStep(bf, "h100", 4).step_time(shape)
    with pytest.raises(ValueError, match="--quantization must be one of bf16, fp8, fp8_block"):
        bf.with_precision("int3")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of bf16, fp8"):
        bf.with_precision(None, "fp8_block")


def test_without_the_package_measured_fails_in_one_line_and_auto_falls_back_with_a_note(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(source.importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiconfigurator_core" else real(name, *a))
    with pytest.raises(source.MissingCostData, match=r"pip install 'aiconfigurator-core==0.12.0'"):
        choose_cost_model("measured", "h100")
    auto = choose_cost_model("auto", "h100")
    assert auto.model == "roofline" and "aiconfigurator-core" in auto.note
    assert type(step_timer(get_model("qwen3-32b"), "h100", 1, auto)).__name__ == "Roofline"


def test_the_cli_refuses_measured_costs_without_the_package_in_one_line(monkeypatch, capsys):
    from tandem.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(source.importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiconfigurator_core" else real(name, *a))
    rc = main(["simulate", "--model", "qwen3-32b", "--gpu", "h100", "--gpus", "2", "--deploy", "C:tp2x1",
               "--policy", "vllm", "--workload", "toolbench", "--sessions", "2", "--cost-model", "measured"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "pip install 'aiconfigurator-core==0.12.0'" in err[0]


def test_a_silicon_row_becomes_the_closed_loop_simulation_its_benchmark_ran():
    from tandem.bench.silicon import Case, Skipped, read_rows, sessions, to_case

    rows = {r["id"]: r for r in read_rows()}
    c = to_case(rows["2026_04_06_llama_3_1_70b_h200_sxm_trtllm_fp8_agg_8192x1024_c8_tp2_ep1_840"])
    assert isinstance(c, Case)
    assert (c.model, c.gpu, c.deploy, c.concurrency, c.isl, c.osl, c.precision) == \
        ("llama-3.1-70b", "h200", "C:tp2x1", 8, 8192, 1024, "fp8")
    # InferenceX: 10 x c requests from a cold start, lengths uniform in [0.8 L, L]
    assert c.client.name == "inferencex"
    ss = sessions(c)
    assert len(ss) == 80
    assert all(6553 <= s.rounds[0].input_tokens <= 8192 and 819 <= s.rounds[0].output_tokens <= 1024 for s in ss)
    # NVIDIA's gap analysis (aiperf): 20 x c requests of exactly isl and osl tokens
    g = to_case(rows["nvidia_llama_3_1_8b_instruct_fp8_nvidia_llama_3_1_8b_instruct_fp8_h200_sxm_vllm_agg_1000x100_c112_"
                     "tp1_epnone_1"])
    assert (g.client.name, g.concurrency, g.kv_cache_dtype) == ("aiperf", 112, "fp8")
    gs = sessions(g)
    assert len(gs) == 2240 and {(s.rounds[0].input_tokens, s.rounds[0].output_tokens) for s in gs} == {(1000, 100)}
    skipped = [to_case(r) for r in rows.values() if r["system"] == "b200_sxm"][0]
    assert isinstance(skipped, Skipped) and "b200_sxm" in skipped.reason


def test_leave_one_out_scores_measured_cells_from_their_neighbours_only():
    # latency = m^2 on m = 1, 2, 4, 8: log-log linear, so every interior cell is predicted exactly
    g = LogGrid.from_points([np.array([1, 2, 4, 8])], np.array([1.0, 4.0, 16.0, 64.0]), (1.0,))
    assert g.leave_one_out(0).tolist() == pytest.approx([0.0, 0.0])
    # a bent curve: 4's neighbours (2 -> 4, 8 -> 64) predict 16 at 4, against 8 measured: error 1.0
    bent = LogGrid.from_points([np.array([1, 2, 4, 8])], np.array([1.0, 4.0, 8.0, 64.0]), (1.0,))
    assert bent.leave_one_out(0).tolist() == pytest.approx([abs(np.sqrt(8.0) / 4.0 - 1.0), 1.0])
    # a filled hole is not scored, nor a cell whose neighbour is a hole
    holes = LogGrid.from_points([np.array([1, 1, 2, 4]), np.array([1, 2, 1, 1])], np.array([1.0, 2.0, 2.0, 4.0]),
                                (1.0, 1.0))
    assert holes.measured.tolist() == [[True, True], [True, False], [True, False]]
    assert holes.leave_one_out(0).tolist() == pytest.approx([0.0])


def test_mixture_of_experts_layers_are_priced_from_the_expert_tables():
    q = get_model("qwen3-235b-a22b").with_precision("fp8_block")
    s = MeasuredStep(q, "h200", 8, "vllm")
    t = [s.decode_time(b, b * 2000) for b in (1, 8, 64)]
    assert 0 < t[0] <= t[1] <= t[2]
    # Ling/LLaDA2.0: 256 routed experts (top-8) and one shared expert that every token passes through
    ling = get_model("llada2.0-16b")
    assert (ling.experts - ling.shared_experts, ling.experts_per_token - ling.shared_experts) == (256, 8)
    assert MeasuredStep(ling, "h100", 1).decode_time(16, 16 * 1000) > 0


def test_a_gpu_with_tables_can_be_derived_from_another_to_check_the_derivation():
    from tandem.sim.cluster import SimConfig

    cfg = SimConfig("llama-3.1-8b", "h200", 1, "C:tp1x1", "vllm", cost_donor="h100")
    assert str(cfg.cost_choice().label) == "derived (vllm, h200 from h100_sxm)"
    own = MeasuredStep("llama-3.1-8b", "h200", 1)
    derived = MeasuredStep("llama-3.1-8b", "h200", 1, donor="h100")
    shape = BatchShape(num_decode=32, decode_ctx_tokens=32 * 2048)
    assert derived.step_time(shape) != own.step_time(shape)


def test_silicon_rows_take_the_precision_their_checkpoint_runs_at():
    from tandem.bench.silicon import read_rows, to_case

    rows = read_rows()
    bf16 = next(r for r in rows if r["model_path"] == "Qwen/Qwen3-32B" and not r["precision"]
                and r["system"] == "h100_sxm" and r["backend"] == "vllm" and r["mode"] == "agg")
    assert to_case(bf16).precision == "bf16"           # nothing recorded: the checkpoint's own weights
    block = next(r for r in rows if r["model_path"] == "Qwen/Qwen3-235B-A22B-FP8" and r["backend"] == "vllm"
                 and r["gemm_quant_mode"] == "fp8" and r["system"] == "h200_sxm")
    assert to_case(block).precision == "fp8_block"     # Qwen's FP8 checkpoints are block-quantised


def test_a_corrupt_or_implausible_table_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tandem.cli.main import main
    from tandem.perf import costs
    from tandem.perf.measured.ops import clear_caches

    garbage = tmp_path / "gemm_perf.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(source.MissingCostData, match="not a readable parquet table"):
        source.read_columns(garbage, ("m", "latency"))
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"m": [1, 2], "latency": ["fast", "slow"]}), text)
    with pytest.raises(source.MissingCostData, match="latencies must be numbers"):
        source.read_columns(text, ("m", "latency"))
    # a latency that is not a finite positive number is a hole, filled from its neighbours (SGLang's H200
    # quantisation table holds such differences); a table with none usable cannot price anything
    g = LogGrid.from_points([np.array([1, 2, 4])], np.array([1.0, -1.0, 4.0]), (1.0,))
    assert float(g(2.0)) == pytest.approx(2.0) and g.measured.tolist() == [True, False, True]
    with pytest.raises(ValueError, match="without a single positive latency"):
        LogGrid.from_points([np.array([1, 2])], np.array([0.0, np.nan]), (1.0,))
    lacking = tmp_path / "lacking.parquet"
    pq.write_table(pa.table({"m": [1, 2]}), lacking)
    with pytest.raises(source.MissingCostData, match="lacks column"):
        source.read_columns(lacking, ("m", "latency"))

    # the simulator, handed the corrupt GEMM table: one line, no traceback
    real = source.find_table

    def corrupt(system, op, framework, filename):
        ref = real(system, op, framework, filename)
        return source.TableRef(garbage, ref.system, op, framework, ref.version) if op == "gemm" else ref

    clear_caches()
    costs.step_timer.cache_clear()
    costs.routing_costs.cache_clear()
    monkeypatch.setattr(source, "find_table", corrupt)
    monkeypatch.setattr("tandem.perf.measured.ops.find_table", corrupt)
    try:
        rc = main(["simulate", "--model", "qwen3-32b", "--gpu", "h100", "--gpus", "2", "--deploy", "C:tp2x1",
                   "--policy", "vllm", "--workload", "toolbench", "--sessions", "2", "--cost-model", "measured"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc != 0 and len(err) == 1 and "not a readable parquet table" in err[0]
    finally:
        monkeypatch.undo()
        clear_caches()
        costs.step_timer.cache_clear()
        costs.routing_costs.cache_clear()


def test_a_rows_prefill_demand_is_its_prefill_rate_over_the_tables_capacity():
    import dataclasses

    from tandem.bench.silicon import agg_policy, prefill_demand, read_rows, to_case

    rows = {r["id"]: r for r in read_rows()}
    g = to_case(rows["nvidia_llama_3_1_8b_instruct_fp8_nvidia_llama_3_1_8b_instruct_fp8_h200_sxm_vllm_agg_1000x100_c112_"
                     "tp1_epnone_1"])
    step = MeasuredStep(get_model("llama-3.1-8b").with_precision("fp8", "fp8"), "h200", 1, "vllm")
    capacity = 8192 / step.step_time_args(8192, 8192 * 500, 0, 8, 0, 0)
    rate = 112 / ((g.ttft_ms + 99 * g.tpot_ms) / 1e3)
    assert prefill_demand(g) == pytest.approx(rate * 1000 / capacity, rel=1e-12)
    # twice the latency: half the request rate, half the demand
    slow = dataclasses.replace(g, ttft_ms=2 * g.ttft_ms, tpot_ms=2 * g.tpot_ms)
    assert prefill_demand(slow) == pytest.approx(prefill_demand(g) / 2, rel=1e-12)
    assert (agg_policy("sglang"), agg_policy("vllm"), agg_policy("trtllm")) == ("sglang", "vllm", "vllm")


def test_an_mla_step_reads_its_decode_attention_from_the_mla_kernel_table():
    """DeepSeek-V3's decode attention is the framework's measured MLA kernel at the local head count (128 / tp):
    a lookup at a measured cell is the table's latency, and two decode steps that differ only in their context
    differ by the layers times the two cells' difference."""
    from tandem.perf.measured.mla import MLAShape

    m = get_model("deepseek-v3")
    ref = source.find_table("h200_sxm", "mla", "sglang", "generation_mla_perf.parquet")
    c = source.read_columns(ref.path, ("kv_cache_dtype", "num_heads", "batch_size", "step", "latency"))

    def cell(b: int, step: int) -> float:
        sel = (c["kv_cache_dtype"] == "bfloat16") & (c["num_heads"] == 16) & (c["batch_size"] == b) & \
            (c["step"] == step)
        assert sel.sum() >= 1
        return float(c["latency"][sel].min()) * 1e-3

    grid = op_tables("h200_sxm", "sglang").generation_mla(MLAShape.of(m, 8), "bfloat16")
    assert float(grid(64, 4096)) == pytest.approx(cell(64, 4095), rel=1e-9)   # step 4095 attends to 4096
    s = MeasuredStep(m, "h200", 8, "sglang")
    long, short = s.decode_time(64, 64 * 4096), s.decode_time(64, 64 * 2048)
    assert long - short == pytest.approx(61 * (cell(64, 4095) - cell(64, 2047)), rel=1e-6)


def test_vllm_mla_kernels_are_its_module_tables_less_the_projections_priced_from_the_gemm_table():
    """vLLM measured MLA only as whole attention blocks; its kernel plus the projections the step prices from the
    GEMM table gives back the module's latency at a measured cell, so nothing is counted twice."""
    from tandem.perf.measured.mla import MLAShape

    m = get_model("deepseek-v3").with_precision("bf16")
    shape = MLAShape.of(m, 8)
    ref = source.find_table("h200_sxm", "mla", "vllm", "mla_context_module_perf.parquet")
    c = source.read_columns(ref.path, ("kv_cache_dtype", "gemm_type", "num_heads", "batch_size", "isl", "latency"))
    sel = (c["kv_cache_dtype"] == "bfloat16") & (c["gemm_type"] == "bfloat16") & (c["num_heads"] == 16) & \
        (c["batch_size"] == 1) & (c["isl"] == 4096)
    module = float(c["latency"][sel].min()) * 1e-3
    ops = op_tables("h200_sxm", "vllm")
    gemm = ops.gemm("bfloat16")
    kernel = float(ops.context_mla(shape, "bfloat16")(1, 4096))
    assert kernel + float(shape.projections(gemm, 4096) + shape.kv_up(gemm, 4096)) == pytest.approx(module, rel=1e-9)
    assert 0 < kernel < module


def test_expert_parallelism_prices_the_experts_from_the_table_at_their_sharding():
    """An ep8 worker reads the MoE table at moe_tp 1 x moe_ep 8 (TRT-LLM's newest table that measured the shape),
    a tp8 worker at moe_tp 8 x moe_ep 1; nothing else in the step changes, so the two differ by the 58 MoE layers
    times the two measured cells' difference."""
    m = get_model("deepseek-v3")
    ep8, tp8 = MeasuredStep(m, "h200", 8, "trtllm", ep=8), MeasuredStep(m, "h200", 8, "trtllm")
    ops = op_tables("h200_sxm", "trtllm")
    assert ops.sources["moe_perf.parquet"].endswith("/1.3.0rc20/moe_perf.parquet")   # rc23 holds one model only
    ref = source.find_tables("h200_sxm", "moe", "trtllm", "moe_perf.parquet")[1]
    assert ref.version == "1.3.0rc20"
    c = source.read_columns(ref.path, ("moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
                                       "moe_tp_size", "moe_ep_size", "distribution", "latency"))

    def cell(moe_tp: int, moe_ep: int) -> float:
        sel = (c["moe_dtype"] == "fp8_block") & (c["num_tokens"] == 64) & (c["hidden_size"] == 7168) & \
            (c["inter_size"] == 2048) & (c["topk"] == 8) & (c["num_experts"] == 256) & \
            (c["moe_tp_size"] == moe_tp) & (c["moe_ep_size"] == moe_ep) & (c["distribution"] == "balanced")
        assert sel.sum() >= 1
        return float(c["latency"][sel].min()) * 1e-3

    diff = ep8.decode_time(64, 64 * 1000) - tp8.decode_time(64, 64 * 1000)
    assert diff == pytest.approx(58 * (cell(1, 8) - cell(8, 1)), rel=1e-6)
    assert repr(ep8).startswith("MeasuredStep(deepseek-v3, h200, tp8ep8,")
    # derived costs price MLA and EP too (the H200 from the H100's tables)
    d = MeasuredStep(m, "h200", 8, "sglang", donor="h100", ep=8)
    assert str(d.label) == "derived (sglang, h200 from h100_sxm)" and d.decode_time(64, 64 * 1000) > 0


def test_deployments_name_expert_parallelism_and_silicon_rows_use_it():
    """`tp8ep8` shards a worker's experts over 8 of its GPUs (old strings keep their meaning); DeepSeek rows with
    expert parallelism become such deployments, and rows tandem cannot represent say why."""
    from tandem.bench.silicon import Case, Skipped, read_rows, to_case
    from tandem.core.deploy import DeploymentError, parse_deploy

    d = parse_deploy("P:tp8ep8x1,D:tp8ep8x9")
    assert (str(d), d.gpus, d.expert_parallel()) == ("P:tp8ep8x1,D:tp8ep8x9", 80, [8] * 10)
    assert str(parse_deploy("C:tp4x2")) == "C:tp4x2" and parse_deploy("C:tp4x2").expert_parallel() == [1, 1]
    with pytest.raises(DeploymentError, match="divide"):
        parse_deploy("C:tp4ep8x1")
    rows = {r["id"]: r for r in read_rows()}
    c = to_case(rows["dsr1_h200_trtllm_fp8_disagg_1024x1024_c576_cfg303"])
    assert isinstance(c, Case)
    assert (c.model, c.deploy, c.precision, c.concurrency) == ("deepseek-v3", "P:tp8ep8x1,D:tp8ep8x9", "fp8_block", 576)
    agg = to_case(rows["dsr1_h200_sglang_fp8_agg_1024x1024_c4_cfg81"])
    assert (agg.deploy, agg.precision, agg.kv_cache_dtype) == ("C:tp8x1", "fp8_block", "bf16")
    assert to_case(rows["2026_03_25_deepseek_r1_h200_sxm_sglang_fp8_disagg_1024x1024_c1024_tp8_0_ep8_0_882"]) == \
        Skipped("2026_03_25_deepseek_r1_h200_sxm_sglang_fp8_disagg_1024x1024_c1024_tp8_0_ep8_0_882",
                "disaggregated worker counts not recorded (neither columns nor provenance)")
    cross = to_case(rows["2026_03_25_deepseek_r1_h100_sxm_trtllm_fp8_disagg_8192x1024_c154_tp16_0_ep16_0_851"])
    assert cross.reason == "tensor parallelism across nodes (tp16 over 8-GPU nodes)"
    adp = to_case(rows["dsr1_h200_trtllm_fp8_disagg_1024x1024_c1152_cfg321"])
    assert adp.reason == "attention data parallelism or pipeline parallelism"
