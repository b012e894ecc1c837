"""Llama (2/3/3.1/3.2) decoder in HF's parameter layout: LlamaForCausalLM."""
from __future__ import annotations

from tandem.engine.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    """Llama: RMSNorm pre-norm decoder, GQA attention with RoPE (optionally llama3-scaled), gated SiLU MLP."""

    qk_norm = False
