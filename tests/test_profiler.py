"""The profiler: step-time fitting, profile files, `tandem profile --quick` and `tandem simulate --perf PROFILE`."""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from tandem.perf.ampd_cost import AMPDCostModel
from tandem.perf.fit import PiecewiseLinear
from tandem.perf.batch_shape import BatchShape
from tandem.perf.step_model import FEATURES, Profile, StepTimeModel, shape_features

SIM_ARGS = ["--workload", "toolbench", "--sessions", "5", "--deploy", "P:tp1x1,D:tp1x1",
            "--slo-ttft", "2", "--slo-itl", "0.1"]


def _random_shapes(n: int, seed: int = 0) -> list[BatchShape]:
    """Prefill, decode and mixed batches like the profiler's grid."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = BatchShape()
        if i % 3 != 1:
            for _ in range(rng.randint(1, 3)):
                s.add_prefill(rng.choice([0, rng.randint(1, 3000)]), rng.randint(1, 600))
        if i % 3 != 0:
            for _ in range(rng.randint(1, 64)):
                s.add_decode(rng.randint(2, 4000))
        out.append(s)
    return out


# Two regimes on query tokens (below / from 256), every coefficient non-negative.
TRUE_BREAK = 256.0
TRUE_COEFS = [[2e-3, 4e-5, 3e-4, 1e-5, 2e-9, 3e-7, 1e-6],
              [5e-3, 2e-5, 1e-4, 5e-6, 4e-9, 1e-7, 2e-6]]


def _truth(s: BatchShape) -> float:
    x = shape_features(s)
    c = TRUE_COEFS[int(x[1] >= TRUE_BREAK)]
    return float(np.dot(c, x))


def _synthetic_model(segments=2) -> tuple[StepTimeModel, list[BatchShape]]:
    shapes = _random_shapes(400)
    return StepTimeModel.from_samples(shapes, [_truth(s) for s in shapes], 2048, segments=segments), shapes


def test_fit_recovers_a_known_step_time_function():
    model, _ = _synthetic_model()
    assert model.meta["train_error"]["max"] < 1e-6
    assert model.fit.segments == 2
    assert abs(model.fit.breakpoints[0] - TRUE_BREAK) < 64           # a boundary between sampled token counts
    for held in _random_shapes(100, seed=1):
        assert model.step_time(held) == pytest.approx(_truth(held), rel=2e-3)
    assert model.step_time(BatchShape()) == 0.0


def test_cross_validation_picks_one_segment_for_a_linear_truth():
    shapes = _random_shapes(120)
    c = TRUE_COEFS[0]
    model = StepTimeModel.from_samples(shapes, [float(np.dot(c, shape_features(s))) for s in shapes], 2048, segments=3)
    assert model.fit.segments == 1
    assert model.fit.coefs[0] == pytest.approx(c, rel=1e-4)
    assert set(model.meta["cv_mean_rel_error_by_segments"]) == {"1", "2", "3"}


def test_prefill_is_chunked_by_the_engine_budget():
    model, _ = _synthetic_model()
    one = model.prefill_time(100, 2048)
    two = model.prefill_time(100, 3000)
    first = model.step_time_args(2048, 2048 * (100 + 2049 / 2), 100, 1, 0, 0)
    rest = model.step_time_args(952, 952 * (2148 + 953 / 2), 2148, 1, 0, 0)
    assert one == pytest.approx(first)
    assert two == pytest.approx(first + rest)
    assert model.decode_time(8, 8000) == pytest.approx(model.step_time(_decodes(8, 1000)))


def _decodes(b: int, ctx: int) -> BatchShape:
    s = BatchShape()
    for _ in range(b):
        s.add_decode(ctx)
    return s


def test_ampd_cost_model_follows_the_step_model():
    model, _ = _synthetic_model()
    cost = model.ampd_cost_model(max_len=8192, kv_capacity_tokens=200_000, kv_bytes_per_token=4096,
                                 kv_link={"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4})
    assert cost.tps == (1,)
    for h, n in [(0, 100), (0, 1500), (3000, 400), (500, 5000)]:
        assert cost.t_pre(h, n, 1) == pytest.approx(model.prefill_time(h, n), rel=0.1)
    for b, c in [(1, 500), (16, 2000), (128, 1000)]:
        assert cost.t_dec(b, 1, b * c) == pytest.approx(model.decode_time(b, b * c), rel=0.1)
    assert cost.t_kv(1000, 1, 1, True) == pytest.approx(1e-4 + 1000 * 4096 / 1e9, rel=1e-6)
    assert AMPDCostModel.from_dict(json.loads(json.dumps(cost.to_dict()))).t_pre(10, 10, 1) == cost.t_pre(10, 10, 1)


def test_step_model_json_round_trip():
    model, shapes = _synthetic_model()
    back = StepTimeModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert [back.step_time(s) for s in shapes[:50]] == [model.step_time(s) for s in shapes[:50]]
    assert back.max_num_batched_tokens == 2048
    assert [c["tokens_below"] for c in model.to_dict()["coefficients"]][-1] is None
    bad = model.to_dict() | {"features": list(FEATURES[:-1])}
    with pytest.raises(ValueError, match="features"):
        StepTimeModel.from_dict(bad)
    with pytest.raises(ValueError, match="coefficients"):
        StepTimeModel(PiecewiseLinear(1, [], [[1.0, 2.0]]), 2048)


def test_profile_json_round_trip(tmp_path):
    model, _ = _synthetic_model()
    cost = model.ampd_cost_model(4096, 100_000, 2048)
    prof = Profile(model="/m/tiny", device={"type": "cpu", "name": "test cpu"}, torch_version="x", engine={},
                   model_config={"layers": 2}, step_model=model, ampd=cost, num_blocks=100, block_size=16,
                   kv_bytes_per_token=2048, max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=256,
                   heldout_error={"n": 3, "median": 0.05, "p90": 0.1}, train_error={"n": 9, "median": 0.01})
    path = tmp_path / "p.json"
    prof.to_json(path)
    back = Profile.from_json(path)
    assert back.kv_capacity_tokens == 1600 and back.name == "tiny" and back.device_name == "test cpu"
    assert back.step_model.step_time(_decodes(4, 100)) == model.step_time(_decodes(4, 100))
    assert back.ampd.t_pre(0, 100, 1) == cost.t_pre(0, 100, 1)
    d = json.loads(path.read_text())
    del d["num_blocks"]
    with pytest.raises(ValueError, match="num_blocks"):
        Profile.from_dict(d)


def test_grids_respect_the_engine_limits():
    from tandem.engine.profiling import heldout_grid, train_grid
    for quick in (True, False):
        pts = train_grid(512, 2048, 64, 20_000, quick=quick)
        held = heldout_grid(30, 512, 2048, 64, 20_000, random.Random(0))
        assert {p.kind for p in pts} == {"prefill", "decode", "mixed"}
        for p in pts + held:
            assert 1 <= p.tokens <= 512
            assert p.blocks(16) * 16 <= 20_000
            assert all(h + n <= 2048 for h, n in p.prefills) and all(c < 2048 for c in p.decodes)
        assert len(held) == 30


# --------------------------------------------------------------------------- the real engine (1m model)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """`tandem profile --quick` of the 1m tiny model, run once for the module: (path, seconds)."""
    from tandem.cli.main import main
    from tandem.engine.tiny_model import make_tiny_model
    d = tmp_path_factory.mktemp("prof")
    make_tiny_model(d / "tiny", arch="qwen3", size="1m", seed=0)
    out = d / "profile.json"
    t0 = time.perf_counter()
    rc = main(["profile", "--model", str(d / "tiny"), "--quick", "--threads", "1", "--num-kv-blocks", "4096", "--no-progress",
               "--out", str(out)])
    assert rc == 0
    return out, time.perf_counter() - t0


def test_quick_profile_of_the_tiny_model(quick_profile, capsys):
    path, seconds = quick_profile
    assert seconds < 60
    d = json.loads(path.read_text())
    he = d["heldout_error"]
    assert he["n"] >= 10 and 0 <= he["median"] < 1 and he["p90"] >= he["median"]
    assert d["model_config"]["layers"] == 4 and d["model_config"]["params"] > 0
    assert d["kv_capacity_tokens"] == d["num_blocks"] * d["block_size"] > 0
    assert d["device"]["type"] == "cpu" and d["device"]["threads"] == 1
    assert {m["split"] for m in d["measurements"]} == {"train", "heldout"}
    assert all(m["seconds"] > 0 and len(m["runs"]) >= 2 for m in d["measurements"])
    prof = Profile.from_dict(d)
    assert prof.step_model.decode_time(1, 100) > 0 and prof.ampd.t_pre(0, 100, 1) > 0


def test_simulate_with_a_profile(quick_profile, capsys):
    from tandem.cli.main import main
    path, _ = quick_profile
    assert main(["simulate", "--perf", str(path), *SIM_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sessions_total"] == 5 and out["model"] == "tiny"
    assert out["ttft_initial_mean_s"] > 0 and out["itl_mean_s"] > 0


def test_profile_drives_the_simulated_workers(quick_profile):
    from tandem.sim.cluster import SimConfig, build
    from tandem.workload.generators import generate
    path, _ = quick_profile
    prof = Profile.from_json(path)
    cfg = SimConfig(model="not-in-the-catalogue", gpu="nor-this", gpus=2, deploy="P:tp1x1,D:tp1x1", perf=str(path))
    coord, workers, loop = build(cfg)
    assert [w.capacity_tokens for w in workers] == [prof.kv_capacity_tokens] * 2
    assert all(w.cfg.max_num_batched_tokens == prof.max_num_batched_tokens for w in workers)
    shape = _decodes(3, 200)
    assert loop.step_time[0](shape) == prof.step_model.step_time(shape)
    assert loop.kv_bytes == prof.kv_bytes_per_token
    loop.run(generate("toolbench", 3, 1.0, 0))
    assert len(coord.records) == 3


@pytest.mark.parametrize("text, why", [("{\"format\": \"tandem-profile\", \"version\": 1}", "missing the field"),
                                       ("not json", "not valid JSON"), ("[1, 2]", "neither")])
def test_bad_profile_is_one_line_exit_2(tmp_path, capsys, text, why):
    from tandem.cli.main import main
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["simulate", "--perf", str(bad), *SIM_ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error:") and why in err[0]


def test_profile_with_an_unpriced_tensor_parallel_degree_is_refused(quick_profile, capsys):
    """A tp1 profile prices tp1 and the rank counts its all-reduces were measured at (at most 8): tp16 is refused."""
    from tandem.cli.main import main
    path, _ = quick_profile
    assert main(["simulate", "--perf", str(path), "--workload", "toolbench", "--deploy", "P:tp16x1,D:tp1x1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at tp1" in err[0] and "not tp16" in err[0]


def test_profile_cli_errors(tmp_path, capsys):
    from tandem.cli.main import main
    assert main(["profile", "--model", str(tmp_path / "nope")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["profile", "--model", str(tmp_path / "empty"), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot profile" in err[0]


def test_kv_path_through_the_engine(tmp_path):
    """The profiler's KV link: export_kv, ZeroMQ over TCP loopback, import_kv, each fitted as a + bytes / rate."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.profiling import measure_kv_path
    from tandem.engine.tiny_model import make_tiny_model
    from tandem.perf.step_model import kv_link_seconds
    make_tiny_model(tmp_path / "tiny", arch="qwen3", size="1m", seed=0)
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "tiny"), num_kv_blocks=512))
    link = measure_kv_path(runner, random.Random(0), repeats=2, max_tokens=1024)
    assert link["sizes_tokens"] == [16, 64, 256, 1024]
    for key in ("bandwidth_bytes_per_s", "export_bytes_per_s", "import_bytes_per_s"):
        assert link[key] > 0
    assert link["latency_s"] >= 0 and link["export_s"] >= 0 and link["import_s"] >= 0
    assert "ZeroMQ" in link["source"]
    assert link["secure"] is True and "CURVE" in link["source"]      # the runtime's KV inboxes are CURVE servers
    assert link["crypto_s_per_byte"] > 0                                # encryption's CPU, beside the steps
    assert kv_link_seconds(link, 1 << 20) > kv_link_seconds(link, 1 << 10) > 0
