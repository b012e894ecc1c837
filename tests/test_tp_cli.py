"""Tensor parallelism at the command line and what it does not run yet: a degree that does not divide the model's
attention heads or exceeds the cores is one `tandem: error:` line and exit status 2 with no process started; LLaDA
and dLLM-Serve phases under TP, and LAPS bucket CUDA graphs under TP, are refused in one line naming what is not
supported (block diffusion with Optimus windows runs under TP: tests/test_engine_tp.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
torch = pytest.importorskip("torch")

from tandem.cli.main import main  # noqa: E402
from tandem.core.types import PREFILL  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.model_runner import TP_LAPS_GRAPHS, ModelRunner  # noqa: E402
from tandem.engine.parallel import group  # noqa: E402
from tandem.engine.prefill_graphs import prefill_graphs_apply  # noqa: E402
from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

SDAR = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tp-cli")
    make_tiny_model(path, arch="qwen3", size="1m", seed=1)
    return str(path)


def _children() -> set[int]:
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                out.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _serve_error(argv: list[str], capsys) -> str:
    """`tandem serve ARGV`'s one error line (asserting exit status 2, one line, no process started)."""
    before = _children()
    assert main(["serve", *argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem: error: "), err
    assert _children() <= before
    return err.removeprefix("tandem: error: ").rstrip("\n")


def test_a_degree_the_heads_or_the_cores_cannot_take_is_one_line(tiny, monkeypatch, capsys):
    """Protects the checks made before any worker or rank starts, for --deploy and -tp alike (the tiny Qwen3 has 4
    attention heads; cores faked)."""
    monkeypatch.setattr(group, "usable_cpus", lambda: 16)
    assert _serve_error(["--model", tiny, "--deploy", "P:tp8x1,D:tp1x1"], capsys) == \
        "--deploy: tensor_parallel_size 8 does not divide the model's 4 attention heads"
    assert _serve_error(["--model", tiny, "--colocated", "1", "-tp", "3"], capsys) == \
        "--tensor-parallel-size: tensor_parallel_size 3 does not divide the model's 4 attention heads"
    monkeypatch.setattr(group, "usable_cpus", lambda: 2)
    assert _serve_error(["--model", tiny, "--deploy", "P:tp1x1,D:tp4x1"], capsys) == \
        "--deploy: tensor_parallel_size 4 exceeds the 2 CPU cores this process may use (one rank per core at least)"
    assert _serve_error(["--model", tiny, "--deploy", "P:tp3x1,D:tp1x1"], capsys) == \
        "--deploy: tensor-parallel degree must be a power of two, got tp3 in 'P:tp3x1'"
    assert _serve_error(["--model", tiny, "--colocated", "1", "--deploy", "C:tp2x1"], capsys) == \
        "--deploy names the workers and their tensor-parallel degrees: drop --colocated and --tensor-parallel-size"


def test_diffusion_phases_and_llada_under_tp_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Protects the refusals of what TP does not run yet: a LLaDA model (its phases keep packed KV on the driver
    only) and SDAR with --dllm-admission (dLLM-Serve phases)."""
    monkeypatch.setattr(group, "usable_cpus", lambda: 2)
    llada = tmp_path / "llada"
    make_tiny_model(llada, arch="llada", size="1m", seed=1)
    assert _serve_error(["--model", str(llada), "--deploy", "C:tp2x1"], capsys) == \
        "--deploy: tensor parallelism does not run LLaDA-style models yet"
    assert _serve_error(["--model", str(SDAR), "--colocated", "1", "-tp", "2", "--dllm-admission", "phase"],
                        capsys).startswith("--tensor-parallel-size: tensor_parallel_size > 1 does not run "
                                           "dLLM-Serve's phases (dllm_admission) yet")


def test_laps_bucket_graphs_under_tp_are_refused_before_any_rank_starts(tiny, monkeypatch):
    """Protects the LAPS refusal: a prefill worker of the laps policy on CUDA (the device faked: the check runs
    before anything touches it) at tp=2 raises TP_LAPS_GRAPHS, one line naming the way out; laps-no-graph and
    enforce_eager capture no bucket graph and pass the check."""
    monkeypatch.setattr(group, "usable_cpus", lambda: 2)
    cfg = EngineConfig(model=tiny, tensor_parallel_size=2, policy="laps")
    others = (EngineConfig(model=tiny, tensor_parallel_size=2, policy="laps-no-graph"),
              EngineConfig(model=tiny, tensor_parallel_size=2, policy="laps", enforce_eager=True))
    monkeypatch.setattr(EngineConfig, "torch_device", lambda self: torch.device("cuda", 0))
    before = _children()
    with pytest.raises(EngineError) as e:
        ModelRunner(cfg, role=PREFILL)
    assert str(e.value) == TP_LAPS_GRAPHS and "\n" not in TP_LAPS_GRAPHS and "laps-no-graph" in TP_LAPS_GRAPHS
    assert _children() <= before
    for other in others:
        assert prefill_graphs_apply(other, torch.device("cuda", 0), PREFILL) is False


def test_the_ray_launcher_reserves_a_whole_group_in_one_placement_group(monkeypatch):
    """Protects Ray placement of a tensor-parallel worker (Ray's placement calls faked: no cluster started): a tp=2
    worker's one placement group (STRICT_PACK, one bundle) holds 2 x threads CPUs, or 2 GPUs on a GPU cluster, and
    its actor runs in it; a tp=1 worker reserves one rank's share."""
    pytest.importorskip("ray")
    import importlib
    pgmod = importlib.import_module("ray.util.placement_group")

    from tandem.runtime.launcher import WorkerEnv, WorkerSpec
    from tandem.runtime.ray_launcher import RayLauncher
    groups, actors = [], []
    monkeypatch.setattr(pgmod, "placement_group", lambda bundles, strategy, name: groups.append((bundles, strategy))
                        or object())

    class Actor:
        def __init__(self, **options):
            actors.append(options)
            self.run = type("Run", (), {"remote": staticmethod(lambda *a: None)})()

    class ActorClass:
        @staticmethod
        def options(**options):
            return type("Pending", (), {"remote": staticmethod(lambda: Actor(**options))})()
    for gpus, want in ((False, [{"CPU": 4.0}, {"CPU": 2.0}]), (True, [{"CPU": 4.0, "GPU": 2.0},
                                                                        {"CPU": 2.0, "GPU": 1.0}])):
        groups.clear()
        actors.clear()
        launcher = RayLauncher(threads=2, gpus=gpus)
        launcher._ray, launcher._actor_cls = object(), ActorClass
        for wid, tp in enumerate((2, 1)):
            spec = WorkerSpec(wid, "tandem.runtime.worker_main:main",
                              {"role": "decode", "engine_args": {"tensor_parallel_size": tp}})
            launcher.spawn(spec, WorkerEnv(wid, "tcp://127.0.0.1:1"))
        assert groups == [([want[0]], "STRICT_PACK"), ([want[1]], "STRICT_PACK")]
        assert [(a["num_cpus"], a["num_gpus"]) for a in actors] == [(w["CPU"], w.get("GPU", 0)) for w in want]
