"""Random checkpoints of real shapes (`tiny_model.REAL_SIZES`: Qwen3-0.6B, Qwen3-8B) for GPU timing.

Nothing here writes a real-size model: the configs are checked as dicts and the parameters counted on the meta
device. The published counts: Qwen3-8B 8,190,735,360 and Qwen3-0.6B 596,049,920 (0.44B without embeddings), the
counts transformers gives for the Hugging Face checkpoints."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.models import ModelConfig, get_model_class  # noqa: E402
from tandem.engine.tiny_model import (REAL_SIZES, SIZES, init_weights, model_config,  # noqa: E402
                                      parameter_count)
from tandem.perf import get_model  # noqa: E402

SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def _shape(cfg: dict) -> tuple:
    return tuple(cfg[k] for k in SHAPE_KEYS)


def test_sizes_list_the_real_presets_after_the_tiny_ones():
    assert SIZES == ("1m", "30m", "0.6b", "8b") and REAL_SIZES == ("0.6b", "8b")


def test_qwen3_8b_preset_is_the_real_config():
    cfg = model_config("qwen3", "8b", "bfloat16")
    assert _shape(cfg) == (36, 4096, 32, 8, 128, 12288, 151936, 40960, False)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_theta"] == 1000000.0 and cfg["rms_norm_eps"] == 1e-6 and cfg["max_window_layers"] == 36


def test_qwen3_0_6b_preset_is_the_real_config():
    cfg = model_config("qwen3", "0.6b")
    assert _shape(cfg) == (28, 1024, 16, 8, 128, 3072, 151936, 40960, True)


def test_real_presets_count_the_published_parameters_on_the_meta_device():
    assert parameter_count("qwen3", "8b") == 8_190_735_360
    assert parameter_count("qwen3", "0.6b") == 596_049_920
    assert parameter_count("qwen3", "8b", tie_word_embeddings=True) == 8_190_735_360 - 151936 * 4096


def test_qwen3_8b_preset_matches_the_perf_catalogue():
    """The engine's model and the roofline's ModelSpec describe the same network: equal counts but the per-head
    q/k norms, which the catalogue leaves out (36 layers x 2 x 128)."""
    cfg, spec = model_config("qwen3", "8b"), get_model("qwen3-8b")
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate, spec.vocab) == \
        (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
         cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"])
    assert spec.params + 36 * 2 * 128 == parameter_count("qwen3", "8b")
    assert spec.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_tiny_presets_keep_their_configs():
    q, ll = model_config("qwen3", "1m"), model_config("llama", "30m")
    assert _shape(q) == (4, 128, 4, 2, 48, 384, 448, 4096, True)
    assert _shape(ll) == (8, 512, 8, 4, 64, 1920, 448, 4096, False)


@pytest.mark.parametrize("size", REAL_SIZES)
def test_real_presets_are_qwen3_only(size):
    with pytest.raises(ValueError, match="only for qwen3"):
        model_config("llama", size)


def test_weights_are_converted_one_tensor_at_a_time_to_the_same_values():
    """`init_weights` in bfloat16 gives every tensor converted from the float32 draw of the same seed."""
    mc = ModelConfig.from_dict(model_config("qwen3", "1m"))
    with torch.device("meta"):
        skeleton = get_model_class(mc.architecture)(mc)
    f32 = init_weights(skeleton, 5, True)
    bf16 = init_weights(skeleton, 5, True, torch.bfloat16, "cpu")
    assert list(bf16) == list(f32) and len(bf16) == 4 * 11 + 2
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
        assert torch.equal(t, f32[name].to(torch.bfloat16)), name


def test_cli_rejects_a_real_size_for_llama_and_a_bad_init_device_in_one_line(tmp_path, capsys):
    assert main(["tiny-model", "--arch", "llama", "--size", "8b", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: ") and "only for qwen3" in err[0]
    assert main(["tiny-model", "--init-device", "nosuchdevice", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: cannot write the tiny model")
