"""Forced tool calls: `tool_choice` "required" or a named function constrains the output by
grammar, so every call's arguments validate against its tool's schema (checked with `jsonschema`), streamed as
OpenAI's incremental `tool_calls` deltas or whole; `parallel_tool_calls: false` allows one call; the scanner that
turns constrained output into calls agrees between streaming and not."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.forced_tools import ForcedCallScanner, ToolMode, ToolPolicy, forced_output, scan_all  # noqa: E402
from tandem.server.protocol import Tool  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "k": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["q", "k"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
REQUIRED = ToolPolicy(ToolMode.REQUIRED)
OUTPUT = ('[{"name": "get_weather", "parameters": {"city": "Pa}r\\"is", "unit": "C"}}, '
          '{"name": "search", "parameters": {"q": "abc", "k": 3}}]')


# ---------------------------------------------------------------------------- scanner and grammar, no model
def test_streamed_deltas_reassemble_to_the_unstreamed_calls_at_any_split():
    """Protects streaming/non-streaming agreement: for random chunkings of one output, the header comes first (id,
    name, empty arguments), then argument fragments, and their concatenation equals the whole-text scan."""
    whole = scan_all(REQUIRED, OUTPUT)
    assert [(c.name, json.loads(c.arguments)) for c in whole] == [
        ("get_weather", {"city": 'Pa}r"is', "unit": "C"}), ("search", {"q": "abc", "k": 3})]
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), rng.randint(1, 30)))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)])]
        s = ForcedCallScanner(REQUIRED)
        args: dict[int, str] = {}
        names: dict[int, str] = {}
        for p in pieces:
            for d in s.feed(p):
                delta = d.as_delta()
                if "id" in delta:
                    assert d.index not in names and delta["type"] == "function"
                    names[d.index] = delta["function"]["name"]
                    assert delta["function"]["arguments"] == d.arguments
                else:
                    assert set(delta["function"]) == {"arguments"}
                args[d.index] = args.get(d.index, "") + d.arguments
        assert names == {0: "get_weather", 1: "search"}
        assert [args[0], args[1]] == [c.arguments for c in whole]


def test_an_item_with_its_keys_out_of_order_is_still_reported_whole():
    """Protects robustness to key order: `parameters` before `name` yields the call when its item closes."""
    calls = scan_all(REQUIRED, '[{"parameters": {"q": "x", "k": 1}, "name": "search"}]')
    assert [(c.name, json.loads(c.arguments), c.closed) for c in calls] == [("search", {"q": "x", "k": 1}, True)]


def test_a_named_call_is_the_whole_output_and_a_cut_call_keeps_its_partial_arguments():
    """Protects the named mode (the output is the arguments) and a call cut by max_tokens (partial, not lost)."""
    named = ToolPolicy(ToolMode.NAMED, "search")
    assert [(c.name, c.arguments) for c in scan_all(named, '{"q": "a", "k": 2}')] == [("search", '{"q": "a", "k": 2}')]
    cut = scan_all(REQUIRED, '[{"name": "search", "parameters": {"q": "ab')
    assert [(c.name, c.arguments, c.closed) for c in cut] == [("search", '{"q": "ab', False)]
    assert scan_all(REQUIRED, '[{"name": "sea') == []


def test_the_forcing_grammar_lists_each_tool_and_allows_one_call_when_not_parallel():
    """Protects the schema vLLM uses for "required" (array of {name, parameters}, minItems 1, maxItems 1 without
    parallel calls) and the tool's own schema for a named function."""
    tools = [Tool.model_validate(t) for t in TOOLS]
    so = forced_output(ToolPolicy(ToolMode.REQUIRED, parallel=False), tools)
    schema = json.loads(so.schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["search"]]
    assert [i["properties"]["parameters"] for i in schema["items"]["anyOf"]] == [WEATHER, SEARCH]
    assert json.loads(forced_output(ToolPolicy(ToolMode.NAMED, "search"), tools).schema) == SEARCH
    assert forced_output(ToolPolicy(ToolMode.AUTO), tools) is None


# ---------------------------------------------------------------------------- through HTTP, a random-weight model
@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-forced-tools")
    make_tiny_model(path, arch="qwen3", size="1m", seed=3)
    c = AsyncLLM.from_model(str(path), served_model_name="tiny", num_kv_blocks=2048, max_model_len=2048)
    yield build_app(c)
    asyncio.run(c.shutdown())


def _body(i: int, stream: bool, **kw) -> dict:
    return {"model": "tiny", "temperature": 1.0, "seed": i, "max_tokens": 200, "stream": stream, "tools": TOOLS,
            "messages": [{"role": "user", "content": f"task {i}"}], **kw}


def _streamed(text: str) -> tuple[dict[int, dict], str | None, str]:
    """Tool calls reassembled from a stream's deltas, the finish reason, and any content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:])["choices"]:
            delta = ch["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or ():
                c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in tc:
                    assert c["id"] is None, "a call's header is sent once"
                    c["id"], c["name"] = tc["id"], tc["function"]["name"]
                c["arguments"] += tc["function"]["arguments"]
            reason = ch["finish_reason"] or reason
    return calls, reason, content


def _run(app, bodies: list[dict]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300) as h:
            return await asyncio.gather(*(h.post("/v1/chat/completions", json=b) for b in bodies))
    return asyncio.run(go())


def _validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_calls_validate_against_their_schemas_streaming_and_not(app):
    """Protects tool_choice "required": 100 of 100 sampled answers (half streamed) have ≥ 1
    call whose name is a tool and whose arguments validate; finish_reason tool_calls; content null."""
    rs = _run(app, [_body(i, i % 2 == 1, tool_choice="required") for i in range(100)])
    n_calls = 0
    for i, r in enumerate(rs):
        assert r.status_code == 200, r.text
        if i % 2:
            calls, reason, content = _streamed(r.text)
            calls = [calls[k] for k in sorted(calls)]
            assert content == ""
        else:
            ch = r.json()["choices"][0]
            calls = [{"id": c["id"], **c["function"]} for c in ch["message"]["tool_calls"]]
            reason = ch["finish_reason"]
            assert ch["message"]["content"] is None
        assert reason == "tool_calls" and calls
        for c in calls:
            assert c["id"].startswith("call_")
            _validate(c["name"], c["arguments"])
        n_calls += len(calls)
    assert n_calls >= 100


def test_a_named_function_and_parallel_tool_calls_false_force_exactly_one_call(app):
    """Protects the named tool_choice (one call of that function, finish_reason stop as OpenAI's) and
    parallel_tool_calls false under "required" (exactly one call)."""
    named = {"type": "function", "function": {"name": "search"}}
    bodies = [_body(i, i % 2 == 1, tool_choice=named) for i in range(4)]
    bodies += [_body(10 + i, i % 2 == 1, tool_choice="required", parallel_tool_calls=False) for i in range(4)]
    rs = _run(app, bodies)
    for i, r in enumerate(rs):
        assert r.status_code == 200, r.text
        if i % 2:
            calls_by_index, reason, _ = _streamed(r.text)
            calls = [calls_by_index[k] for k in sorted(calls_by_index)]
        else:
            ch = r.json()["choices"][0]
            calls, reason = [c["function"] for c in ch["message"]["tool_calls"]], ch["finish_reason"]
        assert len(calls) == 1
        if i < 4:
            assert calls[0]["name"] == "search" and reason == "stop"
        else:
            assert reason == "tool_calls"
        _validate(calls[0]["name"], calls[0]["arguments"])
