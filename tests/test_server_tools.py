"""Hermes/Qwen tool-call parsing on text (batch and streaming), and the server's tool-call responses through the
openai client, driven by a scripted EngineClient (the tiny models generate random tokens, never tool calls)."""
from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tandem.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.engine.tokenizer import Tokenizer  # noqa: E402
from tandem.runtime.client import BackendStats  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.tool_parser import StreamingToolParser, parse_tool_calls  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "search", "arguments": {"q": "caf\u00e9 \\"quoted\\""}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]

TEXTS = [
    "plain answer, no tools",
    CALL,
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL2,
    "before " + CALL + " after",
    "<tool_call>{not json}</tool_call> tail",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}',          # cut by max_tokens
    '<tool_call>\n{"name": "get_weather", "arguments": {"ci',                         # cut mid-JSON
    "a < b and <tool but no call",
    '<tool_call>["a list"]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
]


# ---------------------------------------------------------------------------- parser on text
def test_one_call_is_parsed_with_an_id_and_json_string_arguments():
    """Protects the basic Hermes block: name, arguments re-serialised as a JSON string, call_<hex> id."""
    content, calls = parse_tool_calls(CALL)
    assert content is None and len(calls) == 1
    c = calls[0]
    assert c.name == "get_weather" and json.loads(c.arguments) == {"city": "Paris", "unit": "C"}
    assert c.id.startswith("call_") and int(c.id[5:], 16) >= 0


def test_text_around_calls_is_content_and_several_calls_keep_their_order():
    """Protects content extraction (stripped, None when empty) and multiple blocks."""
    content, calls = parse_tool_calls("Let me check.\n" + CALL + "\n" + CALL2)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[1].arguments) == {"q": 'caf\u00e9 "quoted"'}
    assert calls[0].id != calls[1].id
    assert parse_tool_calls("before " + CALL + " after")[0] == "before  after"


def test_invalid_blocks_stay_content():
    """Protects robustness: blocks that are not {"name": str, ...} JSON objects are left as text."""
    for text in ("<tool_call>{not json}</tool_call> tail", '<tool_call>["a list"]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "x", "arguments": "{bad"}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("") == (None, [])


def test_an_unclosed_final_block_is_parsed_when_its_json_is_complete():
    """Protects outputs cut right after the JSON (max_tokens) and keeps truly cut ones as text."""
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert [c.name for c in calls] == ["get_weather"]
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(cut) == (cut, [])


def test_string_arguments_and_the_parameters_alias():
    """Protects the variants models emit: arguments already a JSON string; `parameters` instead of `arguments`."""
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(calls[0].arguments) == {"a": 1}
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"b": 2}}</tool_call>')
    assert json.loads(calls[0].arguments) == {"b": 2}
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert calls[0].arguments == "{}"


def _stream(text: str, cuts: list[int]) -> tuple[str, list]:
    p = StreamingToolParser()
    content, calls, prev = [], [], 0
    for cut in [*cuts, len(text)]:
        c, done = p.feed(text[prev:cut])
        content.append(c)
        calls += done
        prev = cut
    c, done = p.finish()
    return "".join(content) + c, calls + done


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_parser_agrees_with_the_batch_parser_for_any_split(text):
    """Protects streaming: for every split into deltas, the same calls and the same content as the batch parser
    (up to whitespace at the edges, which the batch parser strips when there are calls)."""
    want_content, want_calls = parse_tool_calls(text)
    rng = random.Random(0)
    splits = [[i] for i in range(len(text))] + [sorted(rng.sample(range(len(text)), min(5, len(text))))
                                                 for _ in range(20)] + [list(range(len(text)))]
    for cuts in splits:
        content, calls = _stream(text, cuts)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls], cuts
        assert (content.strip() or None) == (want_content.strip() if want_content else None), cuts


def test_streaming_parser_never_leaks_a_partial_open_tag():
    """Protects the hold-back: a `<tool_c` prefix is not streamed as content before the block is known."""
    p = StreamingToolParser()
    assert p.feed("Hi <tool_c") == ("Hi", [])          # trailing whitespace waits for what follows
    content, calls = p.feed('all>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["f"]
    assert p.finish() == ("", [])


# ---------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny-tools")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    return Tokenizer.from_pretrained(path)


class ScriptedClient:
    """An EngineClient that 'generates' a fixed text, a few characters per output, and records its prompts."""

    model_name = "scripted"
    max_model_len = 4096

    def __init__(self, tokenizer: Tokenizer, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_token_ids, params, request_id, session_id=None,
                       prompt=None) -> AsyncIterator[RequestOutput]:
        self.prompts.append(list(prompt_token_ids))
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)] or [""]
        for k in range(1, len(pieces) + 1):
            done = k == len(pieces)
            comp = CompletionOutput(0, "".join(pieces[:k]), list(range(k)), None, None, "stop" if done else None)
            yield RequestOutput(request_id, prompt, list(prompt_token_ids), [comp], done, RequestMetrics(0.0),
                                num_cached_tokens=2)
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> BackendStats:
        return BackendStats(workers_alive=1)

    def is_healthy(self) -> bool:
        return True

    async def shutdown(self) -> None:
        pass


def _openai(client: ScriptedClient) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(client)), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)


def _chat(client: ScriptedClient, **kw):
    async def go():
        oai = _openai(client)
        r = await oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "weather?"}],
                                              **kw)
        if kw.get("stream"):
            return [c async for c in r]
        return r
    return asyncio.run(go())


def test_tool_calls_in_a_non_streaming_response(tokenizer):
    """Protects the response: finish_reason tool_calls, message.tool_calls (ids, names, JSON string args), content."""
    r = _chat(ScriptedClient(tokenizer, "Let me check.\n" + CALL + "\n" + CALL2), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "search"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "C"}
    assert r.usage.prompt_tokens_details.cached_tokens == 2


def test_tool_calls_in_a_streaming_response(tokenizer):
    """Protects streaming tool calls: content deltas, one complete tool_calls delta per block (index, id, name,
    arguments), finish_reason tool_calls, and the usage chunk."""
    chunks = _chat(ScriptedClient(tokenizer, "Let me check.\n" + CALL + "\n" + CALL2), tools=TOOLS, stream=True,
                   stream_options={"include_usage": True})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather"), (1, "search")]
    assert all(tc.id.startswith("call_") for tc in calls)
    assert json.loads(calls[1].function.arguments) == {"q": 'caf\u00e9 "quoted"'}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 2


@pytest.mark.parametrize("kw", [{"tools": TOOLS, "tool_choice": "none"}, {}], ids=["tool_choice none", "no tools"])
def test_no_parsing_without_tools_or_with_tool_choice_none(tokenizer, kw):
    """Protects tool_choice none / no tools: the text comes back verbatim with finish_reason stop."""
    text = "Sure: " + CALL
    r = _chat(ScriptedClient(tokenizer, text), **kw)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = _chat(ScriptedClient(tokenizer, text), stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_a_second_round_prompt_renders_the_tool_call_and_its_result(tokenizer):
    """Protects round 2 of a tool conversation: assistant tool_calls and the tool message reach the template."""
    client = ScriptedClient(tokenizer, "It is sunny in Paris.")

    async def go():
        oai = _openai(client)
        return await oai.chat.completions.create(model="scripted", tools=TOOLS, messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}])

    r = asyncio.run(go())
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(client.prompts[0], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
