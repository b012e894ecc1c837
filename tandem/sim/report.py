"""Reports of simulation runs: text and Markdown tables, JSON files, AMPD-style figures (Fig. 4 and 5)."""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ABLATION_ORDER = ("ampd-no-ar-pr", "ampd-no-pr", "ampd")
ABLATION_LABELS = {"ampd-no-ar-pr": "AMPD\nw/o AR+PR", "ampd-no-pr": "AMPD\nw/o PR", "ampd": "AMPD"}
POLICY_LABELS = {"ampd": "AMPD", "dynamo": "Dynamo", "vllm": "vLLM", "continuum": "vLLM-Continuum",
                 "ampd-no-pr": "AMPD w/o PR", "ampd-no-ar-pr": "AMPD w/o AR+PR"}
_STYLE = {"ampd": ("tab:red", "o"), "dynamo": ("tab:blue", "s"), "vllm": ("tab:green", "^"),
          "continuum": ("tab:purple", "D"), "ampd-no-pr": ("tab:orange", "v"), "ampd-no-ar-pr": ("tab:gray", "x")}


@dataclass(frozen=True, slots=True)
class Column:
    """One table column: the row key, its header, and how a value is written (format spec or function)."""

    key: str
    header: str = ""
    fmt: str | Callable[[Any], str] = ""

    def render(self, value: Any) -> str:
        """The cell text of `value`; None (and NaN) become '-'."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        if self.fmt:
            return format(value, self.fmt)
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)


def pct(value: float) -> str:
    """A fraction as a percentage with one decimal: 0.4567 -> '45.7%'."""
    return f"{100.0 * value:.1f}%"


def ms(value: float) -> str:
    """Seconds as milliseconds: 0.0351 -> '35.1'."""
    return f"{1000.0 * value:.1f}"


def _columns(columns: Sequence[str | tuple | Column]) -> list[Column]:
    out = []
    for c in columns:
        if isinstance(c, Column):
            out.append(c)
        elif isinstance(c, str):
            out.append(Column(c, c))
        else:
            out.append(Column(*c))
    return [c if c.header else Column(c.key, c.key, c.fmt) for c in out]


def format_table(rows: Sequence[Mapping], columns: Sequence[str | tuple | Column], title: str | None = None,
                 color: bool | None = None, width: int | None = None) -> str:
    """Render rows as a rich box table to a string; colours only when `color` (default: stdout is a TTY).

    The table takes its natural width up to `width` (default 250 columns) and is never squeezed
    to the terminal: values are not truncated; a narrow terminal wraps the lines instead.
    """
    from rich.console import Console
    from rich.table import Table

    cols = _columns(columns)
    if color is None:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    if width is None:
        width = 250
    table = Table(title=title, show_header=True, header_style="bold" if color else None)
    for c in cols:
        table.add_column(c.header, justify="left" if c.key in ("workload", "policy", "deploy", "metric") else "right",
                         no_wrap=True)
    for row in rows:
        table.add_row(*(c.render(row.get(c.key)) for c in cols))
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                      color_system="standard" if color else None, highlight=False)
    console.print(table)
    return buf.getvalue()


def format_markdown(rows: Sequence[Mapping], columns: Sequence[str | tuple | Column]) -> str:
    """Render rows as a GitHub-flavoured Markdown table."""
    cols = _columns(columns)
    lines = ["| " + " | ".join(c.header for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(c.render(row.get(c.key)).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values from dataclasses, numpy scalars/arrays, tuples, sets and paths; NaN/inf become null."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "tolist"):  # numpy scalar or array
        return to_jsonable(obj.tolist())
    return str(obj)


def write_json(obj: Any, path: str | os.PathLike) -> Path:
    """Write `obj` as indented JSON (atomically: temp file then rename), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_jsonable(obj), f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def write_text(text: str, path: str | os.PathLike) -> Path:
    """Write text to `path`, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ordered(values, order: Sequence[str] = ()) -> list:
    seen = list(dict.fromkeys(values))
    first = [v for v in order if v in seen]
    return first + [v for v in seen if v not in first]


def _slo_label(cell: Mapping) -> str:
    t, i = cell.get("slo_ttft_s"), cell.get("slo_itl_s")
    if t is None or i is None:
        return ""
    return f" (TTFT<={1000 * t:.0f}ms, ITL<={1000 * i:.0f}ms)"


def _percent(v: float | None) -> float:
    return float("nan") if v is None else 100.0 * v


def plot_slo_vs_rate(results: Sequence[Mapping], path: str | os.PathLike, metric: str = "slo_attainment") -> Path:
    """AMPD Fig. 4: one subplot per workload, SLO attainment (%) against arrival rate, one line per policy.

    `results` are cells with keys workload, policy, rate and `metric` (a fraction); optional keys
    model, slo_ttft_s, slo_itl_s title the subplots. Each AMPD point is labelled with its relative
    gain over the best baseline at that rate, as the paper's arrows are.
    """
    plt = _pyplot()
    workloads = _ordered(c["workload"] for c in results)
    policies = _ordered((c["policy"] for c in results), POLICY_LABELS)
    n = max(len(workloads), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        cells = [c for c in results if c["workload"] == w]
        for p in policies:
            pts = sorted((c["rate"], _percent(c.get(metric))) for c in cells if c["policy"] == p)
            if not pts:
                continue
            color, marker = _STYLE.get(p, (None, "o"))
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, color=color,
                    label=POLICY_LABELS.get(p, p), linewidth=1.6, markersize=5)
        _annotate_gain(ax, cells, metric)
        model = cells[0].get("model", "")
        ax.set_title(f"{model} {w}{_slo_label(cells[0])}".strip(), fontsize=9)
        ax.set_xlabel("Request Arrival Rate (request/s)")
        ax.set_ylabel("SLO Attainment (%)")
        ax.set_ylim(-3, 105)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return _save(fig, path, plt)


def _annotate_gain(ax, cells: Sequence[Mapping], metric: str) -> None:
    baselines = [c for c in cells if not str(c["policy"]).startswith("ampd")]
    for c in cells:
        if c["policy"] != "ampd" or c.get(metric) is None:
            continue
        best = max((b.get(metric) for b in baselines if b["rate"] == c["rate"] and b.get(metric) is not None),
                   default=None)
        if not best:
            continue
        gain = (c[metric] - best) / best
        ax.annotate(f"{'↑' if gain >= 0 else '↓'}{abs(100 * gain):.0f}%", (c["rate"], 100 * c[metric]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7, color="tab:red")


def _save(fig, path: str | os.PathLike, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ablation_rate(cells: Sequence[Mapping]) -> float | None:
    rates = sorted({c["rate"] for c in cells})
    return rates[len(rates) // 2] if rates else None


def plot_ablation(results: Sequence[Mapping], path: str | os.PathLike, rate: float | None = None) -> Path:
    """AMPD Fig. 5: per workload, bars of SLO attainment of ampd-no-ar-pr / ampd-no-pr / ampd, plus
    one stacked bar per workload of AMPD's local vs remote prefill share.

    Uses the cells at `rate` (default: per workload, the median of its rates, upper one when even).
    Bars carry the relative gain over AMPD w/o AR+PR, as the paper's arrows do.
    """
    plt = _pyplot()
    workloads = _ordered(c["workload"] for c in results if c["policy"] in ABLATION_ORDER)
    n = len(workloads) + 1
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.6), squeeze=False)
    shares = []
    for ax, w in zip(axes[0], workloads):
        cells = [c for c in results if c["workload"] == w and c["policy"] in ABLATION_ORDER]
        r = rate if rate is not None else _ablation_rate(cells)
        by_policy = {c["policy"]: c for c in cells if c["rate"] == r}
        names = [p for p in ABLATION_ORDER if p in by_policy]
        vals = [_percent(by_policy[p].get("slo_attainment")) for p in names]
        bars = ax.bar(range(len(names)), vals, color=[_STYLE[p][0] for p in names], width=0.6)
        ax.set_xticks(range(len(names)), [ABLATION_LABELS[p] for p in names], fontsize=8)
        base = by_policy.get("ampd-no-ar-pr", {}).get("slo_attainment")
        for p, bar, v in zip(names, bars, vals):
            label = "" if math.isnan(v) else f"{v:.1f}"
            if base and p != "ampd-no-ar-pr" and not math.isnan(v):
                gain = (v / 100 - base) / base
                label += f"\n{'↑' if gain >= 0 else '↓'}{abs(100 * gain):.0f}%"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, 0 if math.isnan(v) else v),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
        ax.set_ylim(0, 115)
        ax.set_ylabel("SLO Attainment (%)")
        ax.set_title(f"{w} @ {r:g} req/s", fontsize=9)
        ampd = by_policy.get("ampd")
        if ampd is not None and ampd.get("local_prefill_fraction") is not None:
            shares.append((w, ampd["local_prefill_fraction"]))
    ax = axes[0][-1]
    if shares:
        xs = range(len(shares))
        local = [100 * s for _, s in shares]
        remote = [100 - v for v in local]
        ax.bar(xs, local, color="tab:orange", label="Local Execution", width=0.6)
        ax.bar(xs, remote, bottom=local, color="tab:blue", label="Remote Execution", width=0.6)
        for x, lo in zip(xs, local):
            ax.annotate(f"{lo:.1f}%", (x, lo / 2), ha="center", va="center", fontsize=7)
            ax.annotate(f"{100 - lo:.1f}%", (x, lo + (100 - lo) / 2), ha="center", va="center", fontsize=7)
        ax.set_xticks(list(xs), [w for w, _ in shares], fontsize=8)
        ax.legend(fontsize=7, loc="upper center", ncol=2, frameon=False)
    ax.set_ylim(0, 118)
    ax.set_ylabel("Proportion (%)")
    ax.set_title("AMPD prefill placement", fontsize=9)
    fig.tight_layout()
    return _save(fig, path, plt)
