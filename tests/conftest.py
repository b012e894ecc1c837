"""Fixtures shared by the test modules, and how a run collects and orders them (bytecode, serial run, slow first)."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

_DONT_WRITE_BYTECODE = sys.dont_write_bytecode

# The modules that take longest run first, so that with `-n 2 --dist loadscope` (each module's tests on one worker: its
# module-scoped servers start once) the two workers end together instead of one finishing a 30 s module alone. Live
# ones (worker processes, servers, Ray: they wait on heartbeats and timeouts) alternate with busy ones (one process
# computing), so that the two workers mostly run one of each: two live modules at once on 2 cores miss heartbeats.
# Each list slowest first; a module missing here only runs later, its tests unaffected. (Measured with --durations;
# refresh when a module becomes slow.)
LIVE_FIRST = (
    "test_runtime_faults.py",
    "test_ray_cluster.py",
    "test_runtime_cluster.py",
    "test_tp_rank_kv_serve.py",
    "test_tp_serve.py",
    "test_runtime_supervisor.py",
    "test_runtime_resilience.py",
    "test_docs_serve.py",
    "test_runtime_serve_e2e.py",
    "test_server_diffusion.py",
    "test_host_tier_serve.py",
    "test_cli_serve_signals.py",
    "test_policy_live.py",
    "test_runtime_transport.py",
    "test_transport_security.py",
    "test_runtime_laps.py",
    "test_server_metrics.py",
    "test_prefix_cache_http.py",
    "test_transport_limits.py",
)
BUSY_FIRST = (
    "test_engine_diffusion.py",
    "test_optimus_sim.py",
    "test_tp_kv_regroup.py",
    "test_engine_tp.py",
    "test_tp_rank_kv.py",
    "test_engine_llm.py",
    "test_sim.py",
    "test_workload_generators.py",
    "test_diffusion_train.py",
    "test_server_hostile.py",
    "test_profile_dllm.py",
    "test_server_body_limits.py",
    "test_engine_dllm_repro.py",
    "test_server_api.py",
    "test_profiler.py",
    "test_server_echo_logit_bias.py",
    "test_server_forced_tools.py",
    "test_engine_dllm_serve.py",
    "test_engine_structured.py",
    "test_gpu_roofline.py",
    "test_engine_host_tier.py",
)
SLOW_FIRST = tuple(name for pair in itertools.zip_longest(LIVE_FIRST, BUSY_FIRST) for name in pair if name)
_RANK = {name: i for i, name in enumerate(SLOW_FIRST)}


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A test module and what it imports first (tandem's modules) are compiled to bytecode in their __pycache__ even
    where PYTHONDONTWRITEBYTECODE is set: otherwise each pytest process (each xdist worker, the serial run) rewrites
    and compiles every test module again (~8 s of CPU each), and every worker process, fork server and `tandem`
    subprocess the tests start compiles tandem from source. Only while a module is collected: installed packages have
    their bytecode already (the exception: a pytest plugin's module first imported then, e.g. anyio.from_thread, gets
    its assert-rewritten copy cached beside it); where a tree is read-only Python skips the write."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    sys.dont_write_bytecode = False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = _DONT_WRITE_BYTECODE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow modules first (SLOW_FIRST), the rest in their usual order; each module's tests keep theirs."""
    items.sort(key=lambda item: _RANK.get(item.path.name, len(SLOW_FIRST)))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`pytest -m serial` (make test's second run) imports only the modules that mark a test serial: collecting the
    other ~120 modules only to deselect all their tests took longer than the serial tests themselves."""
    if (config.getoption("markexpr", "") or "").strip() != "serial":
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return "mark.serial" not in collection_path.read_text(encoding="utf-8")
    return None


_WINDOW_LATENCY: dict[tuple, object] = {}


@pytest.fixture(scope="module")
def window_latency_once(request: pytest.FixtureRequest):
    """A block-diffusion engine measures Optimus's T(c, b) on its own forward when it starts (about 1 s of CPU for
    the tiny SDAR, most of such an engine's start): in a module that starts many engines of one model, the first
    measures and the others take its fit (the same shapes give the same fit up to timing noise, which no decoding
    test may depend on). The measurement itself: tests/test_profile_dllm.py."""
    from tandem.engine import diffusion_setup

    measure = diffusion_setup.measure_window_latency

    def once(model, block, max_tokens, device, **kw):
        shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters())
        key = (type(model).__name__, shapes, block, max_tokens, str(device), tuple(sorted(kw.items())))
        if key not in _WINDOW_LATENCY:
            _WINDOW_LATENCY[key] = measure(model, block, max_tokens, device, **kw)
        return _WINDOW_LATENCY[key]
    mp = pytest.MonkeyPatch()
    mp.setattr(diffusion_setup, "measure_window_latency", once)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: on 2 shared cores OpenMP's barriers make every small op wait a time slice."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
