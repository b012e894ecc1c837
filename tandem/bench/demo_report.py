"""The demo's side-by-side: each policy's measured row with the simulator's row beneath it (and the difference),
as a table, a Markdown file and a PNG of every round's TTFT over the run."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.demo import DemoPlan, PolicyRun, deployment
from tandem.bench.demo_runtime import describe as describe_runtime
from tandem.perf.step_model import Profile
from tandem.workload.records import SessionRecord, dump_records
from tandem.workload.session import SLO

TABLE_WIDTH = 130               # a piped table's width (three rows a policy, differences in every cell)
NOISY_PROFILE_ERROR = 0.15      # a profile whose median held-out step error exceeds this is called out
LONG_ARRIVALS_S = 60.0          # sessions arriving over longer than this (per policy) are called out
PNG_NAME = "ttft.png"
TABLE_NAME = "table.md"
RESULTS_NAME = "results.json"
# (key, header, kind): kind ms (seconds shown in ms, difference relative), pct (a share, difference in percentage
# points), int (a count, difference relative), split (local/remote counts, difference of the local share in points)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("ttft_initial_mean_s", "TTFT init ms", "ms"),
    ("ttft_incremental_mean_s", "TTFT incr ms", "ms"),
    ("itl_mean_s", "ITL ms", "ms"),
    ("round_slo_attainment", "round SLO", "pct"),
    ("local_remote", "local/remote", "split"),
    ("cached_tokens", "cached tokens", "int"),
)


def _split(local: int | None, remote: int | None) -> tuple[int, int] | None:
    return None if local is None or remote is None else (int(local), int(remote))


def figures(metrics: dict, records: Sequence[SessionRecord], local: int | None, remote: int | None) -> dict:
    """One row's figures: the metrics' TTFTs, ITL and round attainment, the local/remote prefill counts, and the
    cached (reused) prompt tokens summed over the records' rounds."""
    out = {key: metrics.get(key) for key, _, kind in COLUMNS if kind in ("ms", "pct")}
    out["local_remote"] = _split(local, remote)
    out["cached_tokens"] = sum(r.history_tokens for s in records for r in s.rounds)
    return out


def measured_figures(run: PolicyRun) -> dict:
    """The live run's row (local/remote from the server's prefill counters)."""
    return figures(run.measured, run.records, run.measured.get("local_prefills"), run.measured.get("remote_prefills"))


def simulated_figures(summary: dict, records: Sequence[SessionRecord]) -> dict:
    """A simulation's row (local/remote from where each simulated round was prefilled)."""
    where = [r.prefill_where for s in records for r in s.rounds if r.prefill_where]
    remote = sum(1 for w in where if w == "remote")
    return figures(summary, records, len(where) - remote, remote)


def _share(split: tuple[int, int] | None) -> float | None:
    return None if split is None or sum(split) == 0 else split[0] / sum(split)


def difference(sim: dict, real: dict) -> dict:
    """The simulator against the measurement, per column: relative (%) for times and counts, percentage points for
    shares (round attainment, the local prefill share); None where either side is missing or the measured is 0."""
    out: dict = {}
    for key, _, kind in COLUMNS:
        s, m = sim.get(key), real.get(key)
        if kind == "split":
            s, m = _share(s), _share(m)
        if s is None or m is None:
            out[key] = None
        elif kind in ("pct", "split"):
            out[key] = 100.0 * (s - m)
        else:
            out[key] = 100.0 * (s - m) / m if m else None
    return out


SIM_SOURCES = ("simulated", "sim+runtime")      # the profile's steps alone; with the measured runtime block


def comparison(runs: Sequence[PolicyRun]) -> list[dict]:
    """Per policy: the measured row, then the simulated one (the profile's steps alone) and, when the runtime was
    measured, the simulation with it, each with its difference to the measured row."""
    rows = []
    for run in runs:
        real = measured_figures(run)
        rows.append({"policy": run.policy, "source": "measured", "figures": real, "diff": None})
        for source, summary, records in ((SIM_SOURCES[0], run.simulated, run.sim_records),
                                         (SIM_SOURCES[1], run.simulated_rt, run.sim_rt_records)):
            if records:
                sim = simulated_figures(summary, records)
                rows.append({"policy": run.policy, "source": source, "figures": sim, "diff": difference(sim, real)})
    return rows


def _cell(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "ms":
        return f"{1e3 * v:.1f}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "split":
        return f"{v[0]}/{v[1]}"
    return f"{v:,}"


def _diff_cell(d: float | None, kind: str) -> str:
    if d is None:
        return ""
    return f" ({d:+.0f} pp)" if kind in ("pct", "split") else f" ({d:+.0f}%)"


def row_cells(row: dict) -> list[str]:
    """A comparison row as text cells: policy, source, then each column (simulated cells carry their difference)."""
    cells = [row["policy"] if row["source"] == "measured" else "", row["source"]]
    diff = row["diff"] or {}
    for key, _, kind in COLUMNS:
        cells.append(_cell(row["figures"].get(key), kind) + _diff_cell(diff.get(key), kind))
    return cells


def markdown_table(rows: Sequence[dict]) -> str:
    """The comparison as a Markdown table."""
    head = ["policy", "run", *(h for _, h, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def print_comparison(rows: Sequence[dict], title: str) -> None:
    """The comparison as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("policy")
    table.add_column("run")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for i, row in enumerate(rows):
        last = i == len(rows) - 1 or rows[i + 1]["source"] == "measured"
        table.add_row(*row_cells(row), end_section=last and i < len(rows) - 1)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, TABLE_WIDTH)     # piped: wide enough for one line a row
    console.print(table)


def plot_ttft(runs: Sequence[PolicyRun], slo: SLO, path: str | Path) -> Path:
    """Every measured round's TTFT against the time it was sent, one colour per policy, the TTFT SLO dashed; the
    simulator's rounds as faint crosses. Written as a PNG (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        pts = sorted((r.arrival_s, r.ttft_s) for s in run.records for r in s.rounds if r.ttft_s is not None)
        att = run.measured.get("round_slo_attainment")
        label = f"{run.policy} measured" + (f" ({100 * att:.0f}% of rounds in SLO)" if att is not None else "")
        if pts:
            ax.plot([t for t, _ in pts], [1e3 * y for _, y in pts], "o-", color=c, ms=3.5, lw=0.8, alpha=0.85,
                    label=label)
        sim_records, what = ((run.sim_rt_records, "simulated + measured runtime") if run.sim_rt_records
                             else (run.sim_records, "simulated"))
        sim = sorted((r.arrival_s, r.ttft_s) for s in sim_records for r in s.rounds if r.ttft_s is not None)
        if sim:
            ax.plot([t for t, _ in sim], [1e3 * y for _, y in sim], "x", color=c, ms=4, alpha=0.45,
                    label=f"{run.policy} {what}")
    ax.axhline(1e3 * slo.ttft_s, color="black", ls="--", lw=1, label=f"TTFT SLO {1e3 * slo.ttft_s:.0f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("round sent (s from the start of the run)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title("Per-round TTFT over the run")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path



def header(plan: DemoPlan, model: str, perf: str, profile: Profile, threads: int,
           load_avg: tuple[float, ...] | None = None, notes: Sequence[str] = ()) -> str:
    """What the demo is about to do, what the profile cache check found (`notes`), and how its rate and SLO were
    derived."""
    cal = plan.calibration
    lines = [f"tandem demo: {plan.workload} x{len(plan.sessions)} sessions (tokens x{plan.scale:g}"
             + (f", outputs capped at {plan.max_tokens_cap}" if plan.max_tokens_cap else "") + f") on {model}, "
             f"two worker processes at {threads} torch thread(s) each, through HTTP; "
             + ", then ".join(plan.policies) + ", each on fresh workers, then the simulator",
             f"  profile {perf}: {profile.device_name}, {profile.device.get('threads', '?')} torch thread(s), "
             f"held-out step error {100 * (profile.heldout_error.get('median') or 0):.1f}%"]
    lines += [f"  {n}" for n in notes]
    err = profile.heldout_error.get("median") or 0.0
    if err > NOISY_PROFILE_ERROR:
        load = profile.options.get("load_avg_before")
        lines.append(f"  the profile predicts its held-out steps {100 * err:.0f}% off" +
                     (f" (made at load average {load:.1f})" if isinstance(load, (int, float)) else "") +
                     f": the rate and SLO below are as rough; delete {perf} to profile again on a quieter machine")
    derived = cal.describe()
    if plan.rate_given:
        lines.append(f"  rate {plan.rate:g} sessions/s (--rate; calibrated: {derived[0]})")
    else:
        lines.append(f"  {derived[0]}")
    span = max((s.arrival_s for s in plan.sessions), default=0.0)
    if span > LONG_ARRIVALS_S:
        lines.append(f"  at this rate the sessions arrive over {span:.0f} s for each policy: the machine profiled "
                     f"slow (see the load average below); Ctrl-C and --rate, or a quieter machine, shorten it")
    if plan.slo_given:
        lines.append(f"  SLO TTFT {1e3 * plan.slo.ttft_s:g} ms, ITL {1e3 * plan.slo.itl_s:g} ms (given; calibrated: "
                     f"{derived[1]})")
    else:
        lines.append(f"  {derived[1]}")
    if load_avg is not None:
        lines.append(f"  load average {load_avg[0]:.2f} {load_avg[1]:.2f} {load_avg[2]:.2f} over "
                     f"{profile.device.get('cores', '?')} cores (other jobs slow the live runs, not the simulation)")
    return "\n".join(lines)


def title(plan: DemoPlan) -> str:
    """The comparison table's title."""
    return (f"{plan.workload} x{len(plan.sessions)} at {plan.rate:.2f} sessions/s, SLO TTFT "
            f"{1e3 * plan.slo.ttft_s:.0f} ms / ITL {1e3 * plan.slo.itl_s:.1f} ms: measured, and simulated from the "
            f"profile (difference to measured)")


def _attainment(summary: dict) -> float | None:
    return summary.get("round_slo_attainment")


def verdict(runs: Sequence[PolicyRun]) -> str | None:
    """What the SLO leaves AMPD to win, from the runs themselves: the measured attainment of AMPD and the baseline
    beside the simulator's (the same sessions without other jobs or run-to-run variation; with the measured
    runtime when there is one); None without two runs."""
    if len(runs) < 2:
        return None
    a, b = runs[0], runs[1]
    ma, mb = _attainment(a.measured), _attainment(b.measured)
    sa, sb = _attainment(a.simulated_rt or a.simulated), _attainment(b.simulated_rt or b.simulated)
    if ma is None or mb is None:
        return None
    line = f"round SLO attainment measured: {a.policy} {100 * ma:.1f}%, {b.policy} {100 * mb:.1f}%"
    if sa is None or sb is None:
        return line
    if round(1000 * sa) == round(1000 * sb):
        return (line + f"; simulated, both {100 * sa:.1f}%: at this SLO the simulator leaves {a.policy} nothing to "
                f"win over {b.policy}, so the measured gap is run-to-run variation (fresh workers, one run after "
                f"the other, other jobs on the machine), not the policy")
    return line + f"; simulated {a.policy} {100 * sa:.1f}%, {b.policy} {100 * sb:.1f}%"


def footer(out: str | Path, runs: Sequence[PolicyRun], profile: Profile, runtime: dict | None = None) -> list[str]:
    """Where the files went, the load during each run, and what each simulation leaves out or measured."""
    folder = Path(out)
    loads = ", ".join(f"{r.policy} {r.load_avg[0]:.2f}" for r in runs if r.load_avg is not None)
    lines = [f"per-round TTFT over time: {folder / PNG_NAME}  (table: {folder / TABLE_NAME}, everything: "
             f"{folder / RESULTS_NAME})"]
    if loads:
        lines.append(f"1-minute load average after each live run: {loads}")
    v = verdict(runs)
    if v is not None:
        lines.append(v)
    if profile.runtime is None:
        lines.append("simulated: engine steps and KV transfers priced from the profile alone; a quick profile has "
                     "no runtime costs (HTTP, messages between steps, the serving process's CPU on the same cores), "
                     "which the live runs pay")
    if runtime is not None:
        lines.append(f"sim+runtime: the same with the {describe_runtime(runtime)} (a probe before the measured "
                     f"sessions; other jobs on the machine are in neither simulation)")
    return lines


def results(plan: DemoPlan, runs: Sequence[PolicyRun], runtime: dict | None = None) -> dict:
    """Everything the demo measured and simulated, JSON-ready."""
    return {"workload": plan.workload, "sessions": len(plan.sessions), "scale": plan.scale,
            "max_tokens_cap": plan.max_tokens_cap, "seed": plan.seed, "rate": plan.rate,
            "slo": {"ttft_s": plan.slo.ttft_s, "itl_s": plan.slo.itl_s},
            "rate_given": plan.rate_given, "slo_given": plan.slo_given,
            "calibration": {**dataclasses.asdict(plan.calibration), "describe": plan.calibration.describe()},
            "comparison": comparison(runs), "runtime": runtime,
            "runs": [{"policy": r.policy, "deployment": deployment(r.policy), "load_avg": r.load_avg,
                      "measured": r.measured, "simulated": r.simulated, "simulated_runtime": r.simulated_rt or None}
                     for r in runs]}


def write_outputs(out: str | Path, plan: DemoPlan, runs: Sequence[PolicyRun], runtime: dict | None = None) -> dict:
    """results.json, table.md and the TTFT PNG into `out` (made if absent); returns the results with the paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    res = results(plan, runs, runtime)
    res["png"] = str(plot_ttft(runs, plan.slo, folder / PNG_NAME))
    (folder / TABLE_NAME).write_text(f"{title(plan)}\n\n{markdown_table(res['comparison'])}\n")
    (folder / RESULTS_NAME).write_text(json.dumps(res, indent=1, default=str) + "\n")
    for run in runs:                                 # every round, measured and simulated (`tandem bench --records`)
        dump_records(run.records, folder / f"records-{run.policy}.jsonl")
        dump_records(run.sim_records, folder / f"records-{run.policy}-simulated.jsonl")
        if run.sim_rt_records:
            dump_records(run.sim_rt_records, folder / f"records-{run.policy}-simulated-runtime.jsonl")
    return res
