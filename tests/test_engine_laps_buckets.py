"""The engine's LAPS bucket path: a short-prefill batch the core placed in a (length, batch) bucket runs over the
bucket's padded rows, and its KV and first tokens are exactly those of the same prompts prefilled unpadded."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [list(range(5, 25)), list(range(30, 60)), list(range(100, 200))]     # 20, 30 and 100 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-buckets")
    make_tiny_model(path, arch="qwen3", size="1m", seed=4)
    return str(path)


def prefill(path: str, policy: str) -> tuple[dict, list[int]]:
    """Prefill PROMPTS on a prefill engine of `policy`: {request: (KV payload, first token)} and each step's pad_to."""
    eng = LLMEngine(EngineConfig(model=path, policy=policy, num_kv_blocks=64, max_model_len=512), role="prefill",
                    worker_id=0)
    for i, p in enumerate(PROMPTS):
        eng.add_prefill(f"r{i}", p, GREEDY, f"s{i}", l_hist=0)
    done, pads = {}, []
    for _ in range(100_000):                       # AWD holds the batch for its window (20 ms of the engine's clock)
        prep = eng.prepare_step()
        if prep.batch is not None:
            pads.append(prep.batch.pad_to)
        eng.finish_step(prep, eng.execute_step(prep))
        eng.core_events.clear()
        for i in range(len(PROMPTS)):
            rid = f"r{i}"
            if rid not in done and eng.requests[rid].first_token is not None:      # its prefill is done
                payload, tok, _ = eng.export_new_kv(rid)
                done[rid] = (payload.data.clone(), tok)
        if len(done) == len(PROMPTS):
            return done, pads
    raise AssertionError("the prefills did not finish")


def test_a_bucketed_short_batch_writes_the_same_kv_and_first_tokens_as_unpadded(tiny):
    """Protects the bucket identity: with LAPS the three prompts run as one step padded to the (128, 4)
    bucket (512 rows); sglang-pd runs them unpadded; every KV entry and first token is equal."""
    padded, pads = prefill(tiny, "laps")
    plain, plain_pads = prefill(tiny, "sglang-pd")
    assert pads == [512] and set(plain_pads) == {0}
    for rid in plain:
        assert padded[rid][1] == plain[rid][1]
        assert torch.equal(padded[rid][0], plain[rid][0])
