"""Closed-loop clients in the simulator (SimConfig.concurrency, `tandem simulate --concurrency N`): N clients each
run one session at a time; a session starts exactly when a client's previous one ends."""
from __future__ import annotations

import json

import pytest

from tandem.cli.main import main
from tandem.sim.cluster import ConfigError, SimConfig, simulate
from tandem.workload.generators import generate
from tandem.workload.records import SessionRecord

CFG = SimConfig(model="qwen2.5-7b", gpu="h200", gpus=2, deploy="P:tp1x1,D:tp1x1", policy="sglang-pd")


def _sessions(n: int = 12, seed: int = 0):
    return generate("chat-multiturn", n, 2.0, seed)


def _max_live(recs: list[SessionRecord]) -> int:
    """Most sessions under way at one time (an end and a start at the same instant do not overlap)."""
    edges = sorted([(r.arrival_s, 1) for r in recs] + [(r.finish_s, -1) for r in recs])
    live = top = 0
    for _, d in edges:
        live += d
        top = max(top, live)
    return top


def test_concurrency_one_runs_sessions_back_to_back():
    sessions = _sessions()
    res = simulate(sessions, SimConfig(**{**_fields(CFG), "concurrency": 1}))
    recs = res.records
    assert [r.session_id for r in recs] == [s.session_id for s in sorted(sessions, key=lambda s: s.arrival_s)]
    assert all(r.completed for r in recs)
    assert recs[0].arrival_s == 0.0
    for k in range(len(recs) - 1):
        assert recs[k + 1].arrival_s == recs[k].finish_s        # the next starts exactly when the previous ends
        assert recs[k + 1].rounds[0].arrival_s == recs[k].finish_s
    assert _max_live(recs) == 1
    assert res.sim_time_s == recs[-1].finish_s
    assert [s.arrival_s for s in sessions] == [s.arrival_s for s in _sessions()]   # the caller's sessions untouched


def test_concurrency_three_keeps_at_most_three_live():
    sessions = _sessions(20)
    recs = simulate(sessions, SimConfig(**{**_fields(CFG), "concurrency": 3})).records
    assert len(recs) == 20 and all(r.completed for r in recs)
    assert sorted(r.arrival_s for r in recs)[:3] == [0.0, 0.0, 0.0]
    assert _max_live(recs) == 3
    ends = sorted(r.finish_s for r in recs)
    later = sorted(r.arrival_s for r in recs)[3:]               # each later start is some session's end
    assert set(later) <= set(ends)
    assert later == ends[:len(later)]                           # the k-th end starts the (k+3)-th session


def test_more_clients_than_sessions_and_open_loop_unchanged():
    sessions = _sessions(4)
    recs = simulate(sessions, SimConfig(**{**_fields(CFG), "concurrency": 64})).records
    assert [r.arrival_s for r in recs] == [0.0] * 4 and all(r.completed for r in recs)
    open_loop = simulate(sessions, CFG).records
    assert sorted(r.arrival_s for r in open_loop) == sorted(s.arrival_s for s in sessions)


def test_failed_sessions_free_their_client():
    """A session that can never fit fails; its client goes on with the next one."""
    sessions = _sessions(5)
    sessions[1].rounds[0].input_tokens = 10_000_000                 # beyond the model's context
    recs = simulate(sessions, SimConfig(**{**_fields(CFG), "concurrency": 1})).records
    assert len(recs) == 5 and recs[1].failed and sum(r.completed for r in recs) == 4
    assert recs[2].arrival_s == recs[1].finish_s


def test_host_loop_client_starts_when_its_last_token_arrives(tmp_path):
    """Profiled engines (HostLoop): the client sees its session end output_s after the worker's last token, and sends
    the next session then; that arrival is the client's send, so its TTFT includes request_s."""
    from test_sim import _profile
    from tandem.workload.session import SLO, Round, Session
    rt = {"request_s": 0.01, "output_s": 0.003, "hop_s": 0.001}
    path = _profile(tmp_path, runtime=rt)[0]
    sessions = [Session(f"s{i}", 5.0 * i, [Round(200, 8, tool_s=0.5), Round(40, 4)], slo=SLO(5.0, 1.0))
                for i in range(4)]
    res = simulate(sessions, SimConfig("x", "x", 2, "P:tp1x1,D:tp1x1", "ampd", perf=str(path), concurrency=1))
    recs = res.records
    assert all(r.completed for r in recs) and recs[0].arrival_s == 0.0
    for a, b in zip(recs, recs[1:]):
        assert b.arrival_s == pytest.approx(a.finish_s, abs=1e-12)
        assert b.arrival_s == pytest.approx(a.rounds[-1].finish_s, abs=1e-12)   # finish_s includes output_s
        assert b.rounds[0].ttft_s > 0.01


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_config_rejects_bad_concurrency(bad):
    with pytest.raises(ConfigError, match="concurrency"):
        simulate(_sessions(2), SimConfig(**{**_fields(CFG), "concurrency": bad}))


ARGS = ["simulate", "--workload", "chat-multiturn", "--model", "qwen2.5-7b", "--gpu", "h200",
        "--deploy", "P:tp1x1,D:tp1x1", "--policy", "sglang-pd", "--sessions", "6"]


def test_cli_closed_loop(capsys):
    assert main([*ARGS, "--concurrency", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["concurrency"] == 2 and out["rate"] is None and out["sessions_completed"] == 6
    assert main([*ARGS, "--concurrency", "2"]) == 0
    assert "closed loop, 2 clients" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0"], "argument --concurrency: must be >= 1, got '0'"),
    (["--concurrency", "-1"], "argument --concurrency: must be >= 1, got '-1'"),
    (["--concurrency", "2.5"], "argument --concurrency: expected an integer, got '2.5'"),
    (["--concurrency", "4", "--rate", "2"], "cannot be combined with --rate"),
    (["--concurrency", "4", "--override-arrivals"], "cannot be combined with --override-arrivals"),
])
def test_cli_concurrency_errors(capsys, extra, message):
    assert main([*ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem: error: ") and message in err


def _fields(cfg: SimConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
