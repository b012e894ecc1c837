"""/tokenize and /detokenize as vLLM's, and streaming fidelity for load generators: one chunk per
engine output with new tokens, a token whose text is still empty included, so a client counting chunks sees every
token."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("torch")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tokenize")
    make_tiny_model(path, arch="qwen3", size="1m", seed=2)
    c = AsyncLLM.from_model(str(path), served_model_name="tiny", num_kv_blocks=256, max_model_len=512)
    yield c
    asyncio.run(c.shutdown())


def _calls(app, calls: list[tuple[str, dict]], headers: dict | None = None) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60,
                                     headers=headers) as h:
            return [await h.post(path, json=body) for path, body in calls]
    return asyncio.run(go())


def test_tokenize_a_prompt_and_messages_as_generation_does_and_detokenize_back(client):
    """Protects the two endpoints: a prompt's ids are the tokenizer's (special tokens by default), messages give
    exactly the ids a chat completion is prompted with (usage.prompt_tokens), token strings on request, and
    detokenize inverts tokenize."""
    tok = client.tokenizer
    text = "The quick brown fox"
    r = _calls(build_app(client), [
        ("/tokenize", {"prompt": text, "return_token_strs": True}),
        ("/tokenize", {"messages": MSGS}),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}),
        ("/detokenize", {"tokens": tok.encode(text, add_special_tokens=False)}),
    ])
    assert [x.status_code for x in r] == [200] * 4, [x.text for x in r]
    p, m, chat, d = (x.json() for x in r)
    assert p["tokens"] == tok.encode(text, add_special_tokens=True) and p["count"] == len(p["tokens"])
    assert p["max_model_len"] == 512 and p["token_strs"] == [tok.id_to_token(i) for i in p["tokens"]]
    assert m["count"] == chat["usage"]["prompt_tokens"] and m["token_strs"] is None
    assert d == {"prompt": text}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, "messages"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_tokenize_bodies_are_400s_naming_the_field(client, path, body, param):
    """Protects the endpoints' input checks (OpenAI-style 400 bodies, never a traceback)."""
    (r,) = _calls(build_app(client), [(path, body)])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_api_key_guards_tokenize_and_detokenize(client):
    """Protects the key on work done for the caller outside /v1."""
    app = build_app(client, api_key="secret")
    r = _calls(app, [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})])
    assert [x.status_code for x in r] == [401, 401]
    ok = _calls(app, [("/tokenize", {"prompt": "a"})], headers={"Authorization": "Bearer secret"})
    assert ok[0].status_code == 200


def test_a_client_counting_chunks_sees_every_token(client):
    """Protects load-generator fidelity: chat and completions streams carry one chunk per generated token (tokens
    with empty text included), so counted chunks = completion_tokens."""
    n = 40
    r = _calls(build_app(client), [
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": n, "ignore_eos": True, "stream": True,
                                  "temperature": 1.0, "seed": 1, "skip_special_tokens": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": n, "ignore_eos": True, "stream": True,
                             "temperature": 1.0, "seed": 1}),
    ])
    for resp, key in zip(r, ("delta", "text")):
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        token_chunks = [e for e in events if e["choices"] and (key == "text" or "content" in e["choices"][0][key])
                        and not (key == "delta" and e["choices"][0]["delta"].get("role"))]
        assert len(token_chunks) == n, [e["choices"] for e in events][:5]


def test_a_reader_behind_the_engine_still_gets_every_output(client):
    """Protects one chunk per token when the HTTP side lags: outputs queued while the reader was busy are each
    yielded (not coalesced into the latest) as long as it is fewer than COALESCE_BACKLOG behind."""
    from tandem.engine.sampling_params import SamplingParams

    async def main():
        gen = client.generate(list(range(5, 15)), SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0),
                              "lagging")
        first = await gen.__anext__()
        while client.engine.has_unfinished_requests():          # the reader is busy: every other output queues
            await asyncio.sleep(0.01)
        rest = [o async for o in gen]
        return [first, *rest]

    outs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 21))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
