"""Structured output through the OpenAI API: `response_format` json_schema and
json_object on chat and completions, streaming and not, every answer parsed and validated with `jsonschema`;
a bad schema is a 400 naming response_format."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

from structured_schema import SCHEMA  # noqa: E402

RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-so-server")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    c = AsyncLLM.from_model(str(path), served_model_name="tiny", num_kv_blocks=512, max_model_len=512)
    yield c
    asyncio.run(c.shutdown())


def _text_of_stream(body: str, chat: bool) -> str:
    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ch = json.loads(line[6:])["choices"]
            if ch:
                out.append((ch[0].get("delta", {}).get("content") if chat else ch[0].get("text")) or "")
    return "".join(out)


def test_json_schema_answers_parse_and_validate_on_chat_and_completions_streaming_or_not(client):
    """Protects the grammar reaching the sampler from the API: 100 of 100 sampled answers,
    concurrent, chat and completions, half of each streamed, all parse and validate."""
    app = build_app(client)

    async def one(h: httpx.AsyncClient, i: int) -> str:
        chat, stream = i % 2 == 0, i % 4 < 2
        body = {"model": "tiny", "temperature": 1.0, "seed": i, "max_tokens": 256, "response_format": RF,
                "stream": stream}
        body.update({"messages": [{"role": "user", "content": f"person {i}"}]} if chat else {"prompt": f"person {i}"})
        r = await h.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            return _text_of_stream(r.text, chat)
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop"
        return ch["message"]["content"] if chat else ch["text"]

    async def go() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300) as h:
            return await asyncio.gather(*(one(h, i) for i in range(100)))

    texts = asyncio.run(go())
    assert len(texts) == 100
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("rf,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}}, ""),
    ({"type": "yaml"}, "text, json_object or json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a" * 70000]}}}, "larger than"),
])
def test_a_bad_response_format_is_a_400_naming_it(client, rf, needle):
    app = build_app(client)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            return await h.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "response_format": rf,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"] and len(r.text) < 1000
