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
