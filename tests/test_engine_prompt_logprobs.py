"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) and logit_bias through the engine on a tiny random
checkpoint: values equal a full-sequence forward's log_softmax, chunked prefill and the prefix cache never lose
a position, and the coordinator keeps such prefills on the session's own worker."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.core.actions import Submit  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.sim.cluster import SimConfig, build  # noqa: E402

PROMPT = list(range(10, 50))                  # 40 tokens: 3 prefill chunks of <= 16, 2 full blocks of 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-plp")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    return str(path)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    """Prefix caching on (the default), prefills chunked by 16 tokens."""
    return LLM(tiny, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def reference(tiny):
    """log_softmax of transformers' forward over a whole token sequence (row j predicts token j + 1)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ref


def _params(k: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k, **kw)


def _assert_matches(plp: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape (None, then the prompt token's logprob plus the top k per position) and the reference values."""
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert entry[ids[j]] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        top = ref[j - 1].topk(k).indices.tolist() if k else []
        assert set(entry) == {ids[j], *top}
        for t in top:
            assert entry[t] == pytest.approx(ref[j - 1, t].item(), abs=1e-4)


def test_prompt_logprobs_equal_a_full_forward_log_softmax_across_prefill_chunks(llm, reference):
    """Protects the values and shape: every prompt position (3 prefill chunks) equals the reference, top 3 too."""
    out = llm.generate([PROMPT], _params(3))[0]
    _assert_matches(out.prompt_logprobs, PROMPT, reference(PROMPT), 3)
    assert llm.generate([list(range(60, 70))], _params(None))[0].prompt_logprobs is None


def test_prompt_logprobs_0_carries_only_each_prompt_token(llm, reference):
    """Protects k = 0: one entry per position, the prompt token's own logprob."""
    ids = list(range(100, 125))
    out = llm.generate([ids], _params(0))[0]
    _assert_matches(out.prompt_logprobs, ids, reference(ids), 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_a_cached_prompt_still_gets_every_position(llm, reference):
    """Protects the prefix-cache skip: a prompt whose 2 full blocks are cached is computed whole when it asks for
    prompt logprobs (0 cached tokens), while the same prompt without them reuses the 32 cached tokens."""
    ids = list(range(200, 240))
    llm.generate([ids], _params(None))
    again = llm.generate([ids], _params(2))[0]
    assert again.num_cached_tokens == 0
    _assert_matches(again.prompt_logprobs, ids, reference(ids), 2)
    assert llm.generate([ids], _params(None))[0].num_cached_tokens == 32


def test_a_session_round_with_prompt_logprobs_recomputes_its_resident_history(llm, reference):
    """Protects sessions: a round asking for prompt logprobs covers the whole conversation, not only its new
    tokens (the resident history is dropped and recomputed), and its greedy reply is unchanged."""
    first = llm.generate([PROMPT], _params(None), session_ids=["s"])[0]
    conv = PROMPT + first.token_ids + [7, 8, 9]
    plain = llm.generate([conv], _params(None))[0]
    out = llm.generate([conv], _params(1), session_ids=["s"])[0]
    assert out.num_cached_tokens == 0 and out.token_ids == plain.token_ids
    _assert_matches(out.prompt_logprobs, conv, reference(conv), 1)
    llm.engine.end_session("s")


def test_logit_bias_forces_a_token_and_an_id_beyond_the_vocabulary_is_refused(llm):
    """Protects logit_bias end to end: +100 on a token makes every greedy and sampled token that one; an id the
    model does not have is an EngineError when the request is added."""
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={321: 100}))[0]
    sampled = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True,
                                                    logit_bias={321: 100}))[0]
    assert greedy.token_ids == [321] * 4 and sampled.token_ids == [321] * 4
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(EngineError, match=f"logit_bias: token id {vocab} is outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}))


def test_a_decode_worker_refuses_a_remote_round_with_prompt_logprobs(tiny):
    """Protects the rule that prompt logprobs exist only where the prefill runs: never a remote round."""
    eng = LLMEngine(EngineConfig(model=tiny), role="decode")
    with pytest.raises(EngineError, match="prefilled on its decode worker"):
        eng.add_request("r", PROMPT, _params(0), session_id="s", remote=True)


def test_the_coordinator_keeps_a_full_prefill_on_the_sessions_worker():
    """Protects the scheduling rule in the core: under an always-remote router (dynamo), a round with full_prefill
    is submitted to its decode worker as a local task, and the session's next plain round goes remote again."""
    coord, workers, loop = build(SimConfig("llama-3.1-70b", "h20", 8, "P:tp4x1,D:tp4x1", "dynamo"))
    (sub,) = [a for a in coord.on_round("s", 500, 4, 0.0, full_prefill=True) if isinstance(a, Submit)]
    rec = coord.records[0]
    assert sub.worker == rec.decode_worker and sub.task.local and sub.task.full_prefill
    assert rec.rounds[0].prefill_where == "local"
    loop._apply([sub])
    loop.run([])
    assert rec.rounds[0].output_tokens == 4
    (nxt,) = [a for a in coord.on_round("s", 50, 4, loop.now) if isinstance(a, Submit)]
    assert workers[nxt.worker].role == "prefill" and not nxt.task.full_prefill
