"""The simulator runs the cores unchanged: determinism, no lost sessions or KV blocks, failure reasons."""
import json

import pytest

from tandem.sim.cluster import ConfigError, SimConfig, build, simulate
from tandem.workload.generators import PAPER_SLOS, agentic_long, generate
from tandem.workload.metrics import summarize
from tandem.workload.session import Round, Session, SLO, dump_sessions, load_sessions

LLAMA = "llama-3.1-70b"


def run(sessions, policy="ampd", deploy="P:tp4x1,D:tp4x1", gpus=8, **kw):
    cfg = SimConfig(LLAMA, "h20", gpus, deploy, policy, **kw)
    coord, workers, loop = build(cfg)
    loop.run(sessions)
    return coord, workers, loop


def toolbench(n=60, rate=1.0, seed=0):
    return generate("toolbench", n, rate, seed, slo=PAPER_SLOS[(LLAMA, "toolbench")])


@pytest.mark.parametrize("policy,deploy", [
    ("ampd", "P:tp4x1,D:tp4x1"), ("ampd-window", "P:tp4x1,D:tp4x1"), ("ampd-no-pr", "P:tp2x2,D:tp4x1"),
    ("ampd-no-ar-pr", "P:tp4x1,D:tp2x2"), ("dynamo", "P:tp4x1,D:tp4x1"), ("vllm", "C:tp4x2"),
    ("continuum", "C:tp2x4")])
def test_every_session_ends_and_every_kv_block_is_returned(policy, deploy):
    sessions = toolbench(80, rate=1.5)
    coord, workers, loop = run(sessions, policy, deploy)
    assert len(coord.records) == 80 and not coord.live
    for rec in coord.records:
        assert rec.completed, rec.fail_reason
        assert len(rec.rounds) == rec.num_rounds
        assert all(r.first_token_s is not None and r.finish_s >= r.first_token_s for r in rec.rounds)
    for w in workers:
        assert w.blocks.num_free == w.blocks.num_blocks, f"worker {w.id} leaked KV blocks"
        assert not w.seqs and not w.queue and not w.active and not w.running


def test_same_seed_same_results_and_different_seed_differs():
    a = simulate(toolbench(seed=3), SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "ampd", seed=3))
    b = simulate(toolbench(seed=3), SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "ampd", seed=3))
    c = simulate(toolbench(seed=4), SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "ampd", seed=4))
    ma, mb, mc = (summarize(r.records, r.sim_time_s) for r in (a, b, c))
    assert json.dumps(ma, sort_keys=True) == json.dumps(mb, sort_keys=True)
    assert a.events == b.events and a.sim_time_s == b.sim_time_s
    assert ma != mc


def test_round_timeline_of_a_lone_session_follows_the_cost_model():
    s = Session("s", 0.0, [Round(700, 10, tool_s=2.0), Round(100, 5)], slo=SLO(1.0, 0.05))
    coord, workers, loop = run([s], "dynamo")
    r0, r1 = coord.records[0].rounds
    assert r0.prefill_where == "remote" and r1.prefill_where == "remote"
    assert r0.history_tokens == 0 and r1.history_tokens == 709      # 700 + 10 outputs, last token not yet in KV
    assert r1.arrival_s == pytest.approx(r0.finish_s + 2.0)
    assert r0.itl_count == 9 and r1.itl_count == 4
    assert r1.kv_transfer_s > 0                                      # history read + incremental write-back


def test_colocated_rounds_reuse_resident_kv():
    s = Session("s", 0.0, [Round(700, 10, tool_s=1.0), Round(100, 5, tool_s=1.0), Round(50, 5)])
    coord, _, _ = run([s], "vllm", "C:tp4x2")
    hist = [r.history_tokens for r in coord.records[0].rounds]
    assert hist == [0, 709, 709 + 1 + 100 + 4]
    assert all(r.recomputed_tokens == 0 for r in coord.records[0].rounds)


def test_small_kv_pool_forces_preemption_and_still_completes_every_session():
    sessions = generate("hotpotqa", 40, 8.0, 1, slo=PAPER_SLOS[(LLAMA, "hotpotqa")])
    coord, workers, _ = run(sessions, "vllm", "C:tp2x1", gpus=2, mem_util=0.78)
    assert workers[0].capacity_tokens < 50_000
    recs = coord.records
    assert all(r.completed for r in recs)
    assert sum(rr.preemptions for r in recs for rr in r.rounds) + sum(rr.recomputed_tokens > 0 for r in recs for rr in r.rounds) > 0
    assert workers[0].blocks.num_free == workers[0].blocks.num_blocks


def test_session_whose_kv_can_never_fit_is_failed_with_a_reason_not_dropped():
    from tandem.perf.roofline import kv_capacity_tokens
    cap = kv_capacity_tokens(LLAMA, "h20", 2, mem_util=0.8)
    big = Session("big", 0.0, [Round(cap // 4, 10, tool_s=1.0), Round(cap, 10)])
    ok = Session("ok", 0.5, [Round(500, 10)])
    coord, workers, _ = run([big, ok], "vllm", "C:tp2x1", gpus=2, mem_util=0.8)
    by_id = {r.session_id: r for r in coord.records}
    assert by_id["ok"].completed
    assert by_id["big"].failed and by_id["big"].fail_reason.startswith("KV exceeds the worker's capacity: ")
    assert len(by_id["big"].rounds) == 2 and by_id["big"].rounds[0].finish_s is not None
    assert workers[0].blocks.num_free == workers[0].blocks.num_blocks


def test_context_beyond_the_model_maximum_fails_with_a_reason():
    s = Session("long", 0.0, [Round(120_000, 10, tool_s=1.0), Round(20_000, 10)])
    coord, _, _ = run([s], "ampd", "P:tp8x1,D:tp8x1", gpus=16)
    rec = coord.records[0]
    assert rec.failed and rec.fail_reason.startswith("context exceeds the model's maximum: ") and "takes 131072" in rec.fail_reason


def test_agentic_sessions_with_hundreds_of_rounds_replay_from_jsonl(tmp_path):
    sessions = agentic_long(3, seed=0)
    assert max(len(s.rounds) for s in sessions) >= 100
    path = tmp_path / "agents.jsonl"
    dump_sessions(sessions, path)
    loaded = load_sessions(path)
    res = simulate(loaded, SimConfig(LLAMA, "h20", 16, "P:tp8x1,D:tp8x1", "ampd"))
    assert len(res.records) == 3
    for rec in res.records:
        assert rec.completed or rec.fail_reason
        if rec.completed:
            assert len(rec.rounds) == rec.num_rounds


def test_policy_and_deployment_kinds_must_agree():
    with pytest.raises(ConfigError, match="co-located"):
        build(SimConfig(LLAMA, "h20", 8, "P:tp4x1,D:tp4x1", "vllm"))
    with pytest.raises(ConfigError, match="disaggregated"):
        build(SimConfig(LLAMA, "h20", 8, "C:tp4x2", "ampd"))
    with pytest.raises(ConfigError, match="unknown policy"):
        build(SimConfig(LLAMA, "h20", 8, "C:tp4x2", "nope"))


def test_long_contexts_on_small_decode_workers_do_not_livelock():
    # GAIA contexts reach the tp2 decode pool's size: preemption and waiting must still converge
    sessions = generate("gaia", 30, 1.6, 0, slo=PAPER_SLOS[(LLAMA, "gaia")])
    coord, workers, loop = run(sessions, "ampd", "P:tp2x2,D:tp2x2", gpus=8)
    assert not coord.live and len(coord.records) == 30
    assert all(r.completed or r.fail_reason for r in coord.records)
    assert loop.events < 2_000_000
    for w in workers:
        assert w.blocks.num_free == w.blocks.num_blocks
