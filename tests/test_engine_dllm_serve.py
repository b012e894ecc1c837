"""dLLM-Serve's Refresh/Reuse phases over head-centric sparse KV inside the engine.

The core plans each sequence's phase (tandem/policy/dllm_serve through WorkerCore's dLLM-Serve mode); the engine
executes it with refresh.py's per-sequence step, the one generate_refresh runs, over packed KV that lives in the
engine's paged KV pool (the blocks the core's admission reserved). On the trained tiny SDAR model: refresh at every
step with ρ = 1 is the full-recompute reference; ρ = 0.5 equals the generate_refresh loop token for token, batched
and streamed as committed prefixes; the buffers are the core's reservations; the memory profile of a diffusion model
sizes the pool from the budget; options are validated. SDAR blocks sit at absolute positions (RefreshSpan.ALIGNED).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer  # noqa: E402


from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.diffusion import DllmConfig, generate_reference  # noqa: E402
from tandem.engine.diffusion.refresh import generate_refresh  # noqa: E402
from tandem.engine.diffusion.sparse_kv import SparseKVConfig  # noqa: E402
from tandem.engine.diffusion.tasks import eval_set  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.memory_profile import guard_bytes  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402
from tandem.policy.dllm_serve import Phase, PhaseSchedule, PhaseSpec  # noqa: E402

from test_engine_diffusion import ASSET  # noqa: E402 - the trained tiny SDAR checkpoint

ONE_A_STEP = DllmConfig(dllm_unmasking_strategy="low_confidence_static")     # block 32, one token a step
LONG = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)       # 2-3 blocks: Reuse reads packed KV


@pytest.fixture(scope="module")
def cases():
    """(the float32 model, one held-out prompt of each of the six tasks)."""
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    return load_model(ASSET, dtype="float32")[0], [tok.encode(e.prompt).ids for e in eval_set(1)]


def _engine(**kw) -> LLMEngine:
    kw.setdefault("dllm_admission", "phase")
    return LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu",
                                  dllm_unmasking_strategy="low_confidence_static", **kw))


def _run(eng: LLMEngine, prompts, params, watch=None) -> list[list[int]]:
    """Every request to the end (watch(eng) after each step); the final token ids in request order."""
    ids = [eng.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    final, streamed = {}, {r: [] for r in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks = o.outputs[0].token_ids
            assert toks[:len(streamed[o.request_id])] == streamed[o.request_id]     # a stream only grows
            streamed[o.request_id] = list(toks)
            if o.finished:
                final[o.request_id] = toks
        if watch is not None:
            watch(eng)
    return [final[r] for r in ids]


def test_refresh_every_step_at_rho_one_is_the_reference(cases):
    """Exactness: delay_step 0 and refresh_interval 1 make every step a full-length recompute (dense, block-causal),
    so the engine's tokens are generate_reference's, three requests batched."""
    model, prompts = cases
    got = _run(_engine(kv_retention_ratio=1.0, dllm_delay_step=0, dllm_refresh_interval=1), prompts[:3], LONG)
    assert got == [generate_reference(model, p, LONG, ONE_A_STEP).token_ids for p in prompts[:3]]


def test_rho_half_equals_the_refresh_loop_batched_with_the_logit_cap(cases):
    """The engine runs generate_refresh's per-sequence step over packed KV in its pool: at ρ = 0.5 (head-centric,
    delay_step 1) the six requests batched, logits 16 rows at a time, give the loop's tokens exactly; the core saw
    FULL, REFRESH and REUSE steps (2 full-length steps a block, the rest Reuse) and a stream showed only prefixes."""
    model, prompts = cases
    eng = _engine(kv_retention_ratio=0.5, max_num_logits=16)
    got = _run(eng, prompts, LONG)
    ref = generate_refresh(model, prompts, LONG, ONE_A_STEP, SparseKVConfig(0.5), delay_step=1)
    assert got == [r.token_ids for r in ref]
    st = eng.core.dllm_stats()
    blocks = sum(r.num_blocks for r in ref)
    assert st["seq_steps"] == {"full": blocks, "refresh": blocks, "reuse": 6 * 48 - 2 * blocks}
    assert eng.stats.dllm_serve["seq_steps_reuse"] == 6 * 48 - 2 * blocks
    assert eng.stats.dllm_serve["admitted_idle"] == 6 and eng.stats.dllm_serve["admitted_running"] == 0


def test_uniform_selection_is_the_loops_uniform_selection(cases):
    """kv_selection uniform (Sparse-dLLM) reaches the backend too: ρ = 0.25, uniform, equals the loop's."""
    model, prompts = cases
    got = _run(_engine(kv_retention_ratio=0.25, kv_selection="uniform"), prompts[:3], LONG)
    ref = generate_refresh(model, prompts[:3], LONG, ONE_A_STEP, SparseKVConfig(0.25, kv_selection="uniform"))
    assert got == [r.token_ids for r in ref]


def test_packed_kv_lives_in_the_blocks_the_core_reserved(cases):
    """Memory: each request's buffer is ⌈ρ·(P + G)⌉ slots (PhaseSchedule.kv_tokens, what admission reserves) over
    the KV blocks the core gave it, every block it holds is one the buffer uses, the free pool drops by exactly
    those blocks while it runs, and every block comes back."""
    prompts = cases[1]
    eng = _engine(kv_retention_ratio=0.5, num_kv_blocks=64, max_model_len=256)
    free0 = eng.core.blocks.num_free
    seen = {}

    def watch(e):
        held = 0
        for sid, buf in e.dllm.buffers.items():
            seq = e.core.seqs[sid]
            table = e.core.blocks.tables[seq]
            st = e.dllm.states[sid]
            assert buf.capacity == -(-(st.P + st.max_tokens) // 2) == e.core.dllm.phases.kv_tokens(st.P, 48)
            assert set(buf.blocks.tolist()) == set(table)
            held += len(table)
            seen[sid] = buf.capacity
        assert e.core.blocks.num_free == free0 - held
    _run(eng, prompts, LONG, watch)
    assert len(seen) == 6 and eng.core.blocks.num_free == free0


def test_a_diffusion_models_memory_profile_sizes_the_pool_from_the_budget():
    """Memory: a block-diffusion checkpoint gets the logit-aware profile (every row of max_num_batched_tokens
    sampled, decomposed under max_num_logits) and its KV pool is budget - weights - persistent - (peak + guard),
    in whole blocks; the cap's peak is the smaller one."""
    eng = _engine(cpu_memory_budget_bytes=256 << 20, max_num_batched_tokens=128, max_num_logits=16,
                  max_model_len=256)
    prof = eng.runner.memory
    assert prof.logit_rows == 128 and prof.decomposed_peak_bytes < prof.monolithic_peak_bytes
    left = (256 << 20) - prof.weight_bytes - prof.persistent_bytes - prof.decomposed_peak_bytes \
        - guard_bytes(prof.decomposed_peak_bytes)
    per_block = 4 * 2 * 16 * 4 * 32 * 4          # layers x K/V x block x KV heads x head_dim x float32
    assert eng.runner.num_blocks == left // per_block == eng.core.blocks.num_free


def test_aligned_phase_arithmetic_follows_sdars_blocks():
    """SDAR's blocks sit at absolute positions: a prompt of 10 leaves 22 answer positions in the first block (32
    rows computed); the peak is P + G rounded up to blocks; block 2 starts after 22 commits."""
    ph = PhaseSchedule(PhaseSpec(32, delay_step=1, span="aligned", retention=0.5))
    st = ph.new(10, 64, order=1, step=0)
    assert (ph.first_tokens(10, 64), ph.peak_tokens(10, 64), st.kv_tokens) == (32, 96, 37)
    assert (ph.phase(st), ph.demand(st), ph.left(st)) == (Phase.FULL, 32, 22)
    ph.advance(st, 21)
    assert (ph.phase(st), ph.demand(st), ph.left(st)) == (Phase.REFRESH, 32, 1)
    ph.advance(st, 1)
    assert (st.block_step, ph.demand(st), ph.left(st)) == (0, 64, 32)
    ph.advance(st, 1)
    ph.advance(st, 1)
    assert (ph.phase(st), ph.demand(st), ph.reuse_context(st)) == (Phase.REUSE, 32, 16)
    for _ in range(30):
        ph.advance(st, 1)
    assert (st.generated, ph.demand(st), ph.left(st)) == (54, 96, 10)     # the last block: 10 positions to G


@pytest.mark.parametrize("kw, msg", [
    (dict(kv_retention_ratio=0.5), "kv_retention_ratio need dllm_admission"),
    (dict(dllm_delay_step=0, kv_pool_kernel=5), "dllm_delay_step, kv_pool_kernel need dllm_admission"),
    (dict(dllm_admission="greedy"), "dllm_admission is one of phase, static, reserve"),
    (dict(dllm_admission="phase", kv_retention_ratio=1.5), "kv_retention_ratio must be a number in (0, 1]"),
    (dict(dllm_admission="phase", kv_pool_kernel=2), "kv_pool_kernel must be an odd integer"),
    (dict(dllm_admission="phase", kv_selection="best"), "kv_selection must be one of head, uniform"),
    (dict(dllm_admission="phase", dllm_delay_step=-1), "delay_step must be an integer >= 0"),
])
def test_bad_dllm_serve_options_are_refused_by_name(kw, msg):
    with pytest.raises(EngineError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=str(ASSET), **kw)


def test_an_autoregressive_model_refuses_dllm_admission(tmp_path):
    make_tiny_model(tmp_path / "ar")
    with pytest.raises(EngineError, match="dllm_admission is for block-diffusion models"):
        LLMEngine(EngineConfig(model=str(tmp_path / "ar"), dtype="float32", device="cpu", dllm_admission="phase"))
