"""Protects the benchmark report writer: results.json, table.md and the plot land side by side, the table printed."""
from __future__ import annotations

import json

from tandem.bench.report import write_report


def test_write_report_writes_the_three_files_and_prints_the_table(tmp_path, capsys):
    drawn = []
    out = write_report(tmp_path / "a" / "b", {"x": 1}, "| t |", lambda res, path: drawn.append((res, path.name)),
                       "fig.png")
    assert out == tmp_path / "a" / "b"
    assert json.loads((out / "results.json").read_text()) == {"x": 1}
    assert (out / "table.md").read_text() == "| t |\n"
    assert drawn == [({"x": 1}, "fig.png")] and capsys.readouterr().out == "| t |\n"
    write_report(out, {"y": 2}, "| u |")                 # no plot: none drawn, the files replaced
    assert json.loads((out / "results.json").read_text()) == {"y": 2} and len(drawn) == 1
