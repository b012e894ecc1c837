"""benchmarks/gpu_roofline.py without a GPU: the one-line skip, and the re-analysis of saved profiles (--from-profile)
against the roofline on made-up measurements whose ratios are known."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from tandem.perf import get_model  # noqa: E402
from tandem.perf.batch_shape import BatchShape  # noqa: E402
from tandem.perf.roofline import Roofline  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_roofline.py"
spec = importlib.util.spec_from_file_location("gpu_roofline", SCRIPT)
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)

Q8 = {"architecture": "Qwen3ForCausalLM", "layers": 36, "hidden": 4096, "intermediate": 12288, "heads": 32,
      "kv_heads": 8, "head_dim": 128, "vocab": 151936, "max_position_embeddings": 4096, "params": 8_190_735_360,
      "dtype": "bfloat16"}


def _row(kind: str, shape: BatchShape, factor: float) -> dict:
    roof = Roofline("qwen3-8b", "h100").step_time(shape)
    return {"split": "train", "kind": kind, "prefills": [], "decodes": [], **{f: getattr(shape, f) for f in
            gr.SHAPE_FIELDS}, "seconds": factor * roof, "runs": [factor * roof]}


def _profile(eager: bool) -> dict:
    rows = []
    for n, f in ((16, 1.5), (512, 1.5), (2048, 2.5)):            # prefill: median 1.5
        s = BatchShape()
        s.add_prefill(0, n)
        rows.append(_row("prefill", s, f))
    for b, f in ((1, 2.0), (64, 3.0)):                           # decode: median 2.5
        s = BatchShape()
        for _ in range(b):
            s.add_decode(1025)
        rows.append(_row("decode", s, f))
    s = BatchShape()
    s.add_prefill(128, 256)
    s.add_decode(300)
    rows.append(_row("mixed", s, 1.25))
    return {"model": "m", "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"}, "torch_version": "2.11.0",
            "model_config": Q8, "measurements": rows, "options": {"enforce_eager": eager, "profiled_max_len": 4096},
            "max_model_len": 4096, "block_size": 16, "num_blocks": 1000, "wall_s": 60.0,
            "heldout_error": {"n": 4, "median": 0.05, "p90": 0.1, "mean": 0.06, "max": 0.2}}


def test_without_cuda_it_skips_in_one_line_and_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gr.main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_roofline: skipped: no CUDA device")


def test_gpu_names_map_to_the_catalogue():
    assert gr.gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert gr.gpu_key("NVIDIA H200") == "h200"
    assert gr.gpu_key("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert gr.gpu_key("Tesla T4") is None
    prof = _profile(False)
    prof["device"]["name"] = "Tesla T4"
    with pytest.raises(ValueError, match="give --gpu"):
        gr.analyse_profile(prof)
    assert gr.analyse_profile(prof, "h100")["gpu"] == "h100"


def test_model_spec_is_the_catalogue_entry_or_built_from_the_config():
    assert gr.model_spec(Q8) is get_model("qwen3-8b")
    small = dict(Q8, layers=28, hidden=1024, intermediate=3072, heads=16, params=596_049_920)   # Qwen3-0.6B
    s = gr.model_spec(small)
    assert s.tied_embeddings and s.params == 596_049_920 - 28 * 2 * 128
    assert not gr.model_spec(dict(small, params=596_049_920 + 151936 * 1024)).tied_embeddings


def test_ratios_by_kind_are_measured_over_roofline():
    a = gr.analyse_profile(_profile(True))
    assert a["mode"] == "eager" and a["gpu"] == "h100" and a["model"] == "qwen3-8b"
    k = a["by_kind"]
    assert (k["prefill"]["n"], k["decode"]["n"], k["mixed"]["n"]) == (3, 2, 1)
    assert k["prefill"]["median"] == pytest.approx(1.5) and k["prefill"]["max"] == pytest.approx(2.5)
    assert k["decode"]["median"] == pytest.approx(2.5) and k["decode"]["min"] == pytest.approx(2.0)
    assert k["mixed"]["median"] == pytest.approx(1.25)
    assert a["all"]["n"] == 6 and a["all"]["median"] == pytest.approx(1.75)
    assert a["by_bound"]["compute"]["n"] + a["by_bound"]["memory"]["n"] == 6
    big = [r for r in a["rows"] if r["prefill_tokens"] == 2048][0]
    assert big["bound"] == "compute" and big["ratio"] == pytest.approx(2.5)


def test_from_profile_writes_the_report_and_keeps_a_saved_sweep(tmp_path, capsys):
    for mode, eager in (("graphs", False), ("eager", True)):
        (tmp_path / f"profile_{mode}.json").write_text(json.dumps(_profile(eager)))
    sweep = {"ctx": 1024, "batches": [1, 8], "reps": 3, "max_model_len": 4096, "block_size": 16,
             "capture": {"sizes": 35, "first": 1, "last": 256, "capture_s": 12.5, "pool_bytes": 300 << 20,
                         "allocated_bytes": 100 << 20, "attention": "gather + SDPA (flash-attn absent)"},
             "variants": {"graphs": {"median_s": [0.010, 0.012], "note": ""},
                          "eager": {"median_s": [0.030, 0.036], "note": ""}},
             "roofline_s": [0.008, 0.009]}
    (tmp_path / "old.json").write_text(json.dumps({"env": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"},
                                                   "decode_sweep": sweep}))
    out = tmp_path / "report"
    assert gr.main(["--from-profile", str(tmp_path / "profile_graphs.json"), "--from-profile",
                    str(tmp_path / "profile_eager.json"), "--sweep-from", str(tmp_path / "old.json"),
                    "--out", str(out)]) == 0
    md = (out / "table.md").read_text()
    assert md == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "| prefill | 3 | 1.50 | 1.50 | 2.50 |" in md and "| decode | 2 | 2.50 | 2.00 | 3.00 |" in md
    assert "| 1 | 10.00 | 30.00 | 3.00x | 8.00 | 1.25 | 3.75 |" in md
    assert "35 sizes (1..256) captured in 12.5 s, graph pool 300 MiB reserved" in md
    res = json.loads((out / "results.json").read_text())
    assert [p["mode"] for p in res["profiles"]] == ["graphs", "eager"] and res["decode_sweep"] == sweep
    assert (out / "gpu_roofline.png").stat().st_size > 10_000


def test_profile_passes_max_model_len_to_the_engine(tmp_path):
    """ProfileOptions.max_model_len is the engine's max_model_len (on CUDA the graphs' block-table width)."""
    from tandem.engine.profiling.options import ProfileOptions
    from tandem.engine.profiling.run import profile
    from tandem.engine.tiny_model import make_tiny_model
    ckpt = make_tiny_model(tmp_path / "m", "qwen3", "1m")
    prof = profile(str(ckpt), ProfileOptions(device="cpu", quick=True, max_model_len=200, repeats=1, heldout=2,
                                             measure_link=False, measure_interference=False))
    assert prof.max_model_len == 200 and prof.engine["max_model_len"] == 200
    assert prof.options["profiled_max_len"] == 200 and prof.options["max_model_len"] == 200
    assert max(r["prefill_kv_read_tokens"] + r["prefill_tokens"] for r in prof.measurements) <= 200
