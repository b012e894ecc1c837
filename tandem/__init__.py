"""tandem: multi-round LLM serving under prefill/decode disaggregation, with a cluster simulator and planner.

`tandem.LLM` and `tandem.SamplingParams` (the offline API) load torch on first use only, so the
simulator and planner start fast.
"""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "EngineConfig", "LLMEngine"]

_LAZY = {
    "LLM": "tandem.engine.llm",
    "SamplingParams": "tandem.engine.sampling_params",
    "EngineConfig": "tandem.engine.config",
    "LLMEngine": "tandem.engine.llm_engine",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
