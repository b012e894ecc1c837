"""vLLM v1's request-level metrics on /metrics (prompt/generation token histograms, prefill/decode/inference
times, preemptions, iteration tokens, cache config info) and the process metrics, with exact counts."""
from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("torch")

from tandem.core.config import PreemptionMode  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.async_llm import AsyncLLM  # noqa: E402
from tandem.server.app import build_app  # noqa: E402
from tandem.server.metrics import build_1_2_5_buckets  # noqa: E402


def _value(text: str, key: str) -> float:
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{key} not in /metrics")


def test_1_2_5_buckets_stop_at_the_maximum():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4) == (1, 2)


def test_request_level_metrics_count_exactly_what_was_served(tmp_path):
    """Protects the vLLM v1 request histograms, vllm:iteration_tokens_total and vllm:cache_config_info."""
    make_tiny_model(tmp_path, arch="qwen3", size="1m", seed=1)
    client = AsyncLLM.from_model(str(tmp_path), served_model_name="tiny", num_kv_blocks=64, max_model_len=256)

    async def run() -> str:
        app = build_app(client)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for prompt, n in (([5] * 17, 4), ([7] * 30, 6)):
                r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                             "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
            return (await http.get("/metrics")).text

    try:
        text = asyncio.run(run())
        steps = client.engine.stats.steps
    finally:
        asyncio.run(client.shutdown())
    lab = '{model_name="tiny"}'
    assert _value(text, f"vllm:request_prompt_tokens_count{lab}") == 2
    assert _value(text, f"vllm:request_prompt_tokens_sum{lab}") == 17 + 30
    assert _value(text, 'vllm:request_prompt_tokens_bucket{le="20.0",model_name="tiny"}') == 1
    assert _value(text, f"vllm:request_generation_tokens_sum{lab}") == 4 + 6
    for name in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds"):
        assert _value(text, f"{name}_count{lab}") == 2
    assert _value(text, f"vllm:num_preemptions_total{lab}") == 0
    # every step of the engine: prefill 17 then 3 decodes, prefill 30 then 5 decodes (one request at a time)
    assert _value(text, f"vllm:iteration_tokens_total_count{lab}") == steps == 2 + 3 + 5
    assert _value(text, f"vllm:iteration_tokens_total_sum{lab}") == 17 + 30 + 3 + 5
    assert _value(text, 'vllm:iteration_tokens_total_bucket{le="1.0",model_name="tiny"}') == 8
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="64"' in info and 'enable_prefix_caching="True"' in info
    assert 'cache_dtype="float32"' in info and info.endswith(" 1.0")
    assert _value(text, "process_resident_memory_bytes") > 0 and "python_info{" in text


def test_swap_preemptions_show_in_the_metrics_and_the_cache_config(tmp_path):
    """Protects vLLM v0's swap gauges and cache_config_info's swap labels: six concurrent requests of 100 tokens
    outgrow a 16-block pool, the engine swaps (preemption_mode=swap) and every request completes; afterwards no
    request is swapped and the swap space is empty."""
    make_tiny_model(tmp_path, arch="qwen3", size="1m", seed=1)
    client = AsyncLLM.from_model(str(tmp_path), served_model_name="tiny", num_kv_blocks=16, max_model_len=256,
                                 preemption_mode="swap", swap_space=0.001)

    async def run() -> str:
        app = build_app(client)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "tiny", "prompt": [5 + i] * 60, "max_tokens": 40, "ignore_eos": True, "temperature": 0})
                for i in range(6)))
            assert [r.status_code for r in rs] == [200] * 6
            return (await http.get("/metrics")).text

    try:
        text = asyncio.run(run())
        core, block_bytes = client.engine.core, client.engine.runner.kv_block_bytes
    finally:
        asyncio.run(client.shutdown())
    lab = '{model_name="tiny"}'
    swapped = core.kv.preempted[PreemptionMode.SWAP]
    assert swapped > 0 and core.kv.preempted[PreemptionMode.RECOMPUTE] == 0
    assert _value(text, f"vllm:num_preemptions_total{lab}") == swapped
    assert _value(text, f"vllm:num_requests_swapped{lab}") == 0
    assert _value(text, f"vllm:cpu_cache_usage_perc{lab}") == 0
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'num_cpu_blocks="{int(0.001 * 2**30) // block_bytes}"' in info and 'preemption_mode="swap"' in info


def test_queue_time_tpot_and_params_n_count_every_request(tmp_path):
    """vllm:request_queue_time_seconds is observed once per engine request, vllm:request_time_per_output_token_seconds
    once per finished one (vLLM's rule: first to last token over the tokens after the first, 0 for one token), and
    vllm:request_params_n once per API request, in vLLM's buckets."""
    make_tiny_model(tmp_path, arch="qwen3", size="1m", seed=1)
    client = AsyncLLM.from_model(str(tmp_path), served_model_name="tiny", num_kv_blocks=64, max_model_len=256)

    async def run() -> str:
        app = build_app(client)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for n, max_tokens in ((1, 1), (1, 5), (2, 4)):
                r = await http.post("/v1/completions", json={"prompt": [5] * 9, "max_tokens": max_tokens, "n": n,
                                                             "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
            return (await http.get("/metrics")).text

    try:
        text = asyncio.run(run())
    finally:
        asyncio.run(client.shutdown())
    lab = '{model_name="tiny"}'
    assert _value(text, f"vllm:request_queue_time_seconds_count{lab}") == 4       # 1 + 1 + 2 engine requests
    assert _value(text, f"vllm:request_time_per_output_token_seconds_count{lab}") == 4
    assert _value(text, 'vllm:request_time_per_output_token_seconds_bucket{le="0.01",model_name="tiny"}') >= 1
    assert _value(text, f"vllm:request_params_n_count{lab}") == 3
    assert _value(text, f"vllm:request_params_n_sum{lab}") == 4
    buckets = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("vllm:request_params_n_bucket")]
    assert buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    assert _value(text, 'vllm:request_params_n_bucket{le="1.0",model_name="tiny"}') == 2
    tpot = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("vllm:request_time_per_output_token_seconds_bucket")]
    assert tpot == ["0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5",
                    "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"]


@pytest.mark.parametrize("deploy", ["1P+1D", "colocated"])
def test_queue_time_is_observed_for_every_request_through_worker_processes(tmp_path, deploy):
    """Through `tandem serve`'s worker processes the queue-time count stayed 0: the workers' scheduling times never
    reached the coordinator. Now the worker that first schedules a request (a prefill worker for a remote prefill,
    else the decode or co-located worker) reports how long ago it did, and every request is observed once: short
    prompts prefill remotely and long ones at home under this TTFT target, so 1P+1D covers both paths."""
    from live_server import LiveServer
    from tandem.runtime.cluster import ClusterConfig

    make_tiny_model(tmp_path, arch="qwen3", size="1m", seed=1)
    engine = dict(max_model_len=1024, num_kv_blocks=512)
    workers, policy = ((1, 1, 0), "ampd") if deploy == "1P+1D" else ((0, 0, 1), "vllm")
    srv = LiveServer(ClusterConfig(str(tmp_path), *workers, policy, served_model_name="tiny", engine_args=engine,
                                   slo_ttft_s=0.010))
    try:
        names = ("vllm:request_queue_time_seconds_count", "tandem:local_prefills_total",
                 "tandem:remote_prefills_total")
        for i, n in enumerate([20, 600, 30, 700, 40, 800]):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5 + i] * n, "max_tokens": 2,
                                                               "ignore_eos": True, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        m = srv.metrics(names)
    finally:
        srv.stop()
    assert m["vllm:request_queue_time_seconds_count"] == 6
    assert m["tandem:local_prefills_total"] + m["tandem:remote_prefills_total"] == 6
    if deploy == "1P+1D":
        assert m["tandem:local_prefills_total"] >= 1 and m["tandem:remote_prefills_total"] >= 1, m
