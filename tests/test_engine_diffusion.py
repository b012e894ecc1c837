"""Block-diffusion decoding in the engine (tandem/engine/diffusion/engine_step.py through the worker core).

On the project's trained tiny SDAR model (tandem/engine/diffusion/assets/tiny-sdar): the engine's plain block
diffusion (dllm_chunk=block) gives the full-recompute reference loop's tokens, greedy and seeded; its streaming
chunks give the KV-cached loop's (the same BlockState, windows sized by the core); outputs do not depend on what
else is batched, through preemptions; a session's second round reuses its whole blocks; a stream only shows
committed prefixes. On a one-layer random SDAR (where a cached K/V cannot depend on later tokens, so reusing it is
exact) the streaming loop equals a full recomputation of the same windows. Bad diffusion options are refused.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer  # noqa: E402

from tandem.core.config import PreemptionMode  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.diffusion import DllmConfig, generate_cached, generate_reference  # noqa: E402
from tandem.engine.diffusion.block_state import BlockState  # noqa: E402
from tandem.engine.diffusion.tasks import eval_set  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.models import BlockDiffusionMetadata  # noqa: E402
from tandem.engine.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
CFG = DllmConfig(dllm_confidence_threshold=0.9)          # the engine's default decoding options
pytestmark = pytest.mark.usefixtures("window_latency_once")    # tests/conftest.py
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    return [tok.encode(e.prompt).ids for e in eval_set(1)]          # one held-out example of each of the 6 tasks


@pytest.fixture(scope="module")
def model():
    m, _ = load_model(ASSET, dtype="float32")
    return m


def _engine(chunk: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", dllm_chunk=chunk, **kw))


def _run(eng: LLMEngine, prompts, params) -> tuple[dict[str, list[int]], dict[str, object]]:
    """Every request to the end: the final token ids and outputs by request id."""
    reqs = [eng.add_request(str(i), p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert sorted(outs) == sorted(reqs)
    return {r: outs[r].outputs[0].token_ids for r in reqs}, outs


def test_block_mode_equals_the_reference_loop_greedy_and_seeded(prompts, model):
    """Chunk = block: c = B with no intra-block reuse gives the plain reference (full recomputation under the
    block-causal mask) token for token, greedy and with seeded top-k/top-p sampling, six prompts batched."""
    seeded = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=100 + i, max_tokens=40)
              for i in range(len(prompts))]
    for params in (GREEDY, seeded):
        got, outs = _run(_engine("block"), prompts, params)
        for i, p in enumerate(prompts):
            ref = generate_reference(model, p, params[i] if isinstance(params, list) else params, CFG)
            assert got[str(i)] == ref.token_ids
            assert outs[str(i)].outputs[0].finish_reason == ref.finish_reason


def test_streaming_chunks_equal_the_cached_loop(prompts, model):
    """One implementation: the engine's fixed chunk of 8 (windows sized by the core) commits what the KV-cached loop
    commits with the same BlockState windows."""
    got, _ = _run(_engine("8"), prompts, GREEDY)
    ref = generate_cached(model, prompts, GREEDY, CFG, chunk=8)
    assert [got[str(i)] for i in range(len(prompts))] == [r.token_ids for r in ref]


def test_outputs_do_not_depend_on_the_batch_even_through_preemptions(prompts):
    """Batching and preemption leave outputs unchanged: each request alone and the six batched on a KV pool of 10 blocks (preemptions forced) give the
    same tokens in block mode (where preemption recomputes); a fixed streaming chunk is batch-invariant too."""
    kw = dict(max_model_len=128, num_kv_blocks=10)
    batched, outs = _run(_engine("block", **kw), prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs.values()) > 0
    for i, p in enumerate(prompts):
        alone, _ = _run(_engine("block", **kw), [p], GREEDY)
        assert alone["0"] == batched[str(i)]
    chunked, _ = _run(_engine("8"), prompts, GREEDY)
    for i in (0, 3):
        alone, _ = _run(_engine("8"), [prompts[i]], GREEDY)
        assert alone["0"] == chunked[str(i)]


def test_streaming_outputs_do_not_depend_on_the_batch_through_swap_preemptions(prompts):
    """Batching and preemption for streaming chunks: chunk 4 on a KV pool of 8 blocks preempts three times. A decoded position's
    K/V depend on the window that wrote it, so a recompute would write them differently; the default preemption
    mode of streaming windows swaps the KV to host memory and back, and each preempted request decodes alone what it
    decodes batched (the others: test_outputs_do_not_depend_on_the_batch_even_through_preemptions's chunk)."""
    kw = dict(max_model_len=128, num_kv_blocks=8)
    eng = _engine("4", **kw)
    batched, outs = _run(eng, prompts, GREEDY)
    assert eng.core.kv.preempted == {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 3}
    preempted = [int(r) for r, o in outs.items() if o.metrics.num_preemptions]
    assert sum(o.metrics.num_preemptions for o in outs.values()) == 3 and preempted
    assert eng.runner.swap_space.held == {} and eng.core.kv.swap_free == eng.core.cfg.swap_blocks
    alone = _engine("4", **kw)
    for i in preempted:
        assert _run(alone, [prompts[i]], GREEDY)[0]["0"] == batched[str(i)]


def test_a_second_round_reuses_whole_blocks_and_equals_a_fresh_prompt(prompts):
    """Multi-round sessions: round two keeps the first round's whole diffusion blocks (a partial last block is
    recomputed with the new prompt) and decodes what a fresh request with the whole conversation decodes."""
    eng = _engine("block")
    eng.add_request("r1", prompts[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), session_id="s")
    first = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                first = o.outputs[0].token_ids
    second_prompt = prompts[0] + first + prompts[1]
    eng.add_request("r2", second_prompt, GREEDY, session_id="s")
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o
    fresh, _ = _run(_engine("block"), [second_prompt], GREEDY)
    assert out.outputs[0].token_ids == fresh["0"]
    assert len(first) == 40 and out.num_cached_tokens == (len(prompts[0]) + 40 - 1) // 32 * 32 == 32


def test_a_stream_shows_only_committed_prefixes_and_max_tokens_exactly(prompts):
    """The streaming contract at the engine: every step's output is a prefix of the final one (never a token past
    an uncommitted position), and max_tokens is honoured exactly (12, inside a block)."""
    eng = _engine("elastic")
    eng.add_request("a", prompts[5], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.append(list(o.outputs[0].token_ids))
    final = seen[-1]
    assert len(final) == 12 and all(final[:len(s)] == s for s in seen)
    assert len(seen) > 1 and any(len(a) < len(b) for a, b in zip(seen, seen[1:]))


def test_elastic_windows_beside_overflowing_prompts_finish_every_request_exactly(prompts):
    """Protects the engine's side of the displacement price: under a 64-token budget, four prompts arriving while two
    requests decode are more than fit beside the smallest windows, so the sizer is told the rows they fill; every
    request still ends with exactly max_tokens, and the rows of the sequences decoding in a step (their windows, K/V
    writes and prompts' leftover tokens) stay within the budget the prompts leave them, or one sequence decodes: the
    late prompts' leftover tokens fill the budget, so some steps run while others sit out."""
    eng = _engine("elastic", max_num_batched_tokens=64)
    told, fits, sat = [], [], []
    plan = eng.core.chunker.plan

    def spy(seqs, room=None, prompts=0):
        got = plan(seqs, room, prompts)
        n = len(got.windows)
        told.append(prompts)
        sat.append(len(seqs) - n)
        rows = sum(w + s.pending + s.extra for w, s in zip(got.windows, seqs))
        fits.append(n == 1 or rows <= room + sum(s.pending + s.extra for s in seqs))
        return got
    eng.core.chunker.plan = spy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"early{i}", prompts[i], params)
    eng.step()
    eng.step()
    for i in range(4):
        eng.add_request(f"late{i}", prompts[2 + i] * 3, params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert sorted(done) == ["early0", "early1", "late0", "late1", "late2", "late3"]
    assert all(len(t) == 24 for t in done.values())
    assert any(p > 0 for p in told) and all(fits) and any(sat)   # some steps ran while others sat out


def test_a_streaming_window_is_c_masked_positions_carrying_the_writes_and_the_prompts_tail():
    """Protects Optimus's window in the decoding state: each step computes the first c masked positions of the
    block; the K/V writes of the last step's commits and the prompt's leftover tokens ride with it outside c; the
    leftover tokens are in every window of their block (never read from the cache there) and in none after it; a
    finished block's last commits are written by the next block's first window. Block 8, a 3-token prompt, c = 2."""
    s = BlockState([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), DllmConfig(), 8, 99,
                   frozenset(), 4096, torch.device("cpu"))
    s.prefilled()
    V = 128

    def commit(w, offsets):                      # logits making exactly these candidates pass the threshold
        logits = torch.zeros(len(w.rows), V)
        for i, j in enumerate(w.candidates):
            logits[i, 10 + j] = 100.0 if j in offsets else 0.0
        return s.apply(w, logits)

    w = s.window(2, reuse=True)
    assert (w.positions, w.writes, w.cached, w.candidates) == ([0, 1, 2, 3, 4], [0, 1, 2], [], [3, 4])
    assert commit(w, {3, 4}) == 2
    w = s.window(2, reuse=True)                  # the tail again, the two commits' writes, the next 2 masks
    assert (w.positions, w.writes, w.cached, w.candidates) == ([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4], [], [5, 6])
    assert commit(w, {5}) == 1
    w = s.window(2, reuse=True)                  # 3, 4 are read from the cache now; the tail is not
    assert (w.positions, w.writes, w.cached, w.candidates) == ([0, 1, 2, 5, 6, 7], [0, 1, 2, 5], [3, 4], [6, 7])
    assert commit(w, {6, 7}) == 2 and s.start == 8   # the block is complete
    w = s.window(2, reuse=True)                  # its last commits first, no tail: 0..5 are cached
    assert (w.positions, w.writes, w.cached, w.candidates) == ([6, 7, 8, 9], [6, 7], [0, 1, 2, 3, 4, 5], [0, 1])
    with pytest.raises(ValueError, match="chunk c >= 1"):
        s.window(0, reuse=True)


def test_the_engine_refuses_a_window_other_than_the_one_the_core_planned(prompts):
    """Protects the one-implementation promise at the engine: the core prices and budgets each window by its rows;
    a decoding state whose window has other rows is a RuntimeError naming both counts, not a silent other step."""
    from tandem.engine.diffusion.engine_step import DiffusionBatch

    eng = _engine("4")
    state = eng.dllm.start("x", list(prompts[0]), SamplingParams(temperature=0.0, max_tokens=8))
    tail = len(prompts[0]) % 32
    batch = DiffusionBatch()
    eng.dllm.decode(batch, "x", state, 4, 4 + tail, [0, 1, 2, 3])       # 4 masked positions + the prompt's tail
    assert len(batch.windows[0].positions) == 4 + tail
    with pytest.raises(RuntimeError, match=f"planned a window of {3 + tail} positions, the decoding state has "
                                           f"{4 + tail}"):
        eng.dllm.decode(DiffusionBatch(), "x", state, 4, 3 + tail, [0, 1, 2, 3])


def test_reusing_decoded_kv_is_exact_where_kv_cannot_depend_on_later_tokens(tmp_path):
    """Streaming mechanics: on a one-layer SDAR a position's K/V depend only on its own token, so the cached-KV
    streaming loop must equal a full recomputation (no cache) over the same windows' positions, token for token,
    at chunks 2, 3 and 8, greedy and seeded."""
    ckpt = make_tiny_model(tmp_path / "m", arch="sdar", seed=3,
                           config_overrides={"num_key_value_heads": 2, "num_hidden_layers": 1})
    m, _ = load_model(ckpt, dtype="float32")
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 37, 64)]
    cfg = DllmConfig(dllm_confidence_threshold=0.2)

    @torch.inference_mode()
    def recompute(prompt, params, c):
        s = BlockState(prompt, params, cfg, 32, m.mask_token_id, frozenset(), 4096, torch.device("cpu"))
        s.prefilled()
        while not s.done:
            w = s.window(c, reuse=True)
            st = s.start
            decoded = {st + j for j, u in enumerate(s.undecoded) if not u}
            pos = list(range(st)) + sorted(decoded | {st + j for j in w.candidates})
            meta = BlockDiffusionMetadata.build([pos], [0], [0], None, 1, 32)
            h = m(torch.tensor([s.token_at(p) for p in pos]), None, None, meta)
            rows = torch.tensor([pos.index(st + j) for j in w.candidates], dtype=torch.long)
            s.apply(w, m.compute_logits(h.index_select(0, rows)))
        return s.out.token_ids

    for params in (SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=60, ignore_eos=True)):
        for c in (2, 3, 8):
            got = generate_cached(m, ps, params, cfg, chunk=c)
            assert [o.token_ids for o in got] == [recompute(p, params, c) for p in ps]


def test_bad_diffusion_options_are_refused_with_one_clear_error(prompts, tmp_path):
    """Unusual knobs are handled: a block length the model was not trained with, steps that do not divide the block, a threshold
    outside (0, 1], an unknown chunk, and a diffusion option on an autoregressive model."""
    with pytest.raises(EngineError, match="dllm_block_length 16 is not supported by this model"):
        _engine("block", dllm_block_length=16)
    with pytest.raises(EngineError, match="diffusion chunk"):
        _engine("fast")
    eng = _engine("block")
    with pytest.raises(EngineError, match="dllm_denoising_steps 5 must divide the block length 32"):
        eng.add_request("x", prompts[0], SamplingParams(max_tokens=4, dllm_denoising_steps=5))
    with pytest.raises(EngineError, match="dllm_block_length 16 is not this engine's block length 32"):
        eng.add_request("x", prompts[0], SamplingParams(max_tokens=4, dllm_block_length=16))
    with pytest.raises(EngineError, match="does not support logprobs"):
        eng.add_request("x", prompts[0], SamplingParams(max_tokens=4, logprobs=2))
    for bad in (0, 1.5, "high"):
        with pytest.raises(SamplingParamsError, match="dllm_confidence_threshold"):
            SamplingParams(dllm_confidence_threshold=bad)
    with pytest.raises(SamplingParamsError, match="dllm_unmasking_strategy"):
        SamplingParams(dllm_unmasking_strategy="random")
    ar = make_tiny_model(tmp_path / "ar", seed=1)
    with pytest.raises(EngineError, match="autoregressive"):
        LLMEngine(EngineConfig(model=str(ar), device="cpu", dllm_block_length=32))
    eng = LLMEngine(EngineConfig(model=str(ar), device="cpu"))
    with pytest.raises(EngineError, match="dllm_confidence_threshold: diffusion options, but this model is "
                                          "autoregressive"):
        eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4, dllm_confidence_threshold=0.5))
