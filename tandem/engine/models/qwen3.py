"""Qwen3 (dense) decoder in HF's parameter layout: Qwen3ForCausalLM."""
from __future__ import annotations

from tandem.engine.models.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: the Llama layout plus per-head RMSNorm of q and k (over head_dim) before RoPE."""

    qk_norm = True
