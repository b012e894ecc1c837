"""The engine end to end on tiny random checkpoints: greedy parity with transformers, batching invariance
under chunked prefill and preemption, multi-round KV reuse, prefix caching, limits and errors."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.core.config import PreemptionMode  # noqa: E402
from tandem.engine.config import EngineError  # noqa: E402
from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

PROMPT_LENS = (5, 17, 33, 50)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(path, arch=request.param, size="1m", seed=1)
    return str(path)


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 8, (n,), generator=g).tolist() for n in lens]


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


# Engines with identical options are built once per checkpoint and shared by the tests below. Every prompt a
# test sends to a shared engine is its own (distinct seeds), so the prefix cache of the default engine never
# serves one test from another's blocks; the prefix-caching-free engine keeps nothing between requests.
@pytest.fixture(scope="module")
def _shared_default(tiny):
    return LLM(tiny)


@pytest.fixture(scope="module")
def _shared_cold(tiny):
    return LLM(tiny, enable_prefix_caching=False)


def _handed_back(llm: LLM) -> None:
    """After a test: nothing may still run on a shared engine; its sessions are ended for the next test."""
    eng = llm.engine
    left = [rid for rid, r in eng.requests.items() if not r.finished]
    for rid in left:
        eng.abort_request(rid)
    for sid in list(eng.sessions):
        eng.end_session(sid)
    assert not left, f"the test left requests running on a shared engine: {left}"


@pytest.fixture
def llm(_shared_default):
    """The default engine (`LLM(tiny)`), shared."""
    yield _shared_default
    _handed_back(_shared_default)


@pytest.fixture
def cold(_shared_cold):
    """`LLM(tiny, enable_prefix_caching=False)`, shared: every request is computed from scratch."""
    yield _shared_cold
    _handed_back(_shared_cold)


def test_greedy_matches_transformers_generate_for_a_batch_of_different_lengths(tiny):
    transformers = pytest.importorskip("transformers")
    llm = LLM(tiny, max_num_batched_tokens=64)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    # min_tokens masks EOS like transformers' min_new_tokens does (ignore_eos alone would let EOS be chosen)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for p, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long), pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist()
        assert out.prompt_token_ids == p
        assert out.outputs[0].finish_reason == "length"


def test_outputs_do_not_depend_on_batching_chunking_or_preemption(tiny, cold):
    prompts = _prompts(400, lens=(40, 70, 25, 90, 60, 33), seed=3)
    alone = [cold.generate([p], GREEDY)[0].token_ids for p in prompts]
    # 24 blocks of 16 tokens cannot hold six sequences of ~150 tokens: the scheduler must preempt
    small = LLM(tiny, num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=32)
    together = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    assert sum(o.metrics.num_preemptions for o in together) > 0
    # preemption by swap (vLLM's preemption_mode="swap"): the KV goes to host memory and back, no prefill again
    swap = LLM(tiny, num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=32, preemption_mode="swap")
    swapped = swap.generate(prompts, GREEDY)
    core = swap.engine.core
    assert [o.token_ids for o in swapped] == alone
    assert core.kv.preempted[PreemptionMode.SWAP] > 0 and core.kv.preempted[PreemptionMode.RECOMPUTE] == 0
    assert sum(o.metrics.num_computed_tokens for o in swapped) == sum(len(p) for p in prompts)
    assert swap.engine.runner.swap_space.held == {} and swap.engine.stats.swapped_out_bytes == 0


def test_aborting_a_swapped_out_request_drops_its_host_copy_and_frees_the_swap_space(tiny):
    """No KV is lost or leaked through a swap: a request aborted while its KV waits in host memory leaves no copy
    behind (the core's Swap(DROP) reaches the engine at its next step), the swap space is whole again, and the other
    requests finish with the tokens they decode alone."""
    prompts = _prompts(400, lens=(40, 70, 25, 90, 60, 33), seed=3)
    eng = LLM(tiny, num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=32, preemption_mode="swap").engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    done: dict[str, list[int]] = {}
    victim = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        if victim is None and eng.core.swapped:
            victim = eng.core.swapped[0].session_id
            rid = next(r for r, q in eng.requests.items() if q.session_id == victim)
            assert eng.runner.swap_space.held and eng.core.kv.swap_free < eng.core.cfg.swap_blocks
            eng.abort_request(rid)
    assert victim is not None
    assert eng.runner.swap_space.held == {} and eng.core.kv.swap_free == eng.core.cfg.swap_blocks \
        and eng.core.swapped == []
    assert eng.stats.swapped_out_bytes == 0 and rid not in done
    alone = LLM(tiny, enable_prefix_caching=False)
    for r, toks in done.items():
        assert toks == alone.generate([prompts[int(r)]], GREEDY)[0].token_ids


def test_a_five_round_session_prefills_only_new_tokens_and_matches_recomputation(llm, cold):
    vocab = llm.engine.model_config.vocab_size
    appends = _prompts(vocab, lens=(30, 7, 12, 3, 20), seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    conv: list[int] = []
    for k, new in enumerate(appends):
        conv = conv + new
        out = llm.generate([conv], params, session_ids=["s"])[0]
        scratch = cold.generate([conv], params)[0]
        assert out.token_ids == scratch.token_ids
        if k == 0:
            assert out.metrics.num_computed_tokens == len(new)
            assert out.num_cached_tokens == 0
        else:   # the new tokens plus the previous round's last output, whose KV was never written
            assert out.metrics.num_computed_tokens == len(new) + 1
            assert out.num_cached_tokens == len(conv) - len(new) - 1
        conv = conv + out.token_ids


def test_prefix_cache_reuses_full_blocks_and_keeps_outputs(llm, cold):
    vocab = llm.engine.model_config.vocab_size
    shared = _prompts(vocab, lens=(70,), seed=7)[0]
    a, b = shared + [5, 6, 7], shared + [9, 10]
    first = llm.generate([a], GREEDY)[0]
    second = llm.generate([b], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64           # 4 full blocks of 16 of the 70 shared tokens
    assert second.metrics.num_computed_tokens == len(b) - 64
    scratch = cold.generate([b], GREEDY)[0]
    assert second.token_ids == scratch.token_ids


def test_stop_strings_token_ids_and_max_tokens_end_requests(llm):
    base = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    out = llm.generate([[10, 11, 12]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      stop_token_ids=[stop_tok]))[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_seeded_sampling_is_reproducible_and_logprobs_are_reported(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=123, max_tokens=16, ignore_eos=True, logprobs=2)
    a = llm.generate(["abc", "defgh"], [p, SamplingParams(temperature=0.7, seed=9, max_tokens=16)])[0]
    b = llm.generate(["abc"], p)[0]
    assert a.token_ids == b.token_ids
    lps = a.outputs[0].logprobs
    assert len(lps) == 16 and all(tok in entry for tok, entry in zip(a.token_ids, lps))
    assert all(v <= 0 for entry in lps for v in entry.values())


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "hi there"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    text = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(out.token_ids) == 4


def test_limits_raise_clear_errors(tiny):
    llm = LLM(tiny, max_model_len=64)
    with pytest.raises(EngineError, match="max_model_len"):
        llm.generate([list(range(3, 67))], GREEDY)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**7]], GREEDY)
    with pytest.raises(EngineError, match="KV pool holds 32 tokens"):
        LLM(tiny, num_kv_blocks=2, max_model_len=64)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(EngineError, match="empty"):
        llm.generate([[]], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_is_clipped_to_the_context(tiny):
    llm = LLM(tiny, max_model_len=40)
    out = llm.generate([list(range(3, 33))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_decode_attention_split_into_many_length_groups_keeps_outputs(cold, monkeypatch):
    """The SDPA backend cuts a decode batch into length-sorted groups by gathered K/V size; with a tiny
    group budget every sequence is its own group, and outputs must equal the one-group run. (The engine
    without prefix caching: the second run recomputes its prompts as the first did, only the grouping differs;
    DECODE_GROUP_BYTES is read at every decode step.)"""
    from tandem.engine.attention import sdpa

    prompts = _prompts(400, lens=(40, 7, 25, 90, 60, 33), seed=5)
    one_group = cold.generate(prompts, GREEDY)
    monkeypatch.setattr(sdpa, "DECODE_GROUP_BYTES", 1)
    many = cold.generate(prompts, GREEDY)
    assert [o.token_ids for o in many] == [o.token_ids for o in one_group]
