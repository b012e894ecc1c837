"""tandem.bench.gpu_roofline and its report without a GPU: the catalogue lookups, measured/roofline ratios of made-up
profiles whose ratios are known, the report of saved profiles, and benchmarks/gpu_roofline.py's command line (the
one-line skip without CUDA, --from-profile)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from tandem.bench import gpu_roofline as gr  # noqa: E402
from tandem.bench.gpu_roofline_report import saved_results, write_report  # noqa: E402
from tandem.perf import get_model  # noqa: E402
from tandem.perf.batch_shape import BatchShape  # noqa: E402
from tandem.perf.roofline import Roofline  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_roofline.py"


def run_script(argv: list[str]) -> subprocess.CompletedProcess:
    """benchmarks/gpu_roofline.py in its own process, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)


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


def test_without_cuda_the_script_skips_in_one_line_and_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = run_script(["--out", str(tmp_path / "unused")])
    assert p.returncode == 2 and p.stdout == ""
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_roofline: skipped: no CUDA device")
    assert not (tmp_path / "unused").exists()


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


def _saved(tmp_path: Path) -> tuple[list[Path], dict]:
    """Two saved profiles (graphs, eager) and an earlier results.json holding a decode sweep; the paths, the sweep."""
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
    return [tmp_path / "profile_graphs.json", tmp_path / "profile_eager.json", tmp_path / "old.json"], sweep


def test_saved_profiles_make_the_report_with_the_saved_sweep(tmp_path):
    """Protects the re-analysis: ratio rows by kind, the decode sweep's rows (graphs, eager, speed-up, roofline and
    both ratios in ms), the capture line, and results.json keeping the earlier file's sweep untouched."""
    (graphs, eager, old), sweep = _saved(tmp_path)
    profiles = [graphs, eager]
    res = saved_results(profiles, [old])
    assert [p["mode"] for p in res["profiles"]] == ["graphs", "eager"] and res["decode_sweep"] == sweep
    assert res["env"] == {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}
    out = tmp_path / "report"
    md = write_report(res, out)
    assert (out / "table.md").read_text() == md + "\n"
    assert "| prefill | 3 | 1.50 | 1.50 | 2.50 |" in md and "| decode | 2 | 2.50 | 2.00 | 3.00 |" in md
    assert "| mixed | 1 | 1.25 | 1.25 | 1.25 |" in md and "| all | 6 | 1.75 | 1.25 | 3.00 |" in md
    assert "| 1 | 10.00 | 30.00 | 3.00x | 8.00 | 1.25 | 3.75 |" in md
    assert "| 8 | 12.00 | 36.00 | 3.00x | 9.00 | 1.33 | 4.00 |" in md
    assert "35 sizes (1..256) captured in 12.5 s, graph pool 300 MiB reserved (100 MiB allocated)" in md
    assert json.loads((out / "results.json").read_text()) == res
    assert (out / "gpu_roofline.png").stat().st_size > 10_000


def test_a_later_results_file_adds_only_what_earlier_ones_lack(tmp_path):
    """Protects --sweep-from's order: the first file that holds a key wins; later files fill in the rest."""
    (tmp_path / "profile.json").write_text(json.dumps(_profile(False)))
    (tmp_path / "a.json").write_text(json.dumps({"env": {"device": "A"}}))
    (tmp_path / "b.json").write_text(json.dumps({"env": {"device": "B"}, "anatomy": {"ctx": 7}, "other": 1}))
    res = saved_results([tmp_path / "profile.json"], [tmp_path / "a.json", tmp_path / "b.json"])
    assert set(res) == {"env", "anatomy", "profiles"}
    assert res["env"] == {"device": "A"} and res["anatomy"] == {"ctx": 7}


def test_the_script_re_analyses_saved_profiles_and_prints_the_table(tmp_path):
    """Protects the command line: --from-profile (twice) and --sweep-from write the report and print its table."""
    (graphs, eager, old), _ = _saved(tmp_path)
    out = tmp_path / "report"
    p = run_script(["--from-profile", str(graphs), "--from-profile", str(eager), "--sweep-from", str(old),
                    "--out", str(out)])
    assert p.returncode == 0, p.stderr
    assert p.stdout == (out / "table.md").read_text()
    assert "| 1 | 10.00 | 30.00 | 3.00x | 8.00 | 1.25 | 3.75 |" in p.stdout
    assert [x["mode"] for x in json.loads((out / "results.json").read_text())["profiles"]] == ["graphs", "eager"]


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
