"""`tandem serve` with a block-diffusion model.

One co-located worker process serves the project's trained tiny SDAR model behind the OpenAI API: a streamed
completion's chunks add up to the non-streamed completion's text and token ids (greedy), usage is exact, the
per-request diffusion options are honoured or refused with an OpenAI-style 400, and /metrics shows the histograms
of tokens committed per step and of the chunk size chosen. The CLI refuses what cannot be served with one line. On
a small KV pool the worker preempts streaming windows by swap, counted in vllm:num_preemptions_total, and serves
what each prompt decodes alone.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402
from live_server import LiveServer  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
KEY = "sk-dllm"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "copy: abc def ->"


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(ClusterConfig(str(ASSET), 0, 0, 1, "vllm", served_model_name="sdar",
                                   engine_args={"max_model_len": 512, "num_kv_blocks": 64, "dllm_chunk": "8"}),
                     api_key=KEY)
    yield srv
    srv.stop()


def _post(srv, body: dict, stream: bool = False) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json=dict({"model": "sdar", "prompt": PROMPT}, **body),
                      headers=AUTH, timeout=60)


def test_a_stream_adds_up_to_the_completion_and_usage_is_exact(server):
    """Greedy: the streamed chunks' text and token ids concatenate to the non-streamed completion's; usage counts
    every prompt and completion token; the chunk size and commit histograms are exported."""
    body = {"max_tokens": 24, "temperature": 0, "return_token_ids": True}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    d = r.json()
    choice = d["choices"][0]
    ids = choice["token_ids"]
    assert d["usage"]["completion_tokens"] == len(ids) and d["usage"]["prompt_tokens"] > 0
    assert d["usage"]["dllm_chunk"] == "8"                 # the mode that ran: the server's fixed chunk
    text, streamed, n_chunks = "", [], 0
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                      json=dict({"model": "sdar", "prompt": PROMPT, "stream": True}, **body)) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                text += c.get("text") or ""
                streamed += c.get("token_ids") or []
                n_chunks += 1
    assert streamed == ids and text == choice["text"] and n_chunks >= 2
    m = httpx.get(server.url + "/metrics", timeout=30).text
    assert "tandem:dllm_tokens_committed_per_step_count" in m and "tandem:dllm_chunk_size_bucket" in m
    assert 'tandem:dllm_chunk_size_bucket{le="8.0",model_name="sdar"}' in m


@pytest.mark.parametrize("field,value,expect", [
    ("dllm_denoising_steps", 5, "dllm_denoising_steps 5 must divide the block length 32"),
    ("dllm_block_length", 16, "dllm_block_length 16 is not this engine's block length 32"),
    ("dllm_confidence_threshold", 0, "dllm_confidence_threshold"),
    ("dllm_confidence_threshold", 1.5, "dllm_confidence_threshold"),
    ("dllm_unmasking_strategy", "random", "dllm_unmasking_strategy"),
    ("dllm_chunk", "fast", "dllm_chunk must be auto, elastic, block or an integer in [1, 4096]"),
    ("dllm_chunk", 0, "dllm_chunk must be auto, elastic, block or an integer in [1, 4096]"),
    ("logprobs", 2, "block-diffusion decoding does not support logprobs"),
])
def test_bad_diffusion_options_get_an_openai_400(server, field, value, expect):
    """A bad diffusion option: one clear 400 with an OpenAI error body, and the server keeps serving."""
    r = _post(server, {"max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert expect in err["message"] and err["type"] == "invalid_request_error"
    assert server.health() == 200


def test_per_request_options_are_honoured(server):
    """A request's own strategy (sequential, one token a step in order) decodes to completion. The server runs a
    fixed chunk of 8 for every request, so a request naming the block still decodes chunk 8, and usage says so."""
    r = _post(server, {"max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       "dllm_unmasking_strategy": "sequential", "dllm_denoising_steps": 32, "dllm_chunk": "block"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["usage"]["dllm_chunk"] == "8"


def test_the_cli_refuses_what_it_cannot_serve_with_one_line(tmp_path):
    """A diffusion model needs co-located workers; a diffusion option needs a diffusion model: exit 2, one line."""
    ar = make_tiny_model(tmp_path / "ar", seed=1)
    for args, expect in (([str(ASSET)], "a block-diffusion model is served by co-located workers: add --colocated N"),
                         ([str(ar), "--colocated", "1", "--dllm-chunk", "8"], "--dllm-chunk: the model is autoregressive")):
        p = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--model", *args, "--port", "0"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and expect in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_worker_process_swaps_streaming_windows_and_serves_what_they_decode_alone():
    """Through the live server (one worker process): six concurrent completions outgrow a pool of 6 blocks, the
    worker preempts by swap (the default for streaming windows: cache_config_info says so), and each completion's
    tokens are what the offline engine decodes for that prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    from tandem.engine.config import EngineConfig
    from tandem.engine.diffusion.tasks import eval_set
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    prompts = [tok.encode(e.prompt).ids for e in eval_set(1)]
    args = {"max_model_len": 96, "num_kv_blocks": 6, "dllm_chunk": "4"}
    srv = LiveServer(ClusterConfig(str(ASSET), 0, 0, 1, "vllm", served_model_name="sdar", engine_args=args),
                     api_key=KEY)
    try:
        def complete(p: list[int]) -> list[int]:
            r = _post(srv, {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(complete, prompts))
        m = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    info = next(line for line in m.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'preemption_mode="swap"' in info and 'num_gpu_blocks="6"' in info
    preempted = next(float(line.split()[-1]) for line in m.splitlines()
                     if line.startswith("vllm:num_preemptions_total{"))
    assert preempted > 0
    eng = LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", **args))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        out = None
        while eng.has_unfinished_requests():
            out = next((o for o in eng.step() if o.finished), out)
        assert out.outputs[0].token_ids == served[i]
