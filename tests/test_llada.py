"""LLaDA-style masked diffusion: the model loaded from LLaDA's HF layout, the reference and prefix-cached loops."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.diffusion.llada_generate import (PrefixCachedLoop, generate_llada_cached,
                                                    generate_llada_reference)
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.loader import ModelLoadError, load_model
from tandem.engine.models import LLaDAModelLM
from tandem.engine.models.bidirectional import BidirectionalBackend, BidirectionalMetadata
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tiny_model import LLADA_MASK_TOKEN, arch_tokenizer, make_tiny_model

SHAPE = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=128)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [4] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=24, ignore_eos=True)
STATIC = DllmConfig(dllm_block_length=8, dllm_unmasking_strategy="low_confidence_static", dllm_denoising_steps=4)
DYNAMIC = DllmConfig(dllm_block_length=8, dllm_confidence_threshold=0.5)


pytestmark = pytest.mark.usefixtures("one_thread")     # tests/conftest.py


def _write(path, **overrides):
    """A tiny random LLaDA checkpoint (LLaDA's config.json and tensor names) at path."""
    make_tiny_model(path, arch="llada", seed=1, config_overrides={**SHAPE, **overrides})
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The 2-layer tiny LLaDA checkpoint's directory."""
    return _write(tmp_path_factory.mktemp("llada"))


@pytest.fixture(scope="module")
def model(ckpt):
    """The 2-layer model, loaded by the engine's loader in float32 on the CPU."""
    return load_model(ckpt, dtype="float32")[0]


def _dense_logits(ckpt, ids: list[int]) -> torch.Tensor:
    """LLaDA's forward written out in float64 from the checkpoint's own tensors, with no attention mask."""
    from safetensors.torch import load_file
    W = {k: v.double() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    c = json.loads((ckpt / "config.json").read_text())
    H, Hkv, L = c["n_heads"], c["n_kv_heads"], c["n_layers"]
    D, T = c["d_model"] // H, len(ids)
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"])

    def rope(x):
        return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin

    x = W["model.transformer.wte.weight"][ids]
    for n in range(L):
        p = f"model.transformer.blocks.{n}."
        h = rms(x, W[p + "attn_norm.weight"])
        q = rope((h @ W[p + "q_proj.weight"].T).view(T, H, D))
        k = rope((h @ W[p + "k_proj.weight"].T).view(T, Hkv, D)).repeat_interleave(H // Hkv, 1)
        v = (h @ W[p + "v_proj.weight"].T).view(T, Hkv, D).repeat_interleave(H // Hkv, 1)
        att = torch.softmax(torch.einsum("thd,shd->hts", q, k) / D ** 0.5, -1)     # every key, both directions
        x = x + torch.einsum("hts,shd->thd", att, v).reshape(T, H * D) @ W[p + "attn_out.weight"].T
        h = rms(x, W[p + "ff_norm.weight"])
        x = x + (F.silu(h @ W[p + "ff_proj.weight"].T) * (h @ W[p + "up_proj.weight"].T)) @ W[p + "ff_out.weight"].T
    return rms(x, W["model.transformer.ln_f.weight"]) @ W["model.transformer.ff_out.weight"].T


def _full_forward(model, ids: list[int]) -> torch.Tensor:
    """The model's logits at every position of ids, no cache."""
    meta = BidirectionalMetadata.build([len(ids)], [0], [0], None, 1)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), None, None, meta))


def test_loads_llada_hf_layout(ckpt, model):
    """Protects loading LLaDA's own layout through load_model: its config fields (mask_token_id from config.json),
    its tensor names mapped to the right modules (gate vs up, output head), bidirectional attention, unshifted logits."""
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["architectures"] == ["LLaDAModelLM"] and "hidden_size" not in cfg
    assert isinstance(model, LLaDAModelLM)
    assert model.mask_token_id == cfg["mask_token_id"] == arch_tokenizer("llada").token_to_id(LLADA_MASK_TOKEN)
    mc = model.config
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
            mc.intermediate_size, mc.vocab_size, mc.tie_word_embeddings) == (64, 2, 4, 2, 16, 128, 32768, False)
    ids = [5, 6, 7, model.mask_token_id, model.mask_token_id, 9, model.mask_token_id]
    got, want = _full_forward(model, ids), _dense_logits(ckpt, ids)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
    # no causal mask: the first position's logits change with the last token
    assert not torch.equal(_full_forward(model, ids[:-1] + [11])[0], got[0])


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cfg", [STATIC, DYNAMIC, DllmConfig(dllm_block_length=8, dllm_unmasking_strategy="sequential",
                                                             dllm_denoising_steps=2)],
                         ids=["static", "dynamic", "sequential"])
def test_refresh_every_step_equals_reference(model, params, cfg):
    """Protects the prefix-cached loop's bookkeeping: recomputing the canvas at every step (refresh_interval 1) gives
    the reference's tokens and commits per step exactly, for a batch, greedy and seeded."""
    outs = generate_llada_cached(model, PROMPTS, params, cfg, refresh_interval=1)
    for prompt, out in zip(PROMPTS, outs):
        ref = generate_llada_reference(model, prompt, params, cfg)
        assert out.token_ids == ref.token_ids and out.commits_per_step == ref.commits_per_step
        assert len(ref.token_ids) == 24 and ref.finish_reason == "length" and all(out.refreshed)
        assert model.mask_token_id not in ref.token_ids


def test_eos_and_max_tokens(model):
    """Protects the stop rules: the first EOS in a completed block ends the output (kept), max_tokens below the canvas
    is exact (the canvas stays gen_length long: the tokens before the limit are the unlimited run's)."""
    full = generate_llada_reference(model, PROMPTS[0], GREEDY, STATIC, eos_token_ids=[])
    eos = full.token_ids[9]
    stop = generate_llada_reference(model, PROMPTS[0], GREEDY, STATIC, eos_token_ids=[eos])
    first = full.token_ids.index(eos)
    assert stop.token_ids == full.token_ids[:first + 1] and stop.finish_reason == "stop"
    assert stop.num_blocks == first // 8 + 1
    short = generate_llada_reference(model, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=13), STATIC,
                                     gen_length=24, eos_token_ids=[])
    assert len(short.token_ids) == 13 and short.finish_reason == "length" and short.num_blocks == 2


class _Recorder(BidirectionalBackend):
    """The default backend, keeping every layer's K and V of the step (layer order)."""

    def __init__(self) -> None:
        super().__init__(use_flash=False)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q, k, v, kv, meta, scale):
        self.kv.append((k.clone(), v.clone()))
        return super().forward(q, k, v, kv, meta, scale)


def test_prefix_cache_exact_at_refresh_and_rows_claimed(model):
    """Protects Fast-dLLM's prefix cache: after each block's full forward the cache holds exactly a full forward's
    K/V of the prefix (prompt + completed blocks), and every other step computes only the active block and the masks
    after it (counted at the model's input)."""
    seen: list[list[int]] = []
    hook = model.model.register_forward_pre_hook(lambda mod, args: seen.append(args[1].tolist()))
    try:
        loop = PrefixCachedLoop(model, [PROMPTS[2]], GREEDY, DYNAMIC, gen_length=24, kv_block_size=4)
        s, checked = loop.seqs[0], 0
        while not s.done:
            refresh, start, canvas = loop.refreshes(0), s.start, s.canvas()
            loop.step()
            if not refresh:
                continue
            rec = _Recorder()
            meta = BidirectionalMetadata.build([len(canvas)], [0], [0], None, 1)
            meta.backend = rec
            with torch.inference_mode():
                model(torch.tensor(canvas), None, None, meta)
            seen.pop()                                       # the check's own forward
            slots = torch.tensor([loop.tables[0][p // 4] * 4 + p % 4 for p in range(start)])
            for layer, (k, v) in zip(loop.kv, rec.kv):
                flat = layer.view(2, -1, *layer.shape[-2:])
                assert torch.equal(flat[0][slots], k[:start]) and torch.equal(flat[1][slots], v[:start])
            checked += 1
    finally:
        hook.remove()
    out = s.out
    P, end = len(PROMPTS[2]), len(PROMPTS[2]) + 24
    assert checked == out.num_blocks == 3 and out.refreshed.count(True) == 3
    assert out.refreshed == [i == 0 or c != out.context_per_step[i - 1] for i, c in enumerate(out.context_per_step)]
    assert sorted(set(out.context_per_step)) == [P, P + 8, P + 16]
    want = [list(range(0 if r else c, end)) for r, c in zip(out.refreshed, out.context_per_step)]
    assert seen == want


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_cache_exact_on_one_layer(tmp_path, params):
    """Protects the cached steps' positions and prefix reads: with one layer a prefix's K/V cannot depend on later
    tokens, so Fast-dLLM's schedule (one full forward per block) must give the reference's tokens exactly."""
    one = load_model(_write(tmp_path, n_layers=1), dtype="float32")[0]
    outs = generate_llada_cached(one, PROMPTS, params, STATIC, kv_block_size=4)
    for prompt, out in zip(PROMPTS, outs):
        ref = generate_llada_reference(one, prompt, params, STATIC)
        assert out.token_ids == ref.token_ids and out.commits_per_step == ref.commits_per_step
        assert out.refreshed.count(True) == 3 < len(out.refreshed)


def _fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash_attn_varlen_func's contract, on the CPU: each packed sequence attends to its packed keys."""
    assert not causal
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert b - a <= max_q and d - c <= max_k
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1),
                                           scale=softmax_scale, enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out


def test_varlen_path_packs_like_sdpa(model):
    """Protects the CUDA flash-attn path's packing (cumulative query and key lengths, cached prefix before the
    queries, non-causal), run here through a CPU stand-in for flash_attn_varlen_func."""
    want = generate_llada_cached(model, PROMPTS, GREEDY, STATIC)
    layers = [layer.self_attn for layer in model.model.layers]
    saved = [a.backend for a in layers]
    try:
        for a in layers:
            a.backend = BidirectionalBackend(varlen=_fake_varlen)
        got = generate_llada_cached(model, PROMPTS, GREEDY, STATIC)
    finally:
        for a, b in zip(layers, saved):
            a.backend = b
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_bad_input(tmp_path, model):
    """Protects the refusals: each mistake gets one ValueError naming it."""
    def refused(match, fn, *args, **kw):
        with pytest.raises(ValueError, match=match):
            fn(*args, **kw)

    bad = _write(tmp_path / "nomask")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["mask_token_id"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json field 'mask_token_id' must be a token id below "
                                             r"vocab_size 32768, got None"):
        load_model(bad)
    cfg.update(mask_token_id=3, block_type="sequential")
    (bad / "config.json").write_text(json.dumps(cfg))
    refused(r"config\.json field 'block_type' = 'sequential' is not supported for LLaDA \(only 'llama'\)",
            load_model, bad)
    p = PROMPTS[0]
    refused(r"^gen_length must be a positive multiple of the block length 8, got 12$",
            generate_llada_reference, model, p, SamplingParams(max_tokens=8), STATIC, gen_length=12)
    refused(r"^dllm_confidence_threshold must be in \(0, 1\], got 0\.0$", generate_llada_cached, model, [p], GREEDY,
            DllmConfig(dllm_block_length=8, dllm_confidence_threshold=0.0))
    refused(r"^dllm_confidence_threshold must be a number in \[0, 1\], got 1\.5$", DllmConfig,
            dllm_confidence_threshold=1.5)
    refused(r"^dllm_denoising_steps 3 must divide the block length 8$", generate_llada_reference, model, p, GREEDY,
            DllmConfig(dllm_block_length=8, dllm_denoising_steps=3))
    refused(r"^max_tokens 24 exceeds gen_length 16$", generate_llada_reference, model, p, GREEDY, STATIC,
            gen_length=16)
    refused(r"^LLaDA decoding needs gen_length or SamplingParams\.max_tokens \(the canvas length\)$",
            generate_llada_reference, model, p, SamplingParams(max_tokens=None), STATIC)
    refused(r"^refresh_interval must be an integer >= 0, got -1$", generate_llada_cached, model, [p], GREEDY, STATIC,
            refresh_interval=-1)
    ar = AttnMetadata.build([3], [3], [[0]], 16)
    refused(r"^a LLaDA model is not autoregressive: decode it with tandem\.engine\.diffusion\.llada_generate",
            model, torch.tensor([1, 2, 3]), torch.arange(3), [], ar)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_paths(ckpt, dtype):
    """Protects the CUDA path chosen at run time: on the GPU the cached loop with refresh at every step equals the
    reference, and in float32 the GPU gives the CPU's greedy tokens."""
    gpu = load_model(ckpt, dtype=dtype, device="cuda")[0]
    outs = generate_llada_cached(gpu, PROMPTS, GREEDY, STATIC, refresh_interval=1)
    refs = [generate_llada_reference(gpu, p, GREEDY, STATIC) for p in PROMPTS]
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    fast = generate_llada_cached(gpu, PROMPTS, GREEDY, STATIC)
    assert all(len(o.token_ids) == 24 for o in fast)
    if dtype == "float32":
        cpu = load_model(ckpt, dtype="float32")[0]
        assert [r.token_ids for r in refs] == [generate_llada_reference(cpu, p, GREEDY, STATIC).token_ids
                                               for p in PROMPTS]
