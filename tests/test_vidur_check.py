"""tandem.bench.vidur on its vendored Vidur data: the rows compared, Vidur's values read as the CSVs hold them, and
tandem's side assembled as the measured step model assembles it; the report built from those rows."""
from __future__ import annotations

import json
import math

import pytest

from tandem.bench import vidur as vc
from tandem.bench.vidur_report import write_report
from tandem.perf.measured.source import available

pytestmark = pytest.mark.skipif(not available(), reason="measured cost tables (aiconfigurator-core) not installed")


def test_vidur_values_are_read_as_the_csvs_hold_them():
    ar = vc.load_vidur_all_reduce()
    assert sorted(ar) == [2, 4]
    # tp2, 128 tokens of 8192 fp16 hidden states = 2 MiB: a CSV row (0.054 ms), read exactly
    assert vc.vidur_all_reduce_ms(ar, 2, 128 * 8192 * 2) == (0.054, "exact")
    assert vc.vidur_all_reduce_ms(ar, 4, 67108864) == (0.603, "exact")       # the largest size profiled
    ms, how = vc.vidur_all_reduce_ms(ar, 2, 16384)                            # between 10240 and 18432 bytes
    assert how == "interpolated" and ms == pytest.approx(0.046)               # both neighbours are 0.046
    assert vc.vidur_all_reduce_ms(ar, 2, 2 * 67108864) == (pytest.approx(0.86), "extrapolated")
    mlp = vc.load_vidur_mlp()
    assert {tp for tp, _ in mlp} == {2, 4} and len(mlp) == 2 * 451
    assert mlp[(2, 1)]["attn_pre_proj"] == 0.058 and mlp[(4, 1)]["mlp_up_proj"] == 0.151
    assert mlp[(2, 2048)]["add"] == pytest.approx((0.0565 + 0.056) / 2)      # duplicate rows averaged


def test_comparison_rows_ratios_and_tandem_assembly():
    rows = vc.compare()
    assert [(r["tp"], r["tokens"], r["op"]) for r in rows] == [
        (tp, t, op) for tp in (2, 4) for t in (1, 8, 32, 128, 512, 2048, 8192) for op in vc.ROWS]
    for r in rows:
        for k in ("vidur_ms", "measured_ms", "roofline_ms", "measured_over_vidur", "roofline_over_vidur"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["tp"], r["tokens"], r["op"], k)
    by = {(r["tp"], r["tokens"], r["op"]): r for r in rows}
    for tp in (2, 4):
        for t in (1, 128, 8192):
            step = by[(tp, t, "step")]
            # the per-op measured sum is exactly what MeasuredStep tabulates for the layers under a CUDA graph
            assert step["measured_ms"] == pytest.approx(step["tandem_token_tables_ms"], rel=1e-9)
            layer = {k: sum(by[(tp, t, op)][k] for op in vc.VIDUR_OPS) + 2 * by[(tp, t, "all_reduce")][k]
                     for k in ("vidur_ms", "measured_ms", "roofline_ms")}
            for k, v in layer.items():
                assert by[(tp, t, "layer")][k] == pytest.approx(v) and step[k] == pytest.approx(80 * v)
    assert by[(2, 128, "all_reduce")]["vidur_ms"] == 0.054 and by[(2, 128, "all_reduce")]["vidur_read"] == "exact"
    assert by[(2, 1, "qkv")]["vidur_ms"] == 0.058
    assert by[(2, 1, "elementwise")]["vidur_ms"] == pytest.approx(
        sum(vc.load_vidur_mlp()[(2, 1)][o] for o in vc.VIDUR_OPS["elementwise"]))


def test_the_report_holds_every_row_and_the_geomean_ratios(tmp_path):
    """Protects the report: one markdown row per compared value (interpolated Vidur reads marked), the ratio tables,
    and results.json's geometric mean of each ratio over the token counts."""
    rows = vc.compare(tps=(2,), tokens=(1, 128))
    md = write_report(rows, tmp_path)
    assert (tmp_path / "table.md").read_text() == md and (tmp_path / "per_op.png").stat().st_size > 0
    by = {(r["tokens"], r["op"]): r for r in rows}
    ar = by[(128, "all_reduce")]
    assert (f"| 2 | 128 | all_reduce | 0.054 | {ar['measured_ms']:.3g} | {ar['roofline_ms']:.3g} | "
            f"{ar['measured_over_vidur']:.2f} | {ar['roofline_over_vidur']:.2f} |") in md
    assert by[(1, "all_reduce")]["vidur_read"] == "interpolated" and "| 2 | 1 | all_reduce | " in md
    assert md.count("| 2 | ") == len(rows) == 2 * len(vc.ROWS)
    qkv = [by[(t, "qkv")]["measured_over_vidur"] for t in (1, 128)]
    assert f"| qkv | {qkv[0]:.2f} | {qkv[1]:.2f} |" in md
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["rows"] == json.loads(json.dumps(rows)) and res["meta"]["vidur"]["commit"] == vc.VIDUR_COMMIT
    assert res["geomean_ratio_over_tokens"]["tp2"]["qkv"]["measured_over_vidur"] == pytest.approx(
        math.sqrt(qkv[0] * qkv[1]))
