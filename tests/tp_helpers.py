"""What the tensor-parallel test modules share: the two-core marker and the tp=1 reference of a three-round session."""
from __future__ import annotations

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm import LLM
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.parallel import group
from tandem.engine.sampling_params import SamplingParams

needs_two_cores = pytest.mark.skipif(group.usable_cpus() < 2, reason="two ranks need two CPU cores")


def three_round_reference(model: str, greedy: SamplingParams) -> tuple[list[list[int]], list[list[int]]]:
    """Three rounds' new tokens (37, 21 and 9 random ids, seed 0) and the tp=1 co-located engine's greedy output after
    each, the conversation growing by both."""
    vocab = LLMEngine(EngineConfig(model=model, num_kv_blocks=8, max_model_len=128)).model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    news = [torch.randint(3, vocab - 8, (k,), generator=g).tolist() for k in (37, 21, 9)]
    ref = LLM(model, max_num_batched_tokens=32)
    conv, want = [], []
    for new in news:
        conv = conv + new
        out = ref.generate([conv], greedy)[0].token_ids
        want.append(out)
        conv = conv + out
    return news, want
