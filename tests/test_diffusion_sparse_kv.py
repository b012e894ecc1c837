"""Head-centric sparse KV and Refresh/Reuse decoding for SDAR.

Selection is checked on hand-built score tensors (each head's own top positions, the uniform baseline's one shared
set, the max-pool), the packed buffer on its fixed size and contents, the attention backend against explicit
attention over the positions it should read, and the decoding loop on the trained tiny model against the two
existing loops: refresh at every step is generate_reference at any ratio, ratio 1 with Reuse steps is
generate_cached.
"""
from __future__ import annotations

import math
from functools import partial

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from tandem.engine.diffusion import TINY_SDAR, DllmConfig, generate_cached, generate_reference  # noqa: E402
from tandem.engine.diffusion.evaluate import evaluate  # noqa: E402
from tandem.engine.diffusion.refresh import generate_refresh  # noqa: E402
from tandem.engine.diffusion.sparse_attention import SeqStep, SparseKVBackend, sparse_step_metadata  # noqa: E402
from tandem.engine.diffusion.sparse_kv import (SparseKVBuffer, SparseKVConfig, buffer_bytes, pool_scores,  # noqa: E402
                                               position_scores, select_positions)
from tandem.engine.diffusion.tasks import eval_set  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.policy.dllm_serve.phases import PhaseSchedule, PhaseSpec  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
ONE_A_STEP = DllmConfig(dllm_block_length=8, dllm_unmasking_strategy="low_confidence_static")


@pytest.fixture(scope="module")
def tiny():
    """The committed trained SDAR checkpoint (float32) and its tokenizer."""
    model, _ = load_model(TINY_SDAR, dtype="float32")
    return model, HFTokenizer.from_file(str(TINY_SDAR / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tiny):
    """Held-out prompts of every predictable task, 2 each (8-16 tokens: several blocks of 8 get cached)."""
    return [tiny[1].encode(e.prompt).ids for e in eval_set(2, 7, ("copy", "reverse", "sort", "count", "add"))]


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("ratio", [0, 0.0, -0.5, 1.01, 2, True, "0.5", None])
def test_retention_ratio_outside_0_1_is_refused_by_name(ratio):
    with pytest.raises(ValueError, match=r"kv_retention_ratio must be a number in \(0, 1\]"):
        SparseKVConfig(kv_retention_ratio=ratio)


@pytest.mark.parametrize("kernel", [0, -1, 2, 4, 3.0, True])
def test_pool_kernel_must_be_odd_and_positive(kernel):
    with pytest.raises(ValueError, match="kv_pool_kernel must be an odd integer >= 1"):
        SparseKVConfig(kv_pool_kernel=kernel)


def test_selection_names_its_choices_and_defaults_are_dllm_serves():
    with pytest.raises(ValueError, match="kv_selection must be one of head, uniform"):
        SparseKVConfig(kv_selection="topk")
    c = SparseKVConfig()
    assert (c.kv_retention_ratio, c.kv_pool_kernel, c.kv_selection) == (0.5, 3, "head")
    SparseKVConfig(kv_retention_ratio=1, kv_pool_kernel=1, kv_selection="uniform")      # the edges are valid


def test_kept_positions_are_the_floor_of_rho_l_at_least_one():
    """⌊ρ·L⌋ (dLLM-Serve's int(L * ratio)), at least 1 of a non-empty cache, the core's reuse_context count."""
    assert [SparseKVConfig(0.25).num_keep(n) for n in (0, 1, 3, 4, 10, 17)] == [0, 1, 1, 1, 2, 4]
    assert [SparseKVConfig(0.3).num_keep(n) for n in (10, 20)] == [3, 6]          # 0.3 * 10 is 2.9999..., kept 3
    assert [SparseKVConfig(1.0).num_keep(n) for n in (1, 16)] == [1, 16]


# ---------------------------------------------------------------- selection


def test_max_pool_smooths_each_head_over_its_window():
    s = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0], [0.0, 0.0, 0.0, 9.0, 0.0]])
    assert pool_scores(s, 1).tolist() == s.tolist()
    assert pool_scores(s, 3).tolist() == [[5, 5, 5, 3, 3], [0, 0, 9, 9, 9]]
    assert pool_scores(s, 5).tolist() == [[5, 5, 5, 5, 3], [0, 9, 9, 9, 9]]


def test_head_centric_keeps_each_heads_own_top_positions():
    """Two heads that care about different positions each keep theirs (position order, kernel 1 and 3)."""
    s = torch.tensor([[9.0, 1.0, 0.0, 2.0, 0.0, 0.0, 7.0, 0.0],
                      [0.0, 0.0, 3.0, 0.0, 8.0, 0.0, 0.0, 1.0]])
    assert select_positions(s, 2, 2, 1, "head").tolist() == [[0, 6], [2, 4]]
    # kernel 3: head 0 pooled [9,9,2,2,2,7,7,7], head 1 [0,3,3,8,8,8,1,1]; ties go to the earlier position
    assert select_positions(s, 2, 3, 3, "head").tolist() == [[0, 1, 5], [3, 4, 5]]


def test_uniform_keeps_one_set_for_every_head_by_the_summed_scores():
    """Sparse-dLLM: pooled scores summed over heads; head 1's 8 at position 4 loses to head 0's 9 and 7."""
    s = torch.tensor([[9.0, 1.0, 0.0, 2.0, 0.0, 0.0, 7.0, 0.0],
                      [0.0, 0.0, 3.0, 0.0, 8.0, 0.0, 0.0, 1.0]])
    # sums with kernel 1: [9, 1, 3, 2, 8, 0, 7, 1]
    assert select_positions(s, 2, 2, 1, "uniform").tolist() == [[0, 4], [0, 4]]
    assert select_positions(s, 2, 3, 1, "uniform").tolist() == [[0, 4, 6], [0, 4, 6]]


def test_gqa_head_centric_takes_the_groups_best_and_uniform_sums_all_query_heads():
    """4 query heads on 2 KV heads: KV head 0 serves query heads 0-1, KV head 1 query heads 2-3."""
    s = torch.tensor([[5.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 4.0, 0.0],
                      [0.0, 3.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 6.0]])
    assert select_positions(s, 2, 2, 1, "head").tolist() == [[0, 2], [1, 3]]
    assert select_positions(s, 2, 1, 1, "uniform").tolist() == [[3], [3]]


def test_scores_are_the_blocks_mean_query_against_each_key_scaled():
    q = torch.tensor([[[1.0, 0.0]], [[3.0, 2.0]]])             # 2 block queries, 1 head: mean (2, 1)
    k = torch.tensor([[[1.0, 1.0]], [[0.0, 2.0]], [[-1.0, 0.0]]])
    assert position_scores(q, k, 0.5).tolist() == [[1.5, 1.0, -1.0]]
    q4 = torch.zeros(1, 4, 2)
    q4[0, 3] = torch.tensor([1.0, 0.0])                        # query head 3 reads KV head 1 (4 heads on 2)
    k2 = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    assert position_scores(q4, k2, 1.0)[:, 0].tolist() == [0.0, 0.0, 0.0, 2.0]


def test_selection_refuses_an_impossible_count():
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        select_positions(torch.zeros(1, 4), 1, 5, 3, "head")
    with pytest.raises(ValueError, match="kv_selection"):
        select_positions(torch.zeros(1, 4), 1, 1, 3, "both")


# ---------------------------------------------------------------- the buffer


def test_buffer_is_fixed_at_its_capacity_and_packs_each_heads_positions():
    buf = SparseKVBuffer(num_layers=2, num_kv_heads=2, head_dim=3, capacity=4, dtype=torch.float32)
    assert buf.data.shape == (2, 2, 2, 4, 3)
    assert buf.nbytes == buffer_bytes(2, 2, 3, 4, torch.float32) == 2 * 2 * 2 * 4 * 3 * 4
    k = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)       # [L=6, Hkv=2, D=3]
    v = -k
    buf.pack(1, k, v, torch.tensor([[0, 5], [2, 3]]))
    kr, vr = buf.read(1)
    assert kr.tolist() == [[k[0, 0].tolist(), k[5, 0].tolist()], [k[2, 1].tolist(), k[3, 1].tolist()]]
    assert torch.equal(vr, -kr) and buf.read(0)[0].shape == (2, 0, 3)
    data = buf.data
    buf.pack(1, k, v, torch.tensor([[1], [4]]))                          # a later Refresh keeps fewer
    assert buf.read(1)[0][:, 0].tolist() == [k[1, 0].tolist(), k[4, 1].tolist()] and buf.data is data
    with pytest.raises(ValueError, match="5 kept positions exceed the buffer's 4 slots"):
        buf.pack(0, k, v, torch.zeros(2, 5, dtype=torch.long))


# ---------------------------------------------------------------- the attention backend


def _block_causal(q, k, v, positions, block, scale):
    """Dense attention of queries over keys of the same positions, key j visible iff block(j) <= block(i)."""
    b = torch.tensor(positions) // block
    mask = b[None, :] <= b[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def test_backend_refresh_is_dense_and_packs_the_selection_then_reuse_reads_only_it():
    """A Refresh (12 cached positions + a block of 4) beside a Reuse of another request, GQA 4 on 2 heads."""
    torch.manual_seed(0)
    B, hq, hkv, d, scale = 4, 4, 2, 8, 8 ** -0.5
    cfg = SparseKVConfig(kv_retention_ratio=0.5, kv_pool_kernel=3)
    backend = SparseKVBackend(cfg)
    a, other = (SparseKVBuffer(1, hkv, d, 8, torch.float32) for _ in range(2))
    other.pack(0, torch.randn(6, hkv, d), torch.randn(6, hkv, d), torch.tensor([[0, 2, 5], [1, 3, 4]]))
    steps = [SeqStep(a, full=True, pack=True, cached=12), SeqStep(other, full=False)]
    positions = [range(0, 16), range(8, 12)]
    meta = sparse_step_metadata(steps, positions, B, backend, torch.device("cpu"))
    T = 20
    q, k, v = torch.randn(T, hq, d), torch.randn(T, hkv, d), torch.randn(T, hkv, d)
    out = backend.forward(q, k, v, 0, meta, scale)
    # the Refresh: dense block-causal attention over its 16 positions
    assert torch.allclose(out[:16], _block_causal(q[:16], k[:16], v[:16], list(range(16)), B, scale), atol=1e-6)
    # ... and its buffer holds, per head, the positions the selection picks from the block's queries
    idx = select_positions(position_scores(q[12:16], k[:12], scale), hkv, 6, 3, "head")
    kr, vr = a.read(0)
    for h in range(hkv):
        assert torch.equal(kr[h], k[idx[h], h]) and torch.equal(vr[h], v[idx[h], h])
    # the Reuse: each query head over its KV head's packed keys and the block's own 4
    ko, vo = other.read(0)
    for h in range(hq):
        keys = torch.cat([ko[h // 2], k[16:, h // 2]])
        vals = torch.cat([vo[h // 2], v[16:, h // 2]])
        ref = torch.softmax(q[16:, h] @ keys.T * scale, dim=-1) @ vals
        assert torch.allclose(out[16:, h], ref, atol=1e-6)


def test_a_refresh_with_nothing_cached_empties_the_buffer():
    backend = SparseKVBackend(SparseKVConfig())
    buf = SparseKVBuffer(1, 1, 4, 3, torch.float32)
    buf.pack(0, torch.ones(3, 1, 4), torch.ones(3, 1, 4), torch.tensor([[0, 1, 2]]))
    meta = sparse_step_metadata([SeqStep(buf, full=True, pack=True, cached=0)], [range(0, 4)], 4, backend,
                                torch.device("cpu"))
    backend.forward(torch.randn(4, 1, 4), torch.randn(4, 1, 4), torch.randn(4, 1, 4), 0, meta, 0.5)
    assert buf.lengths == [0]


# ---------------------------------------------------------------- the decoding loop


def test_refresh_at_every_step_is_the_reference_at_any_ratio(tiny, prompts):
    """delay_step 0, refresh_interval 1: every step recomputes the whole sequence, so the buffer is never read."""
    model = tiny[0]
    ref = [generate_reference(model, p, GREEDY, ONE_A_STEP) for p in prompts]
    for sel in ("head", "uniform"):
        outs = generate_refresh(model, prompts, GREEDY, ONE_A_STEP, SparseKVConfig(0.25, kv_selection=sel),
                                delay_step=0, refresh_interval=1)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert [o.commits_per_step for o in outs] == [r.commits_per_step for r in ref]
        assert all(set(o.phases) == {"refresh"} for o in outs)


def test_ratio_one_with_reuse_steps_is_the_cached_loop(tiny, prompts):
    """At ρ = 1 the packed buffer is the whole cache in position order: Reuse steps give generate_cached's tokens."""
    model = tiny[0]
    cached = generate_cached(model, prompts, GREEDY, ONE_A_STEP)
    for delay in (0, 1):
        outs = generate_refresh(model, prompts, GREEDY, ONE_A_STEP, SparseKVConfig(1.0), delay_step=delay)
        assert [o.token_ids for o in outs] == [c.token_ids for c in cached]
        assert [o.commits_per_step for o in outs] == [c.commits_per_step for c in cached]
        assert sum(o.phases.count("reuse") for o in outs) > 0


def test_phases_follow_delay_step_and_refresh_interval_within_each_block(tiny, prompts):
    """One token a step, blocks of 4: delay_step 1, interval 2 gives full, refresh, reuse, refresh per block."""
    cfg = DllmConfig(dllm_block_length=4, dllm_unmasking_strategy="low_confidence_static")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out,) = generate_refresh(tiny[0], prompts[:1], params, cfg, SparseKVConfig(0.5), delay_step=1,
                              refresh_interval=2)
    first = 4 - len(prompts[0]) % 4                 # the first block holds the prompt's leftover tokens
    per_block = ["full", "refresh", "reuse", "refresh"]
    assert out.phases == per_block[:first] + per_block * ((12 - first) // 4) + per_block[:(12 - first) % 4]


def test_each_requests_buffer_is_fixed_at_ceil_rho_l_the_cores_reservation(tiny, prompts):
    model = tiny[0]
    mc = model.config
    for rho in (0.25, 0.5, 1.0):
        outs = generate_refresh(model, prompts[:3], GREEDY, ONE_A_STEP, SparseKVConfig(rho))
        sched = PhaseSchedule(PhaseSpec(8, retention=rho))
        for p, o in zip(prompts, outs):
            L = len(p) + GREEDY.max_tokens
            assert o.kv_slots == math.ceil(rho * L) == sched.kv_tokens(len(p), GREEDY.max_tokens)
            assert o.kv_bytes == mc.num_hidden_layers * 2 * mc.num_key_value_heads * o.kv_slots * mc.head_dim * 4


def test_low_retention_changes_what_reuse_steps_see(tiny, prompts):
    """ρ = 0.25 with Reuse steps is not the dense cache (else the selection would be a no-op)."""
    model = tiny[0]
    dense = generate_refresh(model, prompts, GREEDY, ONE_A_STEP, SparseKVConfig(1.0), delay_step=0)
    sparse = generate_refresh(model, prompts, GREEDY, ONE_A_STEP, SparseKVConfig(0.25, kv_selection="uniform"),
                              delay_step=0)
    assert [o.token_ids for o in sparse] != [o.token_ids for o in dense]


def test_evaluate_takes_the_refresh_loop_and_reports_each_example(tiny):
    """evaluate(decode=...) scores another loop; at ρ = 1 its per-example exact matches are the cached loop's."""
    model, tok = tiny
    ex = eval_set(3, 11, ("copy", "count"))
    base = evaluate(model, tok, ex, ONE_A_STEP)
    dense = evaluate(model, tok, ex, ONE_A_STEP, decode=partial(generate_refresh, sparse=SparseKVConfig(1.0)))
    assert len(base.exact) == 6 and dense.exact == base.exact
    assert base.predictable.correct == sum(base.exact)
