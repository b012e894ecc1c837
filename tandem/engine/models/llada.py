"""LLaDA (masked diffusion, GSAI-ML/LLaDA-8B-*) in its own HF parameter layout: LLaDAModelLM on the project's layers.

LLaDA's Llama block is Llama layer for layer (RMSNorm pre-norm, RoPE in the rotate-half layout, SiLU-gated MLP, no
biases), with two differences at inference:

- **no causal mask**: every position attends to every position of the sequence (prompt, decoded and still-masked
  tokens alike), in both directions (bidirectional.py);
- **no next-token shift**: the logits at position p predict the token at p (where the input holds `mask_token_id`).

Its checkpoint names (OLMo's) are mapped onto the project's modules by `checkpoint_layout`, so the engine's loader
reads a LLaDA directory unchanged: `model.transformer.wte` (embeddings), `model.transformer.blocks.N.{q,k,v}_proj`,
`attn_out`, `ff_proj` (the gate, through SiLU), `up_proj`, `ff_out` (down), `attn_norm`, `ff_norm`,
`model.transformer.ln_f` and `model.transformer.ff_out` (the output head, absent with `weight_tying`). Its config.json
fields are read by llada_config.py. Decoding: tandem.engine.diffusion.llada_generate.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from tandem.engine.models.bidirectional import BidirectionalBackend, BidirectionalMetadata
from tandem.engine.models.layers import CausalLM

_TOP = {"model.embed_tokens.weight": "model.transformer.wte.weight", "model.norm.weight": "model.transformer.ln_f.weight",
        "lm_head.weight": "model.transformer.ff_out.weight"}
_LAYER = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
          "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
          "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm"}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def llada_checkpoint_name(llama_name: str) -> str:
    """LLaDA's checkpoint name of a tensor named the Llama way (model.layers.N.self_attn.q_proj.weight -> ...)."""
    if llama_name in _TOP:
        return _TOP[llama_name]
    m = _LAYER_NAME.fullmatch(llama_name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"no LLaDA name for {llama_name!r}")
    return f"model.transformer.blocks.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


class LLaDAModelLM(CausalLM):
    """LLaDA: Llama's layers under bidirectional attention, logits unshifted (position p -> token p)."""

    qk_norm = False

    def __init__(self, config: Any, backend: Any = None) -> None:
        """Llama's modules on the bidirectional backend; a loader's `sdpa` backend keeps it off flash-attn."""
        if config.mask_token_id is None:
            raise ValueError("a LLaDA config needs mask_token_id")
        use_flash = None if backend is None or isinstance(backend, BidirectionalBackend) else backend.name == "flash"
        super().__init__(config, backend if isinstance(backend, BidirectionalBackend)
                         else BidirectionalBackend(use_flash=use_flash))
        self.mask_token_id: int = int(config.mask_token_id)

    def checkpoint_layout(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        """LLaDA's checkpoint tensor name -> (parameter name, row offset, shape), in parameter order."""
        return {llada_checkpoint_name(n): spec for n, spec in super().checkpoint_layout().items()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, kv_caches: list[torch.Tensor] | None,
                meta: BidirectionalMetadata) -> torch.Tensor:
        """Token ids [T] -> hidden states [T, hidden]; positions default to meta.positions, kv_caches None: no cache."""
        if not isinstance(meta, BidirectionalMetadata):
            raise ValueError("a LLaDA model is not autoregressive: decode it with "
                             "tandem.engine.diffusion.llada_generate (BidirectionalMetadata steps)")
        if positions is None:
            positions = meta.positions
        return self.model(input_ids, positions, self.caches_or_none(kv_caches, meta, input_ids.device), meta)
