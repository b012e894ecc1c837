"""Structured output (xgrammar) on tiny random checkpoints: JSON-schema and JSON-object generations parse and
validate, grammar-free rows of a mixed batch are untouched, bad schemas fail at the door with one-line errors."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tandem.core.types import PrefillDone  # noqa: E402
from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampler import Sampler  # noqa: E402
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from tandem.engine.structured_output import (StructuredOutput, StructuredOutputError,  # noqa: E402
                                             StructuredOutputManager, vocab_bytes)
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

# Strings are bounded with `pattern` rather than maxLength: xgrammar 0.2.8's maxLength rule lets raw control
# characters into a string (invalid JSON), which a random model does produce.
from structured_schema import SCHEMA  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"so-{request.param}")
    make_tiny_model(path, arch=request.param, size="1m", seed=1)
    return str(path)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, enable_prefix_caching=False)


def test_json_schema_generations_parse_and_validate(llm):
    so = StructuredOutput.json_schema(SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_output=so) for i in range(20)]
    outs = llm.generate([f"Describe person number {i}:" for i in range(20)], params)
    texts = set()
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert c.token_ids[-1] in llm.tokenizer.eos_token_ids        # EOS, allowed only once the JSON is complete
        jsonschema.validate(json.loads(c.text), SCHEMA)
        texts.add(c.text)
    assert len(texts) > 10                                             # sampled, not one answer


def test_greedy_json_schema_with_ignore_eos_still_ends_with_the_grammar(llm):
    so = StructuredOutput.json_schema(SCHEMA)
    out = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, structured_output=so))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_mode_gives_parseable_json(llm):
    so = StructuredOutput.json_object()
    temps = [0.0, 0.0, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=512, structured_output=so) for i, t in enumerate(temps)]
    outs = llm.generate([f"Reply in JSON, case {i}." for i in range(len(temps))], params)
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    # a random model may wander inside a string until max_tokens; those that end must be complete JSON objects
    assert len(stopped) >= 3
    for c in stopped:
        assert isinstance(json.loads(c.text), dict), c.text
    for o in outs:
        assert o.outputs[0].text.startswith("{")


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm):
    prompts = [f"mixed batch prompt {i} " * (i + 1) for i in range(6)]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    so = StructuredOutput.json_schema(SCHEMA)
    mixed = [free if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=128, structured_output=so)
             for i in range(6)]
    base = llm.generate(prompts, [free] * 6)
    got = llm.generate(prompts, mixed)
    for i in range(0, 6, 2):
        assert got[i].outputs[0].token_ids == base[i].outputs[0].token_ids
    for i in range(1, 6, 2):
        jsonschema.validate(json.loads(got[i].outputs[0].text), SCHEMA)
        assert got[i].outputs[0].token_ids != base[i].outputs[0].token_ids


def test_sampler_masks_only_rows_with_a_grammar(tiny):
    from tandem.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny)
    vocab = 448
    mgr = StructuredOutputManager(tok, vocab)
    g = mgr.grammar(StructuredOutput.json_object())
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 3
    sampler = Sampler(tok.eos_token_ids)
    plain = sampler.sample(logits, params).token_ids
    masked = sampler.sample(logits, params, grammars=[None, g, None]).token_ids
    assert masked[0] == plain[0] and masked[2] == plain[2]
    assert tok.decode([masked[1]]).startswith("{")                    # a JSON object's first token
    assert logits.isfinite().all()                                    # the caller's logits are not modified
    # min_tokens forbids EOS where the grammar allows only EOS: the grammar wins
    assert g.matcher.accept_string("{}")
    out = sampler.sample(logits[:1], [SamplingParams(temperature=0.0, min_tokens=5)], output_tokens=[[1, 2]],
                         grammars=[g]).token_ids
    assert out[0] in tok.eos_token_ids
    assert g.accept(out[0]) and g.terminated and g.rejected is None


def test_vocab_bytes_of_the_byte_level_tokenizer(tiny):
    from tandem.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny)
    enc, prefix_space = vocab_bytes(tok, 448)
    assert len(enc) == 448 and not prefix_space
    assert enc[ord("{")] == b"{" and enc[ord("\n")] == b"\n"
    assert enc[tok.token_to_id("Ġthe")] == b" the"
    assert enc[tok.token_to_id("<tool_call>")] == b"<tool_call>"        # an added, non-special token keeps its text
    assert all(enc[t] == b"" for t in tok.eos_token_ids)               # special tokens never match text
    assert enc[tok.vocab_size:] == [b""] * (448 - tok.vocab_size)       # the model's padding


def test_remote_prefill_first_token_advances_the_decode_side_grammar(tiny):
    cfg = dict(model=tiny, max_num_batched_tokens=32, num_kv_blocks=64, max_model_len=1024)
    p = LLMEngine(EngineConfig(**cfg), role="prefill", worker_id=0)
    d = LLMEngine(EngineConfig(**cfg), role="decode", worker_id=1)
    params = SamplingParams(temperature=0.0, max_tokens=128, structured_output=StructuredOutput.json_schema(SCHEMA))
    prompt = d.tokenizer.encode("A remote round of structured output:")
    hist = d.begin_round("s")
    d.add_request("r", prompt, params, session_id="s", remote=True)
    p.add_prefill("r", prompt, params, "s", l_hist=hist)
    outs = []
    for _ in range(50):
        p.step()
        evs, p.core_events = p.core_events, []
        if any(isinstance(ev, PrefillDone) for ev in evs):
            payload, tok, lps = p.export_new_kv("r")
            assert d.tokenizer.decode([tok]).startswith("{")           # the prefill worker sampled under the grammar
            d.receive_kv("r", payload)
            outs = d.on_kv_arrived("r", tok, lps)
            p.on_delivered("r")
            break
    for _ in range(300):
        if any(o.finished for o in outs):
            break
        outs = d.step()
    c = [o for o in outs if o.finished][0].outputs[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), SCHEMA)


def test_grammar_cache_is_keyed_by_spec(llm):
    mgr = llm.engine.structured
    a = mgr.compile(StructuredOutput.json_schema(SCHEMA))
    b = mgr.compile(StructuredOutput.json_schema(json.dumps(SCHEMA)))      # same schema, as text
    assert a is b
    assert mgr.compile(StructuredOutput.json_schema(SCHEMA, strict=False)) is not a


@pytest.mark.parametrize("schema, words", [
    ({"type": "objekt"}, "objekt"),
    ({"type": "object", "properties": 5}, "properties"),
    ({"type": "object", "required": "a"}, "required"),
    ({"$ref": "#/defs/x"}, "defs"),
    ({"type": "string", "pattern": "("}, "parenthesis"),
    ([], "object"),
    ("{not json", "not valid JSON"),
    ({"type": "number", "minimum": float("nan")}, "serialisable"),
])
def test_malformed_schema_is_a_clear_value_error(schema, words):
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutput.json_schema(schema)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "\n" not in msg and words in msg and "/project/" not in msg and len(msg) < 400


def test_spec_validation_and_transport():
    with pytest.raises(StructuredOutputError, match="kind"):
        StructuredOutput("regex", "a+")
    with pytest.raises(StructuredOutputError, match="no schema"):
        StructuredOutput("json_object", {"type": "object"})
    with pytest.raises(StructuredOutputError, match="strict"):
        StructuredOutput.json_schema({"type": "object"}, strict="yes")
    so = StructuredOutput.json_schema(SCHEMA)
    assert json.loads(so.schema) == SCHEMA and list(json.loads(so.schema)["properties"]) == list(SCHEMA["properties"])
    # a dict of its fields (how it crosses a process boundary) becomes a StructuredOutput again
    sp = SamplingParams(structured_output={"kind": "json_schema", "schema": so.schema, "strict": True,
                                           "any_whitespace": False})
    assert sp.structured_output == so and sp.clone().structured_output == so
    with pytest.raises(SamplingParamsError, match="structured_output"):
        SamplingParams(structured_output={"kind": "json_schema", "schema": {"type": "objekt"}})
    with pytest.raises(SamplingParamsError, match="structured_output"):
        SamplingParams(structured_output="json")
    assert StructuredOutput.from_response_format({"type": "text"}) is None
    assert StructuredOutput.from_response_format({"type": "json_object"}) == StructuredOutput.json_object()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert StructuredOutput.from_response_format(rf) == so
    with pytest.raises(StructuredOutputError):
        StructuredOutput.from_response_format({"type": "yaml"})
