"""Request bodies against the server: structure caps checked while the body is scanned (keys per object, total keys,
array elements, nesting depth) with a 400 naming the field, never a stalled event loop; unknown fields ignored with a
warning; one vocabulary bound for every token id a request names; no JSON boolean taken for a token id; logit_bias
capped; completions' text_offset in step with text when special tokens are skipped."""
from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from tandem.engine.sampling_params import MAX_LOGIT_BIAS  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.server.app import DEFAULT_MAX_BODY_BYTES, build_app  # noqa: E402
from tandem.server.body import (DEFAULT_MAX_DEPTH, DEFAULT_MAX_OBJECT_KEYS, DEFAULT_MAX_TOTAL_KEYS,  # noqa: E402
                                BodyLimits, check_structure)
from tandem.server.errors import APIError  # noqa: E402
from tandem.server.vocab import logit_bias_cap, token_id_limit  # noqa: E402

MAX_LEN = 512
COMP, CHAT = "/v1/completions", "/v1/chat/completions"
SPECIAL = 382                    # <|im_start|>: a special token of the tiny tokenizer, not an end of sequence


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-body-limits")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    c = AsyncLLM.from_model(str(path), served_model_name="tiny", num_kv_blocks=256, max_model_len=MAX_LEN)
    yield c
    asyncio.run(c.shutdown())


@pytest.fixture(scope="module")
def app(client):
    return build_app(client)


def _post(app, calls: list[tuple[str, object]]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as h:
            out = []
            for path, body in calls:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                out.append(await h.post(path, content=content, headers={"content-type": "application/json"}))
            return out
    return asyncio.run(go())


def _error(r: httpx.Response, param: str | None, code: str = "invalid_value") -> str:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    return err["message"]


def _many_keys(n: int) -> dict[str, int]:
    return {str(i): 1 for i in range(n)}


def _compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------- structure caps
def test_four_700k_key_logit_bias_bodies_are_400s_within_a_second_while_health_stays_fast(app):
    """The attack: 7.6 MB bodies whose logit_bias has 700k keys took 5 s each to parse and stalled /health 1.65 s.
    Four at once now each get a 400 naming logit_bias within a second, and /health's p99 stays under 100 ms."""
    body = _compact({"prompt": "hi", "max_tokens": 1, "logit_bias": _many_keys(700_000)})
    assert len(body) < DEFAULT_MAX_BODY_BYTES

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            async def attack():
                t0 = time.perf_counter()
                r = await c.post(COMP, content=body, headers={"content-type": "application/json"})
                return r, time.perf_counter() - t0
            tasks = [asyncio.ensure_future(attack()) for _ in range(4)]
            lat = []
            while not all(t.done() for t in tasks) or len(lat) < 20:
                s = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                lat.append(time.perf_counter() - s)
                await asyncio.sleep(0.005)
            return [t.result() for t in tasks], lat
    answers, lat = asyncio.run(go())
    for r, took in answers:
        msg = _error(r, "logit_bias")
        assert msg == f"logit_bias: an object has more than {DEFAULT_MAX_OBJECT_KEYS} keys"
        assert took < 1.0, took
    assert statistics.quantiles(lat, n=100)[98] < 0.1, sorted(lat)[-5:]


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": "a", "response_format": _many_keys(DEFAULT_MAX_OBJECT_KEYS + 1)}, "response_format",
     f"response_format: an object has more than {DEFAULT_MAX_OBJECT_KEYS} keys"),
    ({"prompt": "a", "tools": [_many_keys(4000)] * 17}, "tools",
     f"tools: the body has more than {DEFAULT_MAX_TOTAL_KEYS} keys in all"),
    ({"prompt": "a", "stop": [[1] * 1000] * 70}, "stop", "stop: the body has more than 65536 array elements in all"),
    ({"prompt": "a", "user": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "user",
     f"user: objects and arrays nest deeper than {DEFAULT_MAX_DEPTH} levels"),
    ({"prompt": list(range(2 * MAX_LEN + 1))}, "prompt",
     f"prompt: an array has more than {2 * MAX_LEN} elements (no field takes that many)"),
], ids=["object-keys", "total-keys", "total-elements", "depth", "array"])
def test_each_structure_cap_is_a_400_naming_the_top_level_field(app, body, param, message):
    """Protects every cap of the structure check, on a body small enough to be checked on the event loop."""
    (r,) = _post(app, [(COMP, body)])
    assert _error(r, param) == message


def test_the_caps_let_the_largest_bodies_a_field_takes_through(app, client):
    """The caps sit above what a valid request holds: 4096 keys in one object (a tool's properties), nesting to 64,
    and a token-id prompt one short of the context (its own check answers context_length_exceeded past that)."""
    deep = json.loads("[" * (DEFAULT_MAX_DEPTH - 1) + "]" * (DEFAULT_MAX_DEPTH - 1))
    assert check_structure(json.dumps({"a": deep}).encode(), BodyLimits(max_array=8)) == ["a"]
    props = {f"p{i}": {"type": "string"} for i in range(DEFAULT_MAX_OBJECT_KEYS)}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}
    assert check_structure(json.dumps({"messages": [], "tools": [tool]}).encode(),
                           BodyLimits(max_array=8)) == ["messages", "tools"]
    ok, long = _post(app, [(COMP, {"prompt": [5] * (MAX_LEN - 1), "max_tokens": 1}),
                           (COMP, {"prompt": [5] * (MAX_LEN + 1)})])
    assert ok.status_code == 200, ok.text
    _error(long, "prompt", "context_length_exceeded")


def test_strings_hide_structure_and_malformed_strings_are_invalid_json():
    """The check reads strings as strings (brackets, colons and escaped quotes inside them count for nothing), takes
    8 MB of escapes in pieces, and an unterminated string is invalid_json."""
    tricky = {"prompt": '{"a": [1, 2], "\\"": :,' * 1000, "stop": ["]]]]", "\\\\", '"']}
    assert check_structure(json.dumps(tricky).encode(), BodyLimits(max_array=3)) == ["prompt", "stop"]
    escapes = json.dumps({"prompt": '"' * 3_000_000}).encode()
    assert len(escapes) > 6_000_000 and check_structure(escapes, BodyLimits(max_array=2)) == ["prompt"]
    for bad in (b'{"prompt": "abc', b'{"prompt": "ab\\', b'{"prompt": "\\"\\"'):
        with pytest.raises(APIError) as e:
            check_structure(bad, BodyLimits(max_array=2))
        assert e.value.code == "invalid_json" and e.value.message == "malformed JSON body: a string does not end"


def test_an_unknown_field_is_ignored_with_a_warning_and_capped_as_any_other(app, caplog):
    """vLLM's rule for unknown fields (ignored, logged); one of 700k keys is refused as fast as logit_bias is."""
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        ok, big = _post(app, [(COMP, {"prompt": "hi", "max_tokens": 1, "frobnicate": {"a": 1}}),
                              (COMP, _compact({"prompt": "hi", "frobnicate": _many_keys(700_000)}))])
    assert ok.status_code == 200, ok.text
    warned = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warned == ["The following fields were present in the request but ignored: 'frobnicate'"]
    assert _error(big, "frobnicate") == f"frobnicate: an object has more than {DEFAULT_MAX_OBJECT_KEYS} keys"


# ---------------------------------------------------------------------------- one vocabulary bound
def test_one_vocabulary_bound_for_prompts_detokenize_stop_ids_and_logit_bias(app, client):
    """The model embeds 448 ids, the tokenizer decodes 396: a prompt was checked against one, /detokenize against
    the other. Every token id a request names is now checked against the model's, with the same 400; the ids the
    model can sample past the tokenizer's (its padded rows) are accepted everywhere, decoding to no text, so a
    round's output ids can be sent back as the next prompt."""
    assert (client.vocab_size, client.tokenizer.vocab_size) == (448, 396)
    assert token_id_limit(client) == 448
    ok = _post(app, [(COMP, {"prompt": [5, 447], "max_tokens": 1, "stop_token_ids": [447], "logit_bias": {"447": 1}}),
                     ("/detokenize", {"tokens": [5, 447]})])
    assert [r.status_code for r in ok] == [200, 200], [r.text for r in ok]
    assert ok[1].json() == {"prompt": client.tokenizer.decode([5])}
    bad = _post(app, [(COMP, {"prompt": [5, 448]}), ("/detokenize", {"tokens": [448]}),
                      (COMP, {"prompt": "a", "stop_token_ids": [448]}), (CHAT, {"messages": [
                          {"role": "user", "content": "a"}], "logit_bias": {"448": 1}})])
    for r, param in zip(bad, ("prompt", "tokens", "stop_token_ids", "logit_bias")):
        assert _error(r, param) == f"{param}: token id 448 is outside the vocabulary [0, 448)"


@pytest.mark.parametrize("path,body,param", [
    (COMP, {"prompt": [True]}, "prompt"),
    (COMP, {"prompt": [[5, False]]}, "prompt"),
    ("/detokenize", {"tokens": [5, True]}, "tokens.1"),
    (COMP, {"prompt": "a", "stop_token_ids": [False]}, "stop_token_ids.0"),
])
def test_a_json_boolean_is_never_a_token_id(app, path, body, param):
    """`[true]` was taken as token id 1; a boolean where a token id goes is a 400 naming the field."""
    (r,) = _post(app, [(path, body)])
    _error(r, param)


def test_logit_bias_is_capped_at_vllms_limit_or_the_vocabulary(app):
    """vLLM's cap (1024 entries) or the vocabulary's size, whichever is smaller: 448 for the tiny model."""
    assert (MAX_LOGIT_BIAS, logit_bias_cap(448), logit_bias_cap(152_064), logit_bias_cap(None)) == (1024, 448, 1024,
                                                                                                   1024)
    full, over = _post(app, [(COMP, {"prompt": "a", "max_tokens": 1, "logit_bias": {str(i): 0 for i in range(448)}}),
                             (COMP, {"prompt": "a", "logit_bias": {str(i): 0 for i in range(449)}})])
    assert full.status_code == 200, full.text
    assert _error(over, "logit_bias") == ("logit_bias may have at most 448 entries (vLLM's cap or the vocabulary's "
                                          "size, whichever is smaller), got 449")


# ---------------------------------------------------------------------------- text_offset
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_text_offset_agrees_with_text_when_special_tokens_are_skipped(app, stream, skip):
    """A skipped special token counted in text_offset though absent from text; it now advances the offset only when
    its text is in `text`. The output is forced to three special tokens (logit_bias +100), echoed prompt first."""
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "temperature": 0, "logprobs": 0, "echo": True,
            "logit_bias": {str(SPECIAL): 100}, "skip_special_tokens": skip, "stream": stream}
    (r,) = _post(app, [(COMP, body)])
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
        offsets = [o for lp in lps for o in lp["text_offset"]]
    else:
        choice = r.json()["choices"][0]
        text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    prompt = tokens[:-3]
    assert "".join(prompt) == "hi" and tokens[-3:] == ["<|im_start|>"] * 3
    assert text == "hi" + ("" if skip else "<|im_start|>" * 3)
    head = [sum(len(t) for t in prompt[:i]) for i in range(len(prompt))]
    tail = [2, 2, 2] if skip else [2, 14, 26]
    assert offsets == head + tail
    assert all(text[o:].startswith(t) for o, t in zip(offsets, tokens) if not (skip and t == "<|im_start|>"))
