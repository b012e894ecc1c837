"""Sim-to-real: the simulator with a profiled cost model against the live server.

    python benchmarks/sim_to_real.py [--policy ampd] [--size 30m] [--runs 3] [--out docs/results/sim-to-real]
    python benchmarks/sim_to_real.py --policy continuum --reuse-profile --reuse-calibration

Both sides run the same policy (`--policy`, any of tandem.policy.presets.POLICIES): the live server and the
simulator build their cores with the one factory (tandem/core/factory.py), so the policy's router, picker and
idle-KV retention run on both. A disaggregated policy (ampd, dynamo, ...) runs on 1P+1D (`tandem serve
--prefill-workers 1 --decode-workers 1`, simulated P:tp1x1,D:tp1x1); a co-located one (continuum, vllm) on two
co-located workers (`tandem serve --colocated 2`, simulated C:tp1x2): two worker processes either way, so the
host's cores are shared alike.

1. makes a tiny checkpoint (`tandem tiny-model`, under models/) and profiles it
   (`tandem profile --threads 1`: step-time model, KV path, engine-vs-engine interference);
2. writes a scaled-down ToolBench-shaped multi-round workload as a session file (`sessions-<size>.jsonl`:
   token counts and tool gaps scaled so rounds fit the model's context and a run takes about 90 s);
3. calibrates the live runtime's own costs on a separate probe (never on the workload): the message hop of
   the runtime's transport (an echo worker over the real Hub/Link), and on an idle live server: the worker
   loop's gap between steps (single-stream ITL minus the profiled decode step), the per-round request/response
   latency (idle TTFT minus the simulated remote prefill path) and how much slower prefill steps run while the
   decode worker streams (prefill TTFTs beside a long decode); writes `profile-<size>-live.json` = the profile
   plus that `runtime` block. The calibration is a property of the runtime on this host, not of the policy: it is
   always measured on the ampd 1P+1D probe, and its files (profile, calibration, session file) are per size and
   shared by the policies (`--reuse-profile --reuse-calibration` lets a second policy use the first one's);
4. runs the live server (`tandem serve --policy POLICY --perf PROFILE --slo-ttft S --slo-itl S --threads 1`,
   1P+1D or 2 co-located worker processes) `--runs` times, a fresh server each, and replays the session file
   with the `tandem bench` client (`run_bench`, the code behind `tandem bench`: token-id completions, exact
   lengths, ignore_eos, arrival times and tool gaps of the file), after a few warm-up sessions;
5. simulates the same session file on the same deployment (P:tp1x1,D:tp1x1 or C:tp1x2), policy and SLOs, with
   the profile alone and with the calibrated runtime model (`tandem simulate --perf profile-<size>-live.json`);
6. compares P50 and P95 of TTFT (initial, incremental, all rounds) and ITL (per-round mean ITL, as
   tandem.workload.metrics.summarize defines it) real vs simulated: <out>/<policy>/results.json, table.md,
   sim_vs_real.png (server logs in <out>/<policy>/work/).

The run raises its own scheduling priority (autogroup nice -10, see raise_priority) because the development
machine's two cores are shared with other jobs. See docs/sim-to-real.md.

This file holds the command (flags and the steps in order); beside it, sim_to_real_setup.py holds steps 1, 2, 4 and
5 (checkpoint, profile, workload, live server and replay, simulator run, raise_priority), sim_to_real_calibrate.py
step 3 (echo hop, machine-speed check, runtime calibration) and sim_to_real_report.py step 6 (latency statistics,
table, plot).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from sim_to_real_calibrate import calibrate, echo_hop, speed_check
from sim_to_real_report import latency_stats, plot, populations, qs, rel, round_table, table
from sim_to_real_setup import (CALIBRATION_POLICY, METRICS, QUANTILES, ROOT, TOLERANCE, check_replayed, ensure_model,
                               ensure_profile, layout, live_server, log, make_workload, raise_priority, replay, run_sim,
                               warmup_sessions, with_runtime)


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    from tandem.policy.presets import POLICIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="ampd", choices=tuple(POLICIES),
                    help="policy of both the live server and the simulator (default ampd); disaggregated ones run "
                         "1P+1D, co-located ones (continuum, vllm) 2 co-located workers")
    ap.add_argument("--size", default="30m", choices=("30m", "1m"))
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.4, help="session arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale-in", type=float, default=0.25, help="input tokens x this (default 0.25)")
    ap.add_argument("--scale-out", type=float, default=0.5, help="output tokens x this (default 0.5)")
    ap.add_argument("--scale-tool", type=float, default=1.0, help="tool gaps x this (default 1)")
    ap.add_argument("--slo-ttft", type=float, default=0.5)
    ap.add_argument("--slo-itl", type=float, default=0.05)
    ap.add_argument("--runs", type=int, default=3, help="live runs (a fresh server each)")
    ap.add_argument("--reuse-profile", action="store_true",
                    help="keep an existing profile-<size>.json under --out (shared by the policies)")
    ap.add_argument("--reuse-calibration", action="store_true",
                    help="keep an existing profile-<size>-live.json / calibration-<size>.json under --out (measured "
                         "on the ampd 1P+1D probe, shared by the policies)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "sim-to-real"),
                    help="per-size files here (<out>/1m for --size 1m), results in <that>/<policy>/")
    ap.add_argument("--nice", type=int, default=-10,
                    help="autogroup nice of this run (needs root; 0 leaves the priority alone; default -10)")
    args = ap.parse_args()
    started = time.time()
    load_start = os.getloadavg()[0]
    lay = layout(args.policy)
    prio = raise_priority(args.nice) if args.nice else "unchanged"
    log(f"scheduler priority: {prio}; policy {lay.policy} on {lay.label} ({lay.deploy}); "
        f"1-minute load {load_start:.2f}")
    out = Path(args.out) if args.size == "30m" else Path(args.out) / args.size   # shared by the policies
    res_dir = out / lay.policy
    work = out / "work"                                  # calibration's server log and scratch profile
    res_work = res_dir / "work"                          # this policy's server logs and per-run profiles
    for d in (out, work, res_dir, res_work):
        d.mkdir(parents=True, exist_ok=True)

    model = ensure_model(args.size)
    profile_file = out / f"profile-{args.size}.json"
    fresh_profile = not (args.reuse_profile and profile_file.is_file())
    profile = ensure_profile(model, profile_file, args.reuse_profile)
    from tandem.perf.step_model import Profile
    prof = Profile.from_json(profile)
    sessions = make_workload(args, out / f"sessions-{args.size}.jsonl", prof.max_model_len)
    n_rounds = sum(len(s.rounds) for s in sessions)
    log(f"workload: {len(sessions)} sessions, {n_rounds} rounds, "
        f"{sum(r.input_tokens for s in sessions for r in s.rounds)} new input and "
        f"{sum(r.output_tokens for s in sessions for r in s.rounds)} output tokens, last arrival "
        f"{sessions[-1].arrival_s:.1f} s")

    live_profile = out / f"profile-{args.size}-live.json"
    speed = speed_check(model, prof, profile, fresh_profile)
    calib_file = out / f"calibration-{args.size}.json"
    recalibrated = not (args.reuse_calibration and live_profile.is_file() and calib_file.is_file())
    if not recalibrated:
        calib = json.loads(calib_file.read_text())
        live = json.loads(live_profile.read_text())
        live.pop("runtime", None)
        base = json.loads(profile.read_text())
        base.pop("runtime", None)
        if live != base:
            raise SystemExit(f"{live_profile.name} was calibrated on another profile than {profile.name}: "
                             "run without --reuse-calibration (or with --reuse-profile)")
        probe = calib["check"].get("probe", {})
        log(f"reusing the calibration {live_profile.name} (measured on the {probe.get('policy', CALIBRATION_POLICY)} "
            f"1P+1D probe{', ' + probe['date'] if 'date' in probe else ''})")
    else:
        hop = asyncio.run(echo_hop())
        log(f"runtime transport: hop {hop['hop_s'] * 1e3:.3f} ms (half the median echo round trip)")
        calib = calibrate(model, profile, args, work, hop, speed)
        with_runtime(profile, calib["runtime"], live_profile)
        calib_file.write_text(json.dumps(calib, indent=1) + "\n")
    rt = calib["runtime"]
    log("runtime model: " + ", ".join(f"{k} {rt[k] * 1e3:.2f} ms" for k in ("request_s", "hop_s", "step_gap_s"))
        + f", host CPU {rt['host_token_s'] * 1e3:.2f} ms/token on {rt['cores']} cores, prefill beside a decode "
          f"stream x{rt['interference']['prefill']:.3f}, decode beside prefills x{rt['interference'].get('decode', 1.0):.3f}; machine speed at calibration: prefill "
          f"x{rt['step_factor']['prefill']:.3f}, decode x{rt['step_factor']['decode']:.3f} of the baseline")

    sim_bare = run_sim(sessions, with_runtime(profile, None, res_work / "profile-bare.json"), args.seed, lay)
    bare_stats = latency_stats(sim_bare.records)
    runs, pooled, pooled_sim, run_records, sim_records = [], [], [], [], []
    for i in range(args.runs):
        sp = speed.measure()
        run_rt = {**rt, "step_factor": {"prefill": sp["prefill"], "decode": sp["decode"]}}
        sim = run_sim(sessions, with_runtime(profile, run_rt, res_work / f"profile-{args.size}-run{i}.json"),
                      args.seed, lay)
        sim_st = latency_stats(sim.records)
        log(f"run {i}: machine speed prefill x{sp['prefill']:.3f}, decode x{sp['decode']:.3f} of the baseline "
            f"(x{sp['prefill_vs_profile']:.3f}, x{sp['decode_vs_profile']:.3f} of the profile's figures); "
            f"simulated {sim.sim_time_s:.1f} s in {sim.wall_s:.2f} s")
        with live_server(model, live_profile, args, res_work / f"serve-{args.size}-run{i}.log", lay) as (url, _):
            replay(url, model, warmup_sessions(sessions, sessions[0].slo), args.seed)
            load0 = os.getloadavg()[0]
            t = time.perf_counter()
            res = replay(url, model, sessions, args.seed)
            log(f"run {i}: replayed in {time.perf_counter() - t:.1f} s")
        problems = check_replayed(sessions, res)
        if problems:
            log(f"run {i}: {len(problems)} replay problems, e.g. {problems[0]}")
        st = latency_stats(res.records)
        bm = res.metrics()
        runs.append({"stats": st, "sim": sim_st, "speed": sp, "replay_problems": problems,
                     "load_avg_1min_at_start": load0,
                     "errors": {k: {q: rel(sim_st[k][q], st[k][q]) for q in QUANTILES} for k, _ in METRICS},
                     "bench": {k: bm.get(k) for k in ("duration", "local_prefills", "remote_prefills",
                                                      "median_ttft_ms", "p95_ttft_ms", "median_itl_ms", "p95_itl_ms",
                                                      "client_start_lag_max_s", "total_output_tokens")}})
        pooled.extend(res.records)
        pooled_sim.extend(sim.records)
        run_records.append(res.records)
        sim_records.append(sim.records)
        for k, label in METRICS:
            log(f"  {label:18s} real p50 {st[k]['p50'] * 1e3:7.1f} p95 {st[k]['p95'] * 1e3:7.1f} ms | "
                f"sim p50 {sim_st[k]['p50'] * 1e3:7.1f} p95 {sim_st[k]['p95'] * 1e3:7.1f} ms")
    real = {k: qs(xs) for k, xs in populations(pooled).items()}
    sim_stats = {k: qs(xs) for k, xs in populations(pooled_sim).items()}
    per_round = round_table(sim_records, run_records)
    errors = {k: {q: rel(sim_stats[k][q], real[k][q]) for q in QUANTILES} for k, _ in METRICS}
    errors_bare = {k: {q: rel(bare_stats[k][q], real[k][q]) for q in QUANTILES} for k, _ in METRICS}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    res = {
        "config": {**vars(args), "deploy": lay.deploy, "policy": lay.policy, "layout": lay.label,
                   "serve_args": list(lay.serve_args), "threads_per_worker": 1, "priority": prio, "commit": git,
                   "shared_files": str(out)},
        "load_avg_1min_at_start": load_start,
        "machine": {"cpu": prof.device.get("name"), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": prof.torch_version, "date": datetime.date.today().isoformat()},
        "workload": {"file": f"../sessions-{args.size}.jsonl", "sessions": len(sessions), "rounds": n_rounds},
        "profile": {"file": "../" + profile.name, "heldout_error": prof.heldout_error, "kv_link": prof.kv_link,
                    "interference": prof.interference},
        "calibration": {"file": f"../{calib_file.name}", "reused": bool(args.reuse_calibration and not recalibrated),
                        "probe": calib["check"].get("probe", {"policy": CALIBRATION_POLICY}),
                        "runtime": calib["runtime"], "check": {k: v for k, v in calib["check"].items() if k != "raw"}},
        "sim": sim_stats, "sim_profile_only": bare_stats,
        "real_pooled": real, "live_runs": runs,
        "errors": errors, "errors_profile_only": errors_bare,
        "within_tolerance": all(abs(errors[k][q]) <= TOLERANCE for k, _ in METRICS for q in QUANTILES),
        "tolerance": TOLERANCE, "wall_s": time.time() - started,
        "rounds": per_round,
    }
    (res_dir / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (res_dir / "table.md").write_text(table(res))
    plot(res, res_dir / "sim_vs_real.png")
    print(table(res))
    log(f"wrote {res_dir}/results.json, table.md, sim_vs_real.png in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
