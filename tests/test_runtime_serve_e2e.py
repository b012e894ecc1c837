"""`tandem serve` end to end: the real worker processes (1 prefill + 1 decode, policy ampd) behind the HTTP API.

- 50 ToolBench-shaped sessions replayed through `/v1/completions` (token-id prompts,
  `x-session-id`), every session completes, both local and remote prefills happen and `/metrics` counts them
  as the coordinator routed them, and every round's greedy output equals the offline `tandem.LLM`'s.
- On the cluster backend: bad input gets OpenAI 4xx bodies; 200 concurrent mixed requests leave
  `/health` 200 with every valid request answered.
- The same server with `--state redis://...` against a real redis-server serves a 2-round
  session correctly, and the workers' states are in Redis.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.bench.serve_client import scale_session  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402
from live_server import LiveServer, fire_concurrently, one_thread_llm  # noqa: E402
from tandem.workload.generators import generate  # noqa: E402
from redis_helper import redis_server as _redis_server  # noqa: E402

KEY = "sk-e2e"
MODEL = "tiny-e2e"
MAX_LEN = 2048
ENGINE = dict(max_model_len=MAX_LEN, num_kv_blocks=2048)
AUTH = {"Authorization": f"Bearer {KEY}"}
# Routing costs come from the nominal CPU roofline (no --perf), so they depend only on the prompt sizes: with this
# TTFT target a prefill of up to ~150 new tokens meets 0.9 x SLO remotely and goes to the prefill worker, a longer
# one cannot and runs where it is cheapest, at home (no KV transfer). ToolBench's long first prompts and short
# tool observations (scaled x0.1) give both paths, whatever the machine's load.
SLO_TTFT_S = 0.010
SESSIONS, RATE, SCALE, CAP, SEED = 50, 10.0, 0.1, 8, 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-e2e")
    make_tiny_model(path, arch="qwen3", size="1m", seed=7)
    return str(path)


@pytest.fixture(scope="module")
def server(ckpt):
    srv = LiveServer(ClusterConfig(ckpt, 1, 1, 0, "ampd", served_model_name=MODEL, engine_args=ENGINE,
                                   slo_ttft_s=SLO_TTFT_S), api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(ckpt):
    with one_thread_llm(ckpt, **ENGINE) as llm:
        yield llm


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, session_id: str | None,
                    stream: bool = False) -> dict:
    """One round through /v1/completions with token ids; returns the choice (token_ids) and usage."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    headers = dict(AUTH, **({"x-session-id": session_id} if session_id else {}))
    if not stream:
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        d = r.json()
        return {"token_ids": d["choices"][0]["token_ids"], "finish_reason": d["choices"][0]["finish_reason"],
                "usage": d["usage"]}
    ids, finish, usage = [], None, None
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for ch in ev.get("choices") or ():
                ids += ch.get("token_ids") or []
                finish = ch.get("finish_reason") or finish
            usage = ev.get("usage") or usage
    return {"token_ids": ids, "finish_reason": finish, "usage": usage}


# ---------------------------------------------------------------------------- serving through HTTP
def test_toolbench_replay_through_http_matches_offline_and_counts_both_prefill_paths(server, offline):
    """Protects the whole live path: 50 multi-round sessions (ToolBench shape, x0.1, outputs <= 8 tokens) at
    10 sessions/s through HTTP; none lost; the coordinator routes both ways and /metrics counts exactly its
    decisions (local + remote = rounds); every round's output equals the offline engine's greedy output on the
    same prompt (so KV moved between workers, history reads and incremental prefills are all exact)."""
    sessions = [scale_session(s, SCALE, CAP) for s in generate("toolbench", SESSIONS, RATE, SEED)]
    rounds_total = sum(len(s.rounds) for s in sessions)
    vocab = min(server.cluster.tokenizer.vocab_size, 1000)          # ordinary tokens (specials sit at the end)
    done: list[tuple[str, int, list[int], int, dict]] = []       # (session, round, prompt, max_tokens, result)

    async def session(client: httpx.AsyncClient, s, t0: float) -> None:
        await asyncio.sleep(max(0.0, s.arrival_s - (time.monotonic() - t0)))
        rng = random.Random(s.session_id)
        conv: list[int] = []
        for k, rnd in enumerate(s.rounds):
            conv = conv + [rng.randrange(3, vocab) for _ in range(rnd.input_tokens)]
            res = await _complete(client, conv, rnd.output_tokens, s.session_id, stream=k % 2 == 1)
            done.append((s.session_id, k, list(conv), rnd.output_tokens, res))
            conv = conv + res["token_ids"]
            await asyncio.sleep(rnd.tool_s)

    async def replay() -> float:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            t0 = time.monotonic()
            await asyncio.gather(*(session(client, s, t0) for s in sessions))
            return time.monotonic() - t0

    before = server.metrics()
    recs_before = server.call(lambda: len(server.cluster.shell.coord.records))
    elapsed = asyncio.run(replay())
    after = server.metrics()
    routed = server.call(lambda: [r.prefill_where for rec in server.cluster.shell.coord.records[recs_before:]
                                  for r in rec.rounds])

    assert len(done) == rounds_total                              # every round of every session completed
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == n for *_, n, r in done)
    local = after["tandem:local_prefills_total"] - before["tandem:local_prefills_total"]
    remote = after["tandem:remote_prefills_total"] - before["tandem:remote_prefills_total"]
    assert local + remote == rounds_total
    assert (local, remote) == (routed.count("local"), routed.count("remote")), (local, remote)
    assert local >= 1 and remote >= 1, (local, remote)
    assert after["tandem:kv_transfer_timeouts_total"] == before["tandem:kv_transfer_timeouts_total"]
    # cached tokens: every later round reused its session's resident history (the previous prompt + output - 1)
    by_session: dict[str, list] = {}
    for sid, k, prompt, n, res in done:
        by_session.setdefault(sid, []).append((k, prompt, res))
    for rounds in by_session.values():
        rounds.sort(key=lambda x: x[0])
        for (k0, p0, r0), (k1, p1, r1) in zip(rounds, rounds[1:]):
            assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == len(p0) + len(r0["token_ids"]) - 1
    refs = offline.generate([p for _, _, p, _, _ in done], [_greedy(n) for *_, n, _ in done])
    bad = [(sid, k) for (sid, k, _, _, res), ref in zip(done, refs) if res["token_ids"] != ref.outputs[0].token_ids]
    assert not bad, f"{len(bad)} rounds differ from the offline engine, e.g. {bad[:5]}"
    print(f"\nreplay: {rounds_total} rounds of {SESSIONS} sessions in {elapsed:.1f} s; local {local:g}, "
          f"remote {remote:g}")


# ---------------------------------------------------------------------------- on the cluster
_USER = [{"role": "user", "content": "what is the weather in Paris?"}]
BAD = [
    # (what it protects, path, raw body or JSON, status, code, param)
    ("malformed JSON", "/v1/completions", b'{"prompt": [1, 2', 400, "invalid_json", None),
    ("empty body", "/v1/chat/completions", b"", 400, "invalid_json", None),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("unknown model (chat)", "/v1/chat/completions", {"messages": _USER, "model": "nope"}, 404, "model_not_found",
     "model"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "invalid_value",
     "temperature"),
    ("max_tokens zero", "/v1/chat/completions", {"messages": _USER, "max_tokens": 0}, 400, "invalid_value",
     "max_tokens"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_value", "messages.0.role"),
    ("n > 1 in a session", "/v1/completions", {"prompt": "x", "n": 2, "session_id": "s"}, 400, "invalid_value", "n"),
    ("prompt longer than the context", "/v1/completions", {"prompt": [5] * (MAX_LEN + 10)}, 400,
     "context_length_exceeded", "prompt"),
    ("prompt + max_tokens beyond the context", "/v1/completions", {"prompt": [5] * 100, "max_tokens": MAX_LEN},
     400, "context_length_exceeded", "max_tokens"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10 ** 6], "max_tokens": 2}, 400, None,
     None),
]


def _post(server: LiveServer, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={**AUTH, **(headers or {})}, timeout=60)


def _assert_openai_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text


@pytest.mark.parametrize("what,path,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_through_the_cluster_is_an_openai_4xx(server, what, path, body, status, code, param):
    """Protects the error contract on the multi-process backend: status and OpenAI error body, no traceback;
    the server keeps serving."""
    _assert_openai_error(_post(server, path, body), status, code, param)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_wrong_api_key_and_oversized_body_on_the_cluster(server):
    """Protects --api-key (401) and the 16 MiB body limit (413) in front of the cluster."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        _assert_openai_error(r, 401, "invalid_api_key")
    big = json.dumps({"prompt": "x" * (16 << 20)})
    _assert_openai_error(_post(server, "/v1/completions", big), 413, "request_too_large")
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_200_concurrent_mixed_requests_on_the_cluster(server):
    """Protects robustness under load on worker processes: 200 concurrent requests, a third malformed, the rest
    valid (chat, text and token-id completions, streaming or not, some in sessions): every valid request is
    answered 200, every malformed one a 4xx JSON, /health stays 200 and the decode worker ends idle."""
    bad_bodies = [b"{nope", json.dumps({"messages": _USER, "temperature": -3}).encode(),
                  json.dumps({"messages": _USER, "model": "x"}).encode(), json.dumps({"prompt": ["a", "b"]}).encode()]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[bool, httpx.Response]:
        if i % 3 == 0:
            path = "/v1/completions" if i % 4 == 3 else "/v1/chat/completions"
            return False, await c.post(path, content=bad_bodies[i % 4], headers=AUTH)
        headers = dict(AUTH, **({"x-session-id": f"load-{i}"} if i % 7 == 1 else {}))
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 3, "stream": i % 5 == 0}
            return True, await c.post("/v1/chat/completions", json=body, headers=headers)
        prompt = f"text {i}" if i % 4 else list(range(10 + i % 50, 40 + i % 50))
        return True, await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "stream": i % 5 == 2},
                                  headers=headers)

    valid, bad = fire_concurrently(server.url, one)
    assert len(valid) == 133 and len(bad) == 67
    assert all(r.status_code == 200 for r in valid), [r.text for r in valid if r.status_code != 200][:3]
    assert all(400 <= r.status_code < 500 and "error" in r.json() for r in bad)
    for r in valid:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while server.metrics()["vllm:num_requests_running"]:
        assert time.monotonic() < deadline, "the workers kept running requests"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- --state redis://
def test_redis_state_store_serves_a_two_round_session(ckpt, offline):
    """Protects `tandem serve --state redis://`: worker processes publish their states to Redis (not through the
    coordinator), the coordinator routes from them, a 2-round session's outputs equal the offline engine's, and the
    workers' states and the session's binding are in Redis under tandem:default:."""
    import msgspec
    import redis

    from tandem.runtime.state_store import SessionInfo, WorkerState
    with _redis_server() as url:
        srv = LiveServer(ClusterConfig(ckpt, 1, 1, 0, "ampd", state=url, served_model_name=MODEL,
                                       engine_args=ENGINE), api_key=KEY)
        try:
            async def two_rounds() -> list[dict]:
                async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                    conv, outs = list(range(20, 120)), []
                    for k in range(2):
                        out = await _complete(c, conv, 6, "redis-session", stream=k == 1)
                        outs.append((list(conv), out))
                        conv = conv + out["token_ids"] + list(range(300, 330))
                    return outs
            outs = asyncio.run(two_rounds())
            r = redis.Redis.from_url(url)
            ids = sorted(int(x) for x in r.smembers("tandem:default:workers"))
            states = {i: msgspec.json.decode(r.get(f"tandem:default:worker:{i}"), type=WorkerState) for i in ids}
            session = msgspec.json.decode(r.get("tandem:default:session:redis-session"), type=SessionInfo)
            now = time.time()
            m = srv.metrics()
        finally:
            srv.stop()
    refs = offline.generate([p for p, _ in outs], _greedy(6))
    assert [o["token_ids"] for _, o in outs] == [ref.outputs[0].token_ids for ref in refs]
    assert outs[1][1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 100 + 6 - 1
    assert m["tandem:local_prefills_total"] + m["tandem:remote_prefills_total"] == 2
    assert ids == [0, 1]
    assert {i: s.role for i, s in states.items()} == {0: "prefill", 1: "decode"}
    assert all(s.alive and now - s.published_s < 5 and s.capacity_tokens > 0 for s in states.values())
    assert session.decode_worker == 1 and session.resident_tokens > 0
