"""Decisions the cores make for every shell: the factory's validated policies, prefix-affinity binding,
KV-transfer failure -> local recompute, idle-session expiry, worker loss, multi-token decode steps.
Each is exercised through the simulator (the same cores the engine and the runtime build)."""
import math
import pathlib
import re

import pytest

from tandem.core.config import SchedulerConfig
from tandem.core.factory import build_coordinator, build_worker, make_picker, make_router
from tandem.core.state import InProcessState
from tandem.core.types import COLOCATED, DECODE, PREFILL, PrefillTask, StepResult
from tandem.policy.binding import PrefixAffinityBinder
from tandem.policy.presets import POLICIES, PickerKind, PolicySpec, RouterKind, get_policy
from tandem.policy.reorder import FCFS, SessionFirst, TTFTAwareReorder
from tandem.sim.cluster import ConfigError, SimConfig, simulate
from tandem.sim.faults import FaultError, FaultSpec, parse_faults
from tandem.workload.generators import PAPER_SLOS, generate
from tandem.workload.metrics import summarize
from tandem.workload.session import SLO, Round, Session

LLAMA = "llama-3.1-70b"
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- one construction path

def test_unknown_router_picker_or_binder_names_are_errors_not_silent_defaults():
    with pytest.raises(ValueError, match="unknown router 'adaptiv'"):
        PolicySpec("x", True, "adaptiv", "fcfs")
    with pytest.raises(ValueError, match="unknown picker 'ttft'"):
        PolicySpec("x", True, "adaptive", "ttft")
    with pytest.raises(ValueError, match="unknown binder"):
        PolicySpec("x", True, "adaptive", "fcfs", binder="random")
    with pytest.raises(ValueError, match="reorder_window must be an integer >= 1"):
        get_policy("ampd").with_options(reorder_window=0)
    with pytest.raises(ValueError, match="co-located policy routes every prefill locally"):
        PolicySpec("x", False, "adaptive", "fcfs")
    with pytest.raises(ValueError, match="unknown policy 'ampdd'"):
        get_policy("ampdd")


def test_factory_gives_every_policy_its_router_picker_and_retention():
    want = {"ampd": TTFTAwareReorder, "ampd-no-pr": FCFS, "dynamo": FCFS, "vllm": FCFS, "continuum": SessionFirst}
    for name, picker in want.items():
        spec = get_policy(name)
        role = COLOCATED if not spec.disaggregated else DECODE
        w = build_worker(0, role, 1, 64, name)
        assert type(w.picker) is picker
        assert w.cfg.retain_s == (30.0 if name == "continuum" else 0.0)
        assert w.cfg.max_num_batched_tokens == 2048 and w.cfg.max_num_seqs == 256   # one set of defaults
    assert make_picker(get_policy("ampd").with_options(reorder_window=5)).window == 5
    assert type(make_router(get_policy("dynamo"), __import__("random").Random(0))).__name__ == "LeastCostRemoteRouter"
    assert {p.router for p in POLICIES.values()} <= set(RouterKind)
    assert {p.picker for p in POLICIES.values()} <= set(PickerKind)


def test_engine_and_simulator_build_the_same_core_for_a_policy():
    """The engine's worker core is built by the factory with the policy it was given (not FCFS by default)."""
    from tandem.engine.config import EngineConfig, EngineError
    with pytest.raises(EngineError, match="unknown policy"):
        EngineConfig(model="/nonexistent", policy="nope")
    sim_core = build_worker(0, DECODE, 1, 64, "ampd", SchedulerConfig())
    assert type(sim_core.picker) is TTFTAwareReorder


def test_only_the_factory_constructs_coordinators_and_worker_cores():
    """Shells must not build cores by hand (a shell that skips the policy is the defect this guards)."""
    offenders = []
    for path in (ROOT / "tandem").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tandem/core/factory.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(WorkerCore|Coordinator)\(", line) and not line.lstrip().startswith(("class ", "#")):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert offenders == []


def test_scheduler_config_rejects_bad_values():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="watermark must be in"):
        SchedulerConfig(watermark=1.5)
    with pytest.raises(ValueError, match="kv_timeout_s must be a number of seconds > 0"):
        SchedulerConfig(kv_timeout_s=0)
    with pytest.raises(ConfigError, match="decode_query_tokens must be an integer >= 1"):
        simulate([], SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", decode_query_tokens=0))


# ---------------------------------------------------------------- prefix-affinity binding

def _prefix_session(sid: str, t: float, hashes: list[int], tokens: int = 4096) -> Session:
    return Session(sid, t, [Round(tokens, 8, hash_ids=hashes)], SLO(5.0, 0.5), block_size=512)


def test_sessions_sharing_a_prefix_are_bound_to_the_worker_that_cached_it_and_reuse_its_blocks():
    shared = list(range(100, 108))                     # 8 trace blocks of 512 tokens = 4096 tokens
    other = list(range(200, 208))
    sessions = [_prefix_session("a", 0.0, shared), _prefix_session("b", 0.0, other),
                _prefix_session("c", 30.0, shared[:6] + [999, 998]),   # shares 6 of 8 blocks with "a"
                _prefix_session("d", 31.0, other)]
    res = simulate(sessions, SimConfig(LLAMA, "h20", 8, "C:tp4x2", "vllm"))
    by = {r.session_id: r for r in res.records}
    assert by["a"].decode_worker != by["b"].decode_worker         # no prefix seen yet: least committed KV
    assert by["c"].decode_worker == by["a"].decode_worker         # longest cached prefix wins
    assert by["d"].decode_worker == by["b"].decode_worker
    # the worker's prefix cache gives the shared blocks back as history (6 trace blocks = 3072 tokens), and a
    # prompt identical to a cached one all but its last block (at least one token is always computed)
    assert by["a"].rounds[0].history_tokens == 0 and by["b"].rounds[0].history_tokens == 0
    assert by["c"].rounds[0].history_tokens == 3072 and by["d"].rounds[0].history_tokens == 4096 - 16
    assert all(r.completed for r in res.records)


def test_first_prompt_hashes_name_prefixes_at_the_cores_block_size():
    s1 = _prefix_session("x", 0, [7, 8], tokens=1000)
    s2 = _prefix_session("y", 0, [7, 9], tokens=1000)
    h1, h2 = s1.first_prompt_hashes(16), s2.first_prompt_hashes(16)
    assert len(h1) == 1000 // 16 == 62
    assert h1[:32] == h2[:32] and h1[32] != h2[32]               # the first 512 tokens are shared, not more
    binder = PrefixAffinityBinder()
    binder.index.remember(3, h1)
    assert binder.bind([1, 3], {1: 0, 3: 10}, {1: 100, 3: 100}, h2) == 3
    assert binder.bind([1, 3], {1: 0, 3: 10}, {1: 100, 3: 100}, ()) == 1


# ---------------------------------------------------------------- KV transfer failures, timeouts

def _toolbench(n=40, rate=1.0, seed=0):
    return generate("toolbench", n, rate, seed, slo=PAPER_SLOS[(LLAMA, "toolbench")])


def test_every_failed_kv_transfer_falls_back_to_local_recompute_and_no_session_is_lost():
    ss = _toolbench()
    res = simulate(ss, SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "dynamo", faults=FaultSpec(kv_fail=1.0)))
    rounds = [r for s in res.records for r in s.rounds]
    assert all(s.completed for s in res.records)
    # dynamo sends every prefill remote; each one's first transfer fails and the round is prefilled at home
    assert all(r.prefill_where == "local" and r.kv_failures == 1 for r in rounds)
    m = summarize(res.records, res.sim_time_s)
    assert m["kv_failures"] == len(rounds)
    hist = [r for r in rounds if r.history_tokens > 0]
    assert hist and all(r.kv_fallback_tokens == 0 for r in hist)   # the history read failed: nothing redone
    first = [r for r in rounds if r.history_tokens == 0]
    assert all(r.kv_fallback_tokens == r.input_tokens for r in first)  # the write-back failed: all redone


def test_a_lost_kv_transfer_is_abandoned_after_kv_timeout_and_recomputed_locally():
    s = Session("s", 0.0, [Round(2000, 4)], SLO(100.0, 1.0))
    base = simulate([s], SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "dynamo"))
    lost = simulate([s], SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "dynamo", kv_timeout_s=2.0,
                                   faults=FaultSpec(kv_lost=1.0)))
    r0, r1 = base.records[0].rounds[0], lost.records[0].rounds[0]
    assert r0.prefill_where == "remote" and r1.prefill_where == "local" and r1.kv_failures == 1
    assert r1.kv_fallback_tokens == 2000
    assert lost.records[0].completed
    assert r1.ttft_s > 2.0 > r0.ttft_s                              # waited for the timeout, then prefilled


def test_faults_flag_values_are_validated():
    assert parse_faults("kv-fail=0.05,kill=1@300") == FaultSpec(0.05, 0.0, ((1, 300.0),))
    for bad, msg in [("kv-fail=2", "probability"), ("kv-fail=0.6,kv-lost=0.6", "must not exceed 1"),
                     ("boom=1", "unknown fault"), ("kill=1", "bad value"), ("", "empty")]:
        with pytest.raises(FaultError, match=msg):
            parse_faults(bad)
    with pytest.raises(ConfigError, match="kills worker 7"):
        simulate([], SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", faults=FaultSpec(kills=((7, 1.0),))))


# ---------------------------------------------------------------- worker loss, idle expiry

def test_a_killed_decode_worker_fails_rounds_in_flight_and_rebinds_idle_sessions():
    ss = _toolbench(n=60, rate=2.0)
    cfg = SimConfig(LLAMA, "h20", 16, "P:tp4x1,D:tp4x3", "ampd", faults=FaultSpec(kills=((1, 10.0),)))
    res = simulate(ss, cfg)
    failed = [s for s in res.records if s.failed]
    assert failed and all(s.fail_reason == "worker lost: decode worker 1 stopped" for s in failed)
    assert all(s.completed or s.failed for s in res.records)
    moved = [s for s in res.records if s.completed and any(r.prefill_worker == 1 for r in s.rounds)]
    # sessions that lived on worker 1 between rounds were bound again and finished elsewhere
    assert all(s.decode_worker != 1 for s in moved)
    assert all(r.prefill_worker != 1 for s in res.records for r in s.rounds if r.arrival_s > 10.0)


def test_an_idle_session_past_its_ttl_releases_its_kv_and_recomputes_its_history():
    s = Session("s", 0.0, [Round(1000, 10, tool_s=50.0), Round(100, 10)], SLO(100.0, 1.0))
    keep = simulate([s], SimConfig(LLAMA, "h20", 8, "C:tp4x2", "vllm"))
    gone = simulate([s], SimConfig(LLAMA, "h20", 8, "C:tp4x2", "vllm", session_ttl_s=20.0))
    assert keep.records[0].rounds[1].history_tokens == 1009 and keep.records[0].rounds[1].recomputed_tokens == 0
    r = gone.records[0].rounds[1]
    assert r.history_tokens == 0 and r.recomputed_tokens == 1009 and gone.records[0].completed


# ---------------------------------------------------------------- multi-token steps

def _colocated(q: int, committed_per_step: int | None):
    view_workers = [build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(decode_query_tokens=q))]
    w = view_workers[0]
    w.attach("s")
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 20, 0.0, output_tokens=10, decode_worker=0, worker=0), 0.0)
    t, steps, queries = 0.0, 0, []
    while w.has_work():
        plan = w.schedule(t)
        t += 1.0
        queries.append([s.query_tokens for s in plan.decode])
        c = None if committed_per_step is None else {s.session_id: min(committed_per_step, s.query_tokens)
                                                      for s in plan.decode}
        w.on_step_done(plan, StepResult(1.0, c), t)
        steps += 1
    return w, steps, queries, w.drain()


def test_multi_token_steps_commit_what_the_executor_reports_and_stop_at_max_tokens():
    w, steps, queries, events = _colocated(q=4, committed_per_step=3)
    done = [e for e in events if type(e).__name__ == "RoundDone"][0]
    # prefill gives token 1; then 9 more at 3 per step: 3 decode steps, the last asking only for what is left
    assert steps == 4 and queries == [[], [4], [4], [3]]
    assert done.output_tokens == 10 and done.itl_count == 9 and done.itl_sum == pytest.approx(3.0)
    assert w.seqs["s"].num_tokens == 29 and w.blocks.held(w.seqs["s"]) == 2
    w1, steps1, q1, ev1 = _colocated(q=1, committed_per_step=None)
    assert steps1 == 10 and [e for e in ev1 if type(e).__name__ == "RoundDone"][0].output_tokens == 10


def test_a_step_that_commits_nothing_leaves_the_sequence_waiting_and_reports_no_gap():
    w = build_worker(0, COLOCATED, 1, 64, "vllm", SchedulerConfig(decode_query_tokens=4))
    w.attach("s")
    w.begin_round("s")
    w.submit(PrefillTask("s", 0, 0, 8, 0.0, output_tokens=3, decode_worker=0, worker=0), 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(1.0), 1.0)
    plan = w.schedule(1.0)
    assert plan.entries()[0].query_tokens == 2 and plan.entries()[0].writes_kv
    w.on_step_done(plan, StepResult(1.0, {"s": 0}), 2.0)
    assert w.seqs["s"].num_tokens == 8 and w.seqs["s"].to_decode == 2
    with pytest.raises(ValueError, match="committed 3 tokens in a step that may commit 2"):
        w.on_step_done(w.schedule(2.0), StepResult(1.0, {"s": 3}), 3.0)


def test_simulated_multi_token_steps_finish_every_round_with_its_exact_output_count():
    ss = _toolbench(n=20)
    res = simulate(ss, SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "ampd", decode_query_tokens=4,
                                 commit_tokens=(0, 4)))
    base = simulate(ss, SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "ampd"))
    out = [r.output_tokens for s in res.records for r in s.rounds]
    assert out == [r.output_tokens for s in base.records for r in s.rounds]
    assert all(s.completed for s in res.records)
    steps = sum(w["steps"] for w in res.workers if w["role"] == "decode")
    assert steps < sum(w["steps"] for w in base.workers if w["role"] == "decode")


def test_coordinator_timer_asks_for_a_tick_only_when_a_deadline_is_due():
    w = build_worker(0, PREFILL, 1, 64, "dynamo")
    d = build_worker(1, DECODE, 1, 64, "dynamo")

    class Cost:
        def t_pre(self, h, n, tp): return 0.0
        def t_kv(self, n, a, b, same): return 0.0

    coord = build_coordinator(InProcessState([w, d], Cost(), [0, 0]), "dynamo", SchedulerConfig(kv_timeout_s=5.0))
    assert coord.timer_s == math.inf
    acts = coord.on_round("s", 100, 4, 0.0)
    assert [type(a).__name__ for a in acts] == ["Submit"]
    w.submit(acts[0].task, 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(0.1), 0.1)
    acts = [a for ev in w.drain() for a in coord.on_event(ev, 0.1)]
    assert [type(a).__name__ for a in acts] == ["Transfer", "Timer"] and acts[1].at_s == pytest.approx(5.1)
    assert coord.on_tick(5.0) == []
    fallback = coord.on_tick(5.1)
    assert [type(a).__name__ for a in fallback] == ["Cancel", "RunLocal"]
    assert coord.records[0].rounds[0].prefill_where == "local"


def test_sessions_arriving_after_the_last_decode_worker_died_fail_with_a_reason():
    ss = _toolbench(n=30, rate=2.0)
    res = simulate(ss, SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "ampd", faults=FaultSpec(kills=((1, 5.0),))))
    late = [s for s in res.records if s.arrival_s > 5.0]
    assert late and all(s.failed and s.fail_reason.startswith("no live decode worker") for s in late)
    assert len(res.records) == 30 and all(s.completed or s.failed for s in res.records)


# ---------------------------------------------------------------- co-located step forming

def _second_arrival_step(policy: str):
    """A co-located worker decoding one sequence when a second prompt arrives: the step it forms next."""
    w = build_worker(0, COLOCATED, 1, 64, policy, SchedulerConfig())
    for sid in ("a", "b"):
        w.attach(sid)
        w.begin_round(sid)
    w.submit(PrefillTask("a", 0, 0, 16, 0.0, output_tokens=10, decode_worker=0, worker=0), 0.0)
    w.on_step_done(w.schedule(0.0), StepResult(1.0), 1.0)        # a's prefill: a now decodes
    w.submit(PrefillTask("b", 0, 0, 32, 1.0, output_tokens=10, decode_worker=0, worker=0), 1.0)
    return w.schedule(1.0)


def test_vllm_mixes_a_new_prefill_with_the_running_decodes_and_sglang_pauses_them():
    mixed = _second_arrival_step("vllm")
    assert [s.session_id for s in mixed.decode] == ["a"] and [(t.session_id, n) for t, n in mixed.prefill] == [("b", 32)]
    first = _second_arrival_step("sglang")
    assert first.decode == [] and [(t.session_id, n) for t, n in first.prefill] == [("b", 32)]
    assert not get_policy("sglang").mixed_chunk and get_policy("vllm").mixed_chunk
    with pytest.raises(ValueError, match="mixed_chunk must be a bool"):
        get_policy("vllm").with_options(mixed_chunk="no")
