"""Block-diffusion decoding and training for SDAR-style models: reference loops, unmasking rules, a tiny trainer.

TINY_SDAR is the committed trained checkpoint (`tandem tiny-model --arch sdar --train`, docs/diffusion.md).
"""
from pathlib import Path

from tandem.engine.diffusion.generate import DiffusionOutput, generate_cached, generate_reference
from tandem.engine.diffusion.unmasking import UNMASKING_STRATEGIES, DllmConfig, sample_tokens, select_commits

TINY_SDAR = Path(__file__).resolve().parent / "assets" / "tiny-sdar"

__all__ = ["TINY_SDAR", "UNMASKING_STRATEGIES", "DiffusionOutput", "DllmConfig", "generate_cached",
           "generate_reference", "sample_tokens", "select_commits"]
