"""cpu_omp_threads_bind (vLLM's VLLM_CPU_OMP_THREADS_BIND): the option's text parsed, each rank's and each live
worker's CPUs decided and checked against a given allowed set, one-line errors (CLI exit 2), and for real, in fresh
processes, the OpenMP threads that run torch's operators bound one per CPU (off by default; the whole process when
there is no compiler; a tensor-parallel rank on its own CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.cli.main import main
from tandem.engine.config import EngineConfig, EngineError
from tandem.engine.cpu_bind import (BindMode, CpuBind, CpuBindError, cpu_bind_text, format_cpus, parse_cpu_bind,
                                    plan_ranks, plan_workers, rank_threads)
from tandem.knob import KnobError
from tandem.runtime.cluster_config import ClusterConfig, worker_cpu_binds

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")


@pytest.mark.parametrize("text, want", [
    (None, CpuBind()), ("nobind", CpuBind()), ("NoBind", CpuBind()), ("auto", CpuBind(BindMode.AUTO)),
    ("0-3", CpuBind(BindMode.LISTS, ((0, 1, 2, 3),))), ("0,2,4,6", CpuBind(BindMode.LISTS, ((0, 2, 4, 6),))),
    (" 3, 1-2 ", CpuBind(BindMode.LISTS, ((3, 1, 2),))), ("7", CpuBind(BindMode.LISTS, ((7,),))),
    ("0-1|2-3", CpuBind(BindMode.LISTS, ((0, 1), (2, 3)))), ("4|0,2", CpuBind(BindMode.LISTS, ((4,), (0, 2)))),
])
def test_values_parse_as_vllm_writes_them(text, want):
    assert parse_cpu_bind(text) == want


@pytest.mark.parametrize("text, why", [
    ("", "cpu_omp_threads_bind must be auto, nobind or CPU lists such as 0-3, got an empty value"),
    ("all", "cpu_omp_threads_bind: 'all' is not a CPU list such as 0-3 or 0,2,4,6"),
    ("0-", "cpu_omp_threads_bind: '0-' is not a CPU list such as 0-3 or 0,2,4,6"),
    ("-1", "cpu_omp_threads_bind: '-1' is not a CPU list such as 0-3 or 0,2,4,6"),
    ("0,,1", "cpu_omp_threads_bind: '0,,1' is not a CPU list such as 0-3 or 0,2,4,6"),
    ("0||1", "cpu_omp_threads_bind: '' is not a CPU list such as 0-3 or 0,2,4,6"),
    ("3-1", "cpu_omp_threads_bind: range '3-1' runs backwards"),
    ("0-2,1", "cpu_omp_threads_bind: CPU 1 is listed twice in '0-2,1'"),
    ("0-99999999", "cpu_omp_threads_bind: CPU 99999999 is past the 1024 CPUs a CPU set can name"),
])
def test_a_bad_value_is_one_line(text, why):
    with pytest.raises(CpuBindError) as e:
        parse_cpu_bind(text)
    assert str(e.value) == why
    with pytest.raises(KnobError):
        cpu_bind_text(text)
    with pytest.raises(EngineError, match="^cpu_omp_threads_bind"):
        EngineConfig(model="m", cpu_omp_threads_bind=text)


def test_cpu_lists_are_written_back_compactly():
    assert format_cpus((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert format_cpus((3, 1, 2)) == "3,1-2"
    assert format_cpus(()) == ""


FAKE = {4, 5, 6, 7, 9}          # a process allowed on these CPUs (e.g. under taskset)


def test_nobind_binds_nothing():
    assert plan_ranks(CpuBind(), FAKE, 2, 2) is None
    assert plan_workers(CpuBind(), FAKE, 1, [1, 2]) == [None, None]


def test_auto_takes_the_first_cpus_of_the_allowed_set_and_gives_each_rank_its_own_slice():
    auto = parse_cpu_bind("auto")
    assert plan_ranks(auto, FAKE, 2) == ((4, 5),)
    assert plan_ranks(auto, FAKE, 2, size=2) == ((4, 5), (6, 7))
    assert plan_ranks(auto, FAKE, 1, size=3) == ((4,), (5,), (6,))
    assert plan_ranks(auto, FAKE, 1, size=2, first=3) == ((7,), (9,))


def test_auto_past_the_allowed_set_is_refused():
    auto = parse_cpu_bind("auto")
    with pytest.raises(CpuBindError) as e:
        plan_ranks(auto, FAKE, 3, size=2)
    assert str(e.value) == ("cpu_omp_threads_bind auto: 2 ranks x 3 threads need 6 CPUs, but this process may use 5 "
                            "(4-7,9)")
    with pytest.raises(CpuBindError, match=r"^cpu_omp_threads_bind auto: 6 threads need 6 CPUs, but this process may "
                                           r"use 5 \(4-7,9\)$"):
        plan_ranks(auto, FAKE, 6)
    with pytest.raises(CpuBindError, match="the thread count must be >= 1, got 0"):
        plan_ranks(auto, FAKE, 0)


def test_explicit_lists_are_checked_against_the_allowed_set_and_each_other():
    assert plan_ranks(parse_cpu_bind("9,4"), FAKE, 8) == ((9, 4),)
    assert plan_ranks(parse_cpu_bind("4-5|6-7"), FAKE, 1, size=2) == ((4, 5), (6, 7))
    cases = [("3", 1, "cpu_omp_threads_bind: CPU 3 is not one this process may use (4-7,9)"),
             ("4-8", 1, "cpu_omp_threads_bind: CPU 8 is not one this process may use (4-7,9)"),
             ("4-5", 2, "cpu_omp_threads_bind: 2 tensor-parallel rank(s) need 2 CPU list(s) separated by '|', got 1"),
             ("4|5", 1, "cpu_omp_threads_bind: 1 tensor-parallel rank(s) need 1 CPU list(s) separated by '|', got 2"),
             ("4-5|5-6", 2, "cpu_omp_threads_bind: ranks 0 and 1 both list CPU 5")]
    for text, size, why in cases:
        with pytest.raises(CpuBindError) as e:
            plan_ranks(parse_cpu_bind(text), FAKE, 1, size=size)
        assert str(e.value) == why


def test_a_list_sets_its_ranks_thread_count():
    lists = parse_cpu_bind("0-3|4,6")
    assert [rank_threads(lists, r, 9) for r in (0, 1)] == [4, 2]
    assert rank_threads(parse_cpu_bind("auto"), 1, 9) == 9


def test_a_servers_workers_get_disjoint_cpus_under_auto():
    auto = parse_cpu_bind("auto")
    assert plan_workers(auto, FAKE, 1, [1, 1, 2]) == ["4", "5", "6|7"]
    assert plan_workers(auto, FAKE, 2, [1, 1]) == ["4-5", "6-7"]
    with pytest.raises(CpuBindError) as e:
        plan_workers(auto, FAKE, 2, [1, 2])
    assert str(e.value) == ("cpu_omp_threads_bind auto: 2 workers of 3 rank(s) in all x 2 thread(s) need 6 CPUs, but "
                            "this process may use 5 (4-7,9)")
    assert plan_workers(parse_cpu_bind("9|4"), FAKE, 1, [2]) == ["9|4"]
    with pytest.raises(CpuBindError, match="explicit CPU lists bind one worker's ranks; with 2 workers use auto"):
        plan_workers(parse_cpu_bind("4"), FAKE, 1, [1, 1])


def test_the_cluster_refuses_binding_under_ray_and_passes_nobind_through():
    cfg = ClusterConfig(model="m", engine_args={"cpu_omp_threads_bind": "auto"}, launcher="ray")
    with pytest.raises(ValueError, match="applies to the embedded launcher"):
        worker_cpu_binds(cfg, [1])
    assert worker_cpu_binds(ClusterConfig(model="m"), [1, 1]) == [None, None]
    one = ClusterConfig(model="m", engine_args={"cpu_omp_threads_bind": "auto"})
    assert worker_cpu_binds(one, [1]) == [str(ALLOWED[0])]


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint folder as far as `tandem serve`'s checks read it."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return str(tmp_path)


@pytest.mark.parametrize("value, why", [
    ("0-", "argument --cpu-omp-threads-bind: '0-' is not a CPU list such as 0-3 or 0,2,4,6"),
    (f"{max(ALLOWED) + 1} --colocated 1", f"cpu_omp_threads_bind: CPU {max(ALLOWED) + 1} is not one this process may use "
                            f"({format_cpus(ALLOWED)})"),
    ("0 --prefill-workers 1", "cpu_omp_threads_bind: explicit CPU lists bind one worker's ranks; with 2 workers use "
                              "auto (each worker then gets CPUs of its own)"),
    ("auto --prefill-workers 9 --decode-workers 9", f"cpu_omp_threads_bind auto: 18 workers of 18 rank(s) in all x 1 "
                                                      f"thread(s) need 18 CPUs, but this process may use {len(ALLOWED)}"),
])
def test_serve_refuses_a_bad_binding_in_one_line_before_any_worker(value, why, ckpt, capsys):
    import psutil
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(["serve", "--model", ckpt, "--cpu-omp-threads-bind", *value.split()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: ") and why in err[0], err
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


# --------------------------------------------------------------------------- for real, in fresh processes

PROBE = """
import json, os, sys
import torch
from tandem.engine import omp_affinity
def threads():
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
"""


def _run(code: str, env: dict | None = None, timeout: float = 120) -> dict:
    """Run `code` (after PROBE) in a fresh interpreter; the JSON it prints last."""
    done = subprocess.run([sys.executable, "-c", PROBE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tandem.engine.tiny_model import make_tiny_model
    path = tmp_path_factory.mktemp("tiny-bind")
    make_tiny_model(path, arch="qwen3", size="1m", seed=3)
    return str(path)


ENGINE = """
from tandem import LLM, SamplingParams
torch.set_num_threads({threads})
kw = {kw}
llm = LLM({model!r}, num_kv_blocks=16, max_model_len=64, **kw)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids
b = llm.engine.cpu_binding
team = omp_affinity.team_thread_ids(torch.get_num_threads())
print(json.dumps({{"tokens": list(out), "binding": None if b is None else [list(b.cpus), b.how.value],
                  "torch_threads": torch.get_num_threads(), "team": [sorted(os.sched_getaffinity(t)) for t in team],
                  "threads": threads(), "gomp": sorted({{l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l}})}}))
"""


def test_one_allowed_cpu_binds_the_team_that_runs_torchs_operators(tiny):
    """The option set to one allowed CPU (the last): the engine's OpenMP team is one thread on exactly that CPU,
    torch runs one thread, the binding is recorded, and torch and the kernels share the one libgomp."""
    cpu = ALLOWED[-1]
    r = _run(ENGINE.format(threads=2, kw={"cpu_omp_threads_bind": str(cpu)}, model=tiny))
    assert r["binding"] == [[cpu], "openmp"]
    assert r["torch_threads"] == 1
    assert r["team"] == [[cpu]]
    assert len(r["gomp"]) == 1, r["gomp"]
    assert len(r["tokens"]) == 4


@pytest.fixture(scope="module")
def unbound(tiny) -> dict:
    """A two-thread engine run without the option (the default), shared by the tests that compare against it."""
    return _run(ENGINE.format(threads=2, kw={}, model=tiny))


@two_cores
def test_each_thread_of_the_team_gets_its_own_cpu_in_list_order(tiny, unbound):
    """Two CPUs listed in reverse: thread 0 (the caller) on the second, thread 1 on the first; the same tokens as
    an unbound engine."""
    a, b = ALLOWED[0], ALLOWED[1]
    r = _run(ENGINE.format(threads=1, kw={"cpu_omp_threads_bind": f"{b},{a}"}, model=tiny))
    assert r["binding"] == [[b, a], "openmp"] and r["torch_threads"] == 2
    assert r["team"] == [[b], [a]]
    assert unbound["tokens"] == r["tokens"]


def test_without_the_option_nothing_is_bound(tiny, unbound):
    """The default (and nobind): no binding recorded, every thread of the process on every allowed CPU."""
    for r in (unbound, _run(ENGINE.format(threads=2, kw={"cpu_omp_threads_bind": "nobind"}, model=tiny))):
        assert r["binding"] is None and r["torch_threads"] == 2
        assert all(cpus == ALLOWED for cpus in r["threads"].values()), r["threads"]


def test_without_a_compiler_the_whole_process_is_confined_and_said_once():
    cpu = ALLOWED[-1]
    r = _run(f"""
import logging
said = []
logging.getLogger("tandem.engine.omp_affinity").addHandler(logging.Handler())
logging.getLogger("tandem.engine.omp_affinity").handlers[0].emit = said.append
b = omp_affinity.bind_threads([{cpu}])
omp_affinity.bind_threads([{cpu}])
print(json.dumps({{"how": b.how.value, "threads": threads(), "why": omp_affinity.unavailable_reason(),
                  "said": [r.getMessage() for r in said]}}))
""", env={"CC": "/nonexistent/cc"})
    assert r["how"] == "process" and "FileNotFoundError" in r["why"]
    assert all(cpus == [cpu] for cpus in r["threads"].values()), r["threads"]
    assert r["said"] == [f"process confined to CPUs {cpu} (no per-thread binding: {r['why']})"]


@two_cores
def test_auto_gives_each_tensor_parallel_rank_its_own_cpu(tiny):
    """tp=2 under auto on two CPUs: the driver's team on the first, rank 1's process on the second."""
    r = _run(f"""
from tandem import LLM
llm = LLM({tiny!r}, num_kv_blocks=16, max_model_len=64, tensor_parallel_size=2, cpu_omp_threads_bind="auto")
pid = llm.engine.runner.rank_pids[0]
print(json.dumps({{"driver": list(llm.engine.cpu_binding.cpus), "me": sorted(os.sched_getaffinity(0)),
                  "rank1": sorted(os.sched_getaffinity(pid))}}))
llm.close()
""")
    assert r == {"driver": [ALLOWED[0]], "me": [ALLOWED[0]], "rank1": [ALLOWED[1]]}


@two_cores
def test_a_servers_workers_each_run_on_their_own_cpu(tiny):
    """`tandem serve --cpu-omp-threads-bind auto` with 1P+1D at one thread each: worker i's loop and step threads
    on CPU i alone (the step thread bound from itself), no thread of a worker on the other's CPU, and requests
    served."""
    import httpx
    import psutil

    from live_server import LiveServer
    srv = LiveServer(ClusterConfig(tiny, 1, 1, 0, "ampd", served_model_name="tiny", threads=1,
                                   engine_args={"max_model_len": 128, "num_kv_blocks": 32,
                                                "cpu_omp_threads_bind": "auto"}))
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": [5, 6, 7, 8],
                                                                      "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        for wid, cpu in ((0, ALLOWED[0]), (1, ALLOWED[1])):
            pid = srv.pid(wid)
            masks = [sorted(os.sched_getaffinity(t.id)) for t in psutil.Process(pid).threads()]
            assert sorted(os.sched_getaffinity(pid)) == [cpu]
            assert masks.count([cpu]) >= 2, masks                 # the loop and the step thread at least
            assert all(m in ([cpu], ALLOWED) for m in masks), masks
    finally:
        srv.stop()
