"""The tandem command line: one-line errors with exit status 2, JSON output, experiment presets."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import simulate_cmd
from tandem.cli.main import main

HAS_SIM = importlib.util.find_spec("tandem.sim.cluster") is not None
needs_sim = pytest.mark.skipif(not HAS_SIM, reason="tandem.sim.cluster is not available yet")
REPO = Path(__file__).resolve().parents[1]

BASE = ["simulate", "--workload", "toolbench", "--model", "llama-3.1-70b", "--gpu", "h20", "--gpus", "8",
        "--sessions", "5"]


def _tiny(tmp_path: Path) -> str:
    from tandem.engine.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path / "tiny", arch="qwen3", size="1m", seed=1))


def _bad_jsonl(tmp_path: Path) -> str:
    p = tmp_path / "bad.jsonl"
    good = {"session_id": "a", "arrival_s": 0.0, "rounds": [{"input_tokens": 10, "output_tokens": 5}]}
    p.write_text(json.dumps(good) + "\n{not json\n")
    return str(p)


ERROR_CASES = {
    "unknown model": (lambda t: BASE + ["--model", "gpt-17", "--deploy", "P:tp4x1,D:tp4x1"], "gpt-17"),
    "unknown gpu": (lambda t: BASE + ["--gpu", "tpu9", "--deploy", "P:tp4x1,D:tp4x1"], "tpu9"),
    "deploy needs more GPUs": (lambda t: BASE + ["--deploy", "P:tp4x2,D:tp4x2"], "16 GPUs"),
    "malformed deploy": (lambda t: BASE + ["--deploy", "P:tp4x1;D:4"], "deployment"),
    "not a power of two tp": (lambda t: BASE + ["--deploy", "P:tp3x1,D:tp4x1"], "power of two"),
    "model does not fit": (lambda t: BASE + ["--policy", "vllm", "--deploy", "C:tp1x8"], "does not fit"),
    "missing file": (lambda t: BASE[:2] + [str(t / "nope.jsonl")] + BASE[3:] + ["--deploy", "P:tp4x1,D:tp4x1"],
                     "nope.jsonl"),
    "malformed JSONL line": (lambda t: BASE[:2] + [_bad_jsonl(t)] + BASE[3:] + ["--deploy", "P:tp4x1,D:tp4x1"],
                             ":2"),
    "directory as file": (lambda t: BASE[:2] + [str(t)] + BASE[3:] + ["--deploy", "P:tp4x1,D:tp4x1"], "directory"),
    "unknown workload": (lambda t: BASE[:2] + ["nosuchload"] + BASE[3:] + ["--deploy", "P:tp4x1,D:tp4x1"],
                         "nosuchload"),
    "negative rate": (lambda t: BASE + ["--rate", "-1"], "--rate"),
    "zero sessions": (lambda t: BASE + ["--sessions", "0"], "--sessions"),
    "missing workload": (lambda t: ["simulate"], "--workload"),
    "unknown command": (lambda t: ["fly"], "fly"),
    "one SLO flag without default": (
        lambda t: BASE[:2] + ["agentic-long"] + BASE[3:] + ["--deploy", "P:tp4x1,D:tp4x1", "--slo-ttft", "1"],
        "--slo-itl"),
    "unknown preset": (lambda t: ["experiment", "--preset", "huge", "--out", str(t / "o")], "huge"),
    "unknown prefill basis": (lambda t: BASE + ["--prefill-basis", "history"], "--prefill-basis"),
    "unknown preemption mode": (lambda t: BASE + ["--preemption-mode", "evict"], "--preemption-mode"),
    "negative swap space": (lambda t: BASE + ["--swap-space", "-1"], "--swap-space"),
    "swap without swap space": (lambda t: BASE + ["--deploy", "P:tp4x1,D:tp4x1", "--preemption-mode", "swap",
                                                  "--swap-space", "0"], "--preemption-mode swap needs --swap-space"),
    "serve: swap without swap space": (lambda t: ["serve", "--model", _tiny(t), "--colocated", "1", "--policy",
                                                  "vllm", "--preemption-mode", "swap", "--swap-space", "0"],
                                       "--preemption-mode swap needs --swap-space"),
    "records into a missing folder": (lambda t: BASE + ["--deploy", "P:tp4x1,D:tp4x1", "--records",
                                                        str(t / "no" / "r.jsonl")], "No such directory"),
    "experiment gpus malformed": (lambda t: ["experiment", "--gpus", "toolbench:16", "--out", str(t / "o")],
                                  "--gpus"),
    "experiment gpus for a workload not swept": (
        lambda t: ["experiment", "--workloads", "toolbench", "--gpus", "gaia=16", "--out", str(t / "o")], "gaia"),
}
SIM_ERROR_CASES = {
    "unknown policy": (lambda t: BASE + ["--policy", "fastest", "--deploy", "P:tp4x1,D:tp4x1"], "fastest"),
    "policy vs deployment kind": (lambda t: BASE + ["--policy", "ampd", "--deploy", "C:tp4x2"], "C:tp4x2"),
    "experiment unknown workload": (
        lambda t: ["experiment", "--workloads", "toolbench,bogus", "--out", str(t / "o")], "bogus"),
    "experiment unknown policy": (
        lambda t: ["experiment", "--policies", "ampd,bogus", "--out", str(t / "o")], "bogus"),
}


def _check_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tandem: error: "), err
    assert "Traceback" not in err
    assert needle in lines[0], (needle, err)


def _cases():
    out = [pytest.param(name, case, id=name) for name, case in ERROR_CASES.items()]
    out += [pytest.param(name, case, id=name, marks=needs_sim) for name, case in SIM_ERROR_CASES.items()]
    return out


@pytest.mark.parametrize("name,case", _cases())
def test_errors_in_process(name, case, tmp_path, capsys):
    argv, needle = case[0](tmp_path), case[1]
    rc = main(argv)
    cap = capsys.readouterr()
    _check_error(rc, cap.err, needle)
    assert cap.out == ""


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "tandem.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


# every case runs in-process above; a real process checks the exit path (one line on stderr, exit 2) for a
# flag error and a file error (each subprocess costs ~3 s of interpreter start on 2 cores)
SUBPROCESS_CASES = ["unknown model", "malformed JSONL line"]


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_errors_subprocess(name, tmp_path):
    argv, needle = ERROR_CASES[name][0](tmp_path), ERROR_CASES[name][1]
    p = _run(argv)
    _check_error(p.returncode, p.stderr, needle)


@needs_sim
def test_unknown_policy_subprocess(tmp_path):
    argv, needle = SIM_ERROR_CASES["unknown policy"][0](tmp_path), "fastest"
    p = _run(argv)
    _check_error(p.returncode, p.stderr, needle)


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    def boom(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(simulate_cmd, "cmd_simulate", boom)
    assert main(BASE + ["--deploy", "P:tp4x1,D:tp4x1"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out


def test_internal_errors_are_not_swallowed(monkeypatch):
    def bug(args):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(simulate_cmd, "cmd_simulate", bug)
    with pytest.raises(ZeroDivisionError):
        main(BASE + ["--deploy", "P:tp4x1,D:tp4x1"])


REQUIRED_KEYS = {"slo_attainment", "ttft_initial_p95_s", "ttft_incremental_p95_s", "itl_mean_s",
                 "local_prefill_fraction", "sessions_completed", "sessions_failed", "wall_s", "sim_time_s",
                 "events", "deploy", "policy", "model", "gpu", "workload", "rate", "seed"}


@needs_sim
def test_simulate_json_has_required_keys(capsys):
    rc = main(BASE + ["--deploy", "P:tp4x1,D:tp4x1", "--rate", "1.0", "--seed", "3", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = json.loads(cap.out)
    assert REQUIRED_KEYS <= set(out)
    assert out["sessions_completed"] + out["sessions_failed"] == 5
    assert out["policy"] == "ampd" and out["seed"] == 3 and out["rate"] == 1.0
    assert out["deploy"] == "P:tp4x1,D:tp4x1"
    assert 0.0 <= out["slo_attainment"] <= 1.0          # toolbench x llama-3.1-70b has a paper SLO


@needs_sim
def test_simulate_json_subprocess():
    p = _run(BASE + ["--policy", "vllm", "--deploy", "C:tp4x2", "--json"])
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert REQUIRED_KEYS <= set(out)
    assert out["local_prefill_fraction"] in (None, 1.0)    # co-located prefills count as local


@needs_sim
def test_simulate_table(capsys):
    assert main(BASE + ["--deploy", "P:tp4x1,D:tp4x1"]) == 0
    out = capsys.readouterr().out
    assert "SLO attainment" in out and "TTFT initial p95" in out


def _trace(tmp_path: Path) -> str:
    p = tmp_path / "t.jsonl"
    rows = [{"session_id": f"s{i}", "arrival_s": 100.0 + i, "slo": {"ttft_s": 5.0, "itl_s": 0.2},
             "rounds": [{"input_tokens": 300, "output_tokens": 20, "tool_s": 0.5},
                        {"input_tokens": 50, "output_tokens": 10}]} for i in range(4)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


@needs_sim
def test_simulate_trace_file_keeps_arrivals_and_notes_ignored_rate(tmp_path, capsys):
    argv = ["simulate", "--workload", _trace(tmp_path), "--deploy", "P:tp4x1,D:tp4x1", "--rate", "3", "--json"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["rate"] is None and out["sessions_completed"] == 4
    assert out["sim_time_s"] > 100.0                     # the trace's own arrival times were kept
    assert "--rate 3 is ignored" in cap.err and "error" not in cap.err


@needs_sim
def test_simulate_trace_override_arrivals(tmp_path, capsys):
    argv = ["simulate", "--workload", _trace(tmp_path), "--deploy", "P:tp4x1,D:tp4x1", "--rate", "2",
            "--override-arrivals", "--slo-ttft", "9", "--slo-itl", "0.5", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rate"] == 2.0 and out["sim_time_s"] < 100.0
    assert out["slo_attainment"] == 1.0


@needs_sim
def test_experiment_demo_subset(tmp_path, capsys):
    out_dir = tmp_path / "rep"
    argv = ["experiment", "--preset", "demo", "--workloads", "toolbench", "--policies", "ampd,vllm",
            "--rates", "1.0", "--sessions", "6", "--out", str(out_dir)]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "toolbench" in printed and str(out_dir) in printed
    res = json.loads((out_dir / "results.json").read_text())
    assert {(c["policy"], c["rate"]) for c in res["cells"]} == {("ampd", 1.0), ("vllm", 1.0)}
    for name in ("table.md", "table.txt", "summary.md", "slo_vs_rate.png"):
        assert (out_dir / name).is_file(), name
    assert "vllm" in res["improvement"]


@needs_sim
def test_experiment_gpus_override_searches_deployments_of_that_size(tmp_path, capsys):
    out_dir = tmp_path / "rep"
    argv = ["experiment", "--preset", "demo", "--workloads", "toolbench", "--policies", "ampd",
            "--rates", "1.0", "--sessions", "4", "--gpus", "toolbench=16", "--deploy-per-rate", "--out", str(out_dir)]
    assert main(argv) == 0, capsys.readouterr().err
    res = json.loads((out_dir / "results.json").read_text())
    (d,) = res["deployments"]
    assert d["gpus"] == 16 and d["source"] == "search"          # the demo's fixed 8-GPU deployment does not apply
    from tandem.core.deploy import parse_deploy
    assert parse_deploy(d["deploy"]).gpus == 16
    assert res["cells"][0]["gpus"] == 16


def test_generate_then_replay_the_file_reports_every_session(tmp_path, capsys):
    out = tmp_path / "tb.jsonl"
    assert main(["generate", "--workload", "toolbench", "--sessions", "12", "--rate", "2", "--out", str(out)]) == 0
    assert "wrote 12 sessions" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 12
    rc = main(["simulate", "--workload", str(out), "--model", "llama-3.1-70b", "--gpu", "h20", "--gpus", "8",
               "--deploy", "P:tp4x1,D:tp4x1", "--policy", "ampd", "--json"])
    m = json.loads(capsys.readouterr().out)
    assert rc == 0 and m["sessions_completed"] + m["sessions_failed"] == 12
    assert m["slo_attainment"] is not None          # the generator attached AMPD's SLOs to the file


def test_generate_rejects_a_session_file_as_workload(tmp_path, capsys):
    rc = main(["generate", "--workload", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "y.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tandem: error:") and len(err.strip().splitlines()) == 1


def test_generate_prefill_basis_prompt_makes_whole_prompts_average_table_1(tmp_path, capsys):
    from tandem.workload.session import load_sessions
    files = {}
    for basis in ("input", "prompt"):
        files[basis] = tmp_path / f"{basis}.jsonl"
        assert main(["generate", "--workload", "hotpotqa", "--sessions", "3000", "--rate", "1",
                     "--prefill-basis", basis, "--out", str(files[basis])]) == 0
    capsys.readouterr()
    means = {}  # basis -> (mean whole prompt, mean new tokens) per round
    for basis, path in files.items():
        per_round = []
        for s in load_sessions(path):
            history = 0
            for r in s.rounds:
                per_round.append((history + r.input_tokens, r.input_tokens))
                history += r.input_tokens + r.output_tokens
        means[basis] = [sum(x[i] for x in per_round) / len(per_round) for i in (0, 1)]
    assert means["input"][1] == pytest.approx(1569.8, rel=0.02)     # new tokens per round
    assert means["prompt"][0] == pytest.approx(1569.8, rel=0.02)    # whole prompt per round


def test_prefill_basis_on_a_trace_is_noted_and_ignored(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["generate", "--workload", "azure-conv", "--sessions", "5", "--prefill-basis", "prompt",
                 "--out", str(out)]) == 0
    assert "--prefill-basis only applies to the AMPD generators" in capsys.readouterr().err


@needs_sim
def test_simulate_records_file_holds_every_session_and_agrees_with_the_printed_metrics(tmp_path, capsys):
    from tandem.workload.metrics import summarize
    from tandem.workload.records import load_records
    path = tmp_path / "records.jsonl"
    rc = main(BASE + ["--sessions", "12", "--deploy", "P:tp4x1,D:tp4x1", "--json", "--records", str(path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    recs = load_records(path)
    assert [r.session_id for r in recs] == [f"toolbench-{i}" for i in range(12)]
    assert sum(len(r.rounds) for r in recs) == out["rounds_total"]
    again = summarize(recs, out["sim_time_s"])
    assert again["slo_attainment"] == out["slo_attainment"] and again["ttft_p95_s"] == out["ttft_p95_s"]
