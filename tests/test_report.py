"""Reports: plain/coloured tables, Markdown, JSON with NaN and numpy values, the two figures."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from tandem.sim.report import (Column, format_markdown, format_table, ms, pct, plot_ablation, plot_slo_vs_rate,
                               to_jsonable, write_json)

ROWS = [{"workload": "gaia", "policy": "ampd", "rate": 2.0, "slo_attainment": 0.6566, "itl_mean_s": 0.0312},
        {"workload": "gaia", "policy": "vllm", "rate": 2.0, "slo_attainment": None, "itl_mean_s": float("nan")}]
COLS = [Column("workload"), Column("policy"), Column("rate", "rate", "g"), Column("slo_attainment", "SLO", pct),
        ("itl_mean_s", "ITL ms", ms)]


def test_table_plain_text():
    text = format_table(ROWS, COLS, title="t", color=False)
    assert "\x1b[" not in text
    assert "65.7%" in text and "31.2" in text and "SLO" in text
    vllm_line = next(line for line in text.splitlines() if "vllm" in line)
    assert vllm_line.count("-") >= 2                         # None and NaN render as '-'


def test_table_color_has_ansi():
    assert "\x1b[" in format_table(ROWS, COLS, color=True)


def test_table_accepts_plain_keys():
    text = format_table([{"a": 1, "b": 0.123456}], ["a", "b"], color=False)
    assert "0.1235" in text


def test_markdown():
    md = format_markdown(ROWS, COLS).splitlines()
    assert md[0] == "| workload | policy | rate | SLO | ITL ms |"
    assert md[1] == "|---|---|---|---|---|"
    assert md[2] == "| gaia | ampd | 2 | 65.7% | 31.2 |"
    assert md[3] == "| gaia | vllm | 2 | - | - |"


@dataclass
class _D:
    x: float
    y: tuple


def test_write_json(tmp_path):
    obj = {"nan": float("nan"), "inf": math.inf, "np": np.float64(1.5), "arr": np.arange(3), "d": _D(2.0, (1, 2)),
           "i": np.int64(4)}
    path = write_json(obj, tmp_path / "sub" / "x.json")
    back = json.loads(path.read_text())
    assert back == {"nan": None, "inf": None, "np": 1.5, "arr": [0, 1, 2], "d": {"x": 2.0, "y": [1, 2]}, "i": 4}
    assert to_jsonable({1: "a"}) == {"1": "a"}
    assert not list((tmp_path / "sub").glob("*.tmp"))


def _cells():
    out = []
    for w in ("dureader", "gaia"):
        for p in ("ampd", "dynamo", "vllm", "continuum", "ampd-no-pr", "ampd-no-ar-pr"):
            for i, r in enumerate((0.8, 1.6, 2.4)):
                att = None if (p == "vllm" and r == 2.4) else max(0.0, 0.9 - 0.2 * i - 0.05 * len(p) / 5)
                out.append({"workload": w, "policy": p, "rate": r, "slo_attainment": att, "model": "llama-3.1-70b",
                            "slo_ttft_s": 5.0, "slo_itl_s": 0.05,
                            "local_prefill_fraction": 0.3 if p == "ampd" else 0.0})
    return out


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_slo_vs_rate(tmp_path):
    path = plot_slo_vs_rate(_cells(), tmp_path / "f" / "slo.png")
    assert _is_png(path)


def test_plot_ablation(tmp_path):
    assert _is_png(plot_ablation(_cells(), tmp_path / "abl.png"))
    assert _is_png(plot_ablation(_cells(), tmp_path / "abl2.png", rate=2.4))


def test_plot_ablation_without_shares(tmp_path):
    cells = [c | {"local_prefill_fraction": None} for c in _cells()]
    assert _is_png(plot_ablation(cells, tmp_path / "abl.png"))
