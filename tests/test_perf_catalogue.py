"""Catalogue numbers: datasheet GPU specs and HF-config model shapes the cost models stand on."""
import pytest

from tandem.perf import GPUS, MODELS, DoesNotFitError, UnknownNameError, get_gpu, get_model


def test_llama_70b_param_count_matches_published_70_6b():
    m = get_model("llama-3.1-70b")
    assert m.params == pytest.approx(70.6e9, rel=0.01)
    assert m.active_params == m.params


def test_llama_70b_kv_bytes_per_token_is_2_layers_kvheads_headdim_bf16():
    assert get_model("llama-3.1-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680


@pytest.mark.parametrize("name, params", [
    ("qwen3-32b", 32.8e9), ("qwen2.5-7b", 7.61e9), ("qwen2.5-14b", 14.7e9), ("qwen2.5-32b", 32.5e9),
    ("mixtral-8x7b", 46.7e9), ("qwen3-8b", 8.19e9),
])
def test_model_param_counts_match_model_cards_within_1_percent(name, params):
    assert get_model(name).params == pytest.approx(params, rel=0.01)


def test_mixtral_active_params_count_two_of_eight_experts():
    m = get_model("mixtral-8x7b")
    assert m.active_params == pytest.approx(12.9e9, rel=0.01)
    assert m.body_params - m.active_body_params == 6 * m.layers * 3 * m.hidden * m.intermediate


def test_flop_counts_follow_definitions():
    m = get_model("qwen3-32b")
    assert m.attn_flops_per_pair == 4 * 64 * 64 * 128
    assert m.linear_flops_per_token == 2 * m.active_body_params + 2 * m.hidden * m.vocab
    assert m.weight_bytes == 2 * m.params


def test_model_shapes_are_the_hf_configs():
    q = get_model("qwen2.5-7b")
    assert (q.layers, q.hidden, q.heads, q.kv_heads, q.head_dim, q.intermediate, q.vocab) == (28, 3584, 28, 4, 128, 18944, 152064)
    x = get_model("mixtral-8x7b")
    assert (x.experts, x.experts_per_token, x.max_context) == (8, 2, 32768)
    assert get_model("qwen3-32b").max_context == 131072
    q8 = get_model("Qwen/Qwen3-8B")
    assert (q8.layers, q8.hidden, q8.heads, q8.kv_heads, q8.head_dim, q8.intermediate, q8.vocab) == (36, 4096, 32, 8, 128, 12288, 151936)
    assert not q8.tied_embeddings and q8.params == 8_190_726_144


@pytest.mark.parametrize("alias", ["Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "LLAMA-3.1-70B", "Llama3.1-70B"])
def test_model_names_are_case_insensitive_and_accept_hf_ids(alias):
    assert get_model(alias) is MODELS["llama-3.1-70b"]


def test_unknown_model_raises_listing_valid_names_on_one_line():
    with pytest.raises(UnknownNameError) as e:
        get_model("gpt-5")
    msg = str(e.value)
    assert "\n" not in msg and "gpt-5" in msg
    assert all(k in msg for k in MODELS)
    assert isinstance(e.value, ValueError)


def test_h20_datasheet_numbers_and_ampd_testbed_network():
    g = get_gpu("h20")
    assert (g.bf16_tflops, g.hbm_bw_gbs, g.hbm_gb, g.nvlink_gbs) == (148.0, 4000.0, 96.0, 450.0)
    assert g.net_gbs == 25.0  # 200 GB/s InfiniBand per 8-GPU server
    assert g.gpus_per_node == 8


def test_gpu_catalogue_has_the_six_devices_with_dense_bf16_peaks():
    assert set(GPUS) == {"h100", "h200", "h20", "a100-80g", "l40s", "rtx4090"}
    assert GPUS["h100"].bf16_tflops == 989.4 and GPUS["h100"].hbm_bw_gbs == 3350.0
    assert GPUS["h200"].hbm_gb == 141.0 and GPUS["h200"].hbm_bw_gbs == 4800.0
    assert GPUS["a100-80g"].bf16_tflops == 312.0 and GPUS["a100-80g"].nvlink_gbs == 300.0
    for name in ("l40s", "rtx4090"):  # PCIe only
        assert GPUS[name].nvlink_gbs == 32.0 and not GPUS[name].has_nvlink


def test_gpu_efficiencies_are_fractions():
    for g in GPUS.values():
        assert 0 < g.mfu <= 1 and 0 < g.mbu <= 1 and 0 < g.link_eff <= 1
        assert 0 < g.step_overhead_s < 0.01


@pytest.mark.parametrize("alias", ["H20", "nvidia h20", "h20"])
def test_gpu_names_are_case_insensitive(alias):
    assert get_gpu(alias) is GPUS["h20"]


def test_unknown_gpu_raises_listing_valid_names_on_one_line():
    with pytest.raises(UnknownNameError) as e:
        get_gpu("tpu-v5")
    msg = str(e.value)
    assert "\n" not in msg and all(k in msg for k in GPUS)


def test_errors_are_value_errors():
    assert issubclass(UnknownNameError, ValueError) and issubclass(DoesNotFitError, ValueError)


def test_deepseek_v3_and_r1_are_one_mla_moe_architecture_with_the_published_counts():
    """DeepSeek-V3 and -R1 resolve to one catalogue entry whose fields are the config's, and whose parameter counts
    are the model card's 671B total and 37B active (first 3 layers dense, then 256 routed experts + 1 shared)."""
    from tandem.perf.models import MLA

    m = get_model("deepseek-ai/DeepSeek-R1")
    assert m is get_model("deepseek-ai/DeepSeek-V3") is MODELS["deepseek-v3"]
    assert (m.layers, m.hidden, m.heads, m.vocab, m.dense_layers, m.dense_intermediate) == \
        (61, 7168, 128, 129280, 3, 18432)
    assert (m.experts - m.shared_experts, m.experts_per_token - m.shared_experts, m.intermediate) == (256, 8, 2048)
    assert m.mla == MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert m.weight_dtype == "fp8_block"
    assert m.params == pytest.approx(671e9, rel=0.01)
    assert m.active_params == pytest.approx(37e9, rel=0.02)
    # MLA's projections: q_a + kv_a (down), q_b, kv_b (up), o
    assert m.attn_params_per_layer == 7168 * 2112 + 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168


def test_mla_caches_one_latent_per_token_and_layer_replicated_on_every_tp_rank():
    """The KV-capacity arithmetic sees MLA's compressed latent (kv_lora + rope elements, not per head), and that TP
    replicates it rather than sharding it."""
    from tandem.perf.roofline import ACTIVATION_RESERVE_GIB, MEM_UTIL, kv_bytes_per_token_per_gpu

    m = get_model("deepseek-v3")
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    assert m.with_precision(kv_cache_dtype="fp8").kv_bytes_per_token == 61 * 576 == 35136
    assert [kv_bytes_per_token_per_gpu(m, tp) for tp in (1, 2, 8)] == [70272, 70272, 70272]
    # grouped-query attention, by contrast, shards its KV heads
    assert kv_bytes_per_token_per_gpu(get_model("llama-3.1-70b"), 8) == 2 * 80 * 1 * 128 * 2
    # the down-projection is replicated on every rank too: weights per GPU are (all weights + 7 copies of it) / 8
    from tandem.perf import kv_capacity_tokens
    gib = 1 << 30
    per_gpu = (m.weight_bytes + 7 * 61 * 7168 * 2112) / 8
    free = 141 * gib * MEM_UTIL - ACTIVATION_RESERVE_GIB * gib - per_gpu
    assert kv_capacity_tokens(m, "h200", 8) == int(free // 70272)
    with pytest.raises(DoesNotFitError):
        kv_capacity_tokens(m, "h100", 8)                  # 671 GB of fp8 weights do not fit 8 x 80 GB


def test_mla_attention_flops_are_expanded_for_prefill_and_absorbed_for_decode():
    """Prefill pairs cost 2 x (d_qk + d_v) per head (192 + 128); decode pairs 2 x (latent + kv_lora) per head
    (576 + 512), and the roofline's compute term of a decode step is exactly the model's FLOPs at the fp8 peak
    (linear layers, the down-projection whole on every rank) plus the LM head and attention at the bf16 peak."""
    from tandem.perf import BatchShape, Roofline

    m = get_model("deepseek-v3")
    assert m.attn_flops_per_pair == 2 * 61 * 128 * (192 + 128) == 4_997_120
    assert m.attn_flops_per_pair_decode == 2 * 61 * 128 * (576 + 512) == 16_990_208
    g = get_gpu("h200")
    repl = 61 * 7168 * 2112
    linear = (2 * m.active_body_params - 2 * repl) / 8 + 2 * repl
    expected = (linear / (1978.9e12 * g.mfu) + 2 * 7168 * 129280 / 8 / (989.4e12 * g.mfu)
                + 16_990_208 * 4096 / 8 / (989.4e12 * g.mfu))
    b = Roofline(m, "h200", 8).breakdown(BatchShape(num_decode=1, decode_ctx_tokens=4096))
    assert b["compute"] == pytest.approx(expected, rel=1e-12)
    # a prefill chunk over history also up-projects the history's latents (kv_b: 2 FLOPs per weight per token)
    r = Roofline(m, "h200", 8)
    fresh = r.breakdown(BatchShape(1024, 1024 * (4096 + 1024.5), 0, 1))["compute"]
    hist = r.breakdown(BatchShape(1024, 1024 * (4096 + 1024.5), 4096, 1))["compute"]
    assert hist - fresh == pytest.approx(4096 * 2 * 61 * 512 * 128 * 256 / 8 / (1978.9e12 * g.mfu), rel=1e-9)


def test_expert_parallelism_shards_experts_not_their_sum_and_is_refused_where_it_cannot_apply():
    """Under uniform routing a rank holding experts/ep experts, each over tp/ep GPUs, streams what TP's sharding
    streams; ep must divide tp and the routed experts, and a dense model has no experts to shard."""
    from tandem.perf import BatchShape, Roofline
    from tandem.perf.errors import ParallelismError

    shape = BatchShape(num_decode=64, decode_ctx_tokens=64 * 2000)
    tp8, ep8 = Roofline("deepseek-v3", "h200", 8), Roofline("deepseek-v3", "h200", 8, ep=8)
    assert ep8.step_time(shape) == pytest.approx(tp8.step_time(shape), rel=1e-12)
    assert repr(ep8) == "Roofline(deepseek-v3, h200, tp8ep8)"
    assert Roofline("mixtral-8x7b", "h100", 8, ep=8).ep == 8        # 8 experts over 8 GPUs: one each
    for model, tp, ep in (("llama-3.1-70b", 8, 2), ("deepseek-v3", 4, 8), ("deepseek-v3", 8, 3)):
        with pytest.raises(ParallelismError):
            Roofline(model, "h200", tp, ep=ep)
