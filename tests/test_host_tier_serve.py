"""The host KV tier live: 1P+1D worker processes under ampd-tiered with a small GPU KV pool. A session that says its
tool call will be long (`tool_s`) is offloaded to host memory when its round ends; another request then needs the
decode worker's blocks and evicts the session's GPU copy; the session's next round loads its history back from host
memory: `cached_tokens` equals its history and its greedy output equals the offline engine's. Without a host tier
(ampd) the same run recomputes. /metrics reports the tier's bytes both ways."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

pytest.importorskip("torch")

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.tier_copies import FAULT_ENV  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig, ServingCluster  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

ENGINE = dict(num_kv_blocks=24, max_model_len=384)          # 384 tokens of KV on each worker
A1 = list(range(3, 153))                                     # session A: 150 tokens (10 blocks)
A_NEW = list(range(160, 180))
B = [200 + i % 240 for i in range(300)]                                  # another request: 300 tokens, needs A's blocks
OUT = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-host-tier")
    make_tiny_model(path, arch="qwen3", size="1m", seed=2)
    return str(path)


def _metric(text: str, name: str, label: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


async def _scenario(cl, a1_ids: list[int], tiered: bool) -> dict:
    app = build_app(cl)
    out: dict = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as http:
        async def complete(prompt, **extra):
            r = await http.post("/v1/completions", json={"model": cl.model_name, "prompt": prompt, "max_tokens": OUT,
                                                         "ignore_eos": True, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            body = r.json()
            return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["text"]

        async def metric(name: str, label: str = "", at_least: float = 0.0, wait_s: float = 2.0) -> float:
            """A /metrics value once it reaches `at_least` (the workers publish every few ms), else its last."""
            for _ in range(int(wait_s / 0.05)):
                v = _metric((await http.get("/metrics")).text, name, label)
                if v >= at_least:
                    return v
                await asyncio.sleep(0.05)
            return v

        bad = await http.post("/v1/completions", json={"model": cl.model_name, "prompt": A1, "max_tokens": 1,
                                                       "session_id": "x", "tool_s": -1})
        out["bad_tool_s"] = bad.status_code, bad.json()["error"]["param"]
        _, out["a1"] = await complete(A1, session_id="a", tool_s=30.0)
        if tiered:                                   # the idle session's KV is copied out during its tool call
            out["offload_bytes"] = await metric("tandem:host_kv_copied_bytes_total", 'kind="offload"', 1)
        await complete(B)
        out["a2_cached"], out["a2"] = await complete(A1 + a1_ids + A_NEW, session_id="a")
        if not tiered:
            return out
        for _ in range(40):                          # the copy back is counted with the worker's next StepCounts
            out["load_bytes"] = await metric("tandem:host_kv_copied_bytes_total", 'kind="load"') + \
                await metric("tandem:host_kv_copied_bytes_total", 'kind="prefetch"')
            if out["load_bytes"]:
                break
            await asyncio.sleep(0.05)
        out["cpu_hits"] = await metric("tandem:prefix_cache_hits_by_medium_total", 'medium="CPU"', 1)
        out["capacity"] = await metric("tandem:host_kv_cache_capacity_bytes", at_least=1)
    return out


def _run(ckpt: str, policy: str, a1_ids: list[int], **engine) -> dict:
    async def go():
        cl = await ServingCluster.start(ClusterConfig(ckpt, 1, 1, 0, policy, engine_args={**ENGINE, **engine}))
        try:
            return await _scenario(cl, a1_ids, bool(engine))
        finally:
            await cl.shutdown()
    return asyncio.run(go())


def offline(ckpt: str):
    """Session A's three rounds on the offline engine, KV resident throughout."""
    eng = LLMEngine(EngineConfig(model=ckpt, num_kv_blocks=64, max_model_len=384))
    greedy = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    eng.add_request("1", A1, greedy, session_id="a")
    a1 = _finish(eng)
    eng.add_request("2", A1 + a1.outputs[0].token_ids + A_NEW, greedy, session_id="a")
    a2 = _finish(eng)
    eng.add_request("3", a3_prompt(a1.outputs[0].token_ids, a2.outputs[0].token_ids), greedy, session_id="a")
    a3 = _finish(eng)
    eng.close()
    return a1, a2, a3


def a3_prompt(a1_ids, a2_ids) -> list[int]:
    return A1 + list(a1_ids) + A_NEW + list(a2_ids) + [7, 8, 9]


def _finish(eng):
    for _ in range(200):
        for o in eng.step():
            if o.finished:
                return o
    raise AssertionError("no output")


@pytest.fixture(scope="module")
def reference(ckpt):
    return offline(ckpt)


def test_an_offloaded_session_resumes_from_host_memory(ckpt, reference):
    a1, a2, _ = reference
    history = len(A1) + OUT - 1
    assert a2.num_cached_tokens == history
    out = _run(ckpt, "ampd-tiered", a1.outputs[0].token_ids, kv_offloading_size=0.01)
    assert out["bad_tool_s"] == (400, "tool_s")
    assert out["a1"] == a1.outputs[0].text and out["a2"] == a2.outputs[0].text
    assert out["a2_cached"] == history, out
    assert out["offload_bytes"] > 0 and out["load_bytes"] > 0 and out["cpu_hits"] == history
    assert out["capacity"] > 0


def test_without_a_host_tier_the_same_run_recomputes(ckpt, reference):
    a1, a2, _ = reference
    plain = _run(ckpt, "ampd", a1.outputs[0].token_ids)
    assert plain["a2"] == a2.outputs[0].text
    assert plain["a2_cached"] < len(A1) + OUT - 1     # no host tier: the evicted history is recomputed


def test_failed_copies_and_a_killed_decode_worker_lose_no_session(ckpt, reference, monkeypatch):
    """Every host-tier copy fails (injected on the copy threads): the session's round recomputes with the same greedy
    output. Then the decode worker is killed between rounds: its host tier is gone, the session is bound again and
    its next round recomputes on the replacement, with the offline engine's output."""
    a1, a2, a3 = reference
    monkeypatch.setenv(FAULT_ENV, "1000")
    history = len(A1) + OUT - 1

    async def go():
        cl = await ServingCluster.start(ClusterConfig(ckpt, 1, 1, 0, "ampd-tiered", max_restarts=2,
                                                      engine_args={**ENGINE, "kv_offloading_size": 0.01}))
        app = build_app(cl)
        out: dict = {}
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as http:
                async def complete(prompt):
                    r = await http.post("/v1/completions", json={"model": cl.model_name, "prompt": prompt,
                                                                 "max_tokens": OUT, "ignore_eos": True,
                                                                 "temperature": 0, "session_id": "a", "tool_s": 30})
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.json()["choices"][0]["text"]
                _, out["a1"] = await complete(A1)
                for _ in range(40):                  # the offload fails on the copy thread
                    failed = _metric((await http.get("/metrics")).text, "tandem:host_kv_failed_copies_total")
                    if failed:
                        break
                    await asyncio.sleep(0.05)
                out["failed"] = failed
                r = await http.post("/v1/completions", json={"model": cl.model_name, "prompt": B, "max_tokens": OUT,
                                                             "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
                out["a2_cached"], out["a2"] = await complete(A1 + a1.outputs[0].token_ids + A_NEW)
                wid, (_, pid) = next((w, rp) for w, rp in cl.worker_pids().items() if rp[0] == "decode")
                os.kill(pid, signal.SIGKILL)
                out["replaced"] = False
                for _ in range(200):                 # the supervisor replaces it
                    await asyncio.sleep(0.05)
                    if cl.worker_pids().get(wid, ("", pid))[1] != pid and cl.is_healthy():
                        out["replaced"] = True
                        break
                out["a3_cached"], out["a3"] = await complete(a3_prompt(a1.outputs[0].token_ids,
                                                                       a2.outputs[0].token_ids))
        finally:
            await cl.shutdown()
        return out
    out = asyncio.run(go())
    assert out["failed"] >= 1 and out["replaced"]
    assert out["a1"] == a1.outputs[0].text and out["a2"] == a2.outputs[0].text and out["a3"] == a3.outputs[0].text
    assert out["a2_cached"] < history                 # nothing reached host memory: recomputed
    assert out["a3_cached"] < len(a3_prompt(a1.outputs[0].token_ids, a2.outputs[0].token_ids)) - 3


def test_the_in_process_server_offloads_between_requests(ckpt):
    """AsyncLLM (the in-process backend) runs the host tier's decisions and copies while no request runs: a session's
    idle KV reaches host memory (HiCache-like write-through) without another request, and /metrics shows it."""
    from tandem.runtime.async_llm import AsyncLLM

    async def go():
        client = AsyncLLM.from_model(ckpt, served_model_name="tiny", policy="hicache", kv_offloading_size=0.01,
                                     **ENGINE)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(client)), base_url="http://t",
                                         timeout=60) as http:
                for bad in ({"tool_s": 5}, {"session_id": "a", "tool_s": "soon"}):   # no session; not a number
                    r = await http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **bad,
                                                                      "messages": [{"role": "user", "content": "hi"}]})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_s", r.text
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": A1, "max_tokens": OUT,
                                                             "ignore_eos": True, "session_id": "a", "tool_s": 5})
                assert r.status_code == 200, r.text
                for _ in range(100):
                    text = (await http.get("/metrics")).text
                    if _metric(text, "tandem:host_kv_copied_bytes_total", 'kind="offload"') > 0:
                        break
                    await asyncio.sleep(0.02)
                return text
        finally:
            await client.shutdown()
    text = asyncio.run(go())
    assert _metric(text, "tandem:host_kv_copied_bytes_total", 'kind="offload"') > 0
    assert _metric(text, "tandem:host_kv_cache_bytes") > 0 and _metric(text, "tandem:host_kv_failed_copies_total") == 0


def test_live_kv_events_steer_a_new_session_to_the_worker_holding_its_prefix(ckpt):
    """Two co-located workers, continuum-tool: session a's prompt (10 blocks) is served and its prefix blocks
    registered; the worker publishes them as KV events (BlockStored, GPU) to the coordinator. Session b, whose prompt
    starts with the same 9 blocks, is then bound to that worker (cache-aware binding: 9 held blocks against the
    other worker's none) although least committed KV would pick the idle one, and reuses the 144 prefix tokens."""
    async def go():
        cl = await ServingCluster.start(ClusterConfig(ckpt, 0, 0, 2, "continuum-tool",
                                                      engine_args={**ENGINE, "kv_offloading_size": 0.01}))
        app = build_app(cl)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as http:
                async def complete(prompt, sid):
                    r = await http.post("/v1/completions", json={"model": cl.model_name, "prompt": prompt,
                                                                 "max_tokens": OUT, "ignore_eos": True,
                                                                 "temperature": 0, "session_id": sid})
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                await complete(A1 + [7] * 10, "a")             # 160 tokens: 10 full blocks
                coord = cl.shell.coord
                home = coord.session_worker("a")
                held = 0
                for _ in range(100):                           # the worker's KV events reach the coordinator
                    held = coord.prefixes.match(home, coord.live["a"].hashes)[0]
                    if held:
                        break
                    await asyncio.sleep(0.02)
                cached = await complete(A1[:144] + [9] * 30, "b")
                return home, held, coord.session_worker("b"), cached
        finally:
            await cl.shutdown()
    home, held, b_home, cached = asyncio.run(go())
    assert held == 10 and b_home == home and cached == 144
