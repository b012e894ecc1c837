"""The engine's host KV tier: the core's copies carried out for real beside the steps (engine/tier_copies.py) into
a host pool (engine/host_pool.py). Copies land bit for bit, a step never runs on a block still coming back, and a
failed copy falls back to recompute with the same greedy output."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tandem.core.host_tier import CopyKind  # noqa: E402
from tandem.core.types import SeqState  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BASE = dict(max_num_batched_tokens=64, num_kv_blocks=48, max_model_len=512, block_size=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tier")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    return str(path)


class Clock:
    """An injected engine clock: time moves only when the test says."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def tiered(path, clock=None, **kw):
    cfg = EngineConfig(model=path, policy="hicache", **{"kv_offloading_size": 0.01, **BASE, **kw})
    return LLMEngine(cfg, clock=clock or Clock(), t_pre=lambda h, n: 1e-3 * n)   # recompute: 1 ms a token


def run_round(eng, rid, prompt, sid="s"):
    eng.add_request(rid, prompt, GREEDY, session_id=sid)
    for _ in range(200):
        for out in eng.step():
            if out.finished:
                return out
    raise AssertionError("the round did not finish")


def settle(eng, limit=400):
    """Step until the host tier has nothing in flight nor planned."""
    tier = eng.tier
    for _ in range(limit):
        eng.step()
        if not tier.busy() and not tier.due(eng.clock()) and not eng.core.kv.tier.copies:
            return
    raise AssertionError("the host tier's copies did not settle")


PROMPT = list(range(3, 60))
MORE = list(range(70, 95))


def reference(path):
    """The same two rounds on an engine without a host tier (the session's KV stays on the GPU)."""
    eng = LLMEngine(EngineConfig(model=path, **BASE))
    a = run_round(eng, "a", PROMPT)
    b = run_round(eng, "b", PROMPT + a.outputs[0].token_ids + MORE)
    eng.close()
    return a.outputs[0].token_ids, b.outputs[0].token_ids, b.num_cached_tokens


def test_offload_lands_bit_exact_and_load_resumes_the_session(tiny, one_thread):
    ref_a, ref_b, ref_cached = reference(tiny)
    eng = tiered(tiny)
    assert eng.tier is not None and eng.tier.pool.link_block_s > 0     # the host link was measured at start
    a = run_round(eng, "a", PROMPT)
    assert a.outputs[0].token_ids == ref_a
    settle(eng)                                   # the idle session is written through to the host tier
    seq = eng.core.seqs["s"]
    assert seq.state is SeqState.IDLE and seq.host_tokens == seq.num_tokens > 0
    # the host copy equals the GPU blocks, bit for bit
    pool = eng.tier.pool
    run = eng.core.kv.tier.host.session("s")
    slots = pool.slots(run)
    table = eng.core.blocks.tables[seq]
    n = -(-seq.num_tokens // pool.block_size)
    for host, kv in zip(pool.data, eng.runner.kv_caches):
        assert torch.equal(host[:, slots[:n]], kv[:, table[:n]])
    counters = eng.tier.counters
    assert counters["offload_bytes"] == n * pool.block_bytes
    eng.core.expire("s")                          # its TTL: the GPU copy goes, the host copy stays
    assert seq.state is SeqState.OFFLOADED and not eng.core.blocks.held(seq)
    eng.clock.t += 5.0
    b = run_round(eng, "b", PROMPT + a.outputs[0].token_ids + MORE)
    assert b.outputs[0].token_ids == ref_b         # loaded back from host memory: the same greedy output
    assert b.num_cached_tokens == ref_cached == len(PROMPT) + len(ref_a) - 1
    assert counters["load_bytes"] == n * pool.block_bytes
    assert counters["cpu_hit_tokens"] == ref_cached and counters["failed_copies"] == 0
    assert eng.core.kv.tier.stats.loads == 1
    eng.close()


def test_a_step_never_runs_on_a_block_in_flight(tiny, one_thread):
    """While the load of a session's KV is in flight, steps run other sessions only (the shell asserts it on every
    step), and the session's round starts once the copy has landed."""
    eng = tiered(tiny)
    a = run_round(eng, "a", PROMPT)
    settle(eng)
    eng.core.expire("s")
    gate = __import__("threading").Event()
    real = eng.tier.pool.copy

    def slow(kv, to_host, blocks, slots):        # hold the copy back until the test lets it go
        gate.wait(5)
        real(kv, to_host, blocks, slots)
    eng.tier.pool.copy = slow
    eng.add_request("b", PROMPT + a.outputs[0].token_ids + MORE, GREEDY, session_id="s")
    eng.add_request("o", list(range(200, 230)), GREEDY, session_id="other")
    seq = eng.core.seqs["s"]
    assert seq.loading is not None and seq.loading.kind is CopyKind.LOAD
    for _ in range(3):                            # the other session runs; "s" waits for its blocks
        prep = eng.prepare_step()
        assert prep.plan is not None and "s" not in {e.session_id for e in prep.plan.entries()}
        eng.finish_step(prep, eng.execute_step(prep))
    gate.set()
    done = {}
    for _ in range(300):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) == 2:
            break
    assert set(done) == {"b", "o"} and eng.tier.counters["late_rounds"] == 1
    eng.close()


def test_a_failed_copy_falls_back_to_recompute(tiny, one_thread):
    ref_a, ref_b, _ = reference(tiny)
    eng = tiered(tiny)
    a = run_round(eng, "a", PROMPT)
    settle(eng)
    eng.core.expire("s")
    eng.tier.fail_copies = 1                      # the load raises on the copy thread
    b = run_round(eng, "b", PROMPT + a.outputs[0].token_ids + MORE)
    assert b.outputs[0].token_ids == ref_b        # recomputed: the same greedy output
    assert eng.tier.counters["failed_copies"] == 1
    assert eng.core.kv.tier.stats.recomputes == 1 and eng.core.kv.tier.stats.failed == 1
    eng.close()


def test_a_host_tier_larger_than_memory_is_refused(tiny, one_thread):
    with pytest.raises(EngineError, match="exceeds the .* GiB of host memory available"):
        tiered(tiny, kv_offloading_size=1 << 20)


def test_the_offline_llm_serves_a_tiered_policy(tiny, one_thread):
    """tandem.LLM takes a tiered policy and kv_offloading_size; with no prefill estimate given it prices recompute
    with the checkpoint's nominal roofline, so an offloaded session is loaded back, with the same greedy output."""
    from tandem.engine.llm import LLM
    ref_a, ref_b, ref_cached = reference(tiny)
    with LLM(tiny, policy="hicache", kv_offloading_size=0.01, **BASE) as llm:
        a = llm.generate([PROMPT], GREEDY, session_ids=["s"])[0]
        settle(llm.engine)
        llm.engine.core.expire("s")
        b = llm.generate([PROMPT + a.outputs[0].token_ids + MORE], GREEDY, session_ids=["s"])[0]
        assert b.outputs[0].token_ids == ref_b and b.num_cached_tokens == ref_cached
        assert llm.engine.tier.counters["load_bytes"] > 0


TWO_CORES = pytest.mark.skipif(__import__("tandem.engine.parallel.group", fromlist=["x"]).usable_cpus() < 2,
                               reason="two ranks need two CPU cores")


def full_blocks(eng, sid, tokens):
    """(GPU blocks, host slots) of the session's first `tokens` // block_size blocks (whole ones only)."""
    seq = eng.core.seqs[sid]
    pool = eng.tier.pool
    n = tokens // pool.block_size
    return eng.core.blocks.tables[seq][:n], pool.slots(eng.core.kv.tier.host.session(sid))[:n]


@TWO_CORES
def test_two_ranks_copy_their_heads_bit_exact(tiny):
    """Under tensor parallelism each rank copies its own heads on its own copy threads: the host copy equals the GPU
    blocks bit for bit on every rank (each rank its own heads), and an offloaded session loaded back on two ranks
    gives one rank's greedy tokens."""
    ref_a, ref_b, ref_cached = reference(tiny)
    eng = tiered(tiny, tensor_parallel_size=2)
    try:
        a = run_round(eng, "a", PROMPT)
        settle(eng)
        seq = eng.core.seqs["s"]
        assert seq.state is SeqState.IDLE and seq.host_tokens == seq.num_tokens > 0
        n = -(-seq.num_tokens // eng.tier.pool.block_size)
        blocks, slots = eng.core.blocks.tables[seq][:n], eng.tier.pool.slots(eng.core.kv.tier.host.session("s"))[:n]
        out = eng.tier.compare(blocks, slots)
        assert [same for same, _ in out] == [True, True]
        assert out[0][1] != out[1][1] and 0.0 not in (out[0][1], out[1][1])     # two ranks, two different heads
        assert eng.tier.counters["offload_bytes"] == n * eng.tier.pool.block_bytes
        eng.core.expire("s")
        b = run_round(eng, "b", PROMPT + a.outputs[0].token_ids + MORE)
        assert (a.outputs[0].token_ids, b.outputs[0].token_ids) == (ref_a, ref_b)
        assert b.num_cached_tokens == ref_cached and eng.tier.counters["load_bytes"] == n * eng.tier.pool.block_bytes
        blocks, slots = full_blocks(eng, "s", ref_cached)       # loaded back: the GPU blocks equal the host ones
        assert len(blocks) >= 2 and [same for same, _ in eng.tier.compare(blocks, slots)] == [True, True]
        assert eng.tier.counters["failed_copies"] == 0
    finally:
        eng.close()


@TWO_CORES
def test_a_copy_failed_on_one_rank_fails_on_all_and_recomputes(tiny):
    """The load fails on rank 1 only (the driver's share is done): the copy fails as a whole, the round recomputes
    its context with the same greedy output."""
    ref_a, ref_b, _ = reference(tiny)
    eng = tiered(tiny, tensor_parallel_size=2)
    try:
        a = run_round(eng, "a", PROMPT)
        settle(eng)
        eng.core.expire("s")
        eng.tier.rank_hooks(1, fail=1)
        b = run_round(eng, "b", PROMPT + a.outputs[0].token_ids + MORE)
        assert b.outputs[0].token_ids == ref_b
        assert eng.tier.counters["failed_copies"] == 1 and eng.tier.counters["load_bytes"] == 0
        assert eng.core.kv.tier.stats.recomputes == 1 and eng.core.kv.tier.stats.failed == 1
    finally:
        eng.close()


@TWO_CORES
def test_decode_steps_run_while_a_rank_copies(tiny):
    """Rank 1 holds its share of the session's copy out (a test hook): the driver's share is done, the copy is in
    flight, and every decode step of another session runs meanwhile; once released the copy lands bit for bit."""
    eng = tiered(tiny, tensor_parallel_size=2)
    try:
        eng.tier.rank_hooks(1, hold=True)
        run_round(eng, "a", PROMPT)
        eng.add_request("o", list(range(200, 230)), GREEDY, session_id="other")
        held, beside, tokens = None, 0, 0
        for _ in range(100):
            for out in eng.step():
                if out.request_id == "o":
                    tokens = len(out.outputs[0].token_ids)
            if held is None:
                held = next((c for c in eng.tier.inflight.values() if c.run is not None and c.run.key == "s"), None)
            elif eng.tier.waiting_on(held.id) == {1}:
                beside += 1                     # a step ran while rank 1's share of the copy was in flight
            if tokens == GREEDY.max_tokens:
                break
        assert held is not None and held.kind is CopyKind.OFFLOAD
        assert tokens == GREEDY.max_tokens and beside >= GREEDY.max_tokens - 1
        assert held.id in eng.tier.inflight and eng.core.seqs["s"].host_tokens == 0
        eng.tier.rank_hooks(1, hold=False)
        settle(eng)
        seq = eng.core.seqs["s"]
        assert held.id not in eng.tier.inflight and seq.host_tokens == seq.num_tokens
        blocks, slots = full_blocks(eng, "s", seq.num_tokens)
        assert [same for same, _ in eng.tier.compare(blocks, slots)] == [True, True]
        assert eng.tier.counters["failed_copies"] == 0
    finally:
        eng.close()


@TWO_CORES
def test_a_rank_killed_during_a_copy_fails_the_copy_and_the_engine(tiny):
    """Rank 1 is killed while it holds its share of a copy: the copy ends failed (its notice pipe ended, nothing
    waits for it forever) and the next step fails the engine with one line."""
    import os
    import signal
    from tandem.engine.parallel.driver import TensorParallelError
    eng = tiered(tiny, tensor_parallel_size=2)
    try:
        eng.tier.rank_hooks(1, hold=True)
        run_round(eng, "a", PROMPT)
        eng.step()                                  # the idle session's copy out starts, held on rank 1
        held = next(c for c in eng.tier.inflight.values() if c.run is not None and c.run.key == "s")
        os.kill(eng.runner.group.pids[0], signal.SIGKILL)
        for _ in range(100):
            if not eng.tier.waiting_on(held.id):
                break
            eng.tier.wait(0.1)
        assert (held, False) in eng.tier.ended
        eng.add_request("o", list(range(200, 230)), GREEDY, session_id="other")
        with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 .* was killed by SIGKILL"):
            eng.step()
    finally:
        eng.close()
