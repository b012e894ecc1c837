"""The sweep's report: AMPD's improvement over each baseline, the tables, summary, plots and results.json."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

ABLATION_POLICIES: tuple[str, ...] = ("ampd-no-pr", "ampd-no-ar-pr")
BASELINES: tuple[str, ...] = ("dynamo", "vllm", "continuum", "ampd-no-pr", "ampd-no-ar-pr")

PAPER_IMPROVEMENT: dict[str, str] = {
    "dynamo": "+67.29% on average (up to +967.54%)",
    "vllm": "+339.74% on average (up to +3435.1%)",
    "continuum": "not reported (often tied with vLLM)",
    "ampd-no-pr": "+13.42% to +14.81% (prefill reordering, Fig. 5)",
    "ampd-no-ar-pr": "+44.47% to +402% (routing + reordering, Fig. 5)",
}
"""AMPD's reported gain in SLO attainment over each baseline (§7.2)."""


def relative_improvement(cells: Sequence[dict], baseline: str, target: str = "ampd",
                         metric: str = "slo_attainment") -> dict | None:
    """Mean over cells (workload, rate) of (target - baseline)/baseline where baseline > 0, and how often target >= baseline."""
    by = {(c["workload"], c["rate"], c["policy"]): c.get(metric) for c in cells}
    pairs = [(v, by[w, r, baseline]) for (w, r, p), v in by.items()
             if p == target and v is not None and by.get((w, r, baseline)) is not None]
    if not pairs:
        return None
    rel = [(a - b) / b for a, b in pairs if b > 0]
    return {
        "baseline": baseline,
        "cells": len(pairs),
        "cells_baseline_positive": len(rel),
        "mean_relative_improvement": sum(rel) / len(rel) if rel else None,
        "max_relative_improvement": max(rel) if rel else None,
        "cells_ampd_at_least_baseline": sum(1 for a, b in pairs if a >= b),
        "paper": PAPER_IMPROVEMENT.get(baseline, ""),
    }


def _table_columns() -> list:
    from tandem.sim.report import Column, ms, pct
    return [
        Column("workload", "workload"), Column("policy", "policy"), Column("rate", "rate", "g"),
        Column("deploy", "deploy"), Column("slo_attainment", "SLO", pct),
        Column("round_slo_attainment", "round SLO", pct),
        Column("ttft_initial_p95_s", "TTFT0 p95 s", ".3f"), Column("ttft_incremental_p95_s", "TTFTi p95 s", ".3f"),
        Column("itl_mean_s", "ITL ms", ms), Column("local_prefill_fraction", "local", pct),
        Column("sessions_completed", "done", "d"), Column("sessions_failed", "failed", "d"),
        Column("wall_s", "wall s", ".1f"),
    ]


def summary_text(improvement: dict[str, dict]) -> str:
    """Markdown lines: AMPD's mean relative gain over each baseline beside the paper's."""
    lines = ["| baseline | AMPD mean gain in SLO attainment | cells AMPD >= baseline | paper |", "|---|---|---|---|"]
    for b, imp in improvement.items():
        mean = imp["mean_relative_improvement"]
        gain = "-" if mean is None else f"{100 * mean:+.2f}%"
        lines.append(f"| {b} | {gain} | {imp['cells_ampd_at_least_baseline']}/{imp['cells']} | {imp['paper']} |")
    return "\n".join(lines) + "\n"


RUN_KEYS = ("wall_s", "executor")          # how the sweep ran, not what it found: run.json, not results.json


def split_run(result: dict) -> tuple[dict, dict]:
    """(results, run): the sweep's findings, the same for the same spec however it ran (in-process, --jobs N,
    --ray: byte-identical results.json), and how it ran (wall times, jobs, executor)."""
    results = {k: v for k, v in result.items() if k not in RUN_KEYS and k != "files"}
    results["spec"] = {k: v for k, v in result["spec"].items() if k != "jobs"}
    results["cells"] = [{k: v for k, v in c.items() if k != "wall_s"} for c in result["cells"]]
    run = {k: result[k] for k in RUN_KEYS if k in result}
    run["jobs"] = result["spec"].get("jobs")
    run["cells_wall_s"] = [{"workload": c["workload"], "policy": c["policy"], "rate": c["rate"],
                            "wall_s": c.get("wall_s")} for c in result["cells"]]
    return results, run


def write_outputs(out_dir: Path, result: dict, policies: Sequence[str]) -> dict[str, str]:
    from tandem.sim import report
    cols = _table_columns()
    files = {}
    results, run = split_run(result)
    files["results"] = report.write_json(results, out_dir / "results.json")
    files["run"] = report.write_json(run, out_dir / "run.json")
    title = f"{result['spec']['model']} on {result['spec']['gpu']} ({_costs(result['spec'])})"
    files["table_txt"] = report.write_text(report.format_table(result["cells"], cols, title=title, color=False),
                                           out_dir / "table.txt")
    md = f"# {result['spec']['name']}: {title}\n\n" + report.format_markdown(result["cells"], cols)
    if result["improvement"]:
        md += "\n## AMPD relative improvement\n\n" + summary_text(result["improvement"])
    files["table_md"] = report.write_text(md, out_dir / "table.md")
    files["summary"] = report.write_text(_summary_md(result), out_dir / "summary.md")
    files["slo_vs_rate"] = report.plot_slo_vs_rate(result["cells"], out_dir / "slo_vs_rate.png")
    if any(p in ABLATION_POLICIES for p in policies):
        files["ablation"] = report.plot_ablation(result["cells"], out_dir / "ablation.png",
                                                 rate=result["reference_rate"])
    return {k: str(v) for k, v in files.items()}


def _costs(spec: dict) -> str:
    """The experiment's cost source (measured, derived or roofline), from its simulator settings."""
    from tandem.perf.costs import DEFAULT_COST_MODEL, choose_cost_model
    from tandem.perf.measured.source import DEFAULT_FRAMEWORK, MissingCostData

    sim = dict(spec.get("sim") or {})
    if sim.get("perf"):
        return f"profiled ({sim['perf']})"
    try:
        return str(choose_cost_model(sim.get("cost_model", DEFAULT_COST_MODEL), spec["gpu"],
                                     sim.get("cost_framework", DEFAULT_FRAMEWORK)).label)
    except (ValueError, MissingCostData) as e:
        return f"unresolved ({e})"


def _summary_md(result: dict) -> str:
    spec = result["spec"]
    lines = [f"# Experiment `{spec['name']}`", "",
             f"- model {spec['model']} on {spec['gpu']}; workloads {', '.join(spec['workloads'])}; "
             f"policies {', '.join(spec['policies'])}",
             f"- rates {', '.join(f'{r:g}' for r in spec['rates'])} sessions/s; {spec['sessions']} sessions per cell "
             f"and seed; seeds {', '.join(map(str, spec['seeds']))}",
             ("- deployments chosen per rate (each rate's best SLO attainment)" if spec.get("deploy_per_rate")
              else "- deployments searched at every rate (best mean SLO attainment)" if spec.get("search_all_rates")
              else f"- deployments searched at {result['reference_rate']:g} sessions/s") + f"; wall time {result['wall_s']:.1f} s",
             f"- step costs: {_costs(spec)}",
             f"- Table 1 prefill length read as: {spec.get('prefill_basis', 'input')} "
             "(input: new tokens per round; prompt: each round's whole prompt)",
             "", "## Deployments", "", "| workload | policy | deploy | how |", "|---|---|---|---|"]
    for d in result["deployments"]:
        by_rate = d.get("deploy_by_rate")
        deploy = ("; ".join(f"{r}: {x}" for r, x in by_rate.items()) if by_rate and len(set(by_rate.values())) > 1
                  else d["deploy"])
        lines.append(f"| {d['workload']} | {d['policy']} | {deploy} | {d['source']} |")
    if result["improvement"]:
        lines += ["", "## AMPD relative improvement in SLO attainment", "",
                  "Mean over cells (workload, rate) of (AMPD - baseline) / baseline where baseline > 0.", "",
                  summary_text(result["improvement"])]
    return "\n".join(lines) + "\n"


def format_cells(cells: Sequence[dict], color: bool | None = None) -> str:
    """The experiment's result table as text (what `tandem experiment` prints)."""
    from tandem.sim.report import format_table
    return format_table(cells, _table_columns(), color=color)
