"""Reproducible greedy block-diffusion decoding in the engine (the default `dllm_chunk=auto`).

On the committed tiny SDAR checkpoint: a window's size changes what a step commits (so Optimus's elastic windows,
sized from the load, make a greedy request's tokens depend on what runs beside it); under `auto` the worker core
gives a greedy or seeded request the whole block, whose tokens are SDAR's reference loop's whatever the load, and a
sampled one elastic windows, beside each other in one step; each output says which mode ran; a request may name its
own chunk; the options that do not apply are refused.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer  # noqa: E402

from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.diffusion import DllmConfig, generate_cached, generate_reference  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
CFG = DllmConfig(dllm_confidence_threshold=0.9)
WORDS = "words:"                                   # random words: one token a step, window sizes matter most
pytestmark = pytest.mark.usefixtures("window_latency_once")    # tests/conftest.py
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
LOAD = ["copy: abc def ->", "reverse: kkh ->", "sort: bca ->", "words: x", "count: aab ->"] * 2


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(ASSET / "tokenizer.json"))


@pytest.fixture(scope="module")
def model():
    m, _ = load_model(ASSET, dtype="float32")
    return m


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", max_model_len=512,
                                  num_kv_blocks=256, **kw))


def _run(eng: LLMEngine, prompts: list, params: list[SamplingParams]) -> list:
    """Every request to the end; the finished outputs in request order."""
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


def test_a_windows_size_changes_what_a_greedy_prompt_decodes(tok, model):
    """The root cause of elastic's varying outputs: a streaming window of c computes the first c masked positions of
    the block without the masks after them, and only those can commit; the same greedy prompt decodes to other tokens
    at chunk 8 than with the whole block (the reference), so a chunk chosen from the load changes the tokens."""
    ids = tok.encode(WORDS).ids
    ref = generate_reference(model, ids, GREEDY, CFG).token_ids
    (c8,) = generate_cached(model, [ids], GREEDY, CFG, chunk=8)
    assert c8.token_ids != ref


def test_auto_gives_greedy_requests_the_reference_whatever_runs_beside_them(tok, model):
    """Under the default: the greedy prompt alone, then beside ten sampled requests, then again on the same engine
    after that traffic (the elastic sizer has learnt from it) decodes SDAR's reference tokens each time, reporting
    `block`; the sampled requests beside it ran elastic windows in the same steps."""
    eng = _engine()
    assert eng.config.dllm_chunk == "auto"
    ref = generate_reference(model, tok.encode(WORDS).ids, GREEDY, CFG).token_ids
    sampled = SamplingParams(temperature=0.8, max_tokens=48)
    (alone,) = _run(eng, [WORDS], [GREEDY])
    busy = _run(eng, [WORDS, *LOAD], [GREEDY] + [sampled] * len(LOAD))
    (after,) = _run(eng, [WORDS], [GREEDY])
    assert [o.outputs[0].token_ids for o in (alone, busy[0], after)] == [ref] * 3
    assert [o.dllm_chunk for o in (alone, busy[0], after)] == ["block"] * 3
    assert {o.dllm_chunk for o in busy[1:]} == {"elastic"}
    assert set(eng.core.chunker.steps_by_chunk) - {32}       # elastic windows smaller than the block ran


def test_seeded_requests_are_reproducible_and_a_request_may_name_its_chunk(tok, model):
    """A seeded sampled request decodes the whole block under auto (the reference's seeded tokens, beside load); a
    request naming `8` gets the KV-cached loop's chunk-8 tokens and reports `8`; one naming `elastic` gets elastic
    windows although greedy; `auto` in a request is the engine's choice."""
    eng = _engine()
    ids = tok.encode(WORDS).ids
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=64)
    eight = SamplingParams(temperature=0.0, max_tokens=64, dllm_chunk=8)
    outs = _run(eng, [WORDS, WORDS, WORDS, WORDS, *LOAD],
                [seeded, eight, SamplingParams(temperature=0.0, max_tokens=64, dllm_chunk="elastic"),
                 SamplingParams(temperature=0.0, max_tokens=64, dllm_chunk="auto")]
                + [SamplingParams(temperature=0.8, max_tokens=48)] * len(LOAD))
    assert [o.dllm_chunk for o in outs[:4]] == ["block", "8", "elastic", "block"]
    assert outs[0].outputs[0].token_ids == generate_reference(model, ids, seeded, CFG).token_ids
    assert outs[1].outputs[0].token_ids == generate_cached(model, [ids], GREEDY, CFG, chunk=8)[0].token_ids


def test_a_server_wide_mode_decodes_every_request_and_says_so():
    """`dllm_chunk=elastic` (the old default) keeps elastic windows for greedy requests too, and a fixed chunk or the
    block decode every request with it, whatever the request names; each output reports the mode that ran."""
    for chunk, asked, want in (("elastic", None, "elastic"), ("elastic", "block", "block"), ("block", "8", "block"),
                               ("4", "elastic", "4")):
        (o,) = _run(_engine(dllm_chunk=chunk), [WORDS], [SamplingParams(temperature=0.0, max_tokens=8,
                                                                        dllm_chunk=asked)])
        assert o.dllm_chunk == want, (chunk, asked)


def test_bad_chunks_are_refused_with_one_line(tmp_path):
    """Hostile values of a request's dllm_chunk are one SamplingParamsError naming the field; an AR model refuses the
    option; an AR output reports no chunk."""
    for bad in ("fast", "", 0, -1, 4097, "4097", True, 2.5, "٣", "x" * 10_000):
        with pytest.raises(SamplingParamsError, match="^dllm_chunk must be auto, elastic, block or an integer") as e:
            SamplingParams(dllm_chunk=bad)
        assert "\n" not in str(e.value) and len(str(e.value)) < 300
    assert SamplingParams(dllm_chunk=" Block ").dllm_chunk == "block"
    ar = tmp_path / "ar"
    make_tiny_model(str(ar), arch="qwen3", size="1m", seed=0)
    eng = LLMEngine(EngineConfig(model=str(ar), device="cpu", max_model_len=128))
    with pytest.raises(EngineError, match="dllm_chunk: diffusion options, but this model is autoregressive"):
        eng.add_request(None, "hi", SamplingParams(dllm_chunk="block"))
    (o,) = _run(eng, ["hi"], [SamplingParams(temperature=0.0, max_tokens=2)])
    assert o.dllm_chunk is None


def test_a_llada_model_takes_no_chunk_and_reports_none(tmp_path):
    """A LLaDA-style model decodes in dLLM-Serve phases (no windows, tokens independent of the load): the default
    `auto` and `elastic` start it, a request naming a chunk is one EngineError, and outputs report no chunk."""
    ckpt = make_tiny_model(tmp_path / "llada", arch="llada", seed=1,
                           config_overrides={"d_model": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2,
                                             "mlp_hidden_size": 128})
    for chunk in ("auto", "elastic"):
        eng = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu", num_kv_blocks=64,
                                     max_model_len=256, dllm_chunk=chunk))
    with pytest.raises(EngineError, match="^dllm_chunk block sizes Optimus's streaming windows; this engine decodes "
                                          "in dLLM-Serve phases"):
        eng.add_request(None, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, dllm_chunk="block"))
    (o,) = _run(eng, [[5, 6, 7]], [SamplingParams(temperature=0.0, max_tokens=8)])
    assert o.dllm_chunk is None and len(o.outputs[0].token_ids) >= 1
