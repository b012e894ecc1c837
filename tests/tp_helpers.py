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


# The live TP serving modules' checkpoint, engine limits and tp=1 offline reference (module fixtures, imported there)
SERVED_MODEL = "tiny-tp"
SERVE_ENGINE = dict(max_model_len=512, num_kv_blocks=128, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The tiny Qwen3 (1m, seed 5) the live TP modules serve."""
    from tandem.engine.tiny_model import make_tiny_model
    path = tmp_path_factory.mktemp("tiny-tp-serve")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    return str(path)


@pytest.fixture(scope="module")
def offline(tiny):
    """The one-thread offline engine on that checkpoint: the tokens every deployment must reproduce."""
    from live_server import one_thread_llm
    with one_thread_llm(tiny, **SERVE_ENGINE) as llm:
        yield llm
