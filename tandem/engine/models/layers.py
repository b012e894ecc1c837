"""Building blocks of Llama-family decoders over a flattened token batch and a paged KV cache.

Numerics follow Hugging Face transformers op for op (RMSNorm in float32 cast back before the weight, cos/sin
computed in float32 and cast to the model dtype, residual adds in the model dtype), so logits match it.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.parallel.group import TPGroup, current_group

if TYPE_CHECKING:
    from tandem.engine.attention.base import AttentionBackend
    from tandem.engine.models.config import ModelConfig


def _onednn_usable() -> bool:
    if os.environ.get("TANDEM_CPU_GEMM", "onednn").lower() not in ("onednn", "auto", "1"):
        return False
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except Exception:  # pragma: no cover - builds without oneDNN
        return False


# CPU float32 linears run oneDNN's matmul on weights packed once into its blocked layout (what vLLM's CPU
# backend does). torch's default CPU GEMM is MKL's sgemm, which on AMD CPUs takes an AVX2 path: on the
# development machine (AMD EPYC, AVX-512) the packed oneDNN GEMM is about 2.5x faster. `TANDEM_CPU_GEMM=torch`
# turns it off (plain F.linear).
ONEDNN_LINEAR = _onednn_usable()


class Linear(nn.Linear):
    """nn.Linear whose CPU float32 forward uses a oneDNN-packed copy of its weight (repacked if the weight changes).

    The packed copy is not a parameter or buffer: state dicts, tied weights and checkpoint loading see the plain
    weight. Results equal F.linear to float32 rounding (the accumulation order differs).
    """

    _packed: torch.Tensor | None = None
    _packed_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias): oneDNN's packed GEMM on CPU float32, else F.linear."""
        w = self.weight
        if ONEDNN_LINEAR and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu" \
                and x.dim() == 2 and not torch.is_grad_enabled():
            key = (w.data_ptr(), w._version, tuple(w.shape))
            if self._packed_key != key:
                try:
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
                except Exception:  # pragma: no cover - oneDNN refused: stay on F.linear for this weight
                    self._packed = None
                self._packed_key = key
            if self._packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return F.linear(x, w, bias)


class RowParallelLinear(Linear):
    """A linear whose input features are split across the tensor-parallel group (Megatron's row-parallel layer):
    each rank multiplies its slice, one all-reduce sums them, then the bias is added once.

    `in_shard` = (first input feature, full input features) of this rank's slice in the checkpoint's weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, first: int,
                 full_in: int) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.in_shard = (first, full_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / tp] -> [T, out], summed over the group."""
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split across the group: each rank looks up the ids it holds (zeros for
    the others) and one all-reduce sums them (exact: one non-zero term per token). Its rows past the vocabulary's
    end (the last rank's padding) are zero."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        first, real, padded = tp.vocab(vocab_size)
        self.vocab_shard = (first, real)
        self.weight = nn.Parameter(torch.empty(padded, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden]."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        first, real = self.vocab_shard
        mine = (ids >= first) & (ids < first + real)
        out = F.embedding((ids - first) * mine, self.weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)


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
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return h.mul_(self.weight)              # HF's weight * h, without another temporary
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
        """cos, sin [T, head_dim // 2] in `dtype` for int positions [T].

        HF's cos/sin are these repeated twice along the last dim (emb = cat(freqs, freqs)); the halves are equal,
        so only one is computed and apply_rotary uses it for both halves.
        """
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by half-width cos/sin [T, D // 2] (rotate-half layout) into a new contiguous tensor.

    HF's x * cos + rotate_half(x) * sin, half by half: out1 = x1 * c + (-x2) * s, out2 = x2 * c + x1 * s.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1)
    o1.sub_(x2 * s)                      # x1*c + (-x2)*s: negation is exact, so a - b rounds the same
    torch.mul(x2, c, out=o2)
    o2.add_(x1 * s)
    return out


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one merged matmul (checkpoint: gate_proj, up_proj)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        tp = current_group()
        first, n = tp.split(intermediate)        # this rank's intermediate features (all of them without TP)
        self.intermediate = n
        self.gate_up_proj = Linear(hidden, 2 * n, bias=bias)      # column-parallel: its rows are this rank's
        self.down_proj = RowParallelLinear(n, hidden, bias, tp, first, intermediate)
        # merged parameter -> its checkpoint parts, stacked along dim 0 in this order (see CausalLM.checkpoint_layout):
        # (part, rows here, first row in the checkpoint's tensor, the tensor's rows)
        self.merged_params = {"gate_up_proj": (("gate_proj", n, first, intermediate),
                                               ("up_proj", n, first, intermediate))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gu = self.gate_up_proj(x)
        n = self.intermediate
        return self.down_proj(F.silu(gu[:, :n]).mul_(gu[:, n:]))


class Attention(nn.Module):
    """GQA self-attention with RoPE (optionally Qwen3's per-head q/k RMSNorm first) over the paged KV cache."""

    def __init__(self, cfg: "ModelConfig", backend: "AttentionBackend", qk_norm: bool = False) -> None:
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_key_value_heads}")
        tp = current_group()                      # this rank's heads (all of them without TP)
        q_first, self.num_heads = tp.heads(cfg.num_attention_heads)
        kv_first, self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)
        D = self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        nq, nkv = self.num_heads * D, self.num_kv_heads * D
        self.q_size, self.kv_size = nq, nkv
        self.qkv_proj = Linear(h, nq + 2 * nkv, bias=bias)        # column-parallel: this rank's heads' rows
        full_q, full_kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        self.merged_params = {"qkv_proj": (("q_proj", nq, q_first * D, full_q), ("k_proj", nkv, kv_first * D, full_kv),
                                           ("v_proj", nkv, kv_first * D, full_kv))}
        self.o_proj = RowParallelLinear(nq, h, bias, tp, q_first * D, full_q)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = qk_norm
        self.backend = backend

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into the layer cache `kv`."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        nq, nkv = self.q_size, self.kv_size
        q = qkv[:, :nq].view(T, self.num_heads, self.head_dim)
        k = qkv[:, nq:nq + nkv].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, nq + nkv:].view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        backend = self.backend if meta.backend is None else meta.backend
        n = meta.num_tokens
        if n < T:                     # a padded (bucket) step: attention over the real tokens, zeros for padding
            o = q.new_zeros(T, self.num_heads, self.head_dim)
            o[:n] = backend.forward(q[:n], k[:n], v[:n], kv, meta, self.scale)
        else:
            o = backend.forward(q, k, v, kv, meta, self.scale)
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
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, current_group())
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
        self.tp = current_group()
        self.model = DecoderModel(config, backend, self.qk_norm)
        first, real, padded = self.tp.vocab(config.vocab_size)   # vocab-parallel: this rank's rows of the head
        self.lm_head = Linear(config.hidden_size, padded, bias=False)
        self.lm_head.vocab_shard = (first, real)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the input embeddings when the config says tie_word_embeddings."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttnMetadata) -> torch.Tensor:
        """Token ids [T] at positions [T] -> hidden states [T, hidden], writing the step's KV into kv_caches."""
        return self.model(input_ids, positions, kv_caches, meta)

    def caches_or_none(self, kv_caches: list[torch.Tensor] | None, meta: Any, device: torch.device
                       ) -> list[torch.Tensor]:
        """The layers' KV caches; for None, empty stand-ins when the step neither reads nor writes cached KV (its
        `ctx_lens` and `num_write` all 0; a diffusion step over no cache), else ValueError."""
        if kv_caches is not None:
            return kv_caches
        if any(meta.ctx_lens) or any(meta.num_write):
            raise ValueError("a step that reads or writes cached KV needs kv_caches")
        return [torch.empty(0, device=device)] * len(self.model.layers)

    def checkpoint_layout(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """Hugging Face checkpoint tensor name -> (parameter name, row offset, the checkpoint tensor's shape), in
        parameter order.

        A merged parameter (qkv_proj, gate_up_proj) stacks its checkpoint tensors (q/k/v_proj, gate/up_proj)
        along dim 0; every other parameter is its checkpoint tensor (offset 0). Under tensor parallelism a parameter
        holds a slice of its tensor (checkpoint_slices says which). Tied lm_head.weight is absent, as in
        named_parameters().
        """
        return {name: (param, off, shape) for name, (param, off, shape, _cut) in self._placements().items()}

    def checkpoint_slices(self) -> dict[str, tuple[int, int, int]]:
        """Checkpoint tensor name -> (dim, first, count): the slice of it this rank's parameter holds (tensor
        parallelism: column-parallel rows, row-parallel columns, a vocabulary range); empty without a group."""
        if self.tp.size == 1:
            return {}
        return {name: cut for name, (_p, _o, _s, cut) in self._placements().items() if cut is not None}

    def _placements(self) -> dict[str, tuple[str, int, tuple[int, ...], tuple[int, int, int] | None]]:
        """Checkpoint name -> (parameter, row offset, checkpoint shape, this rank's slice or None)."""
        out: dict[str, tuple[str, int, tuple[int, ...], tuple[int, int, int] | None]] = {}
        for name, p in self.named_parameters():
            mod_path, _, leaf = name.rpartition(".")
            parent_path, _, child = mod_path.rpartition(".")
            parts = getattr(self.get_submodule(parent_path), "merged_params", {}).get(child) if parent_path else None
            if parts:
                off = 0
                for sub, rows, first, full in parts:
                    out[f"{parent_path}.{sub}.{leaf}"] = (name, off, (full,) + tuple(p.shape[1:]), (0, first, rows))
                    off += rows
                if off != p.shape[0]:
                    raise AssertionError(f"merged parameter {name} has {p.shape[0]} rows, its parts {off}")
                continue
            mod = self.get_submodule(mod_path)
            shape, cut = tuple(p.shape), None
            if leaf == "weight" and getattr(mod, "in_shard", None) is not None:      # row-parallel: its columns
                first, full = mod.in_shard
                shape, cut = (shape[0], full), (1, first, shape[1])
            elif leaf == "weight" and getattr(mod, "vocab_shard", None) is not None:  # vocab-parallel: its rows
                first, real = mod.vocab_shard
                shape, cut = (self.config.vocab_size,) + shape[1:], (0, first, real)
            out[name] = (name, 0, shape, cut)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Hidden rows [N, hidden] -> float32 logits [N, vocab]; under tensor parallelism each rank's vocabulary
        slice, gathered on the driver (None on the other ranks)."""
        if self.tp.size == 1:
            return self.lm_head(hidden).float()
        return self.tp.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)
