"""Automatic prefix caching through HTTP: requests without a session id that share a prefix
report `cached_tokens` = the prefix rounded down to whole blocks, and a session whose history diverges at token k
reuses floor(k / block) blocks — in the in-process server and on 1P+1D worker processes (AMPD), where the decode
worker's prefix cache becomes the round's history wherever its prefill runs."""
from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("torch")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.runtime.cluster import ClusterConfig, ServingCluster  # noqa: E402
from tandem.server.app import build_app  # noqa: E402

BS = 16
ENGINE = dict(num_kv_blocks=256, max_model_len=512)
PREFIX = list(range(3, 3 + 70))                  # 70 tokens: 4 whole blocks = 64 cacheable
SESSION = list(range(200, 260))
K = 41                                           # the session's history diverges at token 41: 2 whole blocks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-prefix")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    return str(path)


async def _scenario(client) -> dict:
    app = build_app(client)
    out: dict = {"anon": [], "session": []}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as http:
        async def complete(prompt, **extra):
            r = await http.post("/v1/completions", json={"model": client.model_name, "prompt": prompt,
                                                         "max_tokens": 3, "ignore_eos": True, "temperature": 0,
                                                         **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        for i in range(3):
            out["anon"].append(await complete(PREFIX + [100 + i] * 5))
        out["session"].append(await complete(SESSION, session_id="s1"))
        out["session"].append(await complete(SESSION[:K] + [9] * 30, session_id="s1"))
        text = (await http.get("/metrics")).text
        out["hits"] = _hits(text)
        r = await http.post("/v1/completions", json={"model": client.model_name, "prompt": CHOICES_PROMPT, "n": 3,
                                                     "max_tokens": 2, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        out["choices"] = [c["index"] for c in r.json()["choices"]]
        out["choice_hits"] = _hits((await http.get("/metrics")).text) - out["hits"]
        # vllm:iteration_tokens_total: one 40-token prefill step and 4 one-token decode steps, wherever they ran
        before, _ = await _settled_steps(http)     # worker processes report step counts with their state: wait
        r = await http.post("/v1/completions", json={"model": client.model_name, "prompt": list(range(400, 440)),
                                                     "max_tokens": 5, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        after, text = await _settled_steps(http)
        out["steps"] = (after[0] - before[0], after[1] - before[1])
        out["cache_config"] = next(line.split("{")[0] for line in text.splitlines()
                                   if line.startswith("vllm:cache_config_info{"))
    return out


async def _settled_steps(http: httpx.AsyncClient) -> tuple[tuple[float, float], str]:
    """vllm:iteration_tokens_total's (count, sum) once two reads 0.3 s apart agree, and the last /metrics text."""
    last = None
    for _ in range(40):
        text = (await http.get("/metrics")).text
        now = _steps(text)
        if now == last:
            return now, text
        last = now
        await asyncio.sleep(0.3)
    raise AssertionError("vllm:iteration_tokens_total kept changing")


def _steps(metrics: str) -> tuple[float, float]:
    """(count, sum) of vllm:iteration_tokens_total."""
    def value(name: str) -> float:
        return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))
    return value("vllm:iteration_tokens_total_count"), value("vllm:iteration_tokens_total_sum")


def _hits(metrics: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total{"))


CHOICES_PROMPT = list(range(300, 350))         # 50 tokens: 3 whole blocks, shared by the n = 3 choices
EXPECTED = {"anon": [0, 64, 64], "session": [0, (K // BS) * BS], "choices": [0, 1, 2], "choice_hits": 2 * 48,
            "steps": (5, 44), "cache_config": "vllm:cache_config_info"}


def test_prefix_caching_through_http_in_process(ckpt):
    client = AsyncLLM.from_model(ckpt, served_model_name="tiny", **ENGINE)
    try:
        out = asyncio.run(_scenario(client))
    finally:
        asyncio.run(client.shutdown())
    assert {k: out[k] for k in EXPECTED} == EXPECTED
    assert out["hits"] == 64 + 64 + 32


def test_prefix_caching_through_http_on_disaggregated_workers(ckpt):
    async def go():
        cl = await ServingCluster.start(ClusterConfig(ckpt, 1, 1, 0, "ampd", engine_args=ENGINE))
        try:
            return await _scenario(cl)
        finally:
            await cl.shutdown()
    out = asyncio.run(go())
    assert {k: out[k] for k in EXPECTED} == EXPECTED
    assert out["hits"] == 64 + 64 + 32
