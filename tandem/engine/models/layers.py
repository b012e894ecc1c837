"""Building blocks of Llama-family decoders over a flattened token batch and a paged KV cache.

Numerics follow Hugging Face transformers op for op (RMSNorm in float32 cast back before the weight, cos/sin
computed in float32 and cast to the model dtype, residual adds in the model dtype), so logits match it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.metadata import AttnMetadata

if TYPE_CHECKING:
    from tandem.engine.attention.registry import AttentionBackend
    from tandem.engine.models import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 and cast back before the weight (as HF)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise x [..., dim]."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies (float32, CPU) for rope_type default, linear or llama3 (Llama-3.1 long context)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        long_wave = wavelen > old_len / lo                        # low frequencies: fully interpolated
        short_wave = wavelen < old_len / hi                       # high frequencies: unchanged
        scaled = torch.where(long_wave, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where(~short_wave & ~long_wave, blended, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout); cos/sin are computed per step from the token positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        # A plain attribute, not a buffer: it survives meta-device construction and is never in a state dict.
        self._inv_freq = rope_inv_freq(head_dim, theta, scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype` for int positions [T]."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA self-attention with RoPE (optionally Qwen3's per-head q/k RMSNorm first) over the paged KV cache."""

    def __init__(self, cfg: "ModelConfig", backend: "AttentionBackend", qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        self.scale = self.head_dim ** -0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = qk_norm
        self.backend = backend

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into the layer cache `kv`."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.backend.forward(q, k, v, kv, meta, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: "ModelConfig", backend: "AttentionBackend", qk_norm: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend, qk_norm)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: "ModelConfig", backend: "AttentionBackend", qk_norm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, qk_norm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttnMetadata) -> torch.Tensor:
        """Token ids [T] at positions [T] -> final-normed hidden states [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache tensors (one per layer), got {len(kv_caches)}")
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, kv, meta)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder-only LM: forward gives hidden states, compute_logits projects chosen rows to the vocabulary."""

    qk_norm = False

    def __init__(self, config: "ModelConfig", backend: "AttentionBackend | None" = None) -> None:
        super().__init__()
        if backend is None:
            from tandem.engine.attention.registry import get_backend
            backend = get_backend("sdpa")
        self.config = config
        self.model = DecoderModel(config, backend, self.qk_norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the input embeddings when the config says tie_word_embeddings."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_backend(self, backend: "AttentionBackend") -> None:
        """Switch every layer to another attention backend."""
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttnMetadata) -> torch.Tensor:
        """Token ids [T] at positions [T] -> hidden states [T, hidden], writing the step's KV into kv_caches."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
