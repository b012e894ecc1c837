"""Model catalogue: transformer shapes from the models' Hugging Face `config.json`, and the
parameter, FLOP and KV-cache counts a roofline needs.

Counted parameters: per layer the q/k/v/o projections (or MLA's down- and up-projections), the (gated, SwiGLU) MLP
or its experts plus the router, and two RMSNorm vectors; the input embedding; the LM head unless tied; the final
norm. Small terms are left out on purpose (Qwen2.5's q/k/v biases, Qwen3's per-head q/k norms, MLA's latent norms:
< 0.01% of the parameters).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.perf.errors import unknown_name


DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp8_block": 1}   # fp8_block: 128x128-block scales (DeepSeek/Qwen FP8)
KV_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank latents, and the
    KV cache holds one compressed latent (kv_lora_rank) plus one shared rotary key (qk_rope_head_dim) per token and
    layer, whatever the number of heads."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """Query/key width of one head in the expanded (prefill) form: no-position part plus rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached elements per token and layer: the KV latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def down_width(self) -> int:
        """Output width of the fused down-projection (q_a and kv_a with its rotary key), replicated under TP."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer with grouped-query (or multi-head latent) attention and a gated MLP."""

    name: str
    layers: int
    hidden: int
    heads: int               # query heads
    kv_heads: int            # key/value heads (GQA)
    head_dim: int
    intermediate: int        # MLP width (per expert for MoE)
    vocab: int
    experts: int = 1         # MoE experts per layer (1 = dense)
    experts_per_token: int = 1
    shared_experts: int = 0  # of `experts` and `experts_per_token`, experts every token passes through (Ling 2.0)
    max_context: int = 131072
    tied_embeddings: bool = False
    dtype_bytes: int = 2     # bf16 activations (and weights and KV cache unless quantised below)
    weight_dtype: str = "bf16"   # linear layers' weights: bf16, fp8 (w8a8: vLLM's --quantization fp8) or fp8_block
    kv_dtype: str = "bf16"       # KV cache: bf16, or fp8 (vLLM's --kv-cache-dtype fp8)
    mla: MLA | None = None       # multi-head latent attention (None: grouped-query attention of kv_heads x head_dim)
    dense_layers: int = 0        # MoE models: the first layers with a dense MLP instead of experts (DeepSeek-V3: 3)
    dense_intermediate: int = 0  # their MLP width

    # --- parameter counts -----------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        if self.mla is not None:
            a, h, n = self.mla, self.hidden, self.heads
            return (h * a.down_width + a.q_lora_rank * n * a.qk_head_dim
                    + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim) + n * a.v_head_dim * h)
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return q + kv + o

    @property
    def replicated_params_per_layer(self) -> int:
        """Attention weights every tensor-parallel rank holds whole (MLA's fused down-projection); 0 for GQA."""
        return self.hidden * self.mla.down_width if self.mla is not None else 0

    @property
    def kv_up_params_per_layer(self) -> int:
        """MLA's kv_b up-projection (latent -> per-head no-position keys and values); 0 for GQA."""
        a = self.mla
        return a.kv_lora_rank * self.heads * (a.qk_nope_head_dim + a.v_head_dim) if a is not None else 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the experts (all layers of a dense model count here, with its one 'expert')."""
        return self.layers - self.dense_layers

    @property
    def dense_mlp_params(self) -> int:
        """One dense-MLP layer of a MoE model (gate, up, down)."""
        return 3 * self.hidden * self.dense_intermediate

    def mlp_params(self, experts: int) -> int:
        """Parameters of every layer's MLP with `experts` experts per MoE layer (routers included)."""
        return (self.moe_layers * (experts * self.expert_params + self.router_params_per_layer)
                + self.dense_layers * self.dense_mlp_params)

    @property
    def expert_params(self) -> int:
        """One gated MLP (gate, up, down) — one expert for MoE, the whole MLP for dense."""
        return 3 * self.hidden * self.intermediate

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden * self.experts if self.experts > 1 else 0

    @property
    def dense_params_per_layer(self) -> int:
        """Parameters of a layer that every token uses (attention, norms, router)."""
        return self.attn_params_per_layer + 2 * self.hidden + self.router_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head (counted once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def body_params(self) -> int:
        """Non-embedding parameters (all experts), including the final norm."""
        return self.layers * (self.attn_params_per_layer + 2 * self.hidden) + self.mlp_params(self.experts) \
            + self.hidden

    @property
    def active_body_params(self) -> int:
        """Non-embedding parameters one token passes through (top-k experts for MoE)."""
        return self.layers * (self.attn_params_per_layer + 2 * self.hidden) \
            + self.mlp_params(self.experts_per_token) + self.hidden

    @property
    def params(self) -> int:
        return self.body_params + self.embedding_params

    @property
    def active_params(self) -> int:
        return self.active_body_params + self.embedding_params

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    # --- precision --------------------------------------------------------------------------
    @property
    def weight_elem_bytes(self) -> int:
        """Bytes of one weight of the linear layers (embedding, LM head and norms stay in dtype_bytes)."""
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes of one cached K or V element."""
        return DTYPE_BYTES[self.kv_dtype]

    def with_precision(self, quantization: str | None = None, kv_cache_dtype: str | None = None) -> "ModelSpec":
        """This model with fp8 weights (`quantization="fp8"`) and/or an fp8 KV cache (`kv_cache_dtype="fp8"`);
        None or "auto" keeps the model's own. ValueError names a value not supported."""
        w = self.weight_dtype if quantization in (None, "auto", "none") else quantization
        kv = self.kv_dtype if kv_cache_dtype in (None, "auto") else kv_cache_dtype
        if kv == "fp8_e4m3":
            kv = "fp8"
        for what, v, ok in (("--quantization", w, DTYPE_BYTES), ("--kv-cache-dtype", kv, KV_DTYPES)):
            if v not in ok:
                raise ValueError(f"{what} must be one of {', '.join(sorted(ok))} (or auto), got {v!r}")
        return self if (w, kv) == (self.weight_dtype, self.kv_dtype) else replace(self, weight_dtype=w, kv_dtype=kv)

    # --- bytes ----------------------------------------------------------------------------
    @property
    def linear_params(self) -> int:
        """Parameters of the layers' linear maps (attention projections, MLPs or experts, routers)."""
        return self.layers * self.attn_params_per_layer + self.mlp_params(self.experts)

    @property
    def weight_bytes(self) -> int:
        return self.linear_params * self.weight_elem_bytes + (self.params - self.linear_params) * self.dtype_bytes

    @property
    def kv_elems_per_token_per_layer(self) -> int:
        """Cached elements of one token in one layer: K and V of every KV head, or MLA's latent and rotary key."""
        return self.mla.latent_dim if self.mla is not None else 2 * self.kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache of every layer for one token (all KV heads; MLA: the compressed latent, not per head)."""
        return self.layers * self.kv_elems_per_token_per_layer * self.kv_elem_bytes

    # --- FLOPs ----------------------------------------------------------------------------
    @property
    def body_flops_per_token(self) -> int:
        """Matmul FLOPs of one token through the layers (2 per active weight)."""
        return 2 * self.active_body_params

    @property
    def lm_head_flops_per_token(self) -> int:
        """Logits of one position (engines compute them only for positions they sample)."""
        return 2 * self.hidden * self.vocab

    @property
    def linear_flops_per_token(self) -> int:
        """All linear FLOPs of one token: layers plus LM head."""
        return self.body_flops_per_token + self.lm_head_flops_per_token

    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs of one prefill (query, key) pair over all layers and heads: QK^T (2*d_qk) plus PV (2*d_v); MLA's
        prefill runs expanded, per head at qk_nope+qk_rope and v_head_dim."""
        if self.mla is not None:
            return 2 * self.layers * self.heads * (self.mla.qk_head_dim + self.mla.v_head_dim)
        return 4 * self.layers * self.heads * self.head_dim

    @property
    def attn_flops_per_pair_decode(self) -> int:
        """FLOPs of one decode (query, key) pair: as prefill for GQA; MLA's decode runs absorbed, every head's
        query against the cached latent and rotary key (2*(kv_lora+rope)) and its output in the latent (2*kv_lora)."""
        if self.mla is not None:
            return 2 * self.layers * self.heads * (self.mla.latent_dim + self.mla.kv_lora_rank)
        return self.attn_flops_per_pair


def _m(name, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, **kw) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, **kw)


MODELS: dict[str, ModelSpec] = {
    # Qwen/Qwen3-32B config.json; max_position_embeddings 40960, 131072 with YaRN (as served
    # for long agent contexts). ~32.8B params, untied embeddings.
    "qwen3-32b": _m("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, max_context=131072),
    # Qwen/Qwen3-8B config.json: 36 layers, hidden 4096, 32 heads (8 KV) of 128, MLP 12288, vocab 151936, untied
    # embeddings; max_position_embeddings 40960, 131072 with YaRN as for the 32B. ~8.19B params. The model of
    # benchmarks/gpu_roofline.py (a random checkpoint of this shape measured on an H100).
    # meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads (8 KV) of 128, MLP 14336, vocab 128256,
    # untied embeddings; ~8.03B params.
    "llama-3.1-8b": _m("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_context=131072),
    "qwen3-8b": _m("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, max_context=131072),
    # meta-llama/Llama-3.1-70B config.json: ~70.6B params.
    "llama-3.1-70b": _m("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, max_context=131072),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, top-2; ~46.7B total, ~12.9B active.
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 64 heads (4 KV) of 128, 128 experts of 1536, top-8,
    # vocab 151936, untied; ~235B total, ~22B active. max_position_embeddings 40960, 131072 with YaRN.
    "qwen3-235b-a22b": _m("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 1536, 151936, experts=128, experts_per_token=8,
                          max_context=131072),
    "mixtral-8x7b": _m("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000,
                       experts=8, experts_per_token=2, max_context=32768),
    # Qwen/Qwen2.5-{7,14,32}B config.json (32768 native, 131072 with YaRN per the model cards).
    "qwen2.5-7b": _m("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, max_context=131072),
    "qwen2.5-14b": _m("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064, max_context=131072),
    "qwen2.5-32b": _m("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, max_context=131072),
    # JetLM/SDAR-8B-Chat: Qwen3-8B's shape (its base), decoded in blocks of 32 (Optimus's dense dLLM).
    "sdar-8b": _m("sdar-8b", 36, 4096, 32, 8, 128, 12288, 151936, max_context=32768),
    # inclusionAI/Ling-mini-2.0 and LLaDA2.0-mini (the diffusion model trained from it) config.json: 20 layers,
    # hidden 2048, 16 heads (4 KV) of 128, 256 routed experts of width 512, top-8, one shared expert of the same
    # width, the first layer dense (5120 wide), vocab 157184, untied, 32768 positions. Counted here as 257 experts
    # with 9 active in every layer (the dense first layer, 5120 wide, is within 10% of 9 x 512): ~1.4B active
    # parameters as the model cards say (16B total / 1.4B active; 17.0B total counted here).
    "ling-2.0-16b": _m("ling-2.0-16b", 20, 2048, 16, 4, 128, 512, 157184, experts=257, experts_per_token=9,
                       shared_experts=1,
                       max_context=32768),
    "llada2.0-16b": _m("llada2.0-16b", 20, 2048, 16, 4, 128, 512, 157184, experts=257, experts_per_token=9,
                       shared_experts=1,
                       max_context=32768),
    # GSAI-ML/LLaDA-8B-Instruct config.json (model_type llada, block_type llama): 32 layers (n_layers), d_model 4096,
    # 32 heads and 32 KV heads (MHA) of 128, a gated MLP of mlp_hidden_size 12288 (ff_proj, up_proj, ff_out), vocab
    # (and embedding_size) 126464, weight_tying false, max_sequence_length 4096. ~8.02B params (16.0 GB in bf16);
    # dLLM-Serve's model. Bidirectional (a masked-diffusion LM): its KV is 0.5 MiB a token (MHA).
    "llada-8b": _m("llada-8b", 32, 4096, 32, 32, 128, 12288, 126464, max_context=4096),
    # deepseek-ai/DeepSeek-V3 config.json (DeepSeek-R1: the same architecture): 61 layers, hidden 7168, 128 heads,
    # MLA (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), the first
    # 3 layers dense (intermediate 18432), then 256 routed experts of 2048 (top-8) plus 1 shared expert of the same
    # width, vocab 129280, untied, 163840 positions; native fp8 weights with 128x128 block scales. kv_heads and
    # head_dim are the config's num_key_value_heads and v_head_dim (MLA's cache does not use them). ~671B total and
    # ~37B active parameters (the multi-token-prediction module's 14B are not counted: it is not served by default).
    "deepseek-v3": _m("deepseek-v3", 61, 7168, 128, 128, 128, 2048, 129280, experts=257, experts_per_token=9,
                      shared_experts=1, dense_layers=3, dense_intermediate=18432, weight_dtype="fp8_block",
                      mla=MLA(1536, 512, 128, 64, 128), max_context=163840),
}

_ALIASES: dict[str, str] = {
    "llama3.1-70b": "llama-3.1-70b", "meta-llama-3.1-70b": "llama-3.1-70b",
    "llama3.1-8b": "llama-3.1-8b", "meta-llama-3.1-8b": "llama-3.1-8b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "sdar-8b-chat": "sdar-8b", "ling-mini-2.0": "ling-2.0-16b", "llada2.0-mini": "llada2.0-16b",
    "llada": "llada-8b",
    "deepseek-r1": "deepseek-v3", "deepseek-v3-0324": "deepseek-v3", "deepseek-r1-0528": "deepseek-v3",
}
_ORGS = ("meta-llama/", "nvidia/", "qwen/", "mistralai/", "jetlm/", "inclusionai/", "gsai-ml/", "deepseek-ai/")
_SUFFIXES = ("-instruct", "-chat", "-base", "-v0.1", "-hf", "-fp8")


def _norm(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    for org in _ORGS:
        if key.startswith(org):
            key = key[len(org):]
    changed = True
    while changed:
        changed = False
        for suf in _SUFFIXES:
            if key.endswith(suf) and key not in MODELS:
                key, changed = key[: -len(suf)], True
    return _ALIASES.get(key, key)


def get_model(name: str | ModelSpec) -> ModelSpec:
    """Look a model up by name (case-insensitive; HF ids such as
    'meta-llama/Llama-3.1-70B-Instruct' are accepted); a ModelSpec is returned unchanged."""
    if isinstance(name, ModelSpec):
        return name
    try:
        return MODELS[_norm(str(name))]
    except KeyError:
        raise unknown_name("model", name, MODELS) from None
