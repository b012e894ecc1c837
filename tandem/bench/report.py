"""A benchmark's report files: results.json, table.md and a plot side by side in one folder, the table printed."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


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


def save_log2_plot(fig: Any, ax: Any, xs: Sequence[int], xlabel: str, ylabel: str, path: str | Path,
                   legend_size: int = 8) -> None:
    """Finish a plot against powers of two (x on a log2 axis ticked at `xs`, labels, legend) and save it to `path`."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
