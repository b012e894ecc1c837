"""LLaDA's config.json (GSAI-ML/LLaDA-8B-*, OLMo-style field names) read as the Llama field names ModelConfig parses.

LLaDA (`model_type: "llada"`, `architectures: ["LLaDAModelLM"]`) names its fields as OLMo does: `d_model`, `n_heads`,
`n_kv_heads`, `n_layers`, `mlp_hidden_size` (else `mlp_ratio` * d_model), `embedding_size` (the embedding and output
rows, >= `vocab_size`), `max_sequence_length`, `weight_tying`, `rms_norm_eps`, `rope_theta`, and `mask_token_id`
(126336 in the published models). Only LLaDA's Llama block is supported: SiLU-gated MLP, RMSNorm with a weight and no
bias, RoPE, no biases, no q/k norm, no ALiBi, unscaled logits; any other setting is refused by its field name.
"""
from __future__ import annotations

from typing import Any

LLADA_ARCHITECTURE = "LLaDAModelLM"

# field -> the only value supported (a missing field takes LLaDA's default, which is this value)
_REQUIRED: dict[str, Any] = {
    "block_type": "llama", "layer_norm_type": "rms", "layer_norm_with_affine": True, "bias_for_layer_norm": False,
    "include_bias": False, "include_qkv_bias": False, "attention_layer_norm": False, "alibi": False, "rope": True,
    "scale_logits": False, "input_emb_norm": False,
}


def positive_field(d: dict[str, Any], name: str) -> int:
    """A positive integer field of a config.json dict, by name (ValueError naming it otherwise)."""
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config.json field {name!r} must be a positive integer, got {v!r}")
    return v


def llada_fields(d: dict[str, Any]) -> dict[str, Any]:
    """LLaDA's config.json dict as the Llama-named dict ModelConfig.from_dict parses; ValueError naming a bad field."""
    for name, want in _REQUIRED.items():
        if name in d and d[name] != want:
            raise ValueError(f"config.json field {name!r} = {d[name]!r} is not supported for LLaDA (only {want!r})")
    if d.get("multi_query_attention"):
        raise ValueError("config.json field 'multi_query_attention' is not supported for LLaDA (give n_kv_heads)")
    hidden, heads = positive_field(d, "d_model"), positive_field(d, "n_heads")
    if hidden % heads:
        raise ValueError(f"config.json field 'd_model' {hidden} is not a multiple of n_heads {heads}")
    mlp = d.get("mlp_hidden_size") or positive_field(d, "mlp_ratio") * hidden
    vocab = d.get("embedding_size") or positive_field(d, "vocab_size")
    if d.get("vocab_size") and vocab < d["vocab_size"]:
        raise ValueError(f"config.json field 'embedding_size' {vocab} is below vocab_size {d['vocab_size']}")
    out = {
        "architectures": d.get("architectures"), "model_type": d.get("model_type", "llada"),
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": d.get("n_kv_heads") or heads,
        "num_hidden_layers": positive_field(d, "n_layers"), "intermediate_size": mlp, "vocab_size": vocab,
        "head_dim": hidden // heads, "hidden_act": d.get("activation_type", "silu"),
        "rms_norm_eps": d.get("rms_norm_eps", 1e-5), "rope_theta": d.get("rope_theta", 10000.0),
        "max_position_embeddings": d.get("max_sequence_length", 2048),
        "tie_word_embeddings": bool(d.get("weight_tying", False)),
        "bos_token_id": d.get("bos_token_id"), "eos_token_id": d.get("eos_token_id"),
        "mask_token_id": d.get("mask_token_id"),
    }
    dtype = d.get("dtype") or d.get("torch_dtype")
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out
