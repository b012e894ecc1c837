"""The host KV tier of a worker core (tandem/core/host_tier.py, core/tiering.py, policy/kv_tiers.py), on hand-built
situations: a session idle past its TTL is offloaded, not dropped, when the host tier has room; an offloaded
context is prefetched before its expected return; a full host tier evicts by its rule (LRU or latest expected
return); a block in flight is never read (a round waits for its copy, the coordinator keeps its prefill home, a run
being written is not matched, source blocks are not reused); a failed copy falls back to recompute and the session
goes on. Plus the rules' decisions, cache-aware binding from KV events and the simulator end to end.

Numbers: blocks of 16 tokens, a pool of 64 blocks, a host tier of 1 GiB at 32 MiB a block (32 blocks); a copy
costs 1 ms a token, a prefill 10 ms a token (reloading is 10x cheaper than recomputing)."""
from __future__ import annotations

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_worker
from tandem.core.host_tier import BlockRemoved, BlockStored, CopyKind, HostTier, Medium, RunState
from tandem.core.types import COLOCATED, PrefillTask, RoundDone, SeqState, SessionFailed, StepResult
from tandem.policy.binding import CacheAwareBinder
from tandem.policy.kv_tiers import (
    EvictionKind, IdleAction, IdleContext, InferCeptRule, ToolAwareRule, TTLRule, ToolTimeEstimator,
)
from tandem.policy.presets import get_policy

BLOCK_BYTES = 1 << 25


def link_s(tokens: int) -> float:
    return tokens * 1e-3


def t_pre(hist: int, new: int) -> float:
    return new * 1e-2


def worker(policy: str, blocks: int = 64, host_gib: float = 1.0):
    sched = SchedulerConfig(block_size=16, kv_offloading_size=host_gib, watermark=0.0)
    return build_worker(0, COLOCATED, 1, blocks, get_policy(policy), sched, t_pre, kv_block_bytes=BLOCK_BYTES,
                        host_link_s=link_s)


def start(w, sid: str, new: int, out: int, now: float, k: int = 0) -> PrefillTask:
    hist = w.begin_round(sid, now=now)
    t = PrefillTask(sid, k, hist, new, now, output_tokens=out, decode_worker=0)
    w.submit(t, now)
    return t


def run(w, now: float, dt: float = 0.01) -> tuple[float, list]:
    """Every step until nothing runs; the time after and the events."""
    events = []
    while (plan := w.schedule(now)) is not None:
        now += dt
        w.on_step_done(plan, StepResult(dt), now)
        events += w.drain()
    return now, events


def idle_round(policy: str, **kw):
    """Session a: a 100-token prompt, 2 output tokens (101 positions in 7 blocks), idle from t=0.02."""
    w = worker(policy, **kw)
    start(w, "a", 100, 2, 0.0)
    now, events = run(w, 0.0)
    assert [type(e) for e in events if isinstance(e, RoundDone)] == [RoundDone] and now == pytest.approx(0.02)
    seq = w.seqs["a"]
    assert (seq.state, seq.num_tokens, w.blocks.held(seq)) == (SeqState.IDLE, 101, 7)
    return w, seq, now


def test_ttl_expiry_offloads_instead_of_dropping_when_the_host_has_room():
    """Continuum's TTL with a host tier: pinned 30 s, then a copy of all 7 blocks goes out; the GPU copy stays
    until memory is needed, and then the session is OFFLOADED (its 101 positions in the host tier), not EVICTED."""
    w, seq, now = idle_round("continuum-tiered")
    tier = w.kv.tier
    w.schedule(now)
    assert seq.retain_until == pytest.approx(now + 30.0) and tier.take_copies() == []
    w.schedule(now + 30.5)                                   # the pin ran out
    (c,) = tier.take_copies()
    assert (c.kind, c.tokens, len(c.blocks)) == (CopyKind.OFFLOAD, 101, 7)
    assert c.est_s == pytest.approx(0.101)
    tier.on_copy_done(c.id, now + 30.7)
    assert seq.host_tokens == 101 and tier.host.used == 7
    assert w.kv.reserve(object(), 64 * 16, now + 31.0, preempt=False)   # the whole pool: a must evict
    assert seq.state is SeqState.OFFLOADED and seq.num_tokens == 0 and tier.offloaded == {"a": seq}


def test_ttl_expiry_without_host_room_keeps_the_kv_evictable():
    """The same with a host tier of 4 blocks (too small for 7): nothing is copied; eviction drops it."""
    w, seq, now = idle_round("continuum-tiered", host_gib=4 / 32)
    w.schedule(now + 30.5)
    assert w.kv.tier.take_copies() == [] and seq.retain_until == 0.0
    assert w.kv.reserve(object(), 64 * 16, now + 31.0, preempt=False)
    assert seq.state is SeqState.EVICTED


def test_offloaded_context_is_prefetched_before_its_expected_return():
    """Tool-aware: a 100 s tool (the coordinator's hint) is long: offload with a prefetch due at
    0.02 + 100 - 1 (lead) - 0.101 (copy); the GPU copy expires; at the due time the context comes back and is
    pinned; the round then finds its 101 positions resident (a prefetch hit, no load, no wait)."""
    w, seq, now = idle_round("continuum-tool")
    tier = w.kv.tier
    w.expect_return("a", 100.0, now)
    w.schedule(now)
    (out,) = tier.take_copies()
    assert out.kind is CopyKind.OFFLOAD and tier.prefetch_at["a"] == pytest.approx(100.02 - 1.0 - 0.101)
    tier.on_copy_done(out.id, now + 0.2)
    w.expire("a")                                            # the session TTL: the GPU copy goes
    assert seq.state is SeqState.OFFLOADED and w.blocks.held(seq) == 0
    assert w.wake_s == pytest.approx(98.919)
    w.schedule(98.0)
    assert tier.take_copies() == []                          # not due yet
    w.schedule(98.919)
    (back,) = tier.take_copies()
    assert (back.kind, back.tokens, len(back.blocks)) == (CopyKind.PREFETCH, 101, 7)
    tier.on_copy_done(back.id, 99.02)
    assert seq.state is SeqState.IDLE and seq.retain_until == pytest.approx(100.02 + 10.0)
    t = start(w, "a", 20, 2, 100.02, k=1)
    assert t.l_hist == 101 and tier.stats.prefetch_hits == 1 and tier.stats.loads == 0


def test_a_tool_time_told_as_the_round_starts_is_kept_for_the_rounds_end():
    """The coordinator tells the tool time with the round (a live client's tool_s, the trace's): given while the
    round runs, it waits for the round's end and then plans the idle KV exactly as a hint given at that end (the
    same offload and prefetch time as above); a session that ends first takes its hint with it."""
    w = worker("continuum-tool")
    tier = w.kv.tier
    start(w, "a", 100, 2, 0.0)
    w.expect_return("a", 100.0, 0.0)                          # round under way: kept, not applied
    assert tier.hints == {"a": 100.0} and w.seqs["a"].expect_s != 100.02
    now, _ = run(w, 0.0)
    seq = w.seqs["a"]
    assert tier.hints == {} and seq.expect_s == pytest.approx(100.02)
    w.schedule(now)
    (out,) = tier.take_copies()
    assert out.kind is CopyKind.OFFLOAD and tier.prefetch_at["a"] == pytest.approx(100.02 - 1.0 - 0.101)
    w.expect_return("b", 5.0, now)                            # a session not here yet: kept for its round
    assert tier.hints == {"b": 5.0}
    start(w, "b", 16, 1, now)
    w.release("b")
    assert tier.hints == {}


@pytest.mark.parametrize("rule, victim", [(EvictionKind.LRU, "a"), (EvictionKind.RETURN_TIME, "b")])
def test_a_full_host_tier_evicts_by_its_rule(rule, victim):
    """10 blocks: a (4 blocks, written at t=0, back at t=50) and b (4, written at t=1, back at t=100); 4 more
    evict a under LRU (least recently used) and b under the return-time rule (latest expected return). A run
    being written is never evicted: with c still writing, d finds no room."""
    tier = HostTier(10, rule)
    a = tier.put_session("a", 4, 0.0, 50.0)
    tier.landed(a, 0.0)
    b = tier.put_session("b", 4, 1.0, 100.0)
    tier.landed(b, 1.0)
    assert tier.put_session("c", 4, 2.0, 70.0) is not None
    assert set(tier.session_runs) == {"a", "b", "c"} - {victim} and tier.used == 8 and tier.evictions == 1
    survivor = ({"a", "b"} - {victim}).pop()
    tier.read(tier.session_runs[survivor], 3.0)              # being read: not evictable either
    assert tier.put_session("d", 4, 3.0, 80.0) is None and not tier.room(4, 3.0)


def test_prefix_runs_are_matched_only_once_written():
    """Content-addressed prefix blocks: a run being written is not matched; once written its hashes are, and
    evicting it reports them removed (for BlockRemoved events)."""
    tier = HostTier(4)
    run = tier.put_prefix((11, 12, 13), 0.0)
    assert tier.match((11, 12, 13, 14)) == 0
    tier.landed(run, 0.1)
    assert tier.match((11, 12, 13, 14)) == 3 and tier.match((12,)) == 1
    assert tier.put_prefix((21, 22), 1.0) is not None        # evicts the prefix run (LRU)
    assert tier.take_removed() == [11, 12, 13] and tier.match((11,)) == 0


def test_a_round_waits_for_its_load_and_reads_nothing_in_flight():
    """An OFFLOADED session's round: loading 101 positions (0.101 s) beats recomputing them (1.01 s), so the
    round's history is 101 and its task waits: no step admits it and the coordinator's view says loading (its
    prefill stays home) until the copy lands; then its 20 new tokens run."""
    from tandem.core.state import InProcessState
    w, seq, now = idle_round("continuum-tiered")
    tier = w.kv.tier
    w.schedule(now + 30.5)
    (c,) = tier.take_copies()
    free_before = w.blocks.num_free
    w.expire("a")                                            # the GPU copy goes while the copy out is in flight
    assert w.blocks.num_free == free_before and seq.state is SeqState.IDLE   # its blocks are held until it lands
    tier.on_copy_done(c.id, now + 30.7)
    assert seq.state is SeqState.OFFLOADED and w.blocks.num_free == 64
    t = start(w, "a", 20, 2, 40.0, k=1)
    (load,) = tier.take_copies()
    assert (load.kind, load.tokens, t.l_hist, t.l_incr) == (CopyKind.LOAD, 101, 101, 20)
    assert InProcessState([w], None, [0]).kv_loading(0, "a")
    assert w.schedule(40.0) is None and w.active == []
    tier.on_copy_done(load.id, 40.101)
    plan = w.schedule(40.101)
    assert [(x.session_id, n) for x, n in plan.prefill] == [("a", 20)]


def test_a_failed_load_falls_back_to_recompute_and_the_session_goes_on():
    """The load fails: its blocks are freed, the queued task recomputes the whole context (101 + 20 tokens) and
    the round completes; no SessionFailed."""
    w, seq, now = idle_round("continuum-tiered")
    tier = w.kv.tier
    w.schedule(now + 30.5)
    (c,) = tier.take_copies()
    tier.on_copy_done(c.id, now + 30.7)
    w.expire("a")
    t = start(w, "a", 20, 2, 40.0, k=1)
    (load,) = tier.take_copies()
    tier.on_copy_failed(load.id, 40.05)
    assert (t.l_hist, t.l_incr, w.blocks.held(seq), tier.stats.failed, tier.stats.recomputes) == (0, 121, 0, 1, 1)
    _, events = run(w, 40.05)
    assert [e.session_id for e in events if isinstance(e, RoundDone)] == ["a"]
    assert not any(isinstance(e, SessionFailed) for e in events) and seq.num_tokens == 122


def test_a_failed_offload_leaves_the_gpu_copy():
    """A copy out fails: the host run is forgotten, the session stays resident and idle on the GPU."""
    w, seq, now = idle_round("continuum-tiered")
    tier = w.kv.tier
    w.schedule(now + 30.5)
    (c,) = tier.take_copies()
    tier.on_copy_failed(c.id, now + 30.6)
    assert tier.host.used == 0 and seq.state is SeqState.IDLE and w.blocks.held(seq) == 7 and seq.copy_out is None


def test_prefix_blocks_are_written_through_and_published():
    """A prompt with block hashes: its 6 full blocks are registered on the GPU (BlockStored GPU), written through
    to the host (a WRITE copy of 6 blocks, BlockStored CPU once it lands)."""
    w = worker("hicache")
    hashes = tuple(range(100, 106))
    w.begin_round("p", hashes, 100, now=0.0)
    t = PrefillTask("p", 0, 0, 100, 0.0, output_tokens=1, decode_worker=0, block_hashes=hashes)
    w.submit(t, 0.0)
    _, events = run(w, 0.0)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.hashes, e.medium) for e in stored] == [(hashes, Medium.GPU)]
    (wr,) = [c for c in w.kv.tier.take_copies() if c.kind is CopyKind.WRITE]
    assert len(wr.blocks) == 6 and wr.run.state is RunState.WRITING
    w.kv.tier.on_copy_done(wr.id, 1.0)
    assert [(e.hashes, e.medium) for e in w.drain() if isinstance(e, BlockStored)] == [(hashes, Medium.CPU)]


def test_idle_rules_decide_as_documented():
    """TTL pins then offloads; InferCept picks the least memory-time waste; tool-aware keeps short gaps, offloads
    long ones with a prefetch, drops what is cheaper to recompute when the host is full."""
    def ctx(gap, reload=0.1, recompute=1.0, room=True, running=1000, expired=False, usage=0.5):
        return IdleContext(0.0, 1000, gap, reload, recompute, usage, running, room, expired)
    ttl = TTLRule(30.0)
    assert ttl.decide(ctx(5)).pin_until == 30.0 and ttl.decide(ctx(5, expired=True)).action is IdleAction.OFFLOAD
    ic = InferCeptRule()
    assert ic.decide(ctx(0.1)).action is IdleAction.KEEP          # 0.1 x 1000 < 0.1 x 2000
    d = ic.decide(ctx(10))                                         # swap 0.1 x 2000 < 10 x 1000, 1.0 x 2000
    assert (d.action, d.free_gpu) == (IdleAction.OFFLOAD, True)
    assert ic.decide(ctx(10, room=False)).action is IdleAction.DROP
    ta = ToolAwareRule()
    assert ta.decide(ctx(0.3)).action is IdleAction.KEEP and ta.decide(ctx(0.3)).pin_until == 0.3
    assert ta.decide(ctx(0.3, usage=0.99)).action is IdleAction.OFFLOAD
    d = ta.decide(ctx(60))
    assert (d.action, d.prefetch) == (IdleAction.OFFLOAD, True)
    assert ta.decide(ctx(60, room=False, recompute=0.05)).action is IdleAction.DROP
    assert ta.decide(ctx(60, room=False)).action is IdleAction.KEEP


def test_tool_time_estimator_learns_per_session_in_log_space():
    """Prior 10 s; after gaps of 1 s and 100 s a session expects their log mean weighted 0.7 / 0.3."""
    est = ToolTimeEstimator()
    assert est.expected("s") == pytest.approx(10.0)
    est.observe("s", 1.0)
    est.observe("s", 100.0)
    assert est.expected("s") == pytest.approx(100.0 ** 0.3)
    assert est.expected("other") == pytest.approx(100.0 ** 0.3)   # the worker's mean, same two gaps


def test_cache_aware_binding_follows_the_kv_events_across_tiers():
    """Worker 0 holds the prompt's 4 blocks on its host tier, worker 1 two on its GPU: 0 scores 3.2, 1 scores 2.
    Once worker 0 evicts them (BlockRemoved CPU) it is worker 1, unless worker 1 is 60% committed (2 - 4 x 0.6 =
    -0.4 < worker 0's 0); a prompt held nowhere goes by least committed KV."""
    from tandem.core.coordinator import Coordinator
    from tandem.policy.routing import LocalRouter

    class View:
        def home_workers(self):
            return [0, 1]

        def capacity(self, worker):
            return 100
    b = CacheAwareBinder()
    coord = Coordinator(View(), LocalRouter(), b)
    h = (1, 2, 3, 4)
    assert coord.on_event(BlockStored(0, h, Medium.CPU), 0.0) == []
    coord.on_event(BlockStored(1, h[:2], Medium.GPU), 0.0)
    cap = {0: 100, 1: 100}
    assert b.bind([0, 1], {0: 0, 1: 0}, cap, h) == 0
    coord.on_event(BlockRemoved(0, h, Medium.CPU), 0.0)
    assert b.bind([0, 1], {0: 0, 1: 0}, cap, h) == 1
    assert b.bind([0, 1], {0: 0, 1: 60}, cap, h) == 0
    assert b.bind([0, 1], {0: 30, 1: 0}, cap, (9,)) == 1        # held nowhere: least committed KV


def test_rebinding_scores_home_by_what_it_holds_of_the_context():
    """A session needing 10 blocks, worker 0 its home (capacity 100 tokens, block 16 -> scores in blocks): holding its
    8-block context on the GPU at 50% load without it (8 - 10 x 0.5 = 3) it stays against an idle worker 1 holding
    nothing (0); with its context only in the host tier (6.4 - 5 = 1.4) it still stays; with nothing held (-5) it
    moves to worker 1; worker 1 holding 2 of its prefix blocks on the GPU at 10% load (2 - 1 = 1) beats a home that
    holds nothing and is idle without it (0); ties stay home."""
    b = CacheAwareBinder()
    cap, h = {0: 100, 1: 100}, (1, 2, 3)
    committed = {0: 70, 1: 0}                   # the session's own 20 tokens are part of worker 0's 70
    assert b.rebind(0, 8, 8, 10, 20, [0, 1], committed, cap, h) == 0
    assert b.rebind(0, 0, 8, 10, 20, [0, 1], committed, cap, h) == 0
    assert b.rebind(0, 0, 0, 10, 20, [0, 1], committed, cap, h) == 1
    b.index.stored(1, h[:2], on_gpu=True)
    assert b.rebind(0, 0, 0, 10, 20, [0, 1], {0: 20, 1: 10}, cap, h) == 1
    assert b.rebind(0, 0, 0, 10, 20, [0, 1], {0: 20, 1: 20}, cap, h) == 0     # 0 against 2 - 2 = 0: home


def test_a_session_whose_context_is_gone_is_bound_again_by_load():
    """Two co-located H20 workers, continuum-tool with a 2-block host tier (no room for a context) and a 1 s idle
    expiry. b (long decode) binds to worker 0, a to worker 1, and c, arriving during a's 100 s tool call, to worker 1
    too (a's context still counts there) with a longer decode than b's. a's context is dropped at its expiry, so its
    next round goes to the less loaded worker 0 (one rebind; worker 1 releases it; a's record names its new home) and
    every session completes. With
    a 1000 s expiry a's context stays home (its held blocks outweigh the load) and nothing moves."""
    from tandem.sim.cluster import SimConfig, build
    from tandem.workload.session import Round, Session

    def run(ttl: float):
        sessions = [Session("b", 0.0, [Round(3000, 40000)]), Session("a", 0.5, [Round(2000, 2, 100.0), Round(50, 2)]),
                    Session("c", 50.0, [Round(3000, 60000)])]
        coord, _, loop = build(SimConfig(model="llama-3.1-8b", gpu="h20", gpus=2, deploy="C:tp1x2",
                                         policy="continuum-tool", kv_offloading_size=0.004, session_ttl_s=ttl))
        loop.run(sessions)
        recs = {r.session_id: r for r in coord.records}
        assert not any(r.failed for r in recs.values())
        assert (recs["b"].decode_worker, recs["c"].decode_worker) == (0, 1)
        return coord.rebinds, recs["a"].decode_worker, recs["a"].rounds[1]
    moved, home, rnd = run(1.0)
    assert moved == 1 and home == 0 and rnd.prefill_worker == 0 and rnd.history_tokens == 0
    stayed, home, rnd = run(1000.0)
    assert stayed == 0 and home == 1 and rnd.prefill_worker == 1 and rnd.history_tokens == 2001


def test_a_live_shell_asks_where_the_next_round_goes_before_pinning_it():
    """The live shell's order: move_before_round first (the core's rule), then BeginRound on that worker, then
    on_round(worker=...), which does not move the round again. Session a (worker 0) holds nothing there any more
    while b loads worker 0 (80 of 160 tokens): a's next round moves to idle worker 1 and worker 0 releases it; with
    its context held at home it stays; a policy without cache-aware binding never moves."""
    from tandem.core.actions import Release, Submit
    from tandem.core.coordinator import Coordinator
    from tandem.core.types import RoundDone
    from tandem.policy.binding import LeastKVBinder
    from tandem.policy.routing import LocalRouter

    class View:
        held_a = (0, 0)

        def home_workers(self):
            return [0, 1]

        def capacity(self, worker):
            return 160

        def begin_round(self, worker, sid, hashes=(), prompt_tokens=0, now=None):
            return 0

        def kv_loading(self, worker, sid):
            return False

        def held(self, worker, sid):
            return self.held_a if (worker, sid) == (0, "a") else (0, 0)

    def setup(binder, held):
        view = View()
        view.held_a = held
        coord = Coordinator(view, LocalRouter(), binder, block_size=16)
        coord.on_round("a", 32, 8, 0.0, worker=0)
        coord.on_event(RoundDone("a", 0, 1.0, 8, 0.0, 7, 0.0, 0), 1.0)
        coord.on_round("b", 64, 16, 1.5, worker=0)
        return coord
    coord = setup(CacheAwareBinder(), (0, 0))
    assert coord.move_before_round("a", 40 + 8 + 8, ()) == (1, [Release(0, "a")])
    (sub,) = coord.on_round("a", 8, 8, 2.0, worker=1)
    assert isinstance(sub, Submit) and sub.worker == 1 and coord.rebinds == 1
    assert coord.committed == {0: 80, 1: 56}
    coord = setup(CacheAwareBinder(), (40, 0))                # 40 tokens held = 2 blocks: 2 - 4 x 0.5 = 0 >= 0
    assert coord.move_before_round("a", 56, ()) == (0, [])
    coord = setup(LeastKVBinder(), (0, 0))
    assert coord.move_before_round("a", 56, ()) == (0, [])


def test_the_coordinator_tells_the_tool_time_with_the_round_live_and_simulated():
    """One route for tool times: the coordinator core sends ExpectReturn to the session's worker with the round's
    Submit, from a live client's tool_s (none when the client gave none) or from the trace (none after the last
    round), and only under a tiered policy; nothing at the round's end."""
    from tandem.core.actions import ExpectReturn, Submit, ToolCall
    from tandem.core.coordinator import Coordinator
    from tandem.policy.binding import LeastKVBinder
    from tandem.policy.routing import LocalRouter
    from tandem.workload.session import Round, Session

    class View:
        def home_workers(self):
            return [0]

        def capacity(self, worker):
            return 10_000

        def begin_round(self, worker, sid, hashes=(), prompt_tokens=0, now=None):
            return 0

    coord = Coordinator(View(), LocalRouter(), LeastKVBinder(), tool_hints=True)
    sub, hint = coord.on_round("live", 32, 8, 0.0, tool_s=12.5)
    assert isinstance(sub, Submit) and hint == ExpectReturn(0, "live", 12.5)
    assert coord.on_event(RoundDone("live", 0, 1.0, 8, 0.0, 7, 0.0, 0), 1.0) == []
    (sub,) = coord.on_round("live", 8, 8, 2.0)                # no tool_s from the client: the tier's estimate
    assert isinstance(sub, Submit)
    sim = Session("sim", 0.0, [Round(32, 8, tool_s=3.0), Round(8, 8)])
    assert [type(a) for a in coord.on_session_arrival(sim, 0.0)] == [Submit, ExpectReturn]
    assert [type(a) for a in coord.on_event(RoundDone("sim", 0, 1.0, 8, 0.0, 7, 0.0, 0), 1.0)] == [ToolCall]
    assert [type(a) for a in coord.on_tool_result("sim", 4.0)] == [Submit]      # the last round: no tool after
    plain = Coordinator(View(), LocalRouter(), LeastKVBinder())
    assert [type(a) for a in plain.on_round("live", 32, 8, 0.0, tool_s=12.5)] == [Submit]


def test_untiered_policy_refuses_a_host_tier_and_tiered_needs_one():
    with pytest.raises(ValueError, match="keeps no KV in host memory"):
        build_worker(0, COLOCATED, 1, 64, get_policy("vllm"), SchedulerConfig(kv_offloading_size=1.0),
                     kv_block_bytes=BLOCK_BYTES, host_link_s=link_s)
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        build_worker(0, COLOCATED, 1, 64, get_policy("hicache"), SchedulerConfig(), kv_block_bytes=BLOCK_BYTES,
                     host_link_s=link_s)


@pytest.mark.parametrize("policy, deploy", [("continuum-tool", "C:tp1x2"), ("ampd-tiered", "P:tp1x1,D:tp1x1"),
                                            ("hicache", "C:tp1x2"), ("infercept", "C:tp1x2")])
def test_tiered_policies_simulate_every_session_to_its_end(policy, deploy):
    """Small toolbench runs on 2 GPUs with a 64 GiB host tier per worker: every session completes."""
    from tandem.sim.cluster import SimConfig, simulate
    from tandem.workload.generators import generate
    sessions = generate("toolbench", 12, 2.0, 0)
    res = simulate(sessions, SimConfig(model="llama-3.1-8b", gpu="h20", gpus=2, deploy=deploy, policy=policy,
                                       kv_offloading_size=64.0))
    assert len(res.records) == 12 and not [r.fail_reason for r in res.records if r.failed]
    assert all("kv_tier" in w for w in res.workers if w["role"] != "prefill")


def test_the_simulator_charges_a_load_over_the_host_link():
    """One session, two rounds 100 s apart, on one H20 (llama-3.1-8b, tp1), hicache with 64 GiB: with a 1 s idle
    expiry the GPU copy goes and round 1 first loads its 1001-token context back, so its TTFT is longer than with
    the KV kept by exactly one copy of 1001 positions over the host link (the roofline's swap_time: PCIe Gen5 x16
    at the catalogue's link efficiency)."""
    from tandem.perf.hardware import get_gpu
    from tandem.perf.models import get_model
    from tandem.perf.roofline import kv_bytes_per_token_per_gpu
    from tandem.sim.cluster import SimConfig, simulate
    from tandem.workload.session import Round, Session

    def ttft1(ttl: float) -> float:
        s = Session("s", 0.0, [Round(1000, 2, 100.0), Round(50, 2)])
        res = simulate([s], SimConfig(model="llama-3.1-8b", gpu="h20", gpus=1, deploy="C:tp1x1", policy="hicache",
                                      kv_offloading_size=64.0, session_ttl_s=ttl))
        (rec,) = res.records
        return rec.rounds[1].ttft_s
    g = get_gpu("h20")
    copy_s = 1001 * kv_bytes_per_token_per_gpu(get_model("llama-3.1-8b"), 1) / (g.host_gbs * 1e9 * g.link_eff)
    assert ttft1(1.0) - ttft1(1000.0) == pytest.approx(copy_s, rel=1e-9)


def test_injected_copy_failures_recompute_and_lose_no_session():
    """With --faults kv-fail=0.5 half the host-tier copies fail too: the rounds they would have served recompute
    (the tier's counters say how many), and every session still completes."""
    from tandem.sim.cluster import SimConfig, simulate
    from tandem.sim.faults import FaultSpec
    from tandem.workload.generators import generate
    sessions = generate("toolbench", 12, 2.0, 0)
    res = simulate(sessions, SimConfig(model="llama-3.1-8b", gpu="h20", gpus=2, deploy="C:tp1x2", policy="infercept",
                                       kv_offloading_size=64.0, faults=FaultSpec(kv_fail=0.5)))
    failed = sum(w["kv_tier"]["failed"] for w in res.workers)
    assert failed > 0 and not [r.fail_reason for r in res.records if r.failed]
    assert sum(w["kv_tier"]["recomputes"] for w in res.workers) > 0
