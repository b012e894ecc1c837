"""Optimus's elastic chunk size (policy/optimus), the block-diffusion windows of the worker core, and the simulated
commits (perf/dllm, sim/commit): the latency fit, the N_commit estimate, the argmax, block alignment, TTFT at the
first commit, and Table 2's moments reproduced. Expected numbers are worked out in the comments."""
from __future__ import annotations

import math
import random

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, FirstToken, PrefillTask, RoundDone, StepResult
from tandem.perf.dllm import OPTIMUS_TABLE2, StretchModel, commit_model
from tandem.policy.optimus import (ChunkLatency, ChunkMode, ChunkSizer, ChunkSpec, CommitEstimator, SeqWindow,
                                  StepWindows, parse_chunk)
from tandem.policy.optimus.commit import Tried
from tandem.policy.optimus.latency import StepOverhead

from tandem.sim.cluster import ConfigError, SimConfig, dllm_summary, simulate
from tandem.sim.commit import StretchCommit
from tandem.workload.session import SLO, Round, Session


# ---------------------------------------------------------------------------- T(c, b)
def three_regimes(x: float) -> float:
    """10 ms flat to 256 query tokens, then +20 µs/token to 1024, then +50 µs/token."""
    if x <= 256:
        return 0.010
    if x <= 1024:
        return 0.010 + 20e-6 * (x - 256)
    return 0.010 + 20e-6 * 768 + 50e-6 * (x - 1024)


def test_the_latency_model_recovers_three_affine_regimes_in_b_times_c():
    """Protects §5.2's estimator: fitted to samples of a three-regime function it predicts it within 1% at every
    (c, b), and its regimes change near 256 and 1024 query tokens."""
    lat = ChunkLatency.sample(three_regimes, max_tokens=8192)
    for c in (1, 2, 4, 8, 16, 32):
        for b in (1, 4, 16, 64, 256):
            assert lat(c, b) == pytest.approx(three_regimes(c * b), rel=0.01)
    lo, hi = lat.breakpoints
    assert 192 <= lo <= 384 and 768 <= hi <= 1536
    with pytest.raises(ValueError, match="two or more distinct"):
        ChunkLatency.fit([8, 8], [0.1, 0.1])


def test_the_head_is_charged_per_sampled_row_only():
    """Protects the price of a streaming step's unsampled rows (its K/V writes, a prompt's leftover tokens): with the
    LM head timed apart (head_s), they pay the forward's regimes alone. 100 rows of which 40 sampled at 1 ms + 10 µs
    a row and 50 µs a sampled row: 2 + 2 = 4 ms; all of them sampled (the paper's b·c form): 7 ms."""
    lat = ChunkLatency((), ((0.001, 10e-6),), head_s=50e-6)
    assert lat.rows(100, 1, 0, 40) == pytest.approx(0.004, abs=1e-15)
    assert lat.rows(100) == lat(100, 1) == pytest.approx(0.007, abs=1e-15)
    assert lat.rows(60, 1, 0, 40, 40) == lat.rows(100, 1, 0, 40)   # prompt rows: the forward, no head
    with pytest.raises(ValueError, match="head_s"):
        ChunkLatency((), ((0.001, 10e-6),), head_s=-1.0)


def test_the_step_overhead_learns_what_steps_take_beyond_t():
    """Protects StepOverhead, the online correction of T by the steps' measured times (latency.py): nothing before
    a step; steps of one size put their whole residual in the per-step term; steps of 4 and 16 sequences taking
    3.2 and 6.8 ms more than T give 2 ms a step and 0.3 ms a sequence exactly; a per-sequence slope is never
    negative (steps of 16 sequences closer to T than steps of 4: all of it per step, the weighted mean); a step weighs half
    as much after `halflife` more."""
    ov = StepOverhead()
    assert ov.coefs == (0.0, 0.0) and ov(16) == 0.0
    for _ in range(3):
        ov.add(16, 0.004)
    assert ov.coefs == (pytest.approx(0.004, abs=1e-15), 0.0)
    ov = StepOverhead()
    for _ in range(5):
        ov.add(4, 0.0032)
        ov.add(16, 0.0068)
    a, b = ov.coefs
    assert (a, b) == (pytest.approx(0.002, abs=1e-12), pytest.approx(0.0003, abs=1e-12))
    assert ov(100) == pytest.approx(0.032, abs=1e-12)
    neg = StepOverhead()
    neg.add(4, 0.003)
    neg.add(16, 0.001)
    d = 2 ** (-1 / 64)                       # the first step's weight after the second (halflife 64 steps)
    assert neg.coefs == (pytest.approx((0.003 * d + 0.001) / (d + 1), abs=1e-15), 0.0)
    half = StepOverhead(halflife=1)
    half.add(8, 0.004)
    half.add(8, 0.001)                       # weights 1/2 and 1: (0.002 + 0.001) / 1.5
    assert half(8) == pytest.approx(0.002, abs=1e-15)
    for bad in ((0, 0.1), (4, math.nan), (True, 0.1)):
        with pytest.raises(ValueError, match="step overhead"):
            ov.add(*bad)
    with pytest.raises(ValueError, match="halflife"):
        StepOverhead(0)


# ---------------------------------------------------------------------------- N_commit(c)
def test_the_commit_estimate_starts_at_one_and_a_size_never_run_looks_as_good_as_the_best():
    """Protects §5.3's online mapping (commit.py): 1 before any observation. Block-size windows (the rest of a
    fresh block) committing 6, 10, 8, 8 give N(32) = 8 exactly (one entry in its group: the group's mean, its 4
    optimistic pseudo-windows of min(32, 8) included); a full window never run is min(c, 8): N(8) = 8, N(4) = 4; a
    window of 1 commits 1. Windows of 2 committing 1 and 2, 5,000 of them (the sizer's AR-like end state), leave
    N(32) at 8: a window fades only its own entry."""
    est = CommitEstimator(32)
    assert est(32) == est(8) == 1.0
    est.observe(32, [6, 10])
    est.observe(32, [8, 8])
    assert est(32) == pytest.approx(8.0, abs=1e-12)
    assert (est(8), est(4), est(1)) == (8.0, 4.0, 1.0)
    w = s = 0.0
    for _ in range(2500):
        est.observe(2, [1, 2], left=32)
        w, s = w * 2 ** (-2 / 256) + 2, s * 2 ** (-2 / 256) + 3     # the entry's decayed weight and sum
    assert est(32) == pytest.approx(8.0, abs=1e-12) and est(2) == pytest.approx((s + 4 * 2) / (w + 4), abs=1e-12)
    with pytest.raises(ValueError, match="cannot commit"):
        est.observe(4, [5], left=32)
    with pytest.raises(ValueError, match="cannot commit"):
        est.observe(8, [1], left=4)
    with pytest.raises(ValueError, match="masked positions"):
        est.estimate(8, 4)


def test_bands_that_differ_only_by_noise_are_pooled_and_bands_that_differ_are_kept_apart():
    """Protects the empirical-Bayes pooling of full windows across bands of masked positions left (commit.py):

    - windows of 8 committing 2 and 4 alternately with 20 left and with 30 left: the same mean, so τ² <= 0, w0 is
      infinite and both read the group's (120 + 4 x min(8, 3)) / (40 + 4) = 3;
    - 6 every time with 20 left and 1 with 30 left (the tiny model's mid-block against its block-start windows): no
      spread within, w0 = 0, each its own mean, 6 and 1;
    - 5/7 with 20 left and 0/2 with 30 left, 10 each: σ² = 20 / 18, τ² = (125 - σ²) / 10, w0 = σ² / τ², the group's
      mean (70 + 4 x 6) / 24, and each entry (its sum + w0 x that) / (10 + w0)."""
    alike = CommitEstimator(32)
    alike.observe(8, [2, 4] * 10, left=20)
    alike.observe(8, [4, 2] * 10, left=30)
    assert alike(8, 20) == alike(8, 30) == pytest.approx(3.0, abs=1e-12)
    apart = CommitEstimator(32)
    apart.observe(8, [6] * 10, left=20)
    apart.observe(8, [1] * 10, left=30)
    assert (apart(8, 20), apart(8, 30)) == (pytest.approx(6.0, abs=1e-12), pytest.approx(1.0, abs=1e-12))
    noisy = CommitEstimator(32)
    noisy.observe(8, [5, 7] * 5, left=20)
    noisy.observe(8, [0, 2] * 5, left=30)
    var = 20 / 18
    w0 = var / ((125 - var) / 10)
    prior = (70 + 4 * 6) / 24
    assert noisy(8, 20) == pytest.approx((60 + w0 * prior) / (10 + w0), abs=1e-12)
    assert noisy(8, 30) == pytest.approx(max(1.0, (10 + w0 * prior) / (10 + w0)), abs=1e-12)


def test_the_commit_estimate_knows_its_standard_error():
    """Protects `CommitEstimator.error`, which per-sequence windows test their deviations with: rest windows of 20
    committing 18, 20, 19, 19 (one entry, its group's mean with 4 optimistic pseudo-windows of min(20, 19): 19)
    spread by σ² = 2 / 3 within, over the 4 + 4 windows the estimate stands on: √(1 / 12). A group never observed
    counts the widest spread on [1, m], (m - 1) / 2, over its 4 pseudo-windows: 3.5 / 2 for a window of 8; a
    window of one, always committing 1, has no error once seen."""
    est = CommitEstimator(32)
    assert est.error(8, 32) == pytest.approx(3.5 / 2, abs=1e-12)
    est.observe(20, [18, 20, 19, 19], left=20)
    assert est.estimate(20, 20) == pytest.approx(19.0, abs=1e-12)
    assert est.error(20, 20) == pytest.approx(math.sqrt(1 / 12), abs=1e-12)
    est.observe(1, [1, 1], left=32)
    assert est.error(1, 32) == 0.0


# ---------------------------------------------------------------------------- c*
def sizer(mode="elastic", block=32, size=0):
    return ChunkSizer(ChunkSpec(ChunkMode(mode), size), block, lambda rows, seqs, ctx, sampled, prefill: three_regimes(rows + prefill))


def cn(plan: StepWindows) -> tuple[int, int]:
    """A planned step as (its chunk, how many sequences decode in it)."""
    return plan.chunk, len(plan.windows)


def fresh(b: int, block: int = 32) -> list[SeqWindow]:
    """b sequences at the start of a block: every position masked, nothing to write first."""
    return [SeqWindow(block)] * b


def test_elastic_runs_the_block_until_it_has_seen_it_then_takes_the_argmax():
    """Protects c* = argmax N(c) b / T(c, b): after 32 sequences committing 16 at the block size 32, N(m) = min(16, m)
    over m masked positions. One fresh sequence (T flat, 10 ms): c = 16 and 32 both commit 16 per 10 ms, the first
    (16) is kept. 64 sequences: c=16 -> 1024 tokens, T = 10 + 0.02 x 768 = 25.36 ms, 16 x 64 / 25.36 = 40.4 a ms,
    beating c=8 (512 tokens, 15.12 ms: 33.9) and c=32 (2048 tokens, 76.56 ms: 13.4). 256 sequences: c=4 -> 1024
    tokens, 40.4 a ms, beating c=2 (33.9) and c=8 (26.7). The K/V writes of the last step's commits ride outside c:
    one sequence with 1 masked position left and 15 to write has the same 16 rows and 1 commit at every c, so c = 1
    (the first of equals) is taken."""
    s = sizer()
    assert s.choose(fresh(64)) == 32             # warm-up: the block size until 32 sequence-steps were observed
    s.observe(32, [16] * 32)
    assert [s.estimator(c) for c in (1, 4, 16, 32)] == [1.0, 4.0, 16.0, 16.0]
    assert s.choose(fresh(1)) == 16
    assert s.choose(fresh(64)) == 16
    assert s.choose(fresh(256)) == 4
    assert s.choose([SeqWindow(1, 15)]) == 1
    assert s.steps_by_chunk == {32: 1, 16: 2, 4: 1, 1: 1}


def test_elastic_sizes_each_sequences_window_where_one_size_cannot_serve_the_batch():
    """Protects per-sequence windows: two fresh blocks whose windows of c commit 1, 2, 4, 8, 10 and 28, beside two
    blocks whose positions were all tried, whose windows commit 1 whatever their size; a step costs 10 ms plus 1 ms a
    row. One size for all: c = 8 is best, 18 commits in 42 ms (429/s; 32: 58 in 138 ms, 420/s). Each sequence's own
    share is 3.5 ms (14 ms at windows of one, split 4 ways) plus 1 ms a row beyond one: a fresh block commits 28 per
    34.5 ms at 32 (812/s; 8: 8 per 10.5 ms, 762/s), a tried one 1 per 3.5 ms at 1 (larger windows buy nothing):
    58 commits in 76 ms, 763/s, for the step."""
    s = ChunkSizer(ChunkSpec(), 32, lambda rows, seqs, ctx, sampled, prefill: 0.010 + 0.001 * (rows + prefill))
    for c, k in ((1, 1), (2, 2), (4, 4), (8, 8), (16, 10), (32, 28)):
        s.observe(c, [k] * 100_000, 32, 0)
        s.observe(c, [1] * 100_000, 32, 32)
    batch = [SeqWindow(32), SeqWindow(32), SeqWindow(32, tried=32), SeqWindow(32, tried=32)]
    assert s.plan(batch) == StepWindows(32, [32, 32, 1, 1])
    assert s.plan(batch[:2]) == StepWindows(32, [32, 32]) and s.plan(batch[2:]) == StepWindows(1, [1, 1])
    assert s.steps_by_chunk == {32: 2, 1: 1}


class _Known:
    """A commit estimator whose estimates are given: fresh blocks' windows of c commit FRESH[c], tried ones 1, every
    estimate `sigma` uncertain (standard error)."""

    FRESH = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 10.0, 32: 28.0}

    def __init__(self, sigma: float) -> None:
        self.sigma, self.observations = sigma, 10**6

    def judged(self, m: int, left: int | None = None, tried: int = 0) -> tuple[float, float]:
        return (1.0 if tried else self.FRESH[m]), self.sigma


@pytest.mark.parametrize("sigma, windows", [(0.0, [32, 32, 1, 1]), (0.2, [32, 32, 1, 1]), (0.28, [8, 8, 1, 1]),
                                            (0.4, [8, 8, 8, 8])])
def test_a_sequence_leaves_the_common_window_only_for_a_rate_the_commits_seen_tell_apart(sigma, windows):
    """Protects the significance test of per-sequence windows (a sequence's own rate must beat the common c's by two
    standard errors of the difference): in the simulator, per-sequence windows chasing estimates 2% apart, and
    windows never run again once their entry looked low, cost 6% at 4-16 sequences. The batch of the test above
    (common c = 8; 10 ms + 1 ms a row): a fresh block's own rate at 32 is 28 / 34.5 ms against 8 / 10.5 ms at 8, a
    difference of 0.0497 a ms, with an error of σ·√(1 / 34.5² + 1 / 10.5²): it moves while σ < 0.249; a tried block
    at 1, 1 / 3.5 ms against 1 / 10.5 ms, 0.190 a ms apart with an error of σ·√(1 / 3.5² + 1 / 10.5²): while
    σ < 0.316."""
    s = ChunkSizer(ChunkSpec(), 32, lambda rows, seqs, ctx, sampled, prefill: 0.010 + 0.001 * (rows + prefill),
                   estimator=_Known(sigma))
    batch = [SeqWindow(32), SeqWindow(32), SeqWindow(32, tried=32), SeqWindow(32, tried=32)]
    assert s.plan(batch) == StepWindows(max(windows), windows)


def test_elastic_prices_each_window_where_it_is_and_what_it_reads():
    """Protects the elastic choice on the real batch, not on b·c alone (a pure b·c model chose windows half the best
    fixed chunk's in the simulator, where contexts of ~2,800 tokens make the KV read the step's floor):

    - a window stays in its active block: 64 sequences with 4 masked positions left each cost the same 256 rows
      at c = 4 and at c = 32, so the largest window is as cheap, and c = 4 (the first of the equals) is taken;
    - the cached tokens a step reads are charged once per step whatever c: when every masked position commits, 64
      fresh sequences take c = 16 with no context (1,024 tokens in 25.36 ms against 2,048 in 76.56 ms at c = 32),
      but over 10⁶ cached tokens at 1 µs each c = 32 (2,048 tokens in 1,076.6 ms: 1.90 a ms) beats c = 16 (1,024 in
      1,025.4 ms: 1.00 a ms);
    - the windows must fit the room: 64 fresh sequences in 300 rows take at most c = 4."""
    s = sizer()
    s.observe(32, [16] * 32)
    assert s.choose([SeqWindow(4)] * 64) == 4
    kv = ChunkSizer(ChunkSpec(), 32, lambda rows, seqs, ctx, sampled, prefill: three_regimes(rows + prefill) + 1e-6 * ctx)
    kv.observe(32, [32] * 32)                    # every masked position commits: N(m) = m
    assert kv.choose(fresh(64)) == 16
    assert kv.choose([SeqWindow(32, 0, 0, 1_000_000 // 64)] * 64) == 32
    assert s.choose(fresh(64), room=300) == 4


def test_elastic_prices_windows_at_the_prompt_rows_they_displace():
    """Protects c* when prompts wait beyond the step: with N = 1 / 1.53 / 3.06 / 4.24 / 6.12 / 8 for c = 1..32
    (windows seen), 64 fresh sequences alone take c = 4 (195.8 commits in 10 ms, 19.6 a ms, against c = 8's 271.1 in
    15.12 ms). When 2,048 prompt rows fill the step whatever its windows, each window row displaces a prompt row
    (50 µs in that regime): c = 1 adds 3.2 ms for 64 commits (20.0 a ms), c = 4 12.8 ms for 195.8 (15.3 a ms), so
    c = 1; 4 sequences go from c = 32 (the flat regime) to c = 1. The per-step overhead is the prompts' then: a
    learnt 100 ms a step changes nothing there."""
    s = sizer()
    s.observe(32, [8] * 64)
    for m, got in ((1, [1] * 64), (2, [1, 2] * 32), (4, [3] * 64), (8, [4] * 64), (16, [6] * 64)):
        s.observe(m, got, 32)
    assert [round(s.estimator(c), 4) for c in (1, 2, 4, 8, 16, 32)] == [1.0, 1.5294, 3.0588, 4.2353, 6.1176, 8.0]
    assert s.choose(fresh(64)) == 4 and s.choose(fresh(4)) == 32
    assert s.choose(fresh(64), prompts=2048) == 1 and s.choose(fresh(4), prompts=2048) == 1
    s.overhead.add(64, 0.1)
    assert s.overhead(64) == pytest.approx(0.1) and s.choose(fresh(64), prompts=2048) == 1


def test_the_core_tells_the_sizer_when_ready_prompts_overflow_the_step():
    """Protects what the core passes as `prompts`: 4 sequences decoding under a budget of 64 rows, nothing to carry;
    a ready 100-token prompt is more than the 60 rows the smallest windows leave, so the step is full of prompt rows
    (64); a 20-token prompt fits beside any window (0)."""
    w = build_worker(0, COLOCATED, 1, 256, "vllm", SchedulerConfig(dllm_block_length=32, max_num_batched_tokens=64),
                     t_pre=lambda h, n: 0.01)
    told: list[int] = []
    real = w.chunker.plan
    w.chunker.plan = lambda seqs, room=None, prompts=0: (told.append(prompts), real(seqs, room, prompts))[1]
    for i in range(4):
        w.begin_round(f"s{i}")
        w.submit(PrefillTask(f"s{i}", 0, 0, 32, 0.0, output_tokens=100, decode_worker=0, worker=0), 0.0)
    t = 0.0
    while len(w.running) < 4 or any(s.kv_pending or s.kv_prompt for s in w.running):
        plan = w.schedule(t)
        w.on_step_done(plan, StepResult(1.0, {s.session_id: 0 for s in plan.decode}), t + 1.0)
        t += 1.0
    for sid, n, want in (("p", 100, 64), ("q", 20, 0)):
        told.clear()
        w.begin_round(sid)
        w.submit(PrefillTask(sid, 0, 0, n, t, output_tokens=5, decode_worker=0, worker=0), t)
        plan = w.schedule(t)
        assert told == [want] and plan.prefill and plan.decode
        w.on_step_done(plan, StepResult(1.0, {s.session_id: 0 for s in plan.decode}), t + 1.0)
        t += 1.0
        while w.active:                          # the rest of the prompt
            plan = w.schedule(t)
            w.on_step_done(plan, StepResult(1.0, {s.session_id: 0 for s in plan.decode}), t + 1.0)
            t += 1.0


def test_elastic_runs_the_sequences_that_fit_when_windows_of_one_overflow_the_budget():
    """Protects the sit-out: 8 fresh sequences each carrying 10 rows (a prompt's leftover tokens) leave windows no
    room in a 64-row budget (80 carried). Each c is then run by the first sequences whose rows fit the 64: c = 1 by
    5 (55 rows, 5 commits), 2 by 5 (10), 4 by 4 (16), 8 by 3 (24), 16 by 2 (32), 32 by 1 (its rest window: 16); the
    step is flat (10 ms), so c = 16 for the first 2. With room for windows of 1 every sequence decodes, as before."""
    s = sizer()
    s.observe(32, [16] * 32)
    carrying = [SeqWindow(32, 0, 10)] * 8
    assert cn(s.plan(carrying, room=64 - 80)) == (16, 2)
    assert cn(s.plan(carrying, room=8)) == (1, 8) and cn(s.plan(fresh(8), room=64)) == (8, 8)
    assert s.choose(carrying, room=-16) == 16


def test_the_budget_caps_fixed_chunks_and_the_block_by_sitting_sequences_out():
    """Protects max_num_batched_tokens as a hard cap on every mode's step (vLLM's meaning; the memory profile sizes
    activations on it): 8 sequences carrying 10 rows each under a 64-row budget run chunk 4 for the first 4 (14 rows
    each: 56; a fifth would make 70) and the block (32 rows each, 2 with a completed block's 32 writes) for the first
    2, then 1 when the first has a block to write (64 rows alone), and a single sequence always runs, even over the
    budget. With room for all, every sequence decodes at its window, and without a budget (None) too."""
    carrying = [SeqWindow(32, 0, 10)] * 8
    assert cn(sizer("fixed", size=4).plan(carrying, room=64 - 80)) == (4, 4)
    assert cn(sizer("fixed", size=4).plan(carrying, room=64)) == (4, 8)
    assert cn(sizer("fixed", size=4).plan(carrying)) == (4, 8)
    block = sizer("block")
    assert cn(block.plan(fresh(8), room=64)) == (32, 2) and cn(block.plan(fresh(8), room=256)) == (32, 8)
    assert cn(block.plan([SeqWindow(32, 32)] + fresh(7), room=64)) == (32, 1)
    assert cn(block.plan([SeqWindow(32, 32)], room=16)) == (32, 1) and cn(block.plan(fresh(8))) == (32, 8)


@pytest.mark.parametrize("chunk", ["elastic", "8", "block"])
def test_sequences_that_sit_a_step_out_go_first_in_the_next(chunk):
    """Protects the core's side of the sit-out, in every mode: 4 sequences whose first-block windows carry their
    prompts' 16 leftover tokens (the block: its 32 positions) fill a 64-token budget, so only some decode in a step;
    the ones that sat out decode first in the next, every sequence decodes within two steps, and no step holds more
    rows than the budget unless one sequence alone does."""
    w = build_worker(0, COLOCATED, 1, 256, "vllm", SchedulerConfig(dllm_block_length=32, max_num_batched_tokens=64,
                                                                   dllm_chunk=chunk),
                     t_pre=lambda h, n: 0.01)
    w.chunker.observe(32, [16] * 32)
    for i in range(4):
        w.begin_round(f"s{i}")
        w.submit(PrefillTask(f"s{i}", 0, 0, 16, 0.0, output_tokens=100, decode_worker=0, worker=0), 0.0)
    t = 0.0
    while len(w.running) < 4:
        plan = w.schedule(t)
        w.on_step_done(plan, StepResult(1.0, {s.session_id: 0 for s in plan.decode}), t + 1.0)
        t += 1.0
    sat: set[str] = set()
    for _ in range(6):
        plan = w.schedule(t)
        ran = [s.session_id for s in plan.decode]
        rows = sum(s.query_tokens for s in plan.decode)
        assert len(ran) < 4 and (rows <= 64 or len(ran) == 1)
        assert sat <= set(ran) or set(ran) <= sat    # who sat out goes first
        sat = {f"s{i}" for i in range(4)} - set(ran)
        w.on_step_done(plan, StepResult(1.0, {sid: 0 for sid in ran}), t + 1.0)
        t += 1.0
    assert w.planner.sat_out and set(w.planner.sat_out) == sat


def test_elastic_adds_what_its_steps_took_beyond_t_to_their_price():
    """Protects the sizer's use of the measured step times: 256 fresh sequences with N(m) = min(16, m) take c = 4
    on T alone (1,024 rows in 25.36 ms: 40.4 a ms). Told that step took 100 ms more than T priced it, the sizer
    charges every step 100 ms more: c = 4 makes 1,024 in 125.36 ms (8.2 a ms), c = 8 2,048 in 176.56 ms (11.6),
    c = 16 4,096 in 279.0 ms (14.7; T = 10 + 15.36 + 0.05 x 3,072 ms), c = 32 4,096 in 483.8 ms (8.5): c = 16. A step
    that also ran a prefill chunk (None) teaches nothing; a stalled step counts at most 4 times its price; a fixed
    chunk prices nothing, so its steps teach nothing."""
    s = sizer()
    s.observe(32, [16] * 32)
    assert s.choose(fresh(256)) == 4
    s.observe_step(three_regimes(1024) + 0.1)
    assert s.overhead.coefs[0] == pytest.approx(0.1, abs=1e-12)
    assert s.choose(fresh(256)) == 16
    s.observe_step(None)
    assert s.overhead.coefs[0] == pytest.approx(0.1, abs=1e-12)
    stalled = sizer()                            # a 10 s stall counts as 4 prices (4 x 25.36 ms), not 10 s
    stalled.observe(32, [16] * 32)
    stalled.choose(fresh(256))
    stalled.observe_step(10.0)
    assert stalled.overhead.coefs[0] == pytest.approx(4 * three_regimes(1024), abs=1e-12)
    fixed = sizer("fixed", size=8)
    fixed.choose(fresh(4))
    fixed.observe_step(5.0)
    assert fixed.overhead.coefs == (0.0, 0.0)
    s.choose(fresh(4))
    with pytest.raises(ValueError, match="seconds"):
        s.observe_step(-1.0)


def test_fixed_and_block_chunks_do_not_depend_on_the_load():
    """Protects the baselines: a fixed chunk is min(N, B) whatever the batch; block diffusion is the block and marks
    itself as recomputing it."""
    assert sizer("fixed", size=8).choose(fresh(1)) == sizer("fixed", size=8).choose(fresh(200)) == 8
    assert sizer("fixed", block=4, size=8).choose(fresh(3, 4)) == 4
    assert sizer("block").choose(fresh(50)) == 32 and sizer("block").recomputes_block
    assert not sizer("fixed", size=32).recomputes_block


def test_parse_chunk_takes_elastic_block_or_a_positive_integer():
    """Protects the --dllm-chunk values: the three forms, and a one-line error otherwise."""
    assert parse_chunk("elastic") == ChunkSpec() and parse_chunk("BLOCK").mode is ChunkMode.BLOCK
    assert parse_chunk("16") == ChunkSpec(ChunkMode.FIXED, 16) and str(parse_chunk(16)) == "16"
    for bad in ("0", "-3", "fast", "", 2.5, True):
        with pytest.raises(ValueError):
            parse_chunk(bad)
    with pytest.raises(ValueError, match="dllm_block_length"):
        SchedulerConfig(dllm_block_length=1)


# ---------------------------------------------------------------------------- the worker core
def diffusion_worker(chunk: str, block: int = 8):
    return build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(dllm_block_length=block, dllm_chunk=chunk),
                        t_pre=lambda h, n: 0.01)


def test_windows_stay_inside_blocks_aligned_to_absolute_positions_and_the_first_commit_is_the_first_token():
    """Protects streaming windows in the core: a 6-token prompt leaves 2 positions of the first 8-block, so a fixed
    chunk of 4 gives a window of 2 masked positions (plus the 6 prompt tokens of that block, computed with it); from
    then on each window covers up to 4 masked positions, never past the block (8..16) or max_tokens, and carries
    besides them the K/V writes of the positions the previous step committed; the prefill emits no token: the first
    commit (2 tokens at 2 s) is the round's first token, the 8 others come with ITL gaps; 10 tokens in 6 steps."""
    w = diffusion_worker("4")
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 6, 0.0, output_tokens=10, decode_worker=0, worker=0), 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(1.0), 1.0)
    assert [type(e) for e in w.drain()] == []                 # no FirstToken at the prefill's end
    windows = []
    for k, commit in enumerate((2, 2, 1, 3, 1, 1)):
        plan = w.schedule(1.0 + k)
        (seq,) = plan.decode
        windows.append((seq.query_tokens, seq.commit_cap, seq.kv_pending))
        w.on_step_done(plan, StepResult(1.0, {"s": commit}), 2.0 + k)
        if k == 0:
            ev = w.drain()
            assert [type(e) for e in ev] == [FirstToken] and ev[0].time_s == 2.0
    # (positions computed, masked ones among them, decoded ones to write first)
    assert windows == [(2 + 6, 2, 0), (4 + 2, 4, 2), (4 + 2, 4, 2), (4 + 1, 4, 1), (2 + 3, 2, 3), (1 + 1, 1, 1)]
    done = [e for e in w.drain() if isinstance(e, RoundDone)]
    assert len(done) == 1 and done[0].output_tokens == 10 and done[0].itl_count == 1 + 2 + 1 + 3 + 1 + 1
    assert done[0].itl_sum == pytest.approx(5.0)              # gaps of 1 s after the first commit, 5 of them
    assert w.chunker.tokens_per_step() == pytest.approx(10 / 6)


def test_the_core_gives_each_sequence_the_window_the_sizer_planned_for_it():
    """Protects per-sequence windows in the core: the sizer plans windows of 4 and 1 for two sequences decoding at
    the start of their 8-blocks; each computes and may commit its own (its window, plus the K/V of its prompt's
    tokens in the block: none here), and each window is observed as its own size."""
    w = diffusion_worker("elastic")
    for sid in ("a", "b"):
        w.begin_round(sid)
        w.submit(PrefillTask(sid, 0, 0, 8, 0.0, output_tokens=16, decode_worker=0, worker=0), 0.0)
    plan = w.schedule(0.0)
    while not plan.decode:
        w.on_step_done(plan, StepResult(1.0), 1.0)
        plan = w.schedule(1.0)
    w.chunker.plan = lambda seqs, room=None, prompts=0: StepWindows(4, [4, 1])
    w.chunker.observe = lambda m, committed, left=None, tried=0: seen.append((m, committed, left, tried))
    seen: list = []
    plan = w.schedule(2.0)
    assert [(s.session_id, s.query_tokens, s.commit_cap) for s in plan.decode] == [("a", 4, 4), ("b", 1, 1)]
    w.on_step_done(plan, StepResult(1.0, {"a": 3, "b": 1}), 3.0)
    assert sorted(seen) == [(1, [1], 8, 0), (4, [3], 8, 0)]


def test_the_prompts_leftover_tokens_ride_with_every_window_of_their_block():
    """Protects the prompt's tail in streaming windows: a 3-token prompt leaves 5 masked positions of the first
    8-block; with a chunk of 2 every window of that block carries the 3 prompt tokens besides its masked positions
    and the K/V writes of the previous step's commits (the prompt tokens' K/V are rewritten each step, as the
    engine's BlockState does); once the block is complete (after D) the next block's windows carry none."""
    w = diffusion_worker("2")
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 3, 0.0, output_tokens=10, decode_worker=0, worker=0), 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(1.0), 1.0)
    windows, tried = [], []
    for k, commit in enumerate((2, 1, 1, 1, 1)):
        plan = w.schedule(1.0 + k)
        (seq,) = plan.decode
        windows.append((seq.query_tokens, seq.commit_cap, seq.kv_prompt))
        w.on_step_done(plan, StepResult(1.0, {"s": commit}), 2.0 + k)
        tried.append(seq.tried)
    # (positions computed: masked + writes + prompt tokens, masked ones, prompt tokens)
    assert windows == [(2 + 0 + 3, 2, 3), (2 + 2 + 3, 2, 3), (2 + 1 + 3, 2, 3), (1 + 1 + 3, 1, 3), (2 + 1, 2, 0)]
    # masked positions a window covered and left masked (tried): none, 1 of 2, the window covers it and 1 new one and
    # commits 1, the last one commits the block's last (a new block: none), 1 of 2 again
    assert tried == [0, 1, 1, 0, 1]
    # N_commit's evidence, keyed as the sizer prices it: full windows of 2 by the band of masked positions left (5,
    # then 3; the next block's first window is 2 of the 5 tokens left to decode, the first one's band again), and
    # the rest of the block by m (2 left; 1 left); each by how much of it an earlier window covered: the second
    # window left 1 of its 2 masked, so the third covers 1 tried position of 2 and the fourth its last one
    assert set(w.chunker.estimator._seen) == {("full", 2, 4, Tried.NONE), ("full", 2, 2, Tried.NONE),
                                              ("rest", 2, Tried.SOME), ("rest", 1, Tried.ALL)}


def test_a_diffusion_prefill_is_charged_for_its_whole_blocks_only():
    """Protects the step cost of a diffusion prefill: the prompt's last, partial block is computed with the windows
    of that block (streaming: Seq.kv_prompt; block mode: the whole block), as the engine runs it, so the prefill
    chunk charges only whole blocks: a 20-token prompt with blocks of 8 costs 16 prefill tokens, its 4 leftover
    tokens ride with the first window (4 + its window of 4); a 6-token prompt costs no prefill compute at all."""
    for prompt, charged, first_window in ((20, 16, 4 + 4), (6, 0, 6 + 2)):
        w = diffusion_worker("4")
        w.begin_round("s")
        w.submit(PrefillTask("s", 0, 0, prompt, 0.0, output_tokens=10, decode_worker=0, worker=0), 0.0)
        plan = w.schedule(0.0)
        assert [(t.session_id, n) for t, n in plan.prefill] == [("s", prompt)]
        assert (plan.shape.prefill_tokens, plan.shape.num_prefill) == (charged, 1 if charged else 0)
        w.on_step_done(plan, StepResult(1.0), 1.0)
        (seq,) = w.schedule(1.0).decode
        assert seq.query_tokens == first_window


def test_block_diffusion_recomputes_the_whole_block_and_commits_within_it():
    """Protects the BD-B baseline: every step has B = 8 query rows over the block's start, and may commit only the
    positions left in the block (2 after a 6-token prompt)."""
    w = diffusion_worker("block")
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 6, 0.0, output_tokens=4, decode_worker=0, worker=0), 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(1.0), 1.0)
    plan = w.schedule(1.0)
    (seq,) = plan.decode
    assert (seq.query_tokens, seq.commit_cap) == (8, 2)
    assert plan.shape.num_decode == 8 and plan.shape.decode_ctx_tokens == 8 * (0 + 8)
    with pytest.raises(ValueError, match="may commit 2"):
        w.on_step_done(plan, StepResult(1.0, {"s": 3}), 2.0)


# ---------------------------------------------------------------------------- simulated commits
def test_the_stretch_model_reproduces_table_2_at_block_32_with_diminishing_returns():
    """Protects the simulator's commit distribution: for every Table 2 cell, min(L, 32) has the reported mean and
    standard deviation (to 1e-6), and the expected commits grow with c with diminishing returns: each added position
    gains less than the one before, so token utilisation N(c)/c falls."""
    for model, rows in OPTIMUS_TABLE2.items():
        for dataset, (mean, std) in rows.items():
            m = commit_model(model, dataset)
            assert m.mean(32) == pytest.approx(mean, abs=1e-6) and m.std(32) == pytest.approx(std, abs=1e-6)
            per_position = [(m.mean(2 * c) - m.mean(c)) / c for c in (1, 2, 4, 8, 16)]   # marginal gain
            assert all(g > 0 for g in per_position) and all(a >= b for a, b in zip(per_position, per_position[1:]))
            utilisation = [m.mean(c) / c for c in (1, 2, 4, 8, 16, 32)]
            assert all(a > b for a, b in zip(utilisation, utilisation[1:]))
    with pytest.raises(ValueError, match="valid names"):
        commit_model("qwen3-8b", "sharegpt")
    with pytest.raises(ValueError):
        StretchModel.fit(0.5, 1.0)


def test_sampled_commits_match_the_model_per_window():
    """Protects StretchCommit: 40,000 draws (400 sessions x 100 steps) at a window of 32 average Table 2's SDAR-8B
    ShareGPT 5.29 within 3%, and at a window of 4 the model's E[min(L, 4)]."""
    model = commit_model("sdar-8b", "sharegpt")
    draw = StretchCommit(model, seed=1)
    for c in (32, 4):
        got = [min(c, draw.stretch(f"s{i}")) for i in range(400) for _ in range(100)]
        assert sum(got) / len(got) == pytest.approx(model.mean(c), rel=0.03)


def test_sampled_commits_are_common_random_numbers_across_policies():
    """Protects the simulator's comparison of policies: a session's π and its k-th stretch depend only on the seed
    and its id, not on which other sessions stepped in between (another policy's schedule), so policies compared on
    the same sessions differ by their choices alone; another seed draws other stretches."""
    model = commit_model("sdar-8b", "sharegpt")
    alone = StretchCommit(model, seed=5)
    a = [alone.stretch("a") for _ in range(200)]
    mixed = StretchCommit(model, seed=5)
    b = []
    for k in range(200):
        for other in range(k % 3):
            mixed.stretch(f"x{other}")
        b.append(mixed.stretch("a"))
    assert a == b and alone.session_pi("a") == mixed.session_pi("a")
    assert StretchCommit(model, seed=6).session_pi("a") != alone.session_pi("a")


def test_a_diffusion_simulation_beats_plain_block_diffusion_under_load_and_reports_its_steps():
    """Protects the simulator end to end: SDAR-8B on one A100 at 6 sessions/s of 300-token answers; every session
    completes; elastic chunking's mean TPOT is below plain block diffusion's (which recomputes 32 rows per sequence
    every step); the run reports tokens per step and the windows chosen."""
    rng = random.Random(0)
    t, sessions = 0.0, []
    for i in range(150):
        t += rng.expovariate(6.0)
        sessions.append(Session(f"s{i}", t, [Round(200, 300)], SLO(10.0, 0.05)))
    out = {}
    for chunk in ("elastic", "block"):
        cfg = SimConfig("sdar-8b", "a100-80g", 1, "C:tp1x1", "vllm", dllm_block_length=32, dllm_chunk=chunk)
        res = simulate([Session(s.session_id, s.arrival_s, list(s.rounds), s.slo) for s in sessions], cfg)
        assert all(r.completed for r in res.records)
        tpot = [(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for rec in res.records for r in rec.rounds]
        out[chunk] = (sum(tpot) / len(tpot), dllm_summary(res.workers))
    assert out["elastic"][0] < out["block"][0]
    assert out["block"][1]["dllm_chunk_mean"] == 32
    assert 1 < out["elastic"][1]["dllm_tokens_per_step"] < 32
    with pytest.raises(ConfigError, match="valid names"):
        simulate(sessions[:1], SimConfig("qwen3-8b", "a100-80g", 1, "C:tp1x1", "vllm", dllm_block_length=32))
    assert math.isfinite(out["elastic"][0])


def test_the_core_times_steps_of_windows_alone_for_the_sizer():
    """Protects the core's report of step times to the elastic sizer (WorkerCore.on_step_done): a step of windows
    alone passes its elapsed_s, a step that also ran a prefill chunk passes None (its time is not the windows'), and
    a prefill alone passes nothing."""
    w = build_worker(0, COLOCATED, 1, 256, "vllm", SchedulerConfig(dllm_block_length=32, max_num_batched_tokens=64),
                     t_pre=lambda h, n: 0.01)
    seen: list[float | None] = []
    real = w.chunker.observe_step
    w.chunker.observe_step = lambda s: (seen.append(s), real(s))[1]
    w.begin_round("a")
    w.submit(PrefillTask("a", 0, 0, 40, 0.0, output_tokens=100, decode_worker=0, worker=0), 0.0)
    plan = w.schedule(0.0)                       # the prompt's whole block; its 8 leftover tokens ride with the
    assert plan.prefill and not plan.decode      # first window
    w.on_step_done(plan, StepResult(0.5, {}), 0.5)
    plan = w.schedule(0.5)
    assert plan.decode and not plan.prefill
    w.on_step_done(plan, StepResult(0.25, {"a": 0}), 0.75)
    w.begin_round("b")
    w.submit(PrefillTask("b", 0, 0, 100, 0.75, output_tokens=5, decode_worker=0, worker=0), 0.75)
    plan = w.schedule(0.75)
    assert plan.decode and plan.prefill
    w.on_step_done(plan, StepResult(0.125, {"a": 0}), 0.875)
    assert seen == [0.25, None]


def test_elastic_windows_stay_within_the_budget_and_leave_waiting_prefills_their_share():
    """Protects the token budget of a diffusion step: 4 sequences decoding with a budget of 64 tokens and flat step
    times (so the largest useful window wins: N(c) = min(16, c)) take windows of 16 (4 x 16 = 64) when nothing
    waits; with a 100-token prefill waiting, half the budget stays with it: windows of 8 (4 x 8 = 32) and a 32-token
    prefill chunk in the same step. With dllm_prefill_share 0 (the paper's c*) the windows take the whole budget."""
    def worker(share):
        w = build_worker(0, COLOCATED, 1, 256, "vllm",
                         SchedulerConfig(dllm_block_length=32, max_num_batched_tokens=64, dllm_prefill_share=share),
                         t_pre=lambda h, n: 0.01)
        w.chunker.observe(32, [16] * 32)         # warm-up done: stretches of 16
        for i in range(4):
            w.begin_round(f"s{i}")
            w.submit(PrefillTask(f"s{i}", 0, 0, 32, 0.0, output_tokens=100, decode_worker=0, worker=0), 0.0)
        t = 0.0
        while len(w.running) < 4:                # prefill the prompts (a whole block each: no leftover tokens)
            plan = w.schedule(t)
            w.on_step_done(plan, StepResult(1.0, {s.session_id: 0 for s in plan.decode}), t + 1.0)
            t += 1.0
        plan = w.schedule(t)                     # a step that commits nothing: no K/V left to write
        w.on_step_done(plan, StepResult(1.0, {s.session_id: 0 for s in plan.decode}), t + 1.0)
        w.chunker.estimator = CommitEstimator(32)   # what the set-up's steps taught it, forgotten
        w.chunker.observe(32, [16] * 32)
        return w, t + 1.0

    w, t = worker(0.5)
    plan = w.schedule(t)
    assert [s.query_tokens for s in plan.decode] == [16] * 4 and not plan.prefill
    w.on_step_done(plan, StepResult(1.0, {f"s{i}": 0 for i in range(4)}), t + 1.0)
    w.begin_round("p")
    w.submit(PrefillTask("p", 0, 0, 100, t + 1.0, output_tokens=5, decode_worker=0, worker=0), t + 1.0)
    plan = w.schedule(t + 1.0)
    assert [s.query_tokens for s in plan.decode] == [8] * 4 and [n for _, n in plan.prefill] == [32]
    assert plan.shape.num_decode + plan.shape.prefill_tokens == 64
    w, t = worker(0.0)
    w.begin_round("p")
    w.submit(PrefillTask("p", 0, 0, 100, t, output_tokens=5, decode_worker=0, worker=0), t)
    plan = w.schedule(t)
    assert [s.query_tokens for s in plan.decode] == [16] * 4 and not plan.prefill
    with pytest.raises(ValueError, match="dllm_prefill_share"):
        SchedulerConfig(dllm_prefill_share=1.0)
