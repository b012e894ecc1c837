"""The OpenAI-compatible server over AsyncLLM on a tiny checkpoint: the official openai client, greedy parity
with the offline LLM, streaming, sessions and cached tokens, metrics, every bad-input case, client disconnects
(abort + KV freed), failures after acceptance, and 200 concurrent mixed requests."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tandem.engine.llm import LLM  # noqa: E402
from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.engine.tokenizer import Tokenizer  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.runtime.client import BackendStats, RequestError  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.tool_parser import parse_tool_calls  # noqa: E402
from live_server import fire_concurrently  # noqa: E402

KEY = "sk-test"
MODEL = "tiny"
MAX_LEN = 512
MAX_BODY = 1 << 20
ENGINE_ARGS = dict(num_kv_blocks=1024, max_model_len=MAX_LEN)
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "what is the weather in Paris?"}]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-server")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    return str(path)


@pytest.fixture(scope="module")
def client(ckpt) -> Iterator[AsyncLLM]:
    c = AsyncLLM.from_model(ckpt, served_model_name=MODEL, **ENGINE_ARGS)
    yield c
    asyncio.run(c.shutdown())


@pytest.fixture(scope="module")
def offline(ckpt) -> LLM:
    return LLM(ckpt, **ENGINE_ARGS)


class _Server:
    """uvicorn on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, app) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(client) -> Iterator[_Server]:
    srv = _Server(build_app(client, api_key=KEY, max_body_bytes=MAX_BODY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _post(server: _Server, path: str, body, headers: dict | None = None, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={**AUTH, **(headers or {})}, timeout=60, **kw)


def _sse(text: str) -> list:
    """The JSON events of an SSE body ([DONE] as the string)."""
    events = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _wait_idle(client: AsyncLLM, timeout: float = 10.0) -> None:
    """Wait until the engine has no unfinished request and every KV block is free."""
    eng = client.engine
    deadline = time.time() + timeout
    while eng.has_unfinished_requests() or eng.core.blocks.num_free != eng.core.blocks.num_blocks:
        assert time.time() < deadline, "the engine kept requests or KV blocks"
        time.sleep(0.02)


def _greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------------------- the openai client
def test_models_list_names_the_served_model_and_its_context(oai):
    """Protects GET /v1/models: the served name and max_model_len."""
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_LEN
    assert oai.models.retrieve(MODEL).id == MODEL


def test_chat_is_the_offline_llm_greedy_output(oai, offline):
    """Protects prompt construction (chat template + encode without special tokens) and the response shape."""
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    ref = offline.chat(USER, _greedy(12))[0]
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == (ref.text or None) and not msg.tool_calls
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_chat_with_usage_equals_the_offline_output(oai, offline):
    """Protects SSE chat: role first, content deltas, finish reason, a final usage chunk with empty choices."""
    stream = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    ref = offline.chat(USER, _greedy(12))[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.outputs[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert last.usage.prompt_tokens_details is not None
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_ends_with_done(server):
    """Protects the wire format: `data: {...}` events separated by blank lines, then `data: [DONE]`."""
    r = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    events = _sse(r.text)
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])


def test_completions_match_offline_for_text_and_token_prompts(oai, offline):
    """Protects /v1/completions: text prompts (encoded with special tokens) and token-id prompts."""
    ref = offline.generate(["hello world"], _greedy(10))[0]
    r = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.token_ids)
    ids = ref.prompt_token_ids
    r2 = oai.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert r2.choices[0].text == ref.text
    r3 = oai.completions.create(model=MODEL, prompt=["hello world"], max_tokens=10, temperature=0)
    assert r3.choices[0].text == ref.text
    chunks = list(oai.completions.create(model=MODEL, prompt="hello world", max_tokens=10, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_completion_logprobs_are_per_token_with_top_k(oai, offline):
    """Protects logprobs as an int: tokens, token_logprobs, top_logprobs (k entries) and text offsets."""
    ref = offline.generate(["hello world"], _greedy(6, logprobs=2))[0]
    r = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    for mine, tid, entry in zip(lp.token_logprobs, ref.token_ids, ref.outputs[0].logprobs):
        assert mine == pytest.approx(entry[tid], abs=1e-4)


def test_chat_logprobs_and_top_logprobs(oai):
    """Protects chat logprobs: one entry per token, each with top_logprobs of the requested size."""
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    # greedy: the chosen token is the most likely one
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_stop_string_streams_the_same_text_as_offline(server, offline):
    """Protects streaming hold-back: text that a stop string later cuts is never sent."""
    full = offline.generate(["hello world"], _greedy(24, ignore_eos=True))[0].text
    stop = full[8:10] if len(full) >= 10 else full[-2:]
    ref = offline.generate(["hello world"], _greedy(24, ignore_eos=True, stop=[stop]))[0]
    body = {"prompt": "hello world", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop,
            "stream": True}
    events = _sse(_post(server, "/v1/completions", body).text)
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == ref.text and stop not in text
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_vllm_extras_are_accepted(server, offline):
    """Protects the vLLM sampling extras: top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids."""
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.1,
            "ignore_eos": True, "min_tokens": 6, "stop_token_ids": [1], "skip_special_tokens": False,
            "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.5, "top_p": 0.9}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------- tools, sessions
def test_tool_call_conversation_across_two_rounds(oai, offline, client):
    """Protects the tool path end to end: tools in round 1, assistant tool_calls + tool result in round 2."""
    r1 = oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=16, temperature=0)
    ref1 = offline.chat(USER, _greedy(16), tools=TOOLS)[0]
    content, calls = parse_tool_calls(ref1.text)
    assert r1.choices[0].message.content == content
    assert [c.function.name for c in r1.choices[0].message.tool_calls or []] == [c.name for c in calls]
    assert r1.usage.prompt_tokens == len(ref1.prompt_token_ids)
    round2 = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r2 = oai.chat.completions.create(model=MODEL, messages=round2, tools=TOOLS, tool_choice="auto", max_tokens=16,
                                     temperature=0)
    rendered = client.tokenizer.apply_chat_template(round2, tools=TOOLS, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert r2.usage.prompt_tokens == len(client.tokenizer.encode(rendered, add_special_tokens=False))
    ref2 = offline.chat(round2, _greedy(16), tools=TOOLS)[0]
    content2, _ = parse_tool_calls(ref2.text)
    assert r2.choices[0].message.content == content2
    # tool_choice none: the same prompt, no parsing
    r3 = oai.chat.completions.create(model=MODEL, messages=round2, tools=TOOLS, tool_choice="none", max_tokens=16,
                                     temperature=0)
    assert r3.choices[0].message.content == (ref2.text or None) and not r3.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_reports_cached_history_tokens(server, client, stream):
    """Protects sessions (x-session-id header, body session_id) and prompt_tokens_details.cached_tokens."""
    sid = f"sess-{stream}"
    ids = client.tokenizer.encode(f"{sid}: hello world, this is a session")

    def run(prompt: list[int], headers: dict | None = None, extra: dict | None = None) -> tuple[list[int], dict]:
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None, **(extra or {})}
        r = _post(server, "/v1/completions", body, headers)
        assert r.status_code == 200, r.text
        if not stream:
            return [], r.json()["usage"]
        events = _sse(r.text)
        return [], events[-2]["usage"]

    _, u1 = run(ids, {"x-session-id": sid})
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    out = client.engine.sessions[sid].tokens[len(ids):]          # the resident conversation after round 1
    assert len(out) == 5
    conv = ids + out + client.tokenizer.encode(" and more")
    _, u2 = run(conv, extra={"session_id": sid})
    # every token of round 1 is resident except the last output, whose KV was never written
    assert u2["prompt_tokens_details"]["cached_tokens"] == len(ids) + len(out) - 1
    client.end_session(sid)


def test_conflicting_session_ids_are_rejected(server):
    """Protects session resolution: a header and a body field that disagree are a 400."""
    r = _post(server, "/v1/completions", {"prompt": "hi", "session_id": "a"}, {"x-session-id": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


# ---------------------------------------------------------------------------- health, metrics
def test_health_and_metrics_are_open_and_metrics_have_every_name(server, oai):
    """Protects /health (200, no key) and /metrics (Prometheus text, vLLM + tandem names, model_name label)."""
    oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "tandem:local_prefills_total",
                 "tandem:remote_prefills_total", "tandem:kv_transfer_seconds_bucket", "tandem:workers_alive",
                 "tandem:kv_transfer_timeouts_total"):
        assert f'{name}{{' in text and f'model_name="{MODEL}"' in text, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"}' in text
    assert 'tandem:workers_alive{model_name="tiny"} 1.0' in text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['vllm:generation_tokens_total{model_name="tiny"}']) >= 4
    assert float(lines['vllm:prefix_cache_queries_total{model_name="tiny"}']) > 0
    assert float(lines['vllm:time_to_first_token_seconds_count{model_name="tiny"}']) >= 1


# ---------------------------------------------------------------------------- bad input
_MSG = {"messages": USER}
BAD = [
    # (what it protects, path, body, status, code, param)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json", None),
    ("empty body", "/v1/chat/completions", b"", 400, "invalid_json", None),
    ("body is not an object", "/v1/chat/completions", b"[1, 2]", 400, "invalid_value", None),
    ("messages missing", "/v1/chat/completions", {"max_tokens": 3}, 400, "invalid_value", "messages"),
    ("messages empty", "/v1/chat/completions", {"messages": []}, 400, "invalid_value", "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_value", "messages.0.role"),
    ("temperature not a number", "/v1/chat/completions", {**_MSG, "temperature": "hot"}, 400, "invalid_value",
     "temperature"),
    ("max_tokens not an int", "/v1/chat/completions", {**_MSG, "max_tokens": 1.5}, 400, "invalid_value",
     "max_tokens"),
    ("user content missing", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "invalid_value",
     "messages.0.content"),
    ("image content part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "unsupported_parameter", "messages.0.content"),
    ("unknown model", "/v1/chat/completions", {**_MSG, "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("unknown model (completions)", "/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model_not_found",
     "model"),
    ("negative temperature", "/v1/chat/completions", {**_MSG, "temperature": -1}, 400, "invalid_value",
     "temperature"),
    ("top_p zero", "/v1/chat/completions", {**_MSG, "top_p": 0}, 400, "invalid_value", "top_p"),
    ("max_tokens zero", "/v1/chat/completions", {**_MSG, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max_completion_tokens zero", "/v1/chat/completions", {**_MSG, "max_completion_tokens": 0}, 400,
     "invalid_value", "max_completion_tokens"),
    ("min_tokens above max_tokens", "/v1/chat/completions", {**_MSG, "max_tokens": 2, "min_tokens": 5}, 400,
     "invalid_value", "min_tokens"),
    ("top_logprobs too many", "/v1/chat/completions", {**_MSG, "logprobs": True, "top_logprobs": 50}, 400,
     "invalid_value", "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**_MSG, "top_logprobs": 2}, 400, "invalid_value",
     "top_logprobs"),
    ("presence_penalty out of range", "/v1/chat/completions", {**_MSG, "presence_penalty": 3}, 400,
     "invalid_value", "presence_penalty"),
    ("empty stop string", "/v1/chat/completions", {**_MSG, "stop": [""]}, 400, "invalid_value", "stop"),
    ("n zero", "/v1/chat/completions", {**_MSG, "n": 0}, 400, "invalid_value", "n"),
    ("n above 128", "/v1/chat/completions", {**_MSG, "n": 129}, 400, "invalid_value", "n"),
    ("n > 1 in a session", "/v1/chat/completions", {**_MSG, "n": 2, "session_id": "s"}, 400, "invalid_value", "n"),
    ("stream_options without stream", "/v1/chat/completions", {**_MSG, "stream_options": {"include_usage": True}},
     400, "invalid_value", "stream_options"),
    ("tool_choice required without tools", "/v1/chat/completions", {**_MSG, "tool_choice": "required"}, 400,
     "invalid_value", "tool_choice"),
    ("tool_choice names an unknown function", "/v1/chat/completions",
     {**_MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, 400,
     "invalid_value", "tool_choice"),
    ("tool_choice unknown value", "/v1/chat/completions", {**_MSG, "tools": TOOLS, "tool_choice": "always"}, 400,
     "invalid_value", "tool_choice"),
    ("tool_choice with a json response_format", "/v1/chat/completions",
     {**_MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "invalid_value", "response_format"),
    ("response_format unknown type", "/v1/chat/completions", {**_MSG, "response_format": {"type": "yaml"}}, 400,
     "invalid_value", "response_format"),
    ("logit_bias key not a token id", "/v1/chat/completions", {**_MSG, "logit_bias": {"five": 10}}, 400,
     "invalid_value", "logit_bias"),
    ("prompt + max_tokens beyond context", "/v1/chat/completions", {**_MSG, "max_tokens": MAX_LEN}, 400,
     "context_length_exceeded", "max_tokens"),
    ("prompt beyond context", "/v1/completions", {"prompt": [5] * MAX_LEN}, 400, "context_length_exceeded",
     "prompt"),
    ("several prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "invalid_value", "prompt"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "unsupported_parameter", "suffix"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "invalid_value", "logprobs"),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, 400, "invalid_value", "prompt"),
]


@pytest.mark.parametrize("what,path,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_body(server, client, what, path, body, status, code, param):
    """Protects the error contract: status, `{"error": {message, type, param, code}}`, no traceback."""
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text


def test_context_error_says_the_numbers(server):
    """Protects the context-length message: limit, total, prompt and completion tokens."""
    r = _post(server, "/v1/completions", {"prompt": [5] * 100, "max_tokens": 500})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "512" in msg and "600" in msg and "100" in msg and "500" in msg


def test_token_id_outside_the_vocabulary_is_a_400_from_the_engine(server):
    """Protects EngineError at add time -> RequestError(400) -> an OpenAI 400 body."""
    r = _post(server, "/v1/completions", {"prompt": [1, 10 ** 6], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


@pytest.mark.parametrize("headers,status", [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                            ({"Authorization": "Basic " + KEY}, 401)])
def test_api_key_is_required_on_v1(server, headers, status):
    """Protects --api-key: missing or wrong keys get 401 with an OpenAI body on /v1/*."""
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, server.url + path, headers=headers, content=json.dumps(_MSG))
        assert r.status_code == status and r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_with_a_wrong_key_raises_authentication_error(server):
    """Protects the 401 as the openai client sees it."""
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_body_too_large_by_content_length_and_by_streamed_size(server):
    """Protects max_body_bytes: Content-Length over the limit, and a chunked body that grows past it -> 413."""
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)})
    r = _post(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * (MAX_BODY // 10)
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_json(server):
    """Protects 404/405 as OpenAI JSON bodies."""
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(server.url + "/v1/models/other", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------------- disconnects
def _slow_engine(client: AsyncLLM, delay: float):
    """Make each engine step take at least `delay` seconds and record aborts; returns the list of aborted ids."""
    eng = client.engine
    aborted: list[str] = []
    step, abort = eng.step, eng.abort_request

    def slow_step():
        time.sleep(delay)
        return step()

    def spy_abort(rid):
        aborted.append(rid)
        abort(rid)

    eng.step, eng.abort_request = slow_step, spy_abort
    return aborted, lambda: (setattr(eng, "step", step), setattr(eng, "abort_request", abort))


def test_streaming_client_disconnect_aborts_and_frees_kv(server, client):
    """Protects abort on disconnect while streaming: no unfinished requests and every KV block back."""
    _wait_idle(client)
    aborted, restore = _slow_engine(client, 0.01)
    try:
        body = {"messages": USER, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", content=json.dumps(body), headers=AUTH,
                          timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        _wait_idle(client)
        assert len(aborted) == 1 and aborted[0].startswith("chatcmpl-")
    finally:
        restore()


def test_non_streaming_client_disconnect_aborts_and_frees_kv(server, client):
    """Protects abort on disconnect while a non-streaming request generates."""
    _wait_idle(client)
    aborted, restore = _slow_engine(client, 0.01)
    try:
        body = json.dumps({"prompt": "hello", "max_tokens": 400, "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.time() + 10
        while not client.engine.has_unfinished_requests():
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        sock.close()
        _wait_idle(client)
        assert len(aborted) == 1 and aborted[0].startswith("cmpl-")
    finally:
        restore()


# ---------------------------------------------------------------------------- failures, load
class _FailingClient:
    """An EngineClient whose requests fail after acceptance (or crash), to test the server's error paths."""

    model_name = MODEL
    max_model_len = MAX_LEN

    def __init__(self, tokenizer: Tokenizer, mode: str, healthy: bool = True) -> None:
        self.tokenizer, self.mode, self.healthy = tokenizer, mode, healthy

    async def generate(self, prompt_token_ids, params, request_id, session_id=None,
                       prompt=None) -> AsyncIterator[RequestOutput]:
        if self.mode == "crash":
            raise RuntimeError("boom")
        if self.mode == "reject":
            raise RequestError("busy", status=503, code="overloaded")
        m = RequestMetrics(0.0)
        yield RequestOutput(request_id, None, prompt_token_ids, [CompletionOutput(0, "ab", [5, 6], None, None)],
                            False, m)
        if self.mode == "crash_later":
            raise RuntimeError("boom mid-stream")
        yield RequestOutput(request_id, None, prompt_token_ids,
                            [CompletionOutput(0, "ab", [5, 6], None, None, "abort")], True, m,
                            error="worker 3 died")

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> BackendStats:
        return BackendStats(kv_transfer_seconds=[0.01, 0.02], remote_prefills=3, workers_alive=2)

    def is_healthy(self) -> bool:
        return self.healthy

    async def shutdown(self) -> None:
        pass


def _asgi(app, method: str, path: str, body=None, headers=None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, content=json.dumps(body) if body is not None else None,
                                   headers=headers)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer(ckpt) -> Tokenizer:
    return Tokenizer.from_pretrained(ckpt)


def test_failure_after_acceptance_is_a_json_error_or_an_sse_error_event(tokenizer):
    """Protects RequestOutput.error: 500 JSON when not streaming, `data: {"error"}` then [DONE] when streaming."""
    app = build_app(_FailingClient(tokenizer, "fail"))
    r = _asgi(app, "POST", "/v1/chat/completions", _MSG)
    assert r.status_code == 500 and r.json()["error"]["message"] == "worker 3 died"
    r = _asgi(app, "POST", "/v1/chat/completions", {**_MSG, "stream": True})
    events = _sse(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "worker 3 died"
    r = _asgi(app, "POST", "/v1/completions", {"prompt": "x", "stream": True})
    assert _sse(r.text)[-2]["error"]["message"] == "worker 3 died"
    down = build_app(_FailingClient(tokenizer, "fail", healthy=False))
    assert _asgi(down, "POST", "/v1/completions", {"prompt": "x"}).status_code == 503
    assert _asgi(down, "GET", "/health").status_code == 503


def test_backend_rejection_and_internal_errors_are_json(tokenizer, caplog):
    """Protects RequestError statuses passed through, a crash -> 500 JSON (logged, no traceback in the body), and a
    crash mid-stream -> an SSE error event then [DONE]."""
    r = _asgi(build_app(_FailingClient(tokenizer, "reject")), "POST", "/v1/completions", {"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    r = _asgi(build_app(_FailingClient(tokenizer, "crash")), "POST", "/v1/completions", {"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "boom" not in r.text and "Traceback" not in r.text
    assert any("internal error" in rec.message for rec in caplog.records)
    r = _asgi(build_app(_FailingClient(tokenizer, "crash_later")), "POST", "/v1/completions",
              {"prompt": "x", "stream": True})
    events = _sse(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "boom" not in r.text


def test_metrics_take_backend_stats_and_kv_transfer_observations(tokenizer):
    """Protects /metrics fed from client.stats(): remote prefills, workers, the kv_transfer histogram."""
    app = build_app(_FailingClient(tokenizer, "fail"), served_model_name="m")
    text = _asgi(app, "GET", "/metrics").text
    assert 'tandem:remote_prefills_total{model_name="m"} 3.0' in text
    assert 'tandem:workers_alive{model_name="m"} 2.0' in text
    assert 'tandem:kv_transfer_seconds_count{model_name="m"} 2.0' in text


def test_engine_failure_fails_open_requests_and_health(ckpt):
    """Protects AsyncLLM's failure path: an engine exception ends streams with an error and /health goes 503."""
    c = AsyncLLM.from_model(ckpt, served_model_name=MODEL, num_kv_blocks=64, max_model_len=256)

    def broken():
        raise RuntimeError("CUDA fell over")

    c.engine.step = broken
    app = build_app(c)
    r = _asgi(app, "POST", "/v1/completions", {"prompt": "hello", "stream": True})
    assert r.status_code in (500, 503) and "CUDA fell over" in r.json()["error"]["message"]
    assert _asgi(app, "GET", "/health").status_code == 503
    r = _asgi(app, "POST", "/v1/completions", {"prompt": "hello"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    asyncio.run(c.shutdown())


def test_200_concurrent_mixed_requests_leave_the_server_healthy(server, client):
    """Protects robustness under load: every valid request answered, every malformed one a 4xx, /health 200."""
    bad_bodies = [b"{nope", json.dumps({"messages": USER, "temperature": -3}).encode(),
                  json.dumps({"messages": USER, "model": "x"}).encode(), json.dumps({"prompt": ["a", "b"]}).encode()]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[bool, httpx.Response]:
        if i % 3 == 0:
            path = "/v1/completions" if i % 4 == 3 else "/v1/chat/completions"
            return False, await c.post(path, content=bad_bodies[i % 4], headers=AUTH)
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 3,
                    "stream": i % 5 == 0}
            return True, await c.post("/v1/chat/completions", content=json.dumps(body), headers=AUTH)
        return True, await c.post("/v1/completions", content=json.dumps({"prompt": f"text {i}", "max_tokens": 3}),
                                  headers=AUTH)

    valid, bad = fire_concurrently(server.url, one)
    assert len(valid) + len(bad) == 200
    assert all(r.status_code == 200 for r in valid), [r.text for r in valid if r.status_code != 200][:3]
    assert all(400 <= r.status_code < 500 and "error" in r.json() for r in bad)
    for r in valid:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200
    _wait_idle(client)


def test_completions_return_token_ids_streams_every_token_even_with_empty_text(server):
    """vLLM's return_token_ids: each streamed chunk carries its token ids, so tokens that decode to no text
    (a partial UTF-8 byte) still reach the client; the non-streaming choice carries all ids."""
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    full = _post(server, "/v1/completions", body).json()["choices"][0]
    assert len(full["token_ids"]) == 12 and full["prompt_token_ids"] == [5, 6, 7, 8, 9, 10]
    ids = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
    assert ids == full["token_ids"]
    plain = _post(server, "/v1/completions", {**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]
