"""The subset of a Hugging Face config.json the engine needs (ModelConfig) and the architectures it supports.

Below the model classes (layers.py reads ModelConfig), so it names the architectures rather than importing them;
tandem.engine.models maps each name to its class.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.models.llada_config import LLADA_ARCHITECTURE, llada_fields, positive_field

_ROPE_TYPES = ("default", "linear", "llama3")
ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen3ForCausalLM", "SDARForCausalLM",
                                  LLADA_ARCHITECTURE)   # MODEL_REGISTRY's keys
# Architectures that decode by block diffusion: their config.json names the diffusion block length (`block_size`) and
# the mask token (`mask_token_id`), as SDAR's checkpoints do.
DIFFUSION_ARCHITECTURES: tuple[str, ...] = ("SDARForCausalLM",)


@dataclass
class ModelConfig:
    """The fields of a Hugging Face config.json that build a decoder and size its KV cache."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    torch_dtype: str | None = None            # the checkpoint's dtype name ("bfloat16", ...), if it says
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    attention_bias: bool = False
    mlp_bias: bool = False
    # Block diffusion (SDAR): config.json's `block_size` (the diffusion block length, not the KV cache's block size)
    # and `mask_token_id`; None for autoregressive models. LLaDA (masked diffusion, llada_config.py): mask_token_id
    # only (its block length is a decoding option).
    diffusion_block_size: int | None = None
    mask_token_id: int | None = None

    @property
    def is_canvas_diffusion(self) -> bool:
        """A LLaDA-style masked-diffusion model: bidirectional over its whole canvas, no block length of its own."""
        return self.architecture == LLADA_ARCHITECTURE

    @property
    def is_diffusion(self) -> bool:
        """A diffusion model of either kind (block-diffusion SDAR, or LLaDA-style): it has a mask token."""
        return self.mask_token_id is not None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse a config.json dict; ValueError naming the field when one is missing or unsupported."""
        archs = d.get("architectures") or []
        if not archs or not isinstance(archs, list):
            raise ValueError("config.json has no 'architectures' list")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
        if arch == LLADA_ARCHITECTURE:
            d = llada_fields(d)

        need_int = functools.partial(positive_field, d)
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")
        hidden, heads = need_int("hidden_size"), need_int("num_attention_heads")
        rope_params = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in _ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(_ROPE_TYPES)})")
            if kind == "llama3":
                scaling = {"original_max_position_embeddings": d.get("max_position_embeddings", 2048), **scaling}
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        head_dim = d.get("head_dim") or hidden // heads
        vocab = need_int("vocab_size")
        diffusion_block = mask_id = None
        if arch in DIFFUSION_ARCHITECTURES or arch == LLADA_ARCHITECTURE:
            diffusion_block = need_int("block_size") if arch in DIFFUSION_ARCHITECTURES else None
            mask_id = d.get("mask_token_id")
            if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < vocab:
                raise ValueError(f"config.json field 'mask_token_id' must be a token id below vocab_size {vocab}, "
                                 f"got {mask_id!r}")
        return cls(
            architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=need_int("intermediate_size"),
            num_hidden_layers=need_int("num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
            attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
            diffusion_block_size=diffusion_block, mask_token_id=mask_id,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `path`/config.json."""
        f = Path(path) / "config.json"
        try:
            d = json.loads(f.read_text())
        except FileNotFoundError:
            raise ValueError(f"{f} not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from None
        return cls.from_dict(d)
