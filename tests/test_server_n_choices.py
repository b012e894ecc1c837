"""Several choices per request: one engine request per choice, the later choices
taking the prompt's blocks from the prefix cache (shared), choice i seeded with seed + i (vLLM's rule), streams
merged with each chunk naming its choice, usage counting the prompt once."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("torch")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-n")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    c = AsyncLLM.from_model(str(path), served_model_name="tiny", num_kv_blocks=512, max_model_len=1024)
    yield build_app(c)
    asyncio.run(c.shutdown())


def _chat(i: int, **kw) -> dict:
    return {"model": "tiny", "temperature": 1.0, "seed": 7, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"tell me a story number {i} " * 8}], **kw}


async def _post(h: httpx.AsyncClient, body: dict) -> httpx.Response:
    r = await h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def _hits(text: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total{"))


def _streamed(text: str) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """Per-index content and finish reasons, and the final usage, from a chat stream."""
    content: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        body = json.loads(line[6:])
        for ch in body["choices"]:
            content[ch["index"]] = content.get(ch["index"], "") + (ch["delta"].get("content") or "")
            if ch["finish_reason"]:
                reasons[ch["index"]] = ch["finish_reason"]
        if body.get("usage") and not body["choices"]:
            usage = body["usage"]
    return content, reasons, usage


def test_n_choices_share_the_prompt_blocks_and_follow_the_seed_rule(app):
    """Protects n > 1: three indexed choices, usage = prompt once + every choice's tokens, the two later choices
    each take the prompt's whole blocks from the cache (prefix_cache_hits grows by exactly 2 × those tokens), and
    choice i is what a single request seeded with seed + i gives."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as h:
            before = _hits((await h.get("/metrics")).text)
            r = (await _post(h, _chat(1, n=3))).json()
            after = _hits((await h.get("/metrics")).text)
            alone = [(await _post(h, _chat(1, seed=7 + i))).json()["choices"][0]["message"]["content"]
                     for i in range(3)]
            return r, after - before, alone
    r, hits, alone = asyncio.run(go())
    prompt = r["usage"]["prompt_tokens"]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 24 and r["usage"]["total_tokens"] == prompt + 24
    assert hits == 2 * (prompt // BS) * BS
    assert [c["message"]["content"] for c in r["choices"]] == alone
    assert len(set(alone)) == 3


def test_streamed_choices_are_merged_by_index_with_usage_at_the_end(app):
    """Protects the n > 1 stream: every index gets its content and finish reason, the texts equal the unstreamed
    ones (same seed), and the usage chunk counts all choices."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as h:
            s = await _post(h, _chat(2, n=2, stream=True, stream_options={"include_usage": True}))
            whole = (await _post(h, _chat(2, n=2))).json()
            return s.text, whole
    text, whole = asyncio.run(go())
    content, reasons, usage = _streamed(text)
    assert reasons == {0: "length", 1: "length"}
    assert content == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert usage["completion_tokens"] == 16 and usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert text.rstrip().endswith("data: [DONE]")


def test_completions_n_choices_echo_each_and_stream_by_index(app):
    """Protects n > 1 on completions: indexed choices, each led by the echoed prompt, streaming equal to not."""
    body = {"model": "tiny", "prompt": "once upon a time " * 6, "n": 2, "max_tokens": 6, "ignore_eos": True,
            "temperature": 1.0, "seed": 3, "echo": True}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as h:
            whole = (await h.post("/v1/completions", json=body)).json()
            s = await h.post("/v1/completions", json={**body, "stream": True})
            return whole, s.text
    whole, text = asyncio.run(go())
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert all(c["text"].startswith(body["prompt"]) for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 12
    got: dict[int, str] = {}
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:])["choices"]:
                got[ch["index"]] = got.get(ch["index"], "") + ch["text"]
    assert got == {c["index"]: c["text"] for c in whole["choices"]}
