"""Profiles at a tensor-parallel degree: `tandem profile --tensor-parallel-size 2` for real (ranks as processes), the
profile's tp through save and load, the simulator accepting a worker of the profiled degree and refusing another in
one line, and the all-reduce fit and sharded step timer a tp1 profile prices a tp-N step with."""
from __future__ import annotations

import json

import pytest

from tandem.perf.batch_shape import BatchShape
from tandem.perf.collective import AllReduceFit, CollectiveCost, ShardedStepTimer
from tandem.perf.fit import PiecewiseLinear
from tandem.perf.step_model import FEATURES, KEY, Profile, StepTimeModel

SIM = ["--workload", "toolbench", "--sessions", "3", "--slo-ttft", "2", "--slo-itl", "0.1"]


def test_all_reduce_fit_is_positive_and_monotone_on_hand_made_samples():
    """latency + per-byte from (bytes, seconds): both positive, seconds grow with bytes, exact on a line."""
    samples = [(b, 100e-6 + 0.5e-9 * b) for b in (512, 32768, 524288)]          # 100 us + 0.5 ns/B
    fit = AllReduceFit.from_samples(2, samples)
    assert fit.latency_s == pytest.approx(100e-6, rel=1e-3) and fit.per_byte_s == pytest.approx(0.5e-9, rel=1e-3)
    sizes = [1, 512, 4096, 32768, 524288, 1 << 24]
    times = [fit.seconds(b) for b in sizes]
    assert all(t > 0 for t in times) and times == sorted(times) and len(set(times)) == len(times)
    assert fit.seconds(0) == 0.0
    noisy = AllReduceFit.from_samples(2, [(512, 300e-6), (32768, 200e-6), (524288, 500e-6)])   # not a line
    assert noisy.latency_s >= 0 and noisy.per_byte_s >= 0
    assert AllReduceFit.from_dict(fit.to_dict()) == fit
    with pytest.raises(ValueError, match="two or more"):
        AllReduceFit.from_samples(2, [(512, 1e-4), (512, 2e-4)])


def _base_model() -> StepTimeModel:
    """One segment below 64 query tokens, another from 64: coefficients in FEATURES order."""
    pw = PiecewiseLinear(KEY, [64.0], [[1e-3, 2e-5, 3e-4, 4e-5, 1e-8, 2e-7, 3e-7],
                                       [2e-3, 1e-5, 3e-4, 4e-5, 2e-8, 1e-7, 3e-7]])
    return StepTimeModel(pw, 256)


def test_sharded_timer_divides_the_split_work_and_adds_the_step_all_reduces():
    """Per step: const, chunks and decode rows whole; tokens, attention pairs and KV reads / N (the segment the
    step's tokens pick); plus all_reduces_per_step x the fit at tokens x bytes_per_token."""
    assert [FEATURES[i] for i in (1, 4, 5, 6)] == ["tokens", "prefill_attn_pairs", "prefill_kv_read_tokens",
                                                   "decode_ctx_tokens"]
    fit = AllReduceFit(2, 100e-6, 1e-9)
    coll = CollectiveCost(all_reduces_per_step=9, bytes_per_token=512, backend="gloo", fits={2: fit})
    base = _base_model()
    timer = ShardedStepTimer(base, 2, coll)
    s = BatchShape()
    s.add_prefill(16, 48)
    s.add_decode(100)
    s.add_decode(300)
    tokens = 50                                                              # 48 + 2 decodes: segment 0
    c = base.fit.coefs[0]
    whole = c[0] + c[2] * 1 + c[3] * 2
    split = (c[1] * tokens + c[4] * s.prefill_attn_pairs + c[5] * s.prefill_kv_read_tokens
             + c[6] * s.decode_ctx_tokens) / 2
    assert timer.step_time(s) == pytest.approx(whole + split + 9 * (100e-6 + 1e-9 * tokens * 512), rel=1e-12)
    assert base.step_time(s) == pytest.approx(whole + 2 * split, rel=1e-12)
    assert coll.step_seconds(tokens, 1) == 0.0 and timer.step_time(BatchShape()) == 0.0
    assert CollectiveCost.from_dict(json.loads(json.dumps(coll.to_dict()))).fits == coll.fits
    with pytest.raises(ValueError, match="no all-reduce fit for 4 ranks"):
        ShardedStepTimer(base, 4, coll)


@pytest.fixture(scope="module")
def tp2_profile(tmp_path_factory):
    """`tandem profile --tensor-parallel-size 2` of the 1m tiny model on a small grid (a few seconds): the path."""
    from tandem.engine.parallel.group import usable_cpus
    if usable_cpus() < 2:
        pytest.skip("tensor parallelism on CPU needs two cores")
    from tandem.cli.main import main
    from tandem.engine.tiny_model import make_tiny_model
    d = tmp_path_factory.mktemp("tp2")
    make_tiny_model(d / "tiny", arch="qwen3", size="1m", seed=0)
    out = d / "tp2.json"
    assert main(["profile", "--model", str(d / "tiny"), "--quick", "--tensor-parallel-size", "2", "--max-len", "128",
                 "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--heldout", "2", "--repeats", "1",
                 "--num-kv-blocks", "64", "--no-progress", "--out", str(out)]) == 0
    return out


def test_tp2_profile_round_trips_with_its_degree(tp2_profile):
    """The profile says tp2, its AMPD fit is at tp2, the model's all-reduces were counted (2 per layer + the
    embedding) and agree with those its steps made, and a tp the fit lacks is refused on load."""
    d = json.loads(tp2_profile.read_text())
    assert d["tensor_parallel_size"] == 2 and d["engine"]["tensor_parallel_size"] == 2
    prof = Profile.from_json(tp2_profile)
    assert prof.tensor_parallel_size == 2 and prof.ampd.tps == (2,) and prof.priced_tps() == (2,)
    layers = prof.model_config["layers"]
    coll = prof.collective
    assert coll.all_reduces_per_step == 2 * layers + 1 and coll.bytes_per_token == prof.model_config["hidden"] * 4
    assert coll.in_steps["all_reduces_per_step"] == 2 * layers + 1 and coll.in_steps["all_reduce_s_per_step"] > 0
    assert set(coll.fits) == {2} and coll.fits[2].latency_s + coll.fits[2].per_byte_s > 0
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.tensor_parallel_size == 2 and again.collective.fits == coll.fits
    assert prof.step_timer(2) is prof.step_model and prof.cost_model([2]) is prof.ampd
    d["tensor_parallel_size"] = 3
    with pytest.raises(ValueError, match="no tp3 fit"):
        Profile.from_dict(d)


def test_simulator_takes_tp2_workers_from_a_tp2_profile_and_refuses_tp1_in_one_line(tp2_profile, capsys):
    from tandem.cli.main import main
    from tandem.sim.cluster import SimConfig, build
    from tandem.workload.generators import generate
    prof = Profile.from_json(tp2_profile)
    cfg = SimConfig(model="tiny", gpu="cpu", gpus=4, deploy="P:tp2x1,D:tp2x1", perf=str(tp2_profile))
    coord, workers, loop = build(cfg)
    assert [w.cfg.tp for w in workers] == [2, 2]
    shape = BatchShape()
    shape.add_decode(100)
    assert loop.step_time[0](shape) == prof.step_model.step_time(shape)
    loop.run(generate("toolbench", 3, 1.0, 0))
    assert len(coord.records) == 3
    assert main(["simulate", "--perf", str(tp2_profile), *SIM, "--json"]) == 0      # default deploy: tp2 workers
    assert json.loads(capsys.readouterr().out)["deploy"] == "P:tp2x1,D:tp2x1"
    assert main(["simulate", "--perf", str(tp2_profile), *SIM, "--deploy", "P:tp1x1,D:tp1x1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error:") and "at tp2" in err[0] and "not tp1" in err[0]


def test_a_tp1_profile_prices_tp2_with_its_all_reduce_fit_and_refuses_without_one(tp2_profile, tmp_path, capsys):
    """A tp1 profile (here the tp2 one relabelled, its fits and steps as they are) with a 2-rank all-reduce fit
    prices tp2 workers with the sharded timer; without a fit it refuses tp2 in one line."""
    from tandem.cli.main import main
    from tandem.runtime.costs import serving_cost_model
    d = json.loads(tp2_profile.read_text())
    d["tensor_parallel_size"] = 1
    d["ampd"]["pre"] = {"1": d["ampd"]["pre"]["2"]}
    d["ampd"]["dec"] = {"1": d["ampd"]["dec"]["2"]}
    one = tmp_path / "tp1.json"
    one.write_text(json.dumps(d))
    prof = Profile.from_json(one)
    assert prof.priced_tps() == (1, 2) and isinstance(prof.step_timer(2), ShardedStepTimer)
    cost = prof.cost_model([1, 2])
    assert cost.tps == (1, 2) and cost.t_pre(0, 64, 2) > 0 and cost.t_kv(100, 1, 2, True) > 0
    assert serving_cost_model("unused", 1, 1, perf=str(one), tps=(2,)).tps == (2,)
    assert main(["simulate", "--perf", str(one), *SIM, "--deploy", "P:tp2x1,D:tp1x1"]) == 0
    capsys.readouterr()
    d["collective"] = None
    one.write_text(json.dumps(d))
    assert main(["simulate", "--perf", str(one), *SIM, "--deploy", "P:tp2x1,D:tp1x1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at tp1" in err[0] and "not tp2" in err[0]
    with pytest.raises(ValueError, match="not tp2"):
        serving_cost_model("unused", 1, 1, perf=str(one), tps=(2,))
