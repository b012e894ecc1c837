"""The coordinator core serves live sessions (rounds not known ahead), as the server needs, with the sim's code."""
import pytest

from tandem.core.actions import Release, Submit
from tandem.core.types import StepResult
from tandem.sim.cluster import SimConfig, build
from tandem.workload.session import SLO

LLAMA = "llama-3.1-70b"


def cluster(policy="dynamo", deploy="P:tp4x1,D:tp4x1", session_ttl_s=float("inf")):
    """A simulated cluster whose live sessions never expire unless asked (play() runs until nothing is left)."""
    coord, workers, loop = build(SimConfig(LLAMA, "h20", 8, deploy, policy, session_ttl_s=session_ttl_s))
    return coord, workers, loop


def play(loop, actions):
    """Apply actions and run the event loop until it is idle."""
    loop._apply(actions)
    loop.run([])


def test_live_rounds_reuse_resident_history_and_stay_bound_between_rounds():
    coord, workers, loop = cluster()
    play(loop, coord.on_round("s", 700, 10, 0.0, slo=SLO(1.0, 0.05)))
    rec = coord.records[0]
    d = rec.decode_worker
    assert rec.rounds[0].output_tokens == 10 and rec.rounds[0].finish_s is not None
    assert "s" in coord.live and rec.finish_s is None                  # still bound, not ended
    assert workers[d].seqs["s"].num_tokens == 709                       # 700 + 10 outputs, last has no KV yet
    play(loop, coord.on_round("s", 100, 5, loop.now + 2.0))
    r1 = rec.rounds[1]
    assert r1.history_tokens == 709 and r1.output_tokens == 5 and rec.num_rounds == 2
    assert workers[d].seqs["s"].num_tokens == 709 + 1 + 100 + 4
    play(loop, coord.end_session("s", loop.now))
    assert "s" not in coord.live and rec.completed
    assert all(w.blocks.num_free == w.blocks.num_blocks for w in workers)


def test_a_second_round_while_one_is_in_flight_is_refused():
    coord, workers, loop = cluster()
    loop._apply(coord.on_round("s", 50, 4, 0.0))
    with pytest.raises(ValueError, match="already has a round in flight"):
        coord.on_round("s", 10, 4, 0.0)


def test_a_round_stopped_early_counts_only_the_tokens_it_produced():
    coord, workers, loop = cluster("vllm", "C:tp4x2")
    acts = coord.on_round("s", 64, 50, 0.0)
    (sub,) = [a for a in acts if isinstance(a, Submit)]
    w = workers[sub.worker]
    loop._apply(acts)
    # the executor reports a stop (EOS) after the first decode step
    plan = w.schedule(0.0)
    w.busy = True
    w.on_step_done(plan, StepResult(0.01), 0.01)
    plan = w.schedule(0.01)
    w.on_step_done(plan, StepResult(0.01, None, {"s"}), 0.02)
    w.busy = False
    for ev in w.drain():
        loop._apply(coord.on_event(ev, 0.02))
    rec = coord.records[0]
    assert rec.rounds[0].output_tokens == 2                            # first token + one decode
    assert coord.committed[sub.worker] == 64 + 2                       # the unused 48 are uncommitted
    acts = coord.on_round("s", 10, 5, 1.0)
    (sub,) = [a for a in acts if isinstance(a, Submit)]
    assert sub.task.l_hist == 65 and sub.task.l_incr == 11


def test_losing_a_decode_worker_fails_its_sessions_and_rebinds_new_ones_elsewhere():
    coord, workers, loop = cluster("vllm", "C:tp4x2")
    coord.on_round("a", 64, 8, 0.0)
    lost = coord.session_worker("a")
    coord.view.drop(lost)
    out = coord.on_worker_lost(lost, 0.1)
    assert [type(a) for a in out] == [Release]
    rec = coord.records[0]
    assert rec.failed and rec.fail_reason == f"worker lost: decode worker {lost} stopped"
    coord.on_round("b", 64, 8, 0.2)
    assert coord.session_worker("b") != lost


def test_losing_a_prefill_worker_reroutes_its_tasks():
    coord, workers, loop = cluster("dynamo", "P:tp2x2,D:tp4x1")
    (sub,) = [a for a in coord.on_round("a", 500, 8, 0.0) if isinstance(a, Submit)]
    assert workers[sub.worker].role == "prefill"
    coord.view.drop(sub.worker)
    out = coord.on_worker_lost(sub.worker, 0.1)
    (again,) = out
    assert isinstance(again, Submit) and again.task is sub.task and again.worker != sub.worker
    assert coord.records[0].rounds[0].prefill_worker == again.worker
