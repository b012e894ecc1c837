"""Optimus's T(c, b) from `tandem profile` on a block-diffusion checkpoint: the profile's
dllm_latency section, its fit, its file format, and its two consumers (the engine, the simulator).

One `tandem profile --quick` of the committed trained tiny SDAR (tandem/engine/diffusion/assets/tiny-sdar) serves
every test."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tandem.cli.main import main  # noqa: E402
from tandem.engine.config import EngineConfig, EngineError  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.profiling.windows import HEAD_FLOOR  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.perf.step_model import Profile, rel_errors  # noqa: E402
from tandem.perf.window_profile import SECTION_VERSION, WindowLatencyProfile  # noqa: E402
from tandem.policy.optimus.latency import ChunkLatency  # noqa: E402
from tandem.sim.cluster import ConfigError, SimConfig, build  # noqa: E402

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
TRAIN_MEDIAN_BOUND = 0.5     # the fit's median relative error on its own samples (measured 10-15% on a shared 2-core
                             # VM: T depends on b·c only, while the CPU engine also pays per sequence)
SIM = ["--workload", "sharegpt", "--dllm-commits", "5.29,9.44", "--sessions", "3", "--rate", "2", "--deploy", "C:tp1x1", "--policy", "vllm",
       "--slo-ttft", "5", "--slo-itl", "0.5", "--dllm-block-length", "32", "--dllm-chunk", "elastic"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[Path, str]:
    """The profile file of one quick run and what the command printed."""
    out = tmp_path_factory.mktemp("prof") / "sdar.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["profile", "--model", str(ASSET), "--quick", "--threads", "1", "--repeats", "2", "--heldout", "8",
                   "--num-kv-blocks", "4096", "--no-progress", "--out", str(out)])
    assert rc == 0
    return out, buf.getvalue()


def _latency(w: WindowLatencyProfile) -> ChunkLatency:
    return ChunkLatency.from_profile(w)


def _corrupt(path: Path, tmp_path: Path) -> Path:
    d = json.loads(path.read_text())
    d["dllm_latency"]["fit"]["coefs"] = d["dllm_latency"]["fit"]["coefs"][:1] + [[1.0]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    return bad


def test_profile_writes_the_window_section_and_reports_its_held_out_error(profiled):
    """Protects: `tandem profile` on an SDAR checkpoint times window steps (train grid and held-out set, over a cached
    context), stores samples and fit in a versioned section, prints the fit's held-out error."""
    path, printed = profiled
    d = json.loads(path.read_text())["dllm_latency"]
    assert d["version"] == SECTION_VERSION and d["block"] == 32 and d["context"] == 512
    splits = {s["split"] for s in d["samples"]}
    assert splits == {"train", "heldout"}
    train = [(s["c"], s["b"]) for s in d["samples"] if s["split"] == "train"]
    assert {c for c, _ in train} == {1, 4, 16, 32} and max(c * b for c, b in train) == 256
    assert len(d["fit"]["coefs"]) == len(d["fit"]["breakpoints"]) + 1 == 3
    assert d["heldout_error"]["n"] == 4 and d["heldout_error"]["median"] is not None
    assert "T(c, b) held-out error" in printed and "diffusion T(c, b)" in printed
    prof = Profile.from_json(path)                          # window steps also train the simulator's step timer
    assert sum(m["kind"] == "window" for m in prof.measurements) == len(d["samples"])
    assert all(m["kind"] in ("prefill", "mixed") or m["kind"] == "window" for m in prof.measurements)
    assert not any(m["decodes"] for m in prof.measurements)  # an SDAR model takes no AR decode step


def test_the_fit_reproduces_its_own_samples(profiled):
    """Protects: the stored fit is ChunkLatency.fit of the stored training samples less the LM head timed apart
    (bit for bit), with that head charged per sampled row; every sample's `predicted` is that fit's value, and it
    reproduces its samples to a median relative error within the bound."""
    w = Profile.from_json(profiled[0]).dllm_latency
    m = _latency(w)
    c, b, y = w.points("train")
    assert w.head_s > 0
    fwd = [max(yi - w.head_s * ci * bi, HEAD_FLOOR * yi) for ci, bi, yi in zip(c, b, y)]
    assert dataclasses.replace(ChunkLatency.fit([ci * bi for ci, bi in zip(c, b)], fwd, seqs=b), head_s=w.head_s) == m
    assert m.rows(64, 4, 0, 0) == pytest.approx(m.rows(64, 4, 0, 64) - 64 * w.head_s, rel=1e-12)  # writes: no head
    for s in w.samples:
        assert s["predicted"] == m(s["c"], s["b"])
    assert rel_errors([m(ci, bi) for ci, bi in zip(c, b)], y) == w.train_error
    assert w.train_error["median"] <= TRAIN_MEDIAN_BOUND


def test_round_trip_old_profiles_and_a_corrupt_section(profiled, tmp_path):
    """Protects the file format: a profile re-serialises to the same JSON, one without the section (every older or
    AR profile) loads with none, a section without head_s (from before it) loads with 0, and a corrupt section (a
    negative or non-numeric head_s among them) is one line naming the section, in the loader and the CLI."""
    path = profiled[0]
    d = json.loads(path.read_text())
    assert Profile.from_dict(d).to_dict() == d
    old = dict(d)
    del old["dllm_latency"]
    prof = Profile.from_dict(old)
    assert prof.dllm_latency is None and "dllm_latency" not in prof.to_dict()
    bad = _corrupt(path, tmp_path)
    with pytest.raises(ValueError) as e:
        Profile.from_json(bad)
    assert str(e.value) == ("profile section dllm_latency: fit.coefs must be [beta0, beta1] pairs")
    for head, why in ((-1e-4, "fit.head_s must be >= 0, got -0.0001"), ("fast", "fit.head_s must be a finite number")):
        hostile = json.loads(path.read_text())
        hostile["dllm_latency"]["fit"]["head_s"] = head
        with pytest.raises(ValueError, match=r"^profile section dllm_latency: " + why):
            Profile.from_dict(hostile)
    no_head = json.loads(path.read_text())
    del no_head["dllm_latency"]["fit"]["head_s"]            # a section from before head_s: the head in the regimes
    assert Profile.from_dict(no_head).dllm_latency.head_s == 0.0
    d["dllm_latency"]["version"] = 99
    with pytest.raises(ValueError, match=r"^profile section dllm_latency: version 99 is not supported; expected 1$"):
        Profile.from_dict(d)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["simulate", "--perf", str(bad), *SIM]) == 2
    assert err.getvalue().strip().count("\n") == 0 and "dllm_latency" in err.getvalue()


def test_engine_takes_t_from_the_profile_without_measuring(profiled, tmp_path, monkeypatch):
    """Protects: EngineConfig.dllm_latency_profile gives the chunk sizer exactly the profile's T (no start-up
    measurement), the engine decodes with it, and a bad file is one clear EngineError."""
    def no_measuring(*a, **k):
        raise AssertionError("the engine measured T(c, b) at start")
    monkeypatch.setattr("tandem.engine.diffusion_setup.measure_window_latency", no_measuring)
    path = profiled[0]
    want = _latency(Profile.from_json(path).dllm_latency)
    eng = LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", num_kv_blocks=320,
                                 dllm_latency_profile=str(path)))
    got = eng.core.chunker.latency
    assert got.__self__ == want
    for rows in (1, 3, 4, 5, 64, 127, 128, 129, 256, 1000, 2048):
        for seqs, ctx in ((1, 0), (8, 4096)):
            assert got(rows, seqs, ctx) == want.rows(rows, seqs)   # the cached tokens are not in this model
    eng.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4))
    while eng.has_unfinished_requests():
        eng.step()
    for bad, msg in ((tmp_path / "none.json", "cannot read"), (_corrupt(path, tmp_path), "profile section dllm_latency")):
        with pytest.raises(EngineError) as e:
            LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", dllm_latency_profile=str(bad)))
        assert msg in str(e.value) and "\n" not in str(e.value)
    old = json.loads(path.read_text())
    del old["dllm_latency"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(EngineError, match="has no dllm_latency section"):
        LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu",
                               dllm_latency_profile=str(tmp_path / "old.json")))


def test_simulator_sizes_windows_with_the_profiles_t(profiled, monkeypatch):
    """Protects: `tandem simulate --perf PROFILE` of a diffusion model gives every worker's chunk sizer the profile's
    T as it is (not re-fitted from the step timer), through the factory; a block length it was not measured at is a
    ConfigError."""
    path = profiled[0]
    want = _latency(Profile.from_json(path).dllm_latency)
    cfg = SimConfig("sdar-8b", "a100-80g", 1, "C:tp1x1", "vllm", perf=str(path), dllm_block_length=32, dllm_chunk="elastic")
    _, workers, _ = build(cfg)
    assert [w.chunker.latency.__self__ for w in workers] == [want]
    with pytest.raises(ConfigError, match="blocks of 32"):
        build(SimConfig("sdar-8b", "a100-80g", 1, "C:tp1x1", "vllm", perf=str(path), dllm_block_length=16))

    def refit(*a, **k):
        raise AssertionError("the sizer's T was re-fitted from the step timer")
    monkeypatch.setattr("tandem.core.factory.chunk_latency", refit)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["simulate", "--perf", str(path), *SIM]) == 0


def test_the_head_is_timed_as_the_engine_samples_each_window_apart(monkeypatch):
    """Protects head_s's timing (window_timing.WindowTimer): the LM head runs over groups of head_rows rows and each
    window's rows are sampled apart, as the engine's step samples each sequence, also where a window straddles two
    groups: windows of 3, 5 and 2 rows in groups of 4 are sampled as 3 | 1 + 4 | 2; the start-up fit charges that
    head per sampled row, apart from the forward's regimes."""
    import torch

    from tandem.engine.diffusion import window_timing
    from tandem.engine.loader import load_model

    model, _ = load_model(ASSET, dtype="float32")
    timer = window_timing.WindowTimer(model, 32, torch.device("cpu"), head_rows=4, repeats=1)
    sampled: list[int] = []
    real = window_timing.sample_tokens
    monkeypatch.setattr(window_timing, "sample_tokens", lambda logits: (sampled.append(len(logits)), real(logits))[1])
    with torch.inference_mode():
        ids, meta, _ = timer._inputs([3, 5, 2])
        timer._head(model(ids, None, None, meta), [3, 5, 2])
    assert sampled == [3, 1, 4, 2]
    lat = window_timing.measure_window_latency(model, 32, 64, torch.device("cpu"), repeats=1, head_rows=16)
    assert lat.head_s > 0 and lat.rows(40, 1, 0, 0) == pytest.approx(lat.rows(40, 1, 0, 8) - 8 * lat.head_s)
