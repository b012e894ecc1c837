"""The SDAR block-diffusion model (tandem/engine/models/sdar.py) and its decoding loops (tandem/engine/diffusion).

The model's forward is checked against a dense reference written here from the checkpoint's Hugging Face tensors
(q_proj, k_proj, v_proj, q_norm, ... as SDAR's repos name them) with SDPA under an explicit block-causal mask, for
a prompt prefill, denoise steps and commits, with and without the paged KV cache. The loops are checked on a
scripted model whose confidences are chosen, so every commit is an exact expectation, and on a random SDAR model,
where the KV-cached loop must give the full-recompute reference's tokens.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tandem.engine.attention.metadata import AttnMetadata, allocate_kv_cache  # noqa: E402
from tandem.engine.diffusion import (DllmConfig, generate_cached, generate_reference, sample_tokens,  # noqa: E402
                                     select_commits)
from tandem.engine.loader import ModelLoadError, load_model  # noqa: E402
from tandem.engine.models import BlockDiffusionMetadata, SDARForCausalLM  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import MASK_TOKEN, SDAR_BLOCK_SIZE, SDAR_VOCAB_SIZE, make_tiny_model  # noqa: E402

B = 4            # diffusion block length of the forward tests (the checkpoint says 32; the model takes any)
PAGE = 3         # KV page size, not a divisor of B: blocks straddle pages


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random SDAR checkpoint with grouped-query attention (4 query heads share 2 KV heads)."""
    return make_tiny_model(tmp_path_factory.mktemp("sdar") / "m", arch="sdar", seed=3,
                           config_overrides={"num_key_value_heads": 2})


@pytest.fixture(scope="module")
def model(ckpt):
    m, _ = load_model(ckpt, dtype="float32")
    return m


@pytest.fixture(scope="module")
def hf(ckpt):
    """The checkpoint's tensors by their Hugging Face names, in float64, and its config.json."""
    sd = {k: v.double() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    return sd, json.loads((ckpt / "config.json").read_text())


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rot(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def dense_reference(hf, ids: list[int], positions: list[int], block: int) -> torch.Tensor:
    """Final-normed hidden states [n, H] of tokens at positions, in float64, with SDPA under the explicit mask
    key j visible to query i iff block(pos_j) <= block(pos_i) (SDAR's block-causal attention)."""
    sd, cfg = hf
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(ids)
    pos = torch.tensor(positions, dtype=torch.float64)
    blk = torch.tensor(positions) // block
    visible = blk[None, :] <= blk[:, None]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(n, hq, d)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(n, hkv, d)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(n, hkv, d)
        q = _rot(_rms(q, sd[p + "self_attn.q_norm.weight"], eps), cos, sin)
        k = _rot(_rms(k, sd[p + "self_attn.k_norm.weight"], eps), cos, sin)
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible)
        x = x + o.transpose(0, 1).reshape(n, hq * d) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"], eps)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err = (a.double() - b).abs().max().item()
    assert err < 2e-4, err


def _cache(model, blocks: int = 32):
    c = model.config
    return allocate_kv_cache(c.num_hidden_layers, blocks, PAGE, c.num_key_value_heads, c.head_dim, torch.float32,
                             "cpu")


def _run(model, ids, meta, kv=None):
    with torch.inference_mode():
        return model(torch.tensor(ids), None, kv, meta)


def test_loads_sdar_from_the_hf_layout_with_its_config_fields(ckpt, model, hf):
    """Protects: an SDAR checkpoint (model_type sdar, block_size, mask_token_id, Qwen3's tensor names with q_norm and
    k_norm, tied embeddings) loads into SDARForCausalLM with its diffusion block length and mask id; the tokenizer
    has the mask token; a config without mask_token_id is refused by name."""
    sd, cfg = hf
    assert cfg["model_type"] == "sdar" and cfg["architectures"] == ["SDARForCausalLM"]
    assert cfg["block_size"] == SDAR_BLOCK_SIZE == 32 and cfg["vocab_size"] == SDAR_VOCAB_SIZE == 32768
    assert isinstance(model, SDARForCausalLM)
    assert model.diffusion_block_size == 32 and model.mask_token_id == cfg["mask_token_id"]
    assert "model.layers.0.self_attn.q_norm.weight" in sd and "model.layers.3.mlp.gate_proj.weight" in sd
    assert "lm_head.weight" not in sd and model.lm_head.weight is model.model.embed_tokens.weight
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    from tandem.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(ckpt)
    assert tok.encode(MASK_TOKEN, add_special_tokens=False) == [cfg["mask_token_id"]]
    bad = ckpt.parent / "no-mask"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "mask_token_id"}))
    with pytest.raises(ModelLoadError, match="mask_token_id"):
        load_model(bad)


def test_full_forward_without_cache_equals_dense_block_causal_reference(model, hf):
    """Protects: with no KV cache, the forward over a whole sequence is block-causal (bidirectional inside each block
    of B, blocks causal), for the model's own block length and another, and not the AR causal mask."""
    ids = [(37 * i + 11) % 380 for i in range(14)]
    for block in (B, 32):
        meta = BlockDiffusionMetadata.build([range(14)], [0], [0], None, PAGE, block)
        _close(_run(model, ids, meta), dense_reference(hf, ids, list(range(14)), block))
    causal = dense_reference(hf, ids, list(range(14)), 1)       # blocks of 1 = the AR mask
    meta = BlockDiffusionMetadata.build([range(14)], [0], [0], None, PAGE, B)
    assert (_run(model, ids, meta).double() - causal).abs().max() > 1e-2


def test_prefill_then_denoise_steps_on_the_cache_equal_the_dense_reference(model, hf):
    """Protects: a prompt prefill (whole blocks, K/V written), then denoise steps of the active block (any subset
    of its positions, not contiguous, none written) reading the cached prefix, equal the dense reference over
    prefix + queries; a denoise step leaves the cache untouched; a commit writes the block once and may share its
    forward with the next block's denoise step."""
    mask = model.mask_token_id
    prompt = [(53 * i + 7) % 380 for i in range(8)]           # two whole blocks of 4
    kv = _cache(model)
    table = [5, 0, 9, 2, 7, 11, 3]                             # 21 slots, shuffled pages
    meta = BlockDiffusionMetadata.build([range(8)], [0], [8], [table], PAGE, B)
    _close(_run(model, prompt, meta, kv), dense_reference(hf, prompt, list(range(8)), B))

    # denoise block 2 (positions 8..11): two decoded tokens and two masks, in a shuffled order, one position absent
    q_pos, q_ids = [11, 8, 10], [mask, 201, 77]
    before = [t.clone() for t in kv]
    meta = BlockDiffusionMetadata.build([q_pos], [8], [0], [table], PAGE, B)
    out = _run(model, q_ids, meta, kv)
    ref = dense_reference(hf, prompt + q_ids, list(range(8)) + q_pos, B)[8:]
    _close(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(kv, before))

    # commit block 2 (written) together with block 3's first denoise step (not written)
    block2, block3 = [201, 33, 77, 90], [mask, mask, 5, mask]
    meta = BlockDiffusionMetadata.build([range(8, 16)], [8], [4], [table], PAGE, B)
    out = _run(model, block2 + block3, meta, kv)
    full = prompt + block2 + block3
    _close(out, dense_reference(hf, full, list(range(16)), B)[8:])
    # the next step reads block 2 from the cache: equal to recomputing everything
    meta = BlockDiffusionMetadata.build([range(12, 16)], [12], [0], [table], PAGE, B)
    _close(_run(model, block3, meta, kv), dense_reference(hf, full, list(range(16)), B)[12:])


def test_batched_sequences_in_one_step_equal_each_alone(model):
    """Protects: one step over several sequences (a prefill, a denoise on a cached prefix, a full recompute row)
    gives each sequence what it gets alone: per-sequence masks and cache reads do not leak across rows."""
    kv = _cache(model)
    a_ids, b_pre = [(13 * i) % 300 for i in range(6)], [(29 * i + 1) % 300 for i in range(4)]
    ta, tb = [0, 1, 2], [3, 4, 5, 6]
    _run(model, b_pre, BlockDiffusionMetadata.build([range(4)], [0], [4], [tb], PAGE, B), kv)
    b_q = [model.mask_token_id, 12, model.mask_token_id]
    alone_a = _run(model, a_ids, BlockDiffusionMetadata.build([range(6)], [0], [4], [ta], PAGE, B), _cache(model))
    alone_b = _run(model, b_q, BlockDiffusionMetadata.build([[4, 5, 7]], [4], [0], [tb], PAGE, B), kv)
    meta = BlockDiffusionMetadata.build([range(6), [4, 5, 7]], [0, 4], [4, 0], [ta, tb], PAGE, B)
    both = _run(model, a_ids + b_q, meta, kv)
    assert (both[:6] - alone_a).abs().max() < 1e-5 and (both[6:] - alone_b).abs().max() < 1e-5


def test_an_ar_engine_step_is_read_as_a_whole_block_prefill(model, hf):
    """Protects: the AR engine's AttnMetadata (contiguous queries, all written) runs as a block-causal prefill of
    whole blocks; a step that is not whole blocks (an AR decode) is refused, naming the diffusion loop."""
    kv = _cache(model)
    n = 2 * model.diffusion_block_size
    ids = [(17 * i + 3) % 350 for i in range(n)]
    meta = AttnMetadata.build([n], [n], [list(range(-(-n // PAGE)))], PAGE)
    with torch.inference_mode():
        out = model(torch.tensor(ids), AttnMetadata.positions([n], [n]), kv, meta)
    _close(out, dense_reference(hf, ids, list(range(n)), model.diffusion_block_size))
    with pytest.raises(ValueError, match="tandem.engine.diffusion"):
        with torch.inference_mode():
            model(torch.tensor([1]), AttnMetadata.positions([1], [9]), kv, AttnMetadata.build([1], [9], [[1, 2, 3, 4]],
                                                                                              PAGE))


def test_metadata_refuses_steps_that_break_block_causality():
    """Protects: BlockDiffusionMetadata rejects a cache that ends inside a block, writes that are not the leading
    whole blocks, repeated or cached-over positions, too few KV pages, and cache use without a cache."""
    with pytest.raises(ValueError, match="multiple of the diffusion block"):
        BlockDiffusionMetadata.build([[6, 7]], [6], [0], [[0, 1, 2]], PAGE, B)
    with pytest.raises(ValueError, match="whole diffusion blocks"):
        BlockDiffusionMetadata.build([range(4, 8)], [4], [2], [[0, 1, 2]], PAGE, B)
    with pytest.raises(ValueError, match="whole diffusion blocks"):
        BlockDiffusionMetadata.build([[5, 4, 6, 7]], [4], [4], [[0, 1, 2]], PAGE, B)
    with pytest.raises(ValueError, match="distinct"):
        BlockDiffusionMetadata.build([[4, 4]], [4], [0], [[0, 1]], PAGE, B)
    with pytest.raises(ValueError, match="distinct"):
        BlockDiffusionMetadata.build([[3, 4]], [4], [0], [[0, 1]], PAGE, B)
    with pytest.raises(ValueError, match="KV blocks"):
        BlockDiffusionMetadata.build([range(8)], [0], [8], [[0, 1]], PAGE, B)
    with pytest.raises(ValueError, match="without a KV cache"):
        BlockDiffusionMetadata.build([range(4, 8)], [4], [0], None, PAGE, B)
    meta = BlockDiffusionMetadata.build([range(4), [9, 8]], [0, 8], [4, 0], [[7, 1], [2, 6, 4]], PAGE, B)
    assert meta.slot_mapping.tolist() == [21, 22, 23, 3] and meta.write_rows.tolist() == [0, 1, 2, 3]
    assert meta.positions.tolist() == [0, 1, 2, 3, 9, 8] and meta.num_tokens == 6


# ---------------------------------------------------------------------------------------------- unmasking rules


def test_select_commits_follows_each_strategy_exactly():
    """Protects: the unmasking rules: dynamic commits all above the threshold (strictly) when at least the quota
    pass, else the quota most confident (top-1 with quota 1); static the quota most confident (leftmost on ties);
    sequential the first quota; the quota never exceeds the masked positions left."""
    conf = torch.tensor([0.5, 0.95, 0.2, 0.91, 0.9])
    assert select_commits(conf, "low_confidence_dynamic", 1, 0.9).tolist() == [False, True, False, True, False]
    assert select_commits(conf, "low_confidence_dynamic", 3, 0.9).tolist() == [False, True, False, True, True]
    low = torch.tensor([0.3, 0.6, 0.6, 0.1])
    assert select_commits(low, "low_confidence_dynamic", 1, 0.9).tolist() == [False, True, False, False]
    assert select_commits(low, "low_confidence_static", 2, 0.0).tolist() == [False, True, True, False]
    assert select_commits(low, "sequential", 3, 0.0).tolist() == [True, True, True, False]
    assert select_commits(low[:2], "low_confidence_static", 8, 0.0).tolist() == [True, True]
    assert DllmConfig(dllm_block_length=32, dllm_denoising_steps=8).quota(32) == 4
    assert DllmConfig().quota(32) == 1
    with pytest.raises(ValueError, match="dllm_unmasking_strategy"):
        DllmConfig(dllm_unmasking_strategy="random")
    with pytest.raises(ValueError, match="dllm_denoising_steps"):
        DllmConfig(dllm_block_length=4, dllm_denoising_steps=8)


def test_sample_tokens_confidence_is_the_sampled_tokens_probability():
    """Protects: greedy takes the argmax with its softmax probability; a seeded draw repeats exactly and its
    confidence is the drawn token's probability after temperature/top-k/top-p; top_k 1 gives the argmax at 1.0."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    tok, conf = sample_tokens(logits)
    assert tok.tolist() == [0, 2]
    assert torch.allclose(conf, torch.softmax(logits, -1).max(-1).values)
    runs = [sample_tokens(logits, 0.7, 3, 0.9, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    tok, conf = sample_tokens(logits, 1.0, 1, 1.0, torch.Generator().manual_seed(0))
    assert tok.tolist() == [0, 2] and conf.tolist() == [1.0, 1.0]
    probs = torch.softmax(logits[0, :2] / 0.5, -1)          # top_k 2 at temperature 0.5
    tok, conf = sample_tokens(logits[:1], 0.5, 2, 1.0, torch.Generator().manual_seed(1))
    assert conf.item() == pytest.approx(probs[tok.item()].item(), rel=1e-6)


# -------------------------------------------------------------------------------- decoding loops, scripted model

V, EOS, MASK = 16, 14, 15


class Scripted(torch.nn.Module):
    """An SDAR stand-in whose logits at position p make token script[p] the argmax with probability conf[p]."""

    def __init__(self, script: dict[int, int], conf: dict[int, float], block: int = 4) -> None:
        super().__init__()
        self.config = SimpleNamespace(eos_token_ids=[EOS], max_position_embeddings=64, num_hidden_layers=1,
                                      num_key_value_heads=1, head_dim=2)
        self.diffusion_block_size, self.mask_token_id = block, MASK
        self.script, self.conf = script, conf
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[list[int], list[int], list[int]]] = []

    def forward(self, ids, positions, kv, meta):
        self.calls.append((list(meta.query_lens), list(meta.ctx_lens), list(meta.num_write)))
        return meta.positions.double()[:, None]

    def compute_logits(self, hidden):
        rows = []
        for p in hidden[:, 0].long().tolist():
            c = self.conf.get(p, 0.5)
            probs = torch.full((V,), (1 - c) / (V - 1), dtype=torch.float64)
            probs[self.script.get(p, 1)] = c
            rows.append(probs.log())
        return torch.stack(rows).float()


def _both(model, prompts, params, cfg):
    refs = [generate_reference(model, p, params, cfg) for p in prompts]
    cached = generate_cached(model, prompts, params, cfg)
    for r, c in zip(refs, cached):
        assert (r.token_ids, r.finish_reason, r.commits_per_step) == (c.token_ids, c.finish_reason,
                                                                      c.commits_per_step)
    return refs


def test_dynamic_unmasking_commits_by_confidence_and_stops_at_the_first_eos():
    """Protects: the prompt's leftover tokens start the first block; each step commits the positions above the
    threshold or else the most confident one; an EOS in a completed block ends the output there (EOS kept, tokens
    after it dropped) even when it was committed before earlier positions; both loops agree."""
    # prompt of 6: block 1 holds prompt positions 4, 5 and masks at 6, 7; block 2 is positions 8..11
    script = {6: 3, 7: 4, 8: 5, 9: 6, 10: EOS, 11: EOS}
    conf = {6: 0.6, 7: 0.95, 8: 0.7, 9: 0.5, 10: 0.99, 11: 0.97}
    model = Scripted(script, conf)
    out, = _both(model, [[9, 8, 7, 6, 5, 4]], SamplingParams(temperature=0, max_tokens=20),
                 DllmConfig(dllm_confidence_threshold=0.9))
    # block 1: step 1 commits 7 (0.95); step 2 commits 6. block 2: step 1 commits 10, 11; then 8 (0.7); then 9
    assert out.commits_per_step == [1, 1, 2, 1, 1]
    assert out.token_ids == [3, 4, 5, 6, EOS] and out.finish_reason == "stop" and out.num_blocks == 2


def test_max_tokens_is_exact_and_later_positions_are_never_committed():
    """Protects: max_tokens cuts the output exactly: positions past it in the last block stay masked (never
    committed, never counted), the finish reason is length; ignore_eos decodes through EOS."""
    script = {p: 2 + p % 5 for p in range(40)}
    model = Scripted(script, {p: 0.99 for p in range(40)})
    cfg = DllmConfig(dllm_confidence_threshold=0.9)
    out, = _both(model, [[1] * 5], SamplingParams(temperature=0, max_tokens=6), cfg)
    # positions 5..10: block 1 = {5, 6, 7} in one step, block 2 = {8, 9, 10} (11 is past the limit)
    assert out.token_ids == [script[p] for p in range(5, 11)] and out.finish_reason == "length"
    assert out.commits_per_step == [3, 3]
    script[7] = EOS
    out, = _both(Scripted(script, {p: 0.99 for p in range(40)}), [[1] * 5],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), cfg)
    assert len(out.token_ids) == 6 and EOS in out.token_ids and out.finish_reason == "length"


def test_the_mask_token_is_never_committed_and_a_prompt_mask_is_a_prompt_token():
    """Protects: a model whose argmax is the mask token still finishes (the mask token is never sampled: an untrained
    model looped forever committing it), and a mask token among the prompt's leftover tokens stays a prompt token."""
    model = Scripted({p: MASK for p in range(64)}, {p: 0.6 for p in range(64)})
    out, = _both(model, [[2, 3, 4, 5, 6, MASK]], SamplingParams(temperature=0, max_tokens=5),
                 DllmConfig(dllm_confidence_threshold=0.9))
    # block 1 = prompt [6, MASK] at 4, 5 and masks at 6, 7; block 2 = 8, 9, 10 before the limit: one a step
    assert out.token_ids == [0] * 5 and out.commits_per_step == [1] * 5 and out.finish_reason == "length"


def test_static_and_sequential_quotas_per_step():
    """Protects: low_confidence_static commits exactly the quota per step by confidence, sequential left to right;
    dllm_block_length overrides the model's block length."""
    script = {p: 3 for p in range(64)}
    conf = {8: 0.2, 9: 0.9, 10: 0.4, 11: 0.8, 12: 0.3, 13: 0.7, 14: 0.6, 15: 0.5}
    model = Scripted(script, conf)
    prompt = [2] * 8
    stat = DllmConfig(dllm_block_length=8, dllm_unmasking_strategy="low_confidence_static", dllm_denoising_steps=4)
    out, = _both(model, [prompt], SamplingParams(temperature=0, max_tokens=8), stat)
    assert out.commits_per_step == [2, 2, 2, 2] and out.num_blocks == 1
    seq = DllmConfig(dllm_block_length=8, dllm_unmasking_strategy="sequential", dllm_denoising_steps=2)
    out, = _both(model, [prompt], SamplingParams(temperature=0, max_tokens=8), seq)
    assert out.commits_per_step == [4, 4]


def test_cached_loop_writes_each_block_once_and_reads_it_after():
    """Protects: the KV-cached loop writes the prompt's whole blocks with the first denoise step and each completed
    block with the next block's first step (once), and every denoise step reads exactly the cached prefix."""
    script = {p: 3 for p in range(64)}
    model = Scripted(script, {p: 0.99 for p in range(64)})
    generate_cached(model, [[2] * 9], SamplingParams(temperature=0, max_tokens=10), DllmConfig())
    # prompt 9: blocks [0,4) [4,8) prefilled, block 2 holds position 8 and masks 9..11 -> 3 tokens; block 3; block 4
    assert model.calls == [([12], [0], [8]), ([8], [8], [4]), ([8], [12], [4])]


# ------------------------------------------------------------------------------- decoding loops, a random model


@pytest.mark.parametrize("strategy", ["low_confidence_dynamic", "low_confidence_static", "sequential"])
def test_cached_loop_equals_full_recompute_on_a_random_model(model, strategy):
    """Protects: with the prefix's KV cached (written once per block) and only the active block recomputed, a batch
    of prompts (whole-block and leftover lengths) decodes to exactly the full-recompute reference's tokens and
    commits, greedy and seeded sampling; the seeded sample repeats run to run."""
    prompts = [[5, 6, 7, 8] * 2, [100, 101, 102], list(range(200, 213))]
    cfg = DllmConfig(dllm_block_length=4, dllm_unmasking_strategy=strategy, dllm_denoising_steps=2,
                     dllm_confidence_threshold=0.05)
    for params in (SamplingParams(temperature=0, max_tokens=9),
                   SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11, max_tokens=7)):
        refs = _both(model, prompts, params, cfg)
        assert [len(r.token_ids) for r in refs] == [params.max_tokens] * 3
        if params.seed is not None:
            again = generate_cached(model, prompts, params, cfg)
            assert [a.token_ids for a in again] == [r.token_ids for r in refs]
