"""Simulate every silicon row tandem can represent (aiconfigurator-core's silicon_sample.csv: measured vLLM, SGLang
and TRT-LLM runs) with measured and roofline costs
per-row errors, grouped medians and p90s, a scatter plot, and
the rows left out with their reasons.

    python benchmarks/silicon_validation.py                       # H100 and H200 rows, both cost models
    python benchmarks/silicon_validation.py --gpus h100,h200,l40s --jobs 2 --out docs/results/silicon_validation
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from rich.progress import Progress

from tandem.bench.silicon import CLIENTS, Case, Skipped, prefill_demand, read_rows, simulate_case, to_case
from tandem.perf.measured.source import MissingCostData
from tandem.perf.models import get_model

COST_MODELS = ("measured", "roofline")


def run_one(args: tuple[Case, float, dict[str, str], int]) -> dict:
    """Both cost models' predictions for a row (and the derived one where its GPU is a derivation target), or
    {"error": why} when the row's deployment cannot run."""
    case, scale, derive, warmup = args
    out = asdict(case)
    out["client"] = case.client.name
    try:
        out["prefill_demand"] = prefill_demand(case)
    except (ValueError, MissingCostData):
        out["prefill_demand"] = float("nan")
    models = [(cm, cm, None) for cm in COST_MODELS]
    if case.gpu in derive:
        models.append(("derived", "measured", derive[case.gpu]))
    for cm, model, donor in models:
        try:
            p = simulate_case(case, model, scale=scale, donor=donor, warmup=warmup)
        except (ValueError, MissingCostData) as e:       # does not fit, bad parallelism, missing tables
            return {"row_id": case.row_id, "error": str(e)}
        out.update({f"{cm}_ttft_ms": p.ttft_ms, f"{cm}_tpot_ms": p.tpot_ms, f"{cm}_ttft_median_ms": p.ttft_median_ms,
                    f"{cm}_tpot_median_ms": p.tpot_median_ms, f"{cm}_source": p.cost_source})
        for k in ("ttft", "tpot"):
            out[f"{cm}_{k}_err"] = p.__dict__[f"{k}_ms"] / out[f"{k}_ms"] - 1.0
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _dense_vs(r: dict) -> bool:
    """A dense-model vLLM or SGLang row on an H100 or H200: the rows the measured model is judged on."""
    return r["framework"] in ("vllm", "sglang") and r["gpu"] in ("h100", "h200") and not get_model(r["model"]).is_moe


def _within_capacity(r: dict) -> bool:
    """Whether a row's implied prefill work fits the measured tables' capacity (tandem.bench.silicon.prefill_demand;
    rows.csv from before the column had none: counted as within)."""
    d = r.get("prefill_demand", 0.0)
    return not isinstance(d, float) or not d > 1.0


def summarise(results: list[dict]) -> list[dict]:
    """Median and p90 absolute error per GPU x framework x model x mode, and per GPU x framework x mode."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        for key in ((r["gpu"], r["framework"], r["model"], r["mode"]), (r["gpu"], r["framework"], "all", r["mode"]),
                    (r["gpu"], "all", "all", r["mode"]),
                    ("h100+h200", "vllm+sglang", "dense", r["mode"]) if _dense_vs(r) else None,
                    ("h100+h200", "vllm+sglang", f"dense, {r['client']} rows", r["mode"]) if _dense_vs(r) else None,
                    ("h100+h200", "vllm+sglang", "dense, within the tables' prefill capacity", r["mode"])
                    if _dense_vs(r) and _within_capacity(r) else None):
            if key is not None:
                groups.setdefault(key, []).append(r)
    rows = []
    for key, rs in sorted(groups.items()):
        row = {"gpu": key[0], "framework": key[1], "model": key[2], "mode": key[3], "rows": len(rs)}
        for cm in COST_MODELS + ("derived",):
            if any(not isinstance(r.get(f"{cm}_ttft_err"), float) for r in rs):
                continue                                   # derived costs only on the derivation's target GPU
            for k in ("ttft", "tpot"):
                e = [abs(r[f"{cm}_{k}_err"]) for r in rs]
                row[f"{cm}_{k}_median"] = statistics.median(e)
                row[f"{cm}_{k}_p90"] = quantile(e, 0.9)
        rows.append(row)
    return rows


def table_md(summary: list[dict]) -> str:
    head = ("| GPU | framework | model | mode | rows | TTFT measured median / p90 | TTFT roofline | "
            "TPOT measured median / p90 | TPOT roofline |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in summary:
        def f(cm, k):
            return f"{100 * r[f'{cm}_{k}_median']:.1f}% / {100 * r[f'{cm}_{k}_p90']:.1f}%"
        lines.append(f"| {r['gpu']} | {r['framework']} | {r['model']} | {r['mode']} | {r['rows']} | "
                     f"{f('measured', 'ttft')} | {f('roofline', 'ttft')} | {f('measured', 'tpot')} | "
                     f"{f('roofline', 'tpot')} |")
    return head + "\n".join(lines) + "\n"


def derived_md(summary: list[dict]) -> str:
    """The derived costs' errors beside the measured model's on the same rows (the derivation's target GPU)."""
    rows = [r for r in summary if "derived_ttft_median" in r]
    if not rows:
        return ""
    head = ("| GPU | framework | model | mode | rows | TTFT derived median / p90 | TTFT measured | "
            "TPOT derived median / p90 | TPOT measured | derived / measured median (TTFT, TPOT) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        def f(cm, k):
            return f"{100 * r[f'{cm}_{k}_median']:.1f}% / {100 * r[f'{cm}_{k}_p90']:.1f}%"
        ratio = ", ".join(f"{r[f'derived_{k}_median'] / max(r[f'measured_{k}_median'], 1e-9):.2f}"
                          for k in ("ttft", "tpot"))
        lines.append(f"| {r['gpu']} | {r['framework']} | {r['model']} | {r['mode']} | {r['rows']} | "
                     f"{f('derived', 'ttft')} | {f('measured', 'ttft')} | {f('derived', 'tpot')} | "
                     f"{f('measured', 'tpot')} | {ratio} |")
    return "\nCosts derived from another GPU's tables, on the same rows:\n\n" + head + "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, k in zip(axes, ("ttft", "tpot")):
        for cm, color in (("roofline", "tab:gray"), ("measured", "tab:blue")):
            ax.scatter([r[f"{k}_ms"] for r in results], [r[f"{cm}_{k}_ms"] for r in results], s=8, alpha=0.6,
                       color=color, label=cm)
        lo = min(min(r[f"{k}_ms"] for r in results), min(r[f"measured_{k}_ms"] for r in results)) * 0.8
        hi = max(max(r[f"{k}_ms"] for r in results), max(r[f"measured_{k}_ms"] for r in results)) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"real {k.upper()} (ms)")
        ax.set_ylabel(f"simulated {k.upper()} (ms)")
        ax.legend()
        ax.set_title(f"{k.upper()}: silicon rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def derive_pairs(text: str) -> dict[str, str]:
    """--derive's TARGET:DONOR pairs as a dict (argparse turns the ValueError into a one-line usage error)."""
    pairs = [p.split(":") for p in text.split(",") if p]
    if any(len(p) != 2 or not all(p) for p in pairs):
        raise argparse.ArgumentTypeError(f"expected TARGET:DONOR pairs such as h200:h100, got {text!r}")
    return dict(pairs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="h100,h200", help="catalogue GPUs whose rows to simulate")
    ap.add_argument("--frameworks", default="vllm,sglang,trtllm")
    ap.add_argument("--models", default="", help="catalogue models whose rows to simulate, comma-separated ('': all)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="run each row with this share of its benchmark's requests (1: all of them)")
    ap.add_argument("--limit", type=int, default=0, help="simulate at most this many rows (0: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="docs/results/silicon_validation")
    ap.add_argument("--from-rows", action="store_true", help="summarise OUT/rows.csv again without simulating")
    ap.add_argument("--continuous-warmup", type=int, default=0, metavar="K",
                    help="sensitivity: K x c warm-up requests run through the same closed loop before the measured ones "
                         "(default 0: the measured run starts cold, its warm-up drained first)")
    ap.add_argument("--derive", default="h200:h100", type=derive_pairs,
                    help="TARGET:DONOR pairs, comma-separated: also simulate TARGET's rows on costs derived from "
                         "DONOR's tables ('' for none)")
    a = ap.parse_args(argv)
    if not 0 < a.scale <= 1 or a.limit < 0 or a.jobs < 1 or a.continuous_warmup < 0:
        ap.error("--scale must be in (0, 1], --limit and --continuous-warmup >= 0, --jobs >= 1")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.from_rows:
        results = _read_results(out / "rows.csv")
        for r in results:
            if not isinstance(r.get("prefill_demand"), float):
                r["prefill_demand"] = prefill_demand(_case_of(r))
        _write_rows(results, out / "rows.csv")
        return report(results, _read_skipped(out / "skipped.csv"), out)
    gpus, fws = set(a.gpus.split(",")), set(a.frameworks.split(","))
    models = {get_model(m).name for m in a.models.split(",") if m}
    derive = a.derive
    cases, skipped = [], []
    for row in read_rows():
        c = to_case(row)
        if isinstance(c, Skipped):
            skipped.append(c)
        elif c.gpu in gpus and c.framework in fws and (not models or c.model in models):
            cases.append(c)
    if a.limit:
        cases = cases[: a.limit]
    results = []
    with Progress() as prog, ProcessPoolExecutor(a.jobs) as pool:
        task = prog.add_task("silicon rows", total=len(cases))
        for r in pool.map(run_one, [(c, a.scale, derive, a.continuous_warmup) for c in cases]):
            if "error" in r:
                skipped.append(Skipped(r["row_id"], f"not simulated: {r['error']}"))
            else:
                results.append(r)
            prog.advance(task)
    _write_rows(results, out / "rows.csv")
    with open(out / "skipped.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "reason"])
        w.writerows([(s.row_id, s.reason) for s in skipped])
    return report(results, skipped, out)


def _write_rows(results: list[dict], path: Path) -> None:
    """rows.csv: one line per simulated row (derived columns only on the derivation target's rows)."""
    fields = list(dict.fromkeys(k for r in results for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(results)


def _read_results(path: Path) -> list[dict]:
    """rows.csv back as dicts, numbers as floats."""
    def num(v: str):
        try:
            return float(v)
        except ValueError:
            return v
    with open(path, newline="") as f:
        return [{k: num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _case_of(r: dict) -> Case:
    """A rows.csv row back as its Case."""
    fields = {f: r[f] for f in Case.__dataclass_fields__ if f != "client"}
    for f in ("concurrency", "isl", "osl"):
        fields[f] = int(fields[f])
    return Case(**fields, client=CLIENTS[r["client"]])


def _read_skipped(path: Path) -> list[Skipped]:
    with open(path, newline="") as f:
        return [Skipped(r["id"], r["reason"]) for r in csv.DictReader(f)]


def report(results: list[dict], skipped: list[Skipped], out: Path) -> int:
    """table.md, summary.json and scatter.png from the simulated rows; prints the table."""
    summary = summarise(results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s.reason] = reasons.get(s.reason, 0) + 1
    md = table_md(summary) + derived_md(summary) + "\nRows left out, by reason:\n\n" + "\n".join(
        f"- {n} x {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])) + "\n"
    (out / "table.md").write_text(md)
    plot(results, out / "scatter.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
