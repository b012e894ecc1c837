"""Sim-to-real metrics and report: latency populations and quantiles, per-round table, the markdown table with the
verdict against the tolerance, and the plot (benchmarks/sim_to_real.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sim_to_real_setup import CALIBRATION_POLICY, METRICS, QUANTILES, TOLERANCE


# ------------------------------------------------------------------------------------------ metrics


def populations(records) -> dict[str, list[float]]:
    """The samples behind each compared figure, with tandem.workload.metrics' definitions: TTFT of round 0,
    of rounds > 0, of all rounds; ITL = each round's mean inter-token gap (rounds with at least one gap)."""
    from tandem.workload.metrics import round_mean_itl

    rounds = [r for s in records for r in s.rounds]
    return {"ttft_initial": [r.ttft_s for r in rounds if r.index == 0 and r.ttft_s is not None],
            "ttft_incremental": [r.ttft_s for r in rounds if r.index > 0 and r.ttft_s is not None],
            "ttft_all": [r.ttft_s for r in rounds if r.ttft_s is not None],
            "itl": [round_mean_itl(r) for r in rounds if r.itl_count > 0]}


def latency_stats(records) -> dict:
    """P50/P95 per population. summarize() reports p50/p95 of initial and incremental TTFT and p95 of all-round
    TTFT and of the per-round ITL; the p50s it lacks use the same populations (checked against it here)."""
    from tandem.workload.metrics import summarize

    out = {k: qs(xs) for k, xs in populations(records).items()}
    summ = summarize(records, max((s.finish_s or 0.0) for s in records) or 1.0)
    for k, q, key in (("ttft_initial", "p50", "ttft_initial_p50_s"), ("ttft_initial", "p95", "ttft_initial_p95_s"),
                      ("ttft_incremental", "p50", "ttft_incremental_p50_s"),
                      ("ttft_incremental", "p95", "ttft_incremental_p95_s"), ("ttft_all", "p95", "ttft_p95_s"),
                      ("itl", "p95", "itl_p95_s")):
        assert out[k][q] is None or abs(out[k][q] - summ[key]) < 1e-12, (k, q, out[k][q], summ[key])
    out["summary"] = {k: summ[k] for k in ("sessions_completed", "sessions_failed", "rounds_completed",
                                           "local_prefill_fraction", "slo_attainment", "itl_mean_s", "e2e_mean_s")}
    return out


def qs(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": float(np.percentile(xs, 50)) if xs else None,
            "p95": float(np.percentile(xs, 95)) if xs else None, "mean": float(np.mean(xs)) if xs else None}


def round_table(sims_records, runs_records) -> list[dict]:
    """Every round: its tokens, where the simulator prefilled it, and TTFT / mean ITL per run, simulated and live."""
    from tandem.workload.metrics import round_mean_itl

    real = [{(s.session_id, r.index): r for s in recs for r in s.rounds} for recs in runs_records]
    sims = [{(s.session_id, r.index): r for s in recs for r in s.rounds} for recs in sims_records]
    out = []
    for s in sims_records[0]:
        for r in s.rounds:
            key = (s.session_id, r.index)
            lv, sv = [d.get(key) for d in real], [d.get(key) for d in sims]
            out.append({"session": s.session_id, "round": r.index, "new_tokens": r.input_tokens,
                        "history_tokens": r.history_tokens, "sim_where": r.prefill_where,
                        "sim_ttft_s": [x.ttft_s if x else None for x in sv],
                        "real_ttft_s": [x.ttft_s if x else None for x in lv],
                        "sim_itl_s": [round_mean_itl(x) if x and x.itl_count else None for x in sv],
                        "real_itl_s": [round_mean_itl(x) if x and x.itl_count else None for x in lv]})
    return out


def rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


# ------------------------------------------------------------------------------------------ report


def table(res: dict) -> str:
    size, cfg = res["config"]["size"], res["config"]
    lines = [f"Sim-to-real, tiny-qwen3-{size}, {res['workload']['sessions']} ToolBench-shaped sessions "
             f"({res['workload']['rounds']} rounds), {cfg['layout']} ({cfg['deploy']}), policy {cfg['policy']} on "
             f"both sides, {len(res['live_runs'])} live runs. Real and simulated figures pool the rounds of all runs "
             "(the simulation of each run takes the machine speed measured just before it); per-run ranges in "
             "brackets. Runtime model calibrated on the "
             f"{res['calibration']['probe'].get('policy', CALIBRATION_POLICY)} 1P+1D probe.", "",
             "| metric | real | sim, profile only | error | sim, + runtime model | error | error per run |",
             "|---|---|---|---|---|---|---|"]
    for k, label in METRICS:
        for q in QUANTILES:
            real = res["real_pooled"][k][q]
            runs = [r["stats"][k][q] for r in res["live_runs"]]
            errs = [r["errors"][k][q] for r in res["live_runs"]]
            a, b = res["sim_profile_only"][k][q], res["sim"][k][q]
            lines.append(f"| {label} {q.upper()} | {real * 1e3:.1f} ms [{min(runs) * 1e3:.1f}-{max(runs) * 1e3:.1f}] | "
                         f"{a * 1e3:.1f} ms | {100 * rel(a, real):+.1f}% | {b * 1e3:.1f} ms | "
                         f"**{100 * rel(b, real):+.1f}%** | {100 * min(errs):+.0f}% .. {100 * max(errs):+.0f}% |")
    worst = max(abs(res["errors"][k][q]) for k, _ in METRICS for q in QUANTILES)
    n_in = sum(abs(res["errors"][k][q]) <= TOLERANCE for k, _ in METRICS for q in QUANTILES)
    loads = [r["load_avg_1min_at_start"] for r in res["live_runs"]]
    lines += ["", f"Largest |error| with the runtime model (pooled): {100 * worst:.1f}% "
                  f"({'within' if worst <= TOLERANCE else 'NOT within'} {100 * TOLERANCE:.0f}%; "
                  f"{n_in} of {len(METRICS) * len(QUANTILES)} pooled figures within). "
                  f"1-minute load average at the runs' starts: {min(loads):.2f}-{max(loads):.2f} "
                  f"(at the benchmark's start {res['load_avg_1min_at_start']:.2f})."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [3, 1.3, 2]})
    short = {"ttft_initial": "initial", "ttft_incremental": "incremental", "ttft_all": "all rounds", "itl": "ITL"}
    panels = ((axes[0], [(k, q) for k, _ in METRICS[:3] for q in QUANTILES], "TTFT (ms)"),
              (axes[1], [("itl", q) for q in QUANTILES], "ITL, per-round mean (ms)"))
    for ax, ks, title in panels:
        x = np.arange(len(ks))
        real = [res["real_pooled"][k][q] * 1e3 for k, q in ks]
        lo = [min(r["stats"][k][q] for r in res["live_runs"]) * 1e3 for k, q in ks]
        hi = [max(r["stats"][k][q] for r in res["live_runs"]) * 1e3 for k, q in ks]
        ax.bar(x - 0.27, real, 0.26, label="real (live server)", color="#4c72b0",
               yerr=[np.maximum(np.subtract(real, lo), 0), np.maximum(np.subtract(hi, real), 0)], capsize=3)
        ax.bar(x, [res["sim_profile_only"][k][q] * 1e3 for k, q in ks], 0.26, label="sim, profile only",
               color="#bbbbbb")
        ax.bar(x + 0.27, [res["sim"][k][q] * 1e3 for k, q in ks], 0.26, label="sim, + runtime model", color="#dd8452")
        for i, (k, q) in enumerate(ks):
            ax.annotate(f"{100 * res['errors'][k][q]:+.0f}%", (x[i] + 0.27, res["sim"][k][q] * 1e3), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(x, [f"{short[k]}\n{q.upper()}" for k, q in ks], fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    ax = axes[2]
    for r0, color, label in ((True, "#4c72b0", "round 0"), (False, "#dd8452", "rounds > 0")):
        pts = [(np.mean([v for v in x["real_ttft_s"] if v is not None]), np.mean([v for v in x["sim_ttft_s"] if v]))
               for x in res["rounds"] if (x["round"] == 0) == r0 and any(v is not None for v in x["real_ttft_s"])]
        if pts:
            a = np.array(pts) * 1e3
            ax.scatter(a[:, 0], a[:, 1], s=12, alpha=0.7, color=color, label=label)
    lim = [10, 2000]
    ax.plot(lim, lim, color="k", lw=0.8)
    ax.fill_between(lim, [v * 0.85 for v in lim], [v * 1.15 for v in lim], color="k", alpha=0.08, label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*lim)
    ax.set_ylim(*lim)
    ax.set_xlabel("real TTFT (ms, mean over runs)")
    ax.set_ylabel("simulated TTFT (ms)")
    ax.set_title("every round")
    ax.legend(fontsize=8)
    fig.suptitle(f"tandem sim-to-real: tiny-qwen3-{res['config']['size']}, {res['config']['layout']}, "
                 f"policy {res['config']['policy']}, "
                 f"{res['workload']['sessions']} sessions, {len(res['live_runs'])} live runs "
                 "(error bars: range over runs; labels: error of the runtime model, pooled)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

