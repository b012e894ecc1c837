"""WorkerCore scheduling, driven by hand: token budget, max_num_seqs, watermark, preemption order, idle KV
(LRU, Continuum TTL), prefill-role events and prefix-cache reuse. Every expected number is worked out in the
comments from the configuration of the test (block_size, num_blocks, budget)."""
from __future__ import annotations

import math


from tandem.core.types import (
    COLOCATED, DECODE, PREFILL, FetchHistory, PrefillDone, PrefillTask, RoundDone, SeqState, StepResult,
)
from tandem.core.worker import WorkerConfig, WorkerCore


def make(role=COLOCATED, **kw) -> WorkerCore:
    return WorkerCore(0, WorkerConfig(role=role, tp=1, **kw))


def start(core: WorkerCore, sid: str, l_incr: int, out: int, now: float = 0.0, l_hist: int = 0,
          **kw) -> PrefillTask:
    """A new round of `sid` on a decode / co-located core (begin_round first, as the coordinator does)."""
    core.begin_round(sid)
    t = PrefillTask(sid, 0, l_hist, l_incr, now, output_tokens=out, **kw)
    core.submit(t, now)
    return t


def step(core: WorkerCore, now: float):
    """One iteration: schedule at `now`, finish one second later; returns (plan, events)."""
    plan = core.schedule(now)
    assert plan is not None, "expected a step"
    core.on_step_done(plan, StepResult(1.0), now + 1.0)
    return plan, core.drain()


def chunks(plan) -> list[tuple[str, int]]:
    return [(t.session_id, n) for t, n in plan.prefill]


def names(plan) -> list[str]:
    return [s.session_id for s in plan.decode]


def kinds(events) -> list[tuple[str, str]]:
    return [(type(e).__name__, e.session_id if hasattr(e, "session_id") else e.task.session_id) for e in events]


# ------------------------------------------------------------------------------------------------ token budget

def test_prefill_chunks_never_exceed_the_token_budget_and_a_long_prompt_is_split_exactly():
    core = make(PREFILL, num_blocks=64, block_size=16, max_num_batched_tokens=100)
    a, b = PrefillTask("a", 0, 0, 250, 0.0), PrefillTask("b", 0, 0, 70, 0.0)
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    seen, events = [], []
    now = 0.0
    while (plan := core.schedule(now)) is not None:
        assert sum(n for _, n in plan.prefill) <= 100
        assert plan.shape.prefill_tokens == sum(n for _, n in plan.prefill)
        if not seen:
            assert core.queue == [b]               # a's 250 pending tokens fill the budget: b waits
        seen.append(chunks(plan))
        now += 1.0
        core.on_step_done(plan, StepResult(1.0), now)
        events.append(kinds(core.drain()))
    # 250 = 100 + 100 + 50; b is admitted once a's pending 50 < 100 and takes the other 50, then its last 20
    assert seen == [[("a", 100)], [("a", 100)], [("a", 50), ("b", 50)], [("b", 20)]]
    assert events == [[], [], [("PrefillDone", "a")], [("PrefillDone", "b")]]   # no history: no FetchHistory
    # a prefill worker keeps the new KV until it is delivered: ceil(250/16) + ceil(70/16) = 16 + 5 blocks
    assert core.blocks.num_free == 64 - 21
    core.on_delivered(a, now)
    core.on_delivered(b, now)
    assert core.blocks.num_free == 64 and not core.has_work()


def test_colocated_decodes_take_the_budget_first_and_prefill_chunks_get_the_rest():
    core = make(COLOCATED, num_blocks=64, block_size=16, max_num_batched_tokens=64, mix_decode_with_prefill=True)
    for sid in ("s0", "s1", "s2"):
        start(core, sid, 4, out=10)
    plan, ev = step(core, 0.0)
    assert chunks(plan) == [("s0", 4), ("s1", 4), ("s2", 4)]
    assert kinds(ev) == [("FirstToken", "s0"), ("FirstToken", "s1"), ("FirstToken", "s2")]
    start(core, "long", 200, out=2, now=1.0)
    sizes = []
    for k in range(4):
        plan, ev = step(core, 1.0 + k)
        assert names(plan) == ["s0", "s1", "s2"]   # three decodes ride along every chunk ...
        assert plan.shape.num_decode == 3
        sizes += [n for _, n in plan.prefill]
        assert 3 + sum(n for _, n in plan.prefill) <= 64
    assert sizes == [61, 61, 61, 17]               # ... leaving 64 - 3 = 61 per step: 200 = 3 * 61 + 17
    assert kinds(ev) == [("FirstToken", "long")]
    assert [s.num_tokens for s in core.running] == [8, 8, 8, 200]   # 4 prompt + 4 decoded; 200 prompt


def test_decode_worker_without_mixing_runs_ready_prefills_in_steps_of_their_own():
    core = make(DECODE, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    start(core, "s0", 4, out=5)
    step(core, 0.0)
    start(core, "s1", 100, out=2, now=1.0)
    plan, _ = step(core, 1.0)
    assert (chunks(plan), names(plan)) == ([("s1", 64)], [])    # prefill first, the whole budget, no decode
    plan, ev = step(core, 2.0)
    assert (chunks(plan), names(plan)) == ([("s1", 36)], [])
    assert kinds(ev) == [("FirstToken", "s1")]
    plan, _ = step(core, 3.0)
    assert (chunks(plan), names(plan)) == ([], ["s0", "s1"])
    s0 = core.seqs["s0"]
    assert s0.num_tokens == 4 + 1 and s0.itl_max == 3.0        # s0 stalled while s1 prefilled: one gap of 3 s


# ------------------------------------------------------------------------------------------------ max_num_seqs

def test_max_num_seqs_caps_admitted_plus_running_sequences():
    core = make(COLOCATED, num_blocks=64, block_size=16, max_num_seqs=2, mix_decode_with_prefill=True)
    for sid in ("a", "b", "c"):
        start(core, sid, 4, out=3)
    plans = []
    now = 0.0
    while (plan := core.schedule(now)) is not None:
        assert len(plan.prefill) + len(plan.decode) <= 2
        assert len(core.active) + len(core.running) <= 2
        plans.append((chunks(plan), names(plan)))
        now += 1.0
        core.on_step_done(plan, StepResult(1.0), now)
        core.drain()
    assert plans == [
        ([("a", 4), ("b", 4)], []),                # c waits although the budget and the pool have room
        ([], ["a", "b"]),
        ([], ["a", "b"]),                          # a and b end their 3-token rounds here
        ([("c", 4)], []),
        ([], ["c"]),
        ([], ["c"]),
    ]


# ------------------------------------------------------------------------------------------------ watermark

def test_an_admitted_prefill_leaves_the_watermark_blocks_free():
    core = make(COLOCATED, num_blocks=100, block_size=16, watermark=0.1, max_num_batched_tokens=4096)
    assert core.kv.watermark_blocks == 10             # int(0.1 * 100)
    a = start(core, "a", 50 * 16, out=2)          # 50 blocks + 10 free <= 100 free: admitted, 50 left
    b = start(core, "b", 40 * 16, out=2)          # 40 blocks + 10 free <= 50 free: admitted, exactly 10 left
    c = start(core, "c", 16, out=2)               # 1 block + 10 > 10 free: refused, though 10 blocks are free
    plan = core.schedule(0.0)
    assert core.active == [a, b] and core.queue == [c]
    assert core.blocks.num_free == 10
    assert chunks(plan) == [("a", 800), ("b", 640)]


def test_the_watermark_is_waived_for_a_context_that_needs_the_rest_of_the_pool():
    kept = make(COLOCATED, num_blocks=100, block_size=16, watermark=0.1, max_num_batched_tokens=4096)
    start(kept, "a", 90 * 16, out=2)               # 90 + 10 <= 100: the watermark applies and is met
    kept.schedule(0.0)
    assert kept.blocks.num_free == 10
    waived = make(COLOCATED, num_blocks=100, block_size=16, watermark=0.1, max_num_batched_tokens=4096)
    t = start(waived, "a", 91 * 16, out=2)         # 91 + 10 > 100: it could never be met, so it is waived
    waived.schedule(0.0)
    assert waived.active == [t] and not waived.queue
    assert waived.blocks.num_free == 9


# ------------------------------------------------------------------------------------------------ preemption

def test_growth_preempts_admitted_prefills_first_latest_admitted_first():
    # 6 blocks of 4 tokens; a and b (one block each) are decoding, p1 and p2 (two blocks each) are admitted
    core = make(COLOCATED, num_blocks=6, block_size=4, watermark=0.0, max_num_batched_tokens=16,
                mix_decode_with_prefill=True)
    start(core, "a", 4, out=10)
    start(core, "b", 4, out=10)
    step(core, 0.0)
    a, b = core.seqs["a"], core.seqs["b"]
    assert (a.order, b.order, a.cap, core.blocks.num_free) == (1, 2, 4, 4)
    p1 = start(core, "p1", 8, out=2, now=1.0)
    p2 = start(core, "p2", 8, out=2, now=1.0)
    plan = core.schedule(1.0)
    # admission took the last 4 blocks for p1 and p2; then a's 5th token needs a block: p2 (the latest
    # admitted prefill) gives back its two, not p1 and not b, the decoding sequence admitted after a
    assert names(plan) == ["a", "b"] and chunks(plan) == [("p1", 8)]
    assert core.active == [p1] and core.queue == [p2]
    assert (p2.done, p2.start_s, p2.l_hist, p2.l_incr) == (0, None, 0, 8)
    seq2 = core.seqs["p2"]
    assert (seq2.num_tokens, seq2.preemptions, core.blocks.held(seq2)) == (0, 1, 0)
    assert (a.cap, b.cap, a.preemptions, b.preemptions, core.seqs["p1"].preemptions) == (8, 8, 0, 0, 0)
    assert core.blocks.num_free == 0


def _three_decoding():
    """6 blocks of 4 tokens, all held by a (6 tokens), b (6) and c (8), decoding 3-token rounds; d (12 tokens)
    is queued for lack of memory. c, the latest admitted, needs a third block for its next token."""
    core = make(COLOCATED, num_blocks=6, block_size=4, watermark=0.0, max_num_batched_tokens=64,
                mix_decode_with_prefill=True)
    for sid, n in (("a", 6), ("b", 6), ("c", 8)):
        start(core, sid, n, out=3)
    plan, ev = step(core, 0.0)
    assert chunks(plan) == [("a", 6), ("b", 6), ("c", 8)]
    assert [(s.session_id, s.order, s.num_tokens, s.cap) for s in core.running] == [
        ("a", 1, 6, 8), ("b", 2, 6, 8), ("c", 3, 8, 8)]
    assert core.blocks.num_free == 0
    d = start(core, "d", 12, out=3, now=1.0)
    return core, d


def test_growth_preempts_the_latest_admitted_running_sequence_but_never_the_one_growing():
    core, d = _three_decoding()
    plan = core.schedule(1.0)
    b = core.seqs["b"]
    assert names(plan) == ["a", "c"]               # b (order 2) went for c (order 3, growing), a (order 1) kept
    assert b.state is SeqState.PREFILL and b.num_tokens == 0 and b.preemptions == 1
    assert core.seqs["c"].cap == 12
    assert core.blocks.num_free == 1               # b's 2 blocks freed, one taken by c
    rec = core.queue[0]                            # b re-prefills its 6 tokens before d, which came first
    assert (rec.session_id, rec.recompute, rec.l_hist, rec.l_incr) == ("b", True, 0, 6)
    assert core.queue[1:] == [d]


def test_a_preempted_sequence_recomputes_from_the_queue_head_and_its_round_completes():
    core, d = _three_decoding()
    events = {}
    now, plans = 1.0, []
    while (plan := core.schedule(now)) is not None:
        plans.append((chunks(plan), names(plan)))
        now += 1.0
        core.on_step_done(plan, StepResult(1.0), now)
        events[now] = kinds(core.drain())
    assert plans == [
        ([], ["a", "c"]),                          # t=1: b preempted for c
        ([], ["a", "c"]),                          # t=2: b's 2 blocks do not fit the 1 free: it waits
        ([("b", 6), ("d", 12)], []),               # t=3: a and c idle; a (LRU) evicted for b, then c for d
        ([], ["b", "d"]),
        ([], ["b", "d"]),
    ]
    assert events == {2.0: [], 3.0: [("RoundDone", "a"), ("RoundDone", "c")], 4.0: [("FirstToken", "d")],
                      5.0: [], 6.0: [("RoundDone", "b"), ("RoundDone", "d")]}   # no second FirstToken for b
    assert core.seqs["a"].state is SeqState.EVICTED and core.seqs["c"].state is SeqState.EVICTED
    assert core.seqs["b"].num_tokens == 8 and core.seqs["d"].num_tokens == 14
    assert core.blocks.num_free == 0               # b: 2 blocks, d: ceil(14/4) = 4


def test_round_done_reports_the_preemptions_and_the_stall_in_the_itl():
    core, d = _three_decoding()
    done = {}
    now = 1.0
    while (plan := core.schedule(now)) is not None:
        now += 1.0
        core.on_step_done(plan, StepResult(1.0), now)
        done.update({e.session_id: e for e in core.drain() if isinstance(e, RoundDone)})
    rd = done["b"]
    # b's first token came at t=1; preempted, it decoded its 2nd token only at t=5 and its 3rd at t=6
    assert (rd.output_tokens, rd.preemptions, rd.itl_count, rd.itl_sum, rd.itl_max, rd.time_s) == (3, 1, 2, 5.0,
                                                                                                   4.0, 6.0)
    assert [(done[s].output_tokens, done[s].preemptions) for s in "acd"] == [(3, 0), (3, 0), (3, 0)]
    assert core.seqs["b"].preemptions == 0         # reset for the next round once reported


# ------------------------------------------------------------------------------------------------ idle KV

def test_idle_kv_stays_resident_after_a_round_and_is_evicted_least_recently_used_first():
    core = make(COLOCATED, num_blocks=5, block_size=4, watermark=0.0, mix_decode_with_prefill=True)
    start(core, "x", 4, out=1)
    _, ev = step(core, 0.0)
    assert kinds(ev) == [("FirstToken", "x"), ("RoundDone", "x")]
    x = core.seqs["x"]
    assert x.state is SeqState.IDLE and x.num_tokens == 4 and core.blocks.num_free == 4   # KV kept
    start(core, "y", 4, out=1, now=1.0)
    step(core, 1.0)
    assert list(core.kv.idle) == ["x", "y"] and core.blocks.num_free == 3
    assert core.begin_round("x") == 4             # x's next round finds its history resident ...
    core.submit(PrefillTask("x", 1, 4, 4, 2.0, output_tokens=1), 2.0)
    plan, _ = step(core, 2.0)
    assert chunks(plan) == [("x", 4)] and plan.shape.prefill_kv_read_tokens == 4   # ... and computes only 4
    assert list(core.kv.idle) == ["y", "x"] and x.num_tokens == 8 and core.blocks.num_free == 2
    start(core, "z", 12, out=1, now=3.0)           # 3 blocks, 2 free: y, now the least recently used, goes
    plan = core.schedule(3.0)
    assert chunks(plan) == [("z", 12)]
    y = core.seqs["y"]
    assert y.state is SeqState.EVICTED and y.num_tokens == 0 and core.blocks.held(y) == 0
    assert x.state is SeqState.IDLE and x.num_tokens == 8 and core.blocks.held(x) == 2
    assert core.blocks.num_free == 0
    assert core.begin_round("y") == 0              # y's next round recomputes its history


def test_a_pinned_idle_session_is_not_evicted_before_its_ttl_and_wake_s_says_when():
    core = make(COLOCATED, num_blocks=4, block_size=4, watermark=0.0, retain_s=10.0,
                mix_decode_with_prefill=True)
    start(core, "x", 8, out=1)
    step(core, 0.0)                                # x's round ends at t=1: pinned until 11
    start(core, "y", 4, out=1, now=5.0)
    step(core, 5.0)                                # y's round ends at t=6: pinned until 16
    assert (core.seqs["x"].retain_until, core.seqs["y"].retain_until) == (11.0, 16.0)
    assert core.blocks.num_free == 1
    z = start(core, "z", 8, out=1, now=8.0)        # needs 2 blocks
    assert core.schedule(8.0) is None and core.queue == [z]
    assert core.wake_s == 11.0                     # the earliest pin to expire
    assert core.seqs["x"].state is SeqState.IDLE and core.blocks.num_free == 1
    assert core.schedule(10.5) is None
    core.wake_s = math.inf                         # the shell's wake-up, as the simulator does it
    plan = core.schedule(12.0)
    assert chunks(plan) == [("z", 8)]
    assert core.seqs["x"].state is SeqState.EVICTED   # expired: evicted
    assert core.seqs["y"].state is SeqState.IDLE and core.seqs["y"].num_tokens == 4   # still pinned: kept
    assert core.blocks.num_free == 1               # x's 2 blocks + the free one, less z's 2


# ------------------------------------------------------------------------------------------------ prefill role

def test_a_prefill_worker_fetches_the_history_first_and_reports_prefill_done():
    core = make(PREFILL, num_blocks=16, block_size=16)
    t = PrefillTask("s", 1, 40, 30, 0.0, local=False, decode_worker=3)
    core.submit(t, 0.0)
    assert core.schedule(0.0) is None              # admitted, but the history is not here yet
    assert core.drain() == [FetchHistory(t, 40)]
    assert core.active == [t] and core.blocks.num_free == 16 - 5   # history + new: ceil(70/16) blocks
    core.on_history_fetched(t, 0.5)
    plan = core.schedule(0.5)
    assert plan.prefill == [(t, 30)] and plan.shape.prefill_kv_read_tokens == 40
    core.on_step_done(plan, StepResult(1.0), 1.5)
    assert core.drain() == [PrefillDone(t, 0, 1.5)]
    assert core.blocks.num_free == 11              # held until delivered to the decode worker
    core.on_delivered(t, 2.0)
    assert core.blocks.num_free == 16 and not core.has_work()


# ------------------------------------------------------------------------------------------------ prefix cache

def test_a_second_session_with_the_same_block_hashes_computes_only_the_uncached_tail():
    core = make(COLOCATED, num_blocks=16, block_size=4, mix_decode_with_prefill=True)
    hashes = (101, 102)                            # 10 tokens: two full blocks of 4, then 2 tokens
    x = start(core, "x", 10, out=1, block_hashes=hashes)
    plan, _ = step(core, 0.0)
    assert chunks(plan) == [("x", 10)] and x.cached == 0
    assert core.blocks.num_free == 13              # x stays resident (idle): 3 blocks
    y = start(core, "y", 10, out=1, now=1.0, block_hashes=hashes)
    plan, ev = step(core, 1.0)
    assert chunks(plan) == [("y", 2)]               # only the tail after x's two cached blocks
    assert (y.cached, y.l_hist, y.l_incr) == (8, 8, 2)
    assert plan.shape.prefill_kv_read_tokens == 8
    assert kinds(ev) == [("FirstToken", "y"), ("RoundDone", "y")]
    assert core.seqs["y"].num_tokens == 10
    assert core.blocks.num_free == 12              # y shares x's two blocks and takes one of its own


# ------------------------------------------------------------------------------------------------ bugs found here, fixed

def test_cancelling_a_task_whose_last_chunk_is_in_flight_ends_it_quietly():
    core = make(PREFILL, num_blocks=8, block_size=4)
    t = PrefillTask("s", 0, 0, 6, 0.0, local=False)
    core.submit(t, 0.0)
    plan = core.schedule(0.0)
    assert plan.prefill == [(t, 6)]
    core.cancel(t)                                 # the coordinator no longer wants it
    core.on_step_done(plan, StepResult(1.0), 1.0)
    assert core.drain() == []                      # no PrefillDone for a cancelled task
    assert core.blocks.num_free == 8 and not core.has_work()


def test_releasing_a_decoding_session_mid_step_leaves_no_context_behind():
    core = make(COLOCATED, num_blocks=8, block_size=4, mix_decode_with_prefill=True)
    start(core, "a", 4, out=5)
    start(core, "b", 4, out=5)
    step(core, 0.0)
    plan = core.schedule(1.0)
    assert plan.shape.decode_ctx_tokens == 4 + 4 + 2
    core.release("a")
    core.on_step_done(plan, StepResult(1.0), 2.0)
    plan = core.schedule(2.0)
    assert names(plan) == ["b"]
    assert plan.shape.decode_ctx_tokens == 5 + 1   # b's 5 resident tokens + the one it writes


# ------------------------------------------------------------------------------------------------ decode shortcut

def _seq_state(core: WorkerCore) -> list[tuple]:
    return [(s.session_id, s.num_tokens, s.to_decode, s.itl_sum, s.itl_count, s.itl_max, s.last_token_s, s.state)
            for s in core.seqs.values()]


def _core_state(core: WorkerCore, now: float) -> tuple:
    return (_seq_state(core), core.steps, core.busy_s, core.ctx_tokens, core.itl.mean(now), core.itl.count(now),
            core.utilization(now), core.blocks.num_free, [s.session_id for s in core.running])


def test_the_decode_shortcut_applies_a_step_and_plans_the_next_exactly_as_on_step_done_then_schedule():
    """decode_step_done (the simulator's path for plain decode steps) against on_step_done + schedule on a twin core,
    step by step through block growth (16-token blocks), rounds ending at different steps and a prefill arriving
    mid-run: every state equal after every step, the shortcut declining exactly when the general path has work to
    do (a round ended, a queued prefill, a block to grow)."""
    from tandem.core.worker import decode_step_done, steady_decoder
    twins = [make(DECODE, num_blocks=64, block_size=16, max_num_batched_tokens=256) for _ in range(2)]
    fast, slow = twins
    for core in twins:
        start(core, "a", 30, 40)                       # 30 prompt tokens: the 33rd token needs a third block
        start(core, "b", 10, 7)
    assert steady_decoder(fast)
    now = 0.0
    plans = [core.schedule(now) for core in twins]   # the prefills
    for core, plan in zip(twins, plans):
        core.on_step_done(plan, StepResult(0.5), now + 0.5)
        core.drain()
    now += 0.5
    plans = [core.schedule(now) for core in twins]
    took = declined = 0
    for i in range(45):
        assert names(plans[0]) == names(plans[1]) and plans[0].shape == plans[1].shape
        if not plans[1].decode and not plans[1].prefill:
            break
        end = now + 0.25 + 0.01 * i                    # steps of growing length: distinct gaps in the ITL sums
        if i == 20:
            for core in twins:
                start(core, "c", 5, 3, now=now + 0.1)  # a new round queues while the step runs
        slow.on_step_done(plans[1], StepResult(end - now), end)
        ev_slow = slow.drain()
        nxt_slow = slow.schedule(end)
        ev_slow += slow.drain()
        if plans[0].prefill:
            fast.on_step_done(plans[0], StepResult(end - now), end)
            nxt = None
        else:
            nxt = decode_step_done(fast, plans[0], end - now, end)
        ev_fast = fast.drain()
        if nxt is None:
            declined += 1
            nxt = fast.schedule(end)
            ev_fast += fast.drain()
        else:
            took += 1
        assert kinds(ev_fast) == kinds(ev_slow)
        now = end
        assert _core_state(fast, now) == _core_state(slow, now)
        plans = [nxt, nxt_slow]
        if nxt_slow is None:
            assert nxt is None
            break
    # 40 steps after the prefills. The general path runs at 8: 'a' (30 prompt tokens) grows into its 3rd, 4th and
    # 5th 16-token block (3), 'b' ends, 'c' queues, c's prefill step (a mixed step never takes the shortcut), 'c'
    # ends, 'a' ends; the other 32 take the shortcut
    assert (took, declined, i) == (32, 8, 39)
    assert fast.seqs["a"].to_decode == 0 and fast.seqs["b"].to_decode == 0
