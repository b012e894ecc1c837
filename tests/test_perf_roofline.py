"""Roofline sanity: the regimes, the terms and the scaling a serving-step model must get right."""
import math

import pytest

from tandem.perf import (BatchShape, DoesNotFitError, ParallelismError, Roofline, get_gpu, get_model,
                         kv_capacity_tokens, kv_transfer_time, supported_tps)


def test_decode_batch1_llama70b_h20_tp8_is_weight_streaming_plus_allreduce_plus_overhead():
    r = Roofline("llama-3.1-70b", "h20", 8)
    m, g = r.model, r.gpu
    shape = BatchShape(num_decode=1, decode_ctx_tokens=1000)
    b = r.breakdown(shape)
    assert b["bound"] == "memory"
    weights = m.weight_bytes / (8 * g.hbm_bw_gbs * 1e9 * g.mbu)
    allreduce = 2 * m.layers * r.allreduce_time(m.hidden * m.dtype_bytes)
    expected = weights + allreduce + g.step_overhead_s
    assert r.step_time(shape) == pytest.approx(expected, rel=0.03)
    assert 5e-3 < r.step_time(shape) < 15e-3


def test_prefill_8k_is_compute_bound_and_near_flops_over_peak():
    r = Roofline("llama-3.1-70b", "h20", 8)
    s = BatchShape()
    s.add_prefill(0, 8192)
    b = r.breakdown(s)
    assert b["bound"] == "compute" and b["compute"] > 10 * b["memory"]
    m, g = r.model, r.gpu
    flops = 8192 * m.body_flops_per_token + m.lm_head_flops_per_token + s.prefill_attn_pairs * m.attn_flops_per_pair
    assert b["compute"] == pytest.approx(flops / 8 / (g.bf16_tflops * 1e12 * g.mfu), rel=1e-9)


def test_attention_pairs_of_a_chunk_are_causal():
    s = BatchShape()
    s.add_prefill(100, 4)  # 4 new tokens after 100: each attends to 100 + (1..4) keys
    assert s.prefill_attn_pairs == 4 * 100 + (1 + 2 + 3 + 4)
    assert (s.prefill_tokens, s.prefill_kv_read_tokens, s.num_prefill) == (4, 100, 1)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_step_time_is_monotone_in_tokens_history_and_batch(tp):
    r = Roofline("qwen3-32b", "h20", tp)
    prev = 0.0
    for n in [1, 2, 8, 32, 128, 512, 2048, 8192, 32768]:
        t = r.prefill_time(0, n)
        assert t > prev
        prev = t
    assert r.prefill_time(16384, 512) > r.prefill_time(0, 512)
    prev = 0.0
    for b in [1, 4, 16, 64, 256]:
        t = r.decode_time(b, b * 2000)
        assert t >= prev
        prev = t
    assert r.decode_time(16, 16 * 8000) > r.decode_time(16, 16 * 1000)


def test_tp_scaling_speeds_up_compute_bound_prefill_nearly_linearly():
    t = {tp: Roofline("llama-3.1-70b", "h20", tp).prefill_time(0, 8192) for tp in (1, 2, 4, 8)}
    assert t[1] > t[2] > t[4] > t[8]
    assert 1.7 < t[1] / t[2] <= 2.0
    assert 6.0 < t[1] / t[8] < 8.0  # all-reduce and overhead keep it below 8x


def test_tp_scaling_of_decode_is_sublinear_due_to_fixed_costs():
    t1 = Roofline("qwen3-32b", "h20", 1).decode_time(1, 1000)
    t8 = Roofline("qwen3-32b", "h20", 8).decode_time(1, 1000)
    assert 2.0 < t1 / t8 < 8.0


def test_empty_batch_costs_nothing_and_step_includes_overhead():
    r = Roofline("qwen2.5-7b", "h100", 1)
    assert r.step_time(BatchShape()) == 0.0
    assert r.decode_time(1, 10) > r.gpu.step_overhead_s


def test_step_time_args_equals_step_time():
    r = Roofline("mixtral-8x7b", "a100-80g", 4)
    s = BatchShape()
    s.add_prefill(300, 700)
    s.add_decode(1200)
    s.add_decode(50)
    assert r.step_time(s) == r.step_time_args(s.prefill_tokens, s.prefill_attn_pairs, s.prefill_kv_read_tokens,
                                              s.num_prefill, s.num_decode, s.decode_ctx_tokens)


def test_moe_decode_reads_only_touched_experts_bounded_by_all():
    r = Roofline("mixtral-8x7b", "h100", 1)
    m = r.model
    one = r.breakdown(BatchShape(num_decode=1, decode_ctx_tokens=1))["memory"]
    many = r.breakdown(BatchShape(num_decode=512, decode_ctx_tokens=512))["memory"]
    bw = r.gpu.hbm_bw_gbs * 1e9 * r.gpu.mbu
    assert one < (m.params - 5 * m.layers * m.expert_params) * 2 / bw  # ~2 of 8 experts
    assert many < m.weight_bytes / bw * 1.1 and many > m.weight_bytes / bw * 0.9


def test_chunked_prefill_costs_at_least_unchunked():
    r = Roofline("llama-3.1-70b", "h20", 4)
    assert r.prefill_time(0, 20000, chunk_tokens=8192) >= r.prefill_time(0, 20000)
    assert r.prefill_time(0, 4000, chunk_tokens=8192) == r.prefill_time(0, 4000)


def test_tp_beyond_one_node_is_an_error():
    with pytest.raises(ParallelismError, match="exceeds"):
        Roofline("llama-3.1-70b", "h20", 16)


def test_tp_must_divide_attention_heads():
    with pytest.raises(ParallelismError, match="heads"):
        Roofline("qwen2.5-7b", "h20", 8)  # 28 heads
    assert supported_tps("qwen2.5-7b", "h20") == (1, 2, 4)
    assert supported_tps("llama-3.1-70b", "h20") == (1, 2, 4, 8)


def test_kv_capacity_llama70b_one_h20_does_not_fit():
    with pytest.raises(DoesNotFitError) as e:
        kv_capacity_tokens("llama-3.1-70b", "h20", 1)
    msg = str(e.value)
    assert "\n" not in msg and "141.1 GB" in msg and "tp1" in msg


def test_kv_capacity_is_memory_left_after_weights_over_kv_per_token():
    m, g = get_model("llama-3.1-70b"), get_gpu("h20")
    cap = kv_capacity_tokens(m, g, 8, mem_util=0.9, activation_reserve_gb=2.0)
    free = 96 * 2**30 * 0.9 - m.weight_bytes / 8 - 2 * 2**30
    assert cap == math.floor(free / (m.kv_bytes_per_token / 8))
    assert kv_capacity_tokens(m, g, 4) < cap / 2  # half the GPUs, and weights take more of each


def test_kv_capacity_replicates_kv_heads_beyond_kv_head_count():
    m = get_model("qwen2.5-7b")  # 4 KV heads
    c2, c4 = kv_capacity_tokens(m, "h100", 2), kv_capacity_tokens(m, "h100", 4)
    assert c4 > c2  # tp4 = kv_heads still shards
    with pytest.raises(ParallelismError):
        kv_capacity_tokens(m, "h100", 8)


def test_kv_transfer_is_alpha_plus_bytes_over_parallel_links():
    m, g = get_model("llama-3.1-70b"), get_gpu("h20")
    t = kv_transfer_time(m, g, 3000, 4, 8, same_node=False)
    assert t == pytest.approx(g.net_latency_s + 3000 * 327680 / (4 * 25e9 * g.link_eff))
    t_node = kv_transfer_time(m, g, 3000, 4, 8, same_node=True)
    assert t_node == pytest.approx(g.nvlink_latency_s + 3000 * 327680 / (4 * 450e9 * g.link_eff))
    assert kv_transfer_time(m, g, 0, 4, 8, False) == 0.0
    assert kv_transfer_time(m, g, 3000, 8, 8, False) < t


def test_step_time_is_cheap():
    import time
    r = Roofline("llama-3.1-70b", "h20", 4)
    t0 = time.perf_counter()
    for i in range(20000):
        r.step_time_args(i % 500, 1e5, 100, 1, 32, 64000)
    assert (time.perf_counter() - t0) / 20000 < 20e-6
