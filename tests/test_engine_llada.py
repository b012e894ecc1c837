"""LLaDA-style (bidirectional) models served by the engine and `tandem serve`.

A LLaDA request runs through the same WorkerCore as SDAR's dLLM-Serve mode, with the core's span `canvas`: the canvas
is the prompt and G (max_tokens) rounded up to whole blocks of masks, decoded block by block from the prompt's end; a
Refresh at each block's first step recomputes the canvas and packs the prefix's K/V, the block's other steps are
Reuse steps computing the active block and the masks after it over the packed prefix (Fast-dLLM's prefix cache; dense
at ρ = 1, the default). The engine executes what the core plans with refresh.py's per-sequence step on
llada_generate.CanvasState, so its tokens must be generate_llada_cached's (and, with a refresh at every step,
generate_llada_reference's), whatever else runs beside them. A 2-layer random model from `tandem tiny-model --arch
llada` (the cache goes stale within a block beyond the first layer, so the prefix-cached and reference loops differ:
each is matched by its own schedule).
"""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.diffusion.llada_generate import generate_llada_cached, generate_llada_reference  # noqa: E402
from tandem.engine.diffusion.unmasking import DllmConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.policy.dllm_serve import PhaseSchedule, PhaseSpec  # noqa: E402
from tandem.runtime.cluster import ClusterConfig  # noqa: E402
from live_server import LiveServer  # noqa: E402

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=128)
BLOCK = 8
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [4] * 11]
# max_tokens 20: a canvas of 24 masks, the last block half past the limit (computed, never committed)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
DYNAMIC = DllmConfig(dllm_block_length=BLOCK, dllm_confidence_threshold=0.5)
STATIC = DllmConfig(dllm_block_length=BLOCK, dllm_unmasking_strategy="low_confidence_static", dllm_denoising_steps=4)
KEY = "sk-llada"


pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The 2-layer tiny LLaDA checkpoint (LLaDA's own HF layout)."""
    return make_tiny_model(tmp_path_factory.mktemp("llada"), arch="llada", seed=1, config_overrides=SHAPE)


@pytest.fixture(scope="module")
def model(ckpt):
    """The same checkpoint loaded for the decoding loops (float32, CPU)."""
    return load_model(ckpt, dtype="float32")[0]


def _engine(ckpt, cfg: DllmConfig, **kw) -> LLMEngine:
    """An engine on the checkpoint whose decoding defaults are `cfg`'s."""
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
                                  dllm_block_length=cfg.dllm_block_length,
                                  dllm_unmasking_strategy=cfg.dllm_unmasking_strategy,
                                  dllm_denoising_steps=cfg.dllm_denoising_steps,
                                  dllm_confidence_threshold=cfg.dllm_confidence_threshold, **kw))


def _drain(eng: LLMEngine, streams: dict[str, list[int]], done: dict[str, list[int]]) -> None:
    """Step until nothing is left; every stream only grows; final token ids into `done`."""
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks = list(o.outputs[0].token_ids)
            assert toks[:len(streams.get(o.request_id, []))] == streams.get(o.request_id, [])
            streams[o.request_id] = toks
            if o.finished:
                assert o.error is None, o.error
                done[o.request_id] = toks


def _run(eng: LLMEngine, prompts, params) -> list[list[int]]:
    """The prompts batched from the first step; their final token ids in order."""
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    _drain(eng, {}, done)
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("params,cfg", [(GREEDY, DYNAMIC), (SEEDED, STATIC)], ids=["greedy", "seeded"])
def test_the_engine_is_fast_dllms_prefix_cache_token_for_token(ckpt, model, params, cfg):
    """Protects the mapping Fast-dLLM prefix cache = Refresh at each block's first step + Reuse over a dense cache:
    three prompts batched give generate_llada_cached's tokens, the core's phases are the loop's (one Refresh per
    block, Reuse otherwise), and the query tokens the core packed are exactly those the engine computed."""
    eng = _engine(ckpt, cfg)
    got = _run(eng, PROMPTS, params)
    ref = generate_llada_cached(model, PROMPTS, params, cfg)
    assert got == [r.token_ids for r in ref]
    st = eng.core.dllm_stats()
    assert st["seq_steps"] == {"full": 0, "refresh": sum(sum(r.refreshed) for r in ref),
                               "reuse": sum(len(r.refreshed) - sum(r.refreshed) for r in ref)}
    assert st["tokens"] == eng.stats.decode_tokens > 0


@pytest.mark.parametrize("params,cfg", [(GREEDY, DYNAMIC), (SEEDED, STATIC)], ids=["greedy", "seeded"])
def test_a_refresh_at_every_step_is_the_full_recompute_reference(ckpt, model, params, cfg):
    """Protects the Refresh path (the whole canvas, bidirectional, its logits sampled): refresh_interval 1 gives
    generate_llada_reference's tokens for every prompt, batched, with no Reuse step."""
    eng = _engine(ckpt, cfg, dllm_admission="phase", dllm_refresh_interval=1)
    got = _run(eng, PROMPTS, params)
    assert got == [generate_llada_reference(model, p, params, cfg).token_ids for p in PROMPTS]
    assert eng.core.dllm_stats()["seq_steps"]["reuse"] == 0


@pytest.mark.parametrize("retention", [None, 0.5], ids=["dense", "sparse-0.5"])
def test_outputs_do_not_depend_on_what_runs_beside_them(ckpt, retention):
    """Protects batching invariance: a request decoded alone equals the same request admitted while two others are in
    the middle of their blocks (Reuse steps beside its Refresh), dense and with head-centric sparse KV at ρ = 0.5,
    whose buffers are the ⌈ρ·(P + G)⌉ slots the core reserved; the others run to their max_tokens."""
    kw = {} if retention is None else dict(dllm_admission="phase", kv_retention_ratio=retention)
    probe = SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=20, ignore_eos=True)
    alone = _run(_engine(ckpt, STATIC, **kw), [PROMPTS[2]], probe)[0]
    eng = _engine(ckpt, STATIC, **kw)
    eng.add_request("b", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.add_request("c", PROMPTS[1], SEEDED)
    for _ in range(3):
        eng.step()
    eng.add_request("a", PROMPTS[2], probe)
    schedule = PhaseSchedule(PhaseSpec(BLOCK, retention=retention or 1.0))
    sizes = {"a": (11, 20), "b": (5, 30), "c": (3, 20)}
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for sid, buf in eng.dllm.buffers.items():
            assert buf.capacity == schedule.kv_tokens(*sizes[sid.removeprefix("req-")])
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    assert done["a"] == alone
    assert len(done["b"]) == 30 and len(done["c"]) == 20
    assert eng.core.dllm_stats()["seq_steps"]["reuse"] > 0


def test_max_tokens_is_clamped_to_whole_blocks_that_fit_and_a_prompt_without_room_is_refused(ckpt):
    """Protects the canvas rule (canvas_max_tokens): without max_tokens a request generates the whole blocks left
    under max_model_len; a prompt leaving less than one block is refused with one EngineError."""
    eng = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=40,
                                 dllm_block_length=BLOCK))
    eng.add_request("x", list(range(5, 19)), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    eng.add_request("z", list(range(5, 19)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    done: dict[str, list[int]] = {}
    _drain(eng, {}, done)
    assert len(done["x"]) == len(done["z"]) == 24          # 14 + 24 <= 40 < 14 + 32
    with pytest.raises(EngineError, match="leaves less than one diffusion block"):
        eng.add_request("y", list(range(5, 38)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kw,expect", [
    (dict(dllm_chunk="8"), "dllm_chunk 8 sizes Optimus's streaming windows, which need a block-causal model"),
    (dict(dllm_chunk="block"), "no position's K/V is final when it is committed"),
    (dict(dllm_denoising_steps=3), "dllm_denoising_steps 3 must divide the block length 8"),
])
def test_options_that_do_not_apply_are_refused_by_the_engine(ckpt, kw, expect):
    """Protects the refusals: Optimus's windows (fixed or whole-block chunks) do not apply to a bidirectional canvas,
    and say why; steps must divide the block; one EngineError each."""
    with pytest.raises(EngineError) as e:
        LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64,
                               dllm_block_length=BLOCK, **kw))
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_optimus_options_on_a_llada_model_with_one_line(ckpt, tmp_path, capsys):
    """Protects `tandem serve`'s refusals: --dllm-chunk and --dllm-latency-profile on a LLaDA checkpoint exit 2 with
    one line saying why; a LLaDA model needs co-located workers."""
    prof = tmp_path / "p.json"
    prof.write_text("{}")
    for args, expect in (([str(ckpt), "--colocated", "1", "--dllm-chunk", "8"],
                          "--dllm-chunk sizes Optimus's streaming windows, which need a block-causal model"),
                         ([str(ckpt), "--colocated", "1", "--dllm-latency-profile", str(prof)],
                          "--dllm-latency-profile sizes Optimus's streaming windows"),
                         ([str(ckpt)], "served by co-located workers")):
        assert main(["serve", "--model", *args, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def server(ckpt):
    """`tandem serve --colocated 1` on the checkpoint, blocks of 8."""
    srv = LiveServer(ClusterConfig(str(ckpt), 0, 0, 1, "vllm", served_model_name="llada",
                                   engine_args={"max_model_len": 256, "num_kv_blocks": 64, "dllm_block_length": BLOCK}),
                     api_key=KEY)
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=dict({"model": "llada"}, **body),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_the_server_streams_the_committed_prefix_and_counts_usage_exactly(server, model):
    """Protects the OpenAI API path: a completion of a token-id prompt is generate_llada_cached's tokens with exact
    usage; its stream's chunks (the committed prefix as it grows, several steps) add up to it, text and ids."""
    prompt = PROMPTS[0]
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    want = generate_llada_cached(model, [prompt], GREEDY, DllmConfig(dllm_block_length=BLOCK))[0].token_ids
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    d = r.json()
    choice = d["choices"][0]
    assert choice["token_ids"] == want
    assert d["usage"] == {**d["usage"], "prompt_tokens": 5, "completion_tokens": len(want),
                          "total_tokens": 5 + len(want)}
    text, ids, chunks = "", [], 0
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "llada", "stream": True, **body}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    text += c.get("text") or ""
                    ids += c.get("token_ids") or []
                    chunks += 1
    assert ids == want and text == choice["text"] and chunks >= 2


def test_chat_renders_the_template_and_counts_usage_exactly(server, model):
    """Protects chat on a LLaDA tokenizer (Llama 3's template): the server's rendered prompt (/tokenize) decoded by
    generate_llada_cached gives the chat completion's exact usage."""
    messages = [{"role": "user", "content": "copy: abc"}]
    tok = _post(server, "/tokenize", {"messages": messages})
    assert tok.status_code == 200, tok.text
    ids = tok.json()["tokens"]
    want = generate_llada_cached(model, [ids], SamplingParams(temperature=0.0, max_tokens=12),
                                 DllmConfig(dllm_block_length=BLOCK))[0].token_ids
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"]) == (len(ids), len(want))


@pytest.mark.parametrize("field,value,expect", [
    ("dllm_block_length", 16, "dllm_block_length 16 is not this engine's block length 8"),
    ("dllm_denoising_steps", 3, "dllm_denoising_steps 3 must divide the block length 8"),
    ("logprobs", 2, "block-diffusion decoding does not support logprobs"),
])
def test_bad_request_options_get_one_openai_400(server, field, value, expect):
    """Protects per-request refusals on a LLaDA server: one 400 naming the option, and the server keeps serving."""
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert expect in err["message"] and err["type"] == "invalid_request_error"
    assert server.health() == 200


def test_a_prompt_without_room_for_one_block_is_a_400_from_the_coordinator(server):
    """Protects the canvas clamp on the server: a 250-token prompt under max_model_len 256 leaves less than one block
    of 8; the coordinator answers one OpenAI 400 (it was a worker failure, a 5xx), and the server keeps serving."""
    r = _post(server, "/v1/completions", {"prompt": [5] * 250, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "leaves less than one diffusion block (8 positions)" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert server.health() == 200


def test_the_canvas_span_counts_what_the_engine_computes():
    """Protects the canvas span's arithmetic the engine relies on: a Refresh is the whole canvas (P + G rounded up),
    a Reuse the block and the masks after it over ⌊ρ·prefix⌋ keys, the buffer ⌈ρ·(P + G)⌉."""
    ph = PhaseSchedule(PhaseSpec(BLOCK, delay_step=0, span="canvas", retention=0.5))
    st = ph.new(5, 20, 0, 0)
    assert (ph.demand(st), ph.left(st), ph.kv_tokens(5, 20)) == (29, 8, math.ceil(0.5 * 25))
    ph.advance(st, 8)
    ph.advance(st, 2)                                 # block 2, a Reuse: positions 8..23 of the canvas
    assert (ph.demand(st), ph.reuse_context(st), ph.left(st)) == (16, 6, 6)
    ph.advance(st, 6)
    assert (ph.demand(st), ph.left(st)) == (29, 4)    # block 3 (4 positions before the limit) refreshes
