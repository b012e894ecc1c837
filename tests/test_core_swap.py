"""Preemption by swap (vLLM's preemption_mode="swap"): the worker core copies a preempted sequence's KV blocks to
host memory and back instead of dropping them, resumes swapped sequences before it admits new work, falls back to
recompute when the swap space is full and forgets a swapped copy whose session ends; the factory picks swap for
streaming diffusion windows (a recompute rewrites their K/V differently) and recompute elsewhere; the simulator
charges every copy over the GPU's host link. Expected numbers are worked out in the comments."""
from __future__ import annotations

import pytest

from tandem.core.config import GIB, PreemptionMode, SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, PrefillTask, RoundDone, SeqState, StepResult, SwapKind
from tandem.core.worker import WorkerConfig, WorkerCore
from tandem.perf.hardware import get_gpu
from tandem.perf.roofline import Roofline, kv_bytes_per_token_per_gpu
from tandem.sim.cluster import SimConfig, build
from tandem.workload.traces import load_sharegpt

SWAP, RECOMPUTE = PreemptionMode.SWAP, PreemptionMode.RECOMPUTE


def make(swap_blocks: int) -> WorkerCore:
    return WorkerCore(0, WorkerConfig(role=COLOCATED, tp=1, num_blocks=6, block_size=4, watermark=0.0,
                                      max_num_batched_tokens=64, mix_decode_with_prefill=True,
                                      preemption_mode=SWAP, swap_blocks=swap_blocks))


def start(core: WorkerCore, sid: str, l_incr: int, out: int, now: float = 0.0) -> PrefillTask:
    core.begin_round(sid)
    t = PrefillTask(sid, 0, 0, l_incr, now, output_tokens=out)
    core.submit(t, now)
    return t


def three_decoding(swap_blocks: int) -> WorkerCore:
    """6 blocks of 4 tokens, all held by a (6 tokens), b (6) and c (8), decoding 3-token rounds (one token each
    so far); d (12 tokens) is queued. c, the latest admitted, needs a third block for its next token."""
    core = make(swap_blocks)
    for sid, n in (("a", 6), ("b", 6), ("c", 8)):
        start(core, sid, n, out=3)
    plan = core.schedule(0.0)
    core.on_step_done(plan, StepResult(1.0), 1.0)
    core.drain()
    assert core.blocks.num_free == 0
    start(core, "d", 12, out=3, now=1.0)
    return core


def run(core: WorkerCore, now: float = 1.0):
    """Every step to the end: (prefill chunks, decodes, swaps) per step and the RoundDone events by session."""
    steps, done = [], {}
    while (plan := core.schedule(now)) is not None:
        swaps = [(sw.kind.value, sw.session_id, len(sw.blocks)) for sw in core.take_swaps()]
        steps.append(([(t.session_id, n) for t, n in plan.prefill], [s.session_id for s in plan.decode], swaps))
        now += 1.0
        core.on_step_done(plan, StepResult(1.0), now)
        done.update({e.session_id: e for e in core.drain() if isinstance(e, RoundDone)})
    return steps, done


def test_a_preempted_sequence_is_swapped_out_and_back_in_without_a_recompute():
    core = three_decoding(swap_blocks=4)
    b = core.seqs["b"]
    steps, done = run(core)
    assert steps == [
        ([], ["a", "c"], [("out", "b", 2)]),        # t=1: b (order 2) gives its 2 blocks to c, to host memory
        ([], ["a", "c"], []),                        # t=2: b's 2 blocks do not fit the 1 free; d may not start
        ([("d", 12)], ["b"], [("in", "b", 2)]),      # t=3: a evicted (LRU) for b, which resumes; then c for d
        ([], ["b", "d"], []),
        ([], ["d"], []),
    ]
    # b decoded its 2nd token at t=4 and its 3rd at t=5 with no prefill again (recompute: t=5 and t=6)
    assert (done["b"].preemptions, done["b"].itl_count, done["b"].itl_max, done["b"].time_s) == (1, 2, 3.0, 5.0)
    assert core.kv.preempted == {RECOMPUTE: 0, SWAP: 1}
    assert (b.state, b.num_tokens, b.swapped_blocks, core.kv.swap_free, core.swapped) == (SeqState.IDLE, 8, 0, 4, [])


def test_a_queued_prefill_waits_while_a_swapped_sequence_waits_for_its_blocks():
    core = three_decoding(swap_blocks=4)
    core.schedule(1.0)                               # b swapped out; c took one of its blocks, one is free
    start(core, "e", 3, out=2, now=1.5)              # e fits the free block, but b came first
    plan = core.schedule(1.5)
    assert [t.session_id for t, _ in plan.prefill] == [] and [t.session_id for t in core.queue] == ["d", "e"]
    assert core.swapped == [core.seqs["b"]] and core.blocks.num_free == 1


def test_a_full_swap_space_falls_back_to_recompute():
    core = three_decoding(swap_blocks=1)             # b holds 2 blocks: no room on the host
    core.schedule(1.0)
    rec = core.queue[0]
    assert core.take_swaps() == [] and core.kv.preempted == {RECOMPUTE: 1, SWAP: 0}
    assert (rec.session_id, rec.recompute, rec.l_incr, core.seqs["b"].state) == ("b", True, 6, SeqState.PREFILL)


def test_a_session_that_ends_while_swapped_out_drops_its_host_copy():
    core = three_decoding(swap_blocks=4)
    core.schedule(1.0)
    [out] = core.take_swaps()
    core.release("b")
    [drop] = core.take_swaps()
    assert (out.kind, drop.kind, drop.session_id, drop.blocks) == (SwapKind.OUT, SwapKind.DROP, "b", ())
    assert (core.kv.swap_free, core.swapped, core.seqs.get("b")) == (4, [], None)


@pytest.mark.parametrize("kw, block_bytes, want", [
    (dict(dllm_block_length=32), 1 << 20, (SWAP, 4096)),                       # streaming (elastic): 4 GiB / 1 MiB
    (dict(dllm_block_length=32, dllm_chunk="8"), 1 << 20, (SWAP, 4096)),
    (dict(dllm_block_length=32, dllm_chunk="block"), 1 << 20, (RECOMPUTE, 0)),  # recompute is exact there
    ({}, 1 << 20, (RECOMPUTE, 0)),                                              # autoregressive
    (dict(dllm_block_length=32), 0, (RECOMPUTE, 0)),                           # the shell gave no block size
    (dict(preemption_mode="swap", swap_space=0.5), GIB // 8, (SWAP, 4)),
    (dict(dllm_block_length=32, preemption_mode="recompute"), 1 << 20, (RECOMPUTE, 0)),
])
def test_the_factory_swaps_streaming_diffusion_windows_and_recomputes_elsewhere(kw, block_bytes, want):
    core = build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(**kw), kv_block_bytes=block_bytes)
    assert (core.cfg.preemption_mode, core.cfg.swap_blocks) == want


@pytest.mark.parametrize("kw, msg", [
    (dict(preemption_mode="evict"), "preemption_mode must be recompute or swap"),
    (dict(swap_space=-1.0), "swap_space must be a finite number of GiB >= 0"),
    (dict(swap_space=float("inf")), "swap_space must be a finite number of GiB >= 0"),
    (dict(swap_space=True), "swap_space must be a finite number of GiB >= 0"),
    (dict(preemption_mode="swap", swap_space=0), "preemption_mode swap needs swap_space > 0 GiB"),
])
def test_bad_preemption_knobs_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**kw)


def test_swap_needs_room_for_one_block():
    with pytest.raises(ValueError, match="swap_space 0.5 GiB holds no KV block of 1073741824 bytes"):
        build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(preemption_mode="swap", swap_space=0.5),
                     kv_block_bytes=GIB)


def test_a_swap_moves_the_kv_over_the_gpus_host_link():
    roof = Roofline("qwen3-8b", "h100")
    per_token = kv_bytes_per_token_per_gpu(roof.model, 1)
    h100 = get_gpu("h100")
    assert (h100.host_gbs, get_gpu("a100-80g").host_gbs) == (64.0, 32.0)   # PCIe Gen5 / Gen4 x16
    assert roof.swap_time(1000) == pytest.approx(1000 * per_token / (64e9 * h100.link_eff), rel=1e-12)
    assert roof.swap_time(0) == 0.0


def test_the_simulator_swaps_streaming_windows_and_charges_every_copy():
    """SDAR-8B on an A100 with 30% of its memory: 64 ShareGPT clients outgrow the KV pool. With chunk 8 the default
    mode swaps (no recompute), every swap's tokens are charged over the host link, and every session completes."""
    sessions = load_sharegpt(limit=64, rate=50.0, seed=0)
    for mode, swaps, recomputes in ((None, True, False), ("recompute", False, True)):
        cfg = SimConfig("sdar-8b", "a100-80g", 1, "C:tp1x1", "vllm", concurrency=64, dllm_block_length=32,
                        dllm_chunk="8", mem_util=0.3, preemption_mode=mode)
        coord, workers, loop = build(cfg)
        w = workers[0]
        planned, charged = [], []
        take, timer = w.take_swaps, loop.swap_time[0]
        w.take_swaps = _recording(take, planned)
        loop.swap_time = [_recording_timer(timer, charged)]
        loop.run(sessions, concurrency=64)
        assert all(rec.completed for rec in coord.records)
        assert (w.kv.preempted[SWAP] > 0, w.kv.preempted[RECOMPUTE] > 0) == (swaps, recomputes)
        assert sum(charged) == cfg.block_size * sum(len(sw.blocks) for sw in planned)
        assert len(planned) == 2 * w.kv.preempted[SWAP]                      # each swapped out once, back in once
        assert w.kv.swap_free == w.cfg.swap_blocks and not w.swapped


def _recording(take, planned: list):
    def f():
        out = take()
        planned.extend(out)
        return out
    return f


def _recording_timer(timer, charged: list):
    def f(tokens: int) -> float:
        charged.append(tokens)
        return timer(tokens)
    return f


def test_on_a_profiled_host_a_swap_costs_the_engines_kv_export_or_import(tmp_path):
    """Profiled engines (HostLoop): a swap-out is charged as the profile's KV export of its bytes, a swap-in as its
    import, and dropping a host copy costs nothing; the charge goes to the worker's next step."""
    from test_sim import _profile
    from tandem.core.types import Swap
    link = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4, "export_s": 2e-5, "export_bytes_per_s": 4e9,
            "import_s": 3e-5, "import_bytes_per_s": 2e9}
    path = _profile(tmp_path, kv_link=link)[0]
    coord, workers, loop = build(SimConfig("x", "x", 1, "C:tp1x1", "vllm", perf=str(path), preemption_mode="swap"))
    nbytes = 3 * 16 * 1000                           # 3 blocks of 16 positions at 1,000 KV bytes a position
    loop._charge_swaps(0, [Swap(SwapKind.OUT, "a", (1, 2, 3)), Swap(SwapKind.DROP, "b", ())])
    assert loop._take_swap_s(0) == pytest.approx(2e-5 + nbytes / 4e9, rel=1e-12)
    loop._charge_swaps(0, [Swap(SwapKind.IN, "a", (4, 5, 6))])
    assert loop._take_swap_s(0) == pytest.approx(3e-5 + nbytes / 2e9, rel=1e-12) and loop._take_swap_s(0) == 0.0
    assert workers[0].cfg.preemption_mode is SWAP and workers[0].cfg.swap_blocks == (4 << 30) // (16 * 1000)
