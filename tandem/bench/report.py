"""A benchmark's report files: results.json, table.md and a plot side by side in one folder, the table printed."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_report(out: str | Path, results: dict, table: str, plot: Callable[[dict, Path], None] | None = None,
                 plot_name: str = "plot.png") -> Path:
    """Write `results` (JSON), `table` (Markdown) and, with `plot`, plot(results, out/plot_name) into `out` (made if
    absent); print the table; return the folder."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (folder / "table.md").write_text(table + "\n")
    if plot is not None:
        plot(results, folder / plot_name)
    print(table)
    return folder
