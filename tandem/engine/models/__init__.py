"""Model classes by HF architecture name, and the subset of config.json the engine needs (ModelConfig)."""
from __future__ import annotations

from tandem.engine.models.config import ARCHITECTURES, DIFFUSION_ARCHITECTURES, ModelConfig
from tandem.engine.models.llada import LLaDAModelLM
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.qwen3 import Qwen3ForCausalLM
from tandem.engine.models.sdar import BlockDiffusionBackend, BlockDiffusionMetadata, SDARForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SDARForCausalLM": SDARForCausalLM,
    "LLaDAModelLM": LLaDAModelLM,
}


def get_model_class(architecture: str) -> type:
    """The engine's class for an HF architecture name; ValueError naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r} "
                         f"(supported: {', '.join(sorted(MODEL_REGISTRY))})") from None


__all__ = ["ARCHITECTURES", "DIFFUSION_ARCHITECTURES", "MODEL_REGISTRY", "BlockDiffusionBackend",
           "BlockDiffusionMetadata", "LLaDAModelLM", "LlamaForCausalLM", "ModelConfig", "Qwen3ForCausalLM",
           "SDARForCausalLM", "get_model_class"]
