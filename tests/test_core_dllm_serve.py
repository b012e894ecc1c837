"""dLLM-Serve in the worker core: Refresh/Reuse phases of LLaDA-style
requests and their admission under the query-token budget (tandem/policy/dllm_serve, tandem/core/worker.py), driven
by hand. Every expected number is worked out in the comments; the property test runs random arrivals, lengths,
phase policies and commits and checks the budget and the two starvation bounds stated in
tandem/policy/dllm_serve/admission.py at every step."""
from __future__ import annotations

import random

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.types import COLOCATED, DECODE, FirstToken, PrefillTask, RoundDone, SessionFailed, StepResult
from tandem.core.worker import WorkerConfig, WorkerCore
from tandem.policy.dllm_serve import (
    Admission, AdmissionMode, Candidate, DllmServe, Phase, PhaseSchedule, PhaseSpec, RefreshSpan,
)


def worker(mode="phase", budget=40, blocks=64, block=4, seqs=8, **kw):
    """A co-located LLaDA-style worker: KV blocks of 4 positions (64 of them: 256 positions), diffusion blocks of 4."""
    sched = SchedulerConfig(block_size=4, max_num_batched_tokens=budget, max_num_seqs=seqs, dllm_block_length=block,
                            dllm_admission=mode, **kw)
    return build_worker(0, COLOCATED, 1, blocks, "vllm", sched)


def submit(w, sid, prompt, gen, now=0.0):
    w.begin_round(sid)
    w.submit(PrefillTask(sid, 0, 0, prompt, now, output_tokens=gen, decode_worker=0, worker=0), now)


def run(w, commits=1, t0=0.0, limit=1000):
    """Step until idle, each request committing `commits` (capped by its window); per step (batch tokens,
    [(session, phase, query tokens, writes KV)]) and the events."""
    steps, events, t = [], [], t0
    while (plan := w.schedule(t)) is not None and len(steps) < limit:
        e = plan.entries()
        steps.append((sum(x.query_tokens for x in e),
                      [(x.session_id, w.phase_of(x.session_id).value, x.query_tokens, x.writes_kv) for x in e]))
        w.on_step_done(plan, StepResult(1.0, {s.session_id: min(commits, s.commit_cap) for s in plan.decode}), t + 1)
        events += w.drain()
        t += 1
    return steps, events


# ------------------------------------------------------------------------------------------------ hand-built

def test_a_request_dropping_to_reuse_lets_a_queued_one_in_and_a_refresh_collision_waits_one_step():
    """Protects §4.4's accounting and the deferral rule. Budget 40, blocks of 4, delay_step 0 (one Refresh at each
    block's start, then Reuse), a Refresh = the whole canvas (prompt + 8): a and b (prompt 12: 20 tokens) and c
    (prompt 16: 24). Step 0: a and b refresh (40), c does not fit. Step 1: a and b reuse their block (4 + 4), so c's
    Refresh (24) is admitted: 32. Steps 2-3: three Reuses, 12. Step 4: a and b start block 2 (20 + 20 = 40) and c's
    Reuse (4) would make 44: c waits one step (the only deferred request: it runs at step 5, first in line). Step 5:
    12. Step 6: c starts its block 2 (24) beside two Reuses: 32. a and b end at step 7 (8 tokens, one a step), c at
    step 9 (it lost a step at 4)."""
    w = worker(dllm_delay_step=0)
    for sid, p in (("a", 12), ("b", 12), ("c", 16)):
        submit(w, sid, p, 8)
    steps, events = run(w)
    assert [n for n, _ in steps] == [40, 32, 12, 12, 40, 12, 32, 12, 4, 4]
    assert steps[0][1] == [("a", "refresh", 20, True), ("b", "refresh", 20, True)]
    assert steps[1][1] == [("a", "reuse", 4, False), ("b", "reuse", 4, False), ("c", "refresh", 24, True)]
    assert steps[4][1] == [("a", "refresh", 20, True), ("b", "refresh", 20, True)]
    assert steps[5][1][0] == ("c", "reuse", 4, False)        # the deferred request goes first
    assert steps[6][1][2] == ("c", "refresh", 24, True)
    done = {e.session_id: e.time_s for e in events if isinstance(e, RoundDone)}
    assert done == {"a": 8.0, "b": 8.0, "c": 10.0}
    first = {e.session_id: e.time_s for e in events if isinstance(e, FirstToken)}
    assert first == {"a": 1.0, "b": 1.0, "c": 2.0}            # a diffusion round's first commit is its first token
    st = w.dllm_stats()
    assert (st["deferrals"], st["max_deferred"], st["admitted"], st["admitted_while_running"]) == (1, 1, 3, 1)
    assert st["seq_steps"] == {"full": 0, "refresh": 6, "reuse": 18} and st["max_tokens"] == 40
    assert w.blocks.num_free == 64                             # every buffer back in the pool


def test_the_static_baseline_runs_the_largest_batch_of_peaks_that_fits_to_completion():
    """Protects the Fast-dLLM-like baseline: each request reserves its Refresh peak (20, 20, 24) for its whole life;
    the first batch is {a, b} (40 of 40), c waits until both finish although their Reuse steps use 8 of 40 tokens;
    then c alone. 16 steps against the phase policy's 10. `reserve` (request-level continuous) is the same here:
    a and b end together."""
    for mode in ("static", "reserve"):
        w = worker(mode, dllm_delay_step=0)
        for sid, p in (("a", 12), ("b", 12), ("c", 16)):
            submit(w, sid, p, 8)
        steps, events = run(w)
        assert [n for n, _ in steps] == [40, 8, 8, 8, 40, 8, 8, 8, 24, 4, 4, 4, 24, 4, 4, 4]
        assert w.dllm_stats()["deferrals"] == 0


def test_reserve_admits_into_a_finished_requests_reservation_and_static_waits_for_the_batch():
    """a (prompt 12, 4 tokens: one block) and b (prompt 12, 8 tokens) fill the budget (16 + 20 = 36 of 40); c (peak
    20) waits. a ends at step 3: `reserve` admits c at step 4 beside b (20 + 20 reserved), `static` only after b
    ends (step 8)."""
    def first_step(mode):
        w = worker(mode, dllm_delay_step=0)
        submit(w, "a", 12, 4)
        submit(w, "b", 12, 8)
        submit(w, "c", 12, 8)
        steps, _ = run(w)
        return next(i for i, (_, rows) in enumerate(steps) if any(r[0] == "c" for r in rows))
    assert first_step("reserve") == 4
    assert first_step("static") == 8
    assert first_step("phase") == 1                  # a and b reuse at step 1: 4 + 4 + c's 20 = 28 <= 40


def test_the_static_batch_size_is_the_largest_that_fits_the_token_budget_the_pool_and_max_num_seqs():
    """Uniform requests of peak 30 (prompt 22 + 8): a budget of 100 takes 3 a batch (90), the next 2 after them.
    A pool of 20 blocks (80 positions, ρ = 1: a buffer is 30 positions = 8 blocks) takes 2; max_num_seqs 1 takes 1."""
    def batches(**kw):
        w = worker("static", budget=100, dllm_delay_step=0, **kw)
        for i in range(5):
            submit(w, f"r{i}", 22, 8)
        steps, _ = run(w)
        sizes, last = [], None
        for _, rows in steps:
            ids = tuple(r[0] for r in rows)
            if ids != last:
                sizes.append(len(ids))
                last = ids
        return sizes
    assert batches() == [3, 2]
    assert batches(blocks=20) == [2, 2, 1]
    assert batches(seqs=1) == [1, 1, 1, 1, 1]


def test_delay_step_interval_and_span_set_each_steps_phase_and_query_tokens():
    """delay_step 1 (dLLM-Serve's default): each block starts with a full-attention step that writes no cache (FULL),
    then the Refresh that writes it, then Reuse. refresh_interval 2 adds a Refresh 2 steps after the cache write.
    span `prefix`: the Refresh is prompt + generated + the active block (12 + 4 = 16 in block 1, 20 in block 2)."""
    w = worker(budget=100, dllm_delay_step=1)
    submit(w, "a", 12, 8)
    steps, _ = run(w)
    assert [r[0][1:] for _, r in steps] == [("full", 20, False), ("refresh", 20, True), ("reuse", 4, False),
                                           ("reuse", 4, False)] * 2
    w = worker(budget=100, block=8, dllm_delay_step=0, dllm_refresh_interval=2)
    submit(w, "a", 12, 8)
    steps, _ = run(w)
    assert [r[0][1] for _, r in steps] == ["refresh", "reuse", "refresh", "reuse", "refresh", "reuse", "refresh",
                                           "reuse"]
    w = worker(budget=100, dllm_delay_step=0, dllm_refresh_span="prefix")
    submit(w, "a", 12, 8)
    steps, _ = run(w)
    assert [r[0][2] for _, r in steps] == [16, 4, 4, 4, 20, 4, 4, 4]


def test_a_window_commits_within_its_block_and_a_multi_token_commit_ends_the_block_early():
    """Blocks of 4, commits of 3: block 1 takes 2 steps (3, then the 1 left), so block 2 starts (a Refresh) at step 2;
    the executor may commit no more than what is left of the block."""
    w = worker(budget=100, dllm_delay_step=0)
    submit(w, "a", 12, 8)
    steps, _ = run(w, commits=3)
    assert [r[0][1] for _, r in steps] == ["refresh", "reuse", "refresh", "reuse"]
    w = worker(budget=100, dllm_delay_step=0)
    submit(w, "a", 12, 8)
    plan = w.schedule(0.0)
    assert plan.decode[0].commit_cap == 4
    with pytest.raises(ValueError, match="may commit 4"):
        w.on_step_done(plan, StepResult(1.0, {"a": 5}), 1.0)


def test_kv_buffers_are_fixed_at_retention_times_length_and_freed_at_round_end():
    """ρ = 0.5: a request of 12 + 8 keeps ⌈0.5 x 20⌉ = 10 positions (3 blocks of 4) for its life; a Reuse reads
    ⌊0.5 x 16⌋ = 8 retained keys besides its block of 4 (the roofline shape: 4 rows over 12 keys). The round's end
    frees the buffer; the next round recomputes the whole conversation (no history is kept). The worker tells the
    coordinator it holds sequences of up to 256 / 0.5 = 512 positions (its pool is 256)."""
    w = worker(budget=100, dllm_delay_step=0, dllm_kv_retention=0.5)
    assert w.capacity_tokens == 512
    submit(w, "a", 12, 8)
    plan = w.schedule(0.0)
    assert w.blocks.num_free == 64 - 3
    assert plan.shape.prefill_tokens == 20 and plan.shape.prefill_attn_pairs == 400 and plan.shape.num_prefill == 4
    w.on_step_done(plan, StepResult(1.0, {"a": 1}), 1.0)
    plan = w.schedule(1.0)
    assert plan.shape.num_decode == 4 and plan.shape.decode_ctx_tokens == 4 * (8 + 4)
    run(w, t0=1.0)
    assert w.blocks.num_free == 64
    assert w.begin_round("a") == 0                           # nothing resident: the next round's prompt is whole


def test_requests_that_can_never_run_fail_with_the_reason():
    """A Refresh of 12 + 30 = 42 tokens exceeds a budget of 40: it could never be packed. A buffer of 300 positions
    exceeds a pool of 256."""
    w = worker()
    submit(w, "big", 12, 30)
    submit(w, "huge", 10, 290)
    w2 = worker(budget=400)
    submit(w2, "huge", 10, 290)
    fails = [e for e in w.drain() + w2.drain() if isinstance(e, SessionFailed)]
    assert [f.session_id for f in fails] == ["big", "huge", "huge"]
    assert "max_num_batched_tokens 40" in fails[0].reason and "capacity" in fails[2].reason
    assert w.schedule(0.0) is None and not w.queue


def test_options_are_validated_and_a_core_never_runs_without_the_policy_it_was_asked_for():
    for bad, match in ((dict(dllm_admission="fifo", dllm_block_length=4), "dllm_admission is one of"),
                       (dict(dllm_admission="phase"), "needs a block-diffusion model"),
                       (dict(dllm_block_length=4, dllm_delay_step=-1), "delay_step"),
                       (dict(dllm_block_length=4, dllm_refresh_interval=1.5), "refresh_interval"),
                       (dict(dllm_block_length=4, dllm_kv_retention=0), "retention"),
                       (dict(dllm_block_length=4, dllm_refresh_span="half"), "half")):
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(**bad)
    assert SchedulerConfig(dllm_block_length=4, dllm_admission=" Phase ").dllm_admission == "phase"
    with pytest.raises(ValueError, match="co-located"):
        build_worker(0, DECODE, 1, 64, "ampd", SchedulerConfig(dllm_block_length=4, dllm_admission="phase"))
    cfg = WorkerConfig(role=COLOCATED, tp=1, num_blocks=64, dllm_block=4, dllm_admission="phase")
    with pytest.raises(ValueError, match="needs its DllmServe"):
        WorkerCore(0, cfg)
    static = DllmServe(PhaseSpec(4), Admission("static", 40, 8))
    with pytest.raises(ValueError, match="needs its DllmServe"):
        WorkerCore(0, cfg, dllm=static)
    plain = WorkerConfig(role=COLOCATED, tp=1, num_blocks=64, dllm_block=4)
    with pytest.raises(ValueError, match="no dllm_admission"):
        WorkerCore(0, plain, dllm=static)
    w = worker("reserve")
    assert w.dllm.mode is AdmissionMode.RESERVE and w.chunker is None


def test_the_optimus_window_mode_is_unchanged_when_the_mode_is_off():
    """Without dllm_admission a diffusion worker still sizes Optimus windows (a ChunkSizer, no phases)."""
    w = build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(dllm_block_length=4, dllm_chunk="block"))
    assert w.chunker is not None and w.dllm is None
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 6, 0.0, output_tokens=4, decode_worker=0, worker=0), 0.0)
    plan = w.schedule(0.0)
    assert [t.session_id for t, _ in plan.prefill] == ["s"] and not plan.decode


def test_the_admission_policy_alone():
    """The sans-I/O decision: running requests least recently run first, the deferred ones keep their place; a
    deferral stops admission; the queue is FCFS and read only up to the first refusal."""
    adm = Admission("phase", 100, 4)
    run_ = [Candidate("x", 60, 60, last_run=5, order=1), Candidate("y", 50, 50, last_run=4, order=2),
            Candidate("z", 10, 60, last_run=5, order=3)]
    read = []

    def queue():
        for k in ("q1", "q2"):
            read.append(k)
            yield Candidate(k, 10, 10, kv=4)
    sel = adm.select(run_, queue(), free_kv=100)
    assert (sel.run, sel.deferred, sel.admit, sel.tokens) == (["y", "z"], ["x"], [], 60)
    assert read == []
    sel = adm.select(run_[1:], queue(), free_kv=4)
    assert (sel.run, sel.admit, sel.tokens, read) == (["y", "z"], ["q1"], 70, ["q1", "q2"])


def test_phase_schedule_arithmetic():
    ph = PhaseSchedule(PhaseSpec(32, delay_step=1, span=RefreshSpan.FULL, retention=0.5))
    st = ph.new(100, 70, order=1, step=0)
    assert st.kv_tokens == 85 and ph.peak_tokens(100, 70) == 170 and ph.first_tokens(100, 70) == 170
    assert [ph.phase(st), ph.demand(st), ph.left(st)] == [Phase.FULL, 170, 32]
    ph.advance(st, 31)
    assert [ph.phase(st), ph.left(st), ph.reuse_context(st)] == [Phase.REFRESH, 1, 69]
    ph.advance(st, 1)
    ph.advance(st, 32)
    assert (st.generated, ph.block_len(st), ph.demand(st), ph.phase(st)) == (64, 6, 170, Phase.FULL)
    prefix = PhaseSchedule(PhaseSpec(32, delay_step=0, span="prefix"))
    st = prefix.new(100, 70, order=1, step=0)
    assert prefix.first_tokens(100, 70) == prefix.demand(st) == 132
    prefix.advance(st, 32)
    prefix.advance(st, 32)
    assert prefix.demand(st) == 170 and prefix.reuse_context(st) == 164


# ------------------------------------------------------------------------------------------------ property

@pytest.mark.parametrize("seed", range(8))
def test_property_budget_and_starvation_bounds_under_random_arrivals_lengths_and_phases(seed):
    """The budget invariant and starvation bounds. Random knobs (budget, block, delay_step, refresh interval, span, retention, pool, max_num_seqs),
    random arrivals (0-3 a step) and lengths, random commits (1 to the window) for a few hundred steps, then drained.
    Every step: the packed query tokens never exceed max_num_batched_tokens (all three modes); phase mode: a request
    deferred at step t runs by step t + m_t (m_t requests deferred at t), and the head of the queue is admitted
    within R steps of becoming the head (R the tokens the running requests still had to generate then). At the end
    every request has finished and every KV block is back."""
    rng = random.Random(seed)
    for mode in ("phase", "phase", "static", "reserve"):
        budget = rng.choice([64, 200, 512, 1000])
        block = rng.choice([2, 4, 8, 32])
        w = worker(mode, budget=budget, blocks=rng.choice([budget // 4 + 1, 500, 4000]), block=block,
                   seqs=rng.choice([3, 16, 256]), dllm_delay_step=rng.choice([0, 1, 2]),
                   dllm_refresh_interval=rng.choice([0, 0, 3]), dllm_refresh_span=rng.choice(["full", "prefix"]),
                   dllm_kv_retention=rng.choice([1.0, 0.5, 0.25]))
        pmax = rng.choice([16, 64, 300])          # prompt lengths: small ones make many Reuses and Refresh collisions
        sessions, n, t = set(), 0, 0
        deadline: dict[str, int] = {}                # running request -> step it must run by (phase mode)
        head, head_bound = None, 0
        max_wait = 0
        while t < 50_000:
            if t < 300:
                for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 5])):
                    gen = rng.randint(1, min(3 * block + 3, budget - 1))
                    prompt = rng.randint(1, max(1, min(budget - gen, pmax)))
                    submit(w, f"r{n}", prompt, gen, float(t))
                    sessions.add(f"r{n}")
                    n += 1
            before = {s.session_id for s in w.running}
            remaining = sum(s.to_decode for s in w.running)
            if w.queue and w.queue[0].session_id != head:
                head, head_bound = w.queue[0].session_id, t + remaining
            plan = w.schedule(float(t))
            if plan is None:
                assert not w.queue and not w.running
                if t >= 300:
                    break
                t += 1
                continue
            ids = [s.session_id for s in plan.decode]
            assert len(ids) == len(set(ids))
            assert sum(e.query_tokens for e in plan.entries()) <= budget
            assert plan.shape.prefill_tokens + plan.shape.num_decode <= budget
            if mode == "phase":
                deferred = before - set(ids)
                for sid in ids:
                    if sid in deadline:
                        assert t <= deadline.pop(sid), f"{sid} ran after its deferral bound"
                for sid in deferred:
                    deadline[sid] = min(deadline.get(sid, t + len(deferred)), t + len(deferred))
                if head is not None and head in ids:
                    assert t <= head_bound, f"queue head {head} admitted at {t}, bound {head_bound}"
                    head = None
            else:
                assert before <= set(ids)            # request-level modes never defer a running request
            max_wait = max(max_wait, w.dllm_stats()["max_deferred"])
            w.on_step_done(plan, StepResult(1.0, {s.session_id: rng.randint(1, s.commit_cap) for s in plan.decode}),
                           float(t + 1))
            for e in w.drain():
                if isinstance(e, RoundDone):
                    sessions.discard(e.session_id)
                    w.release(e.session_id)
                assert not isinstance(e, SessionFailed)
            t += 1
        assert not sessions, f"{mode}: unfinished {sorted(sessions)[:5]}"
        assert w.blocks.num_free == w.cfg.num_blocks
        assert w.dllm_stats()["max_deferred"] <= max(0, w.cfg.max_num_seqs - 1)
