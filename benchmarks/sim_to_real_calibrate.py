"""Sim-to-real calibration of the live runtime on a probe (never the workload): the transport's message hop, the
machine-speed check and the runtime block fitted with the simulator (benchmarks/sim_to_real.py)."""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from sim_to_real_setup import (CALIBRATION_POLICY, ROOT, check_replayed, layout, live_server, log, replay, run_sim,
                               warmup_sessions, with_runtime)


# ------------------------------------------------------------------------------------------ calibration


async def echo_hop(rounds: int = 300) -> dict:
    """Half the round trip of a control message between this process and a worker process over the runtime's
    transport (Hub/Link: ZeroMQ over TCP, msgspec), the real launcher and an echo worker."""
    if str(ROOT / "tests") not in sys.path:      # the echo worker is a test fixture (tests/echo_worker.py);
        sys.path.insert(0, str(ROOT / "tests"))  # spawned workers inherit this sys.path
    from echo_worker import CODEC, Echo
    from tandem.runtime.launcher import Cluster, WorkerSpec
    from tandem.runtime.transport import Hub

    rtts = []
    async with Hub(CODEC) as hub:
        cluster = Cluster(hub)
        await cluster.start([WorkerSpec(0, "echo_worker:main")])
        try:
            for i in range(rounds):
                t = time.perf_counter()
                await hub.send(0, Echo(i))
                while True:
                    _, msg, _ = await hub.recv()
                    if isinstance(msg, Echo) and msg.seq == i:
                        break
                rtts.append(time.perf_counter() - t)
        finally:
            await cluster.stop()
    rtts = rtts[20:]
    return {"hop_s": statistics.median(rtts) / 2, "rtt_p90_s": float(np.percentile(rtts, 90)), "n": len(rtts)}


class SpeedCheck:
    """A few of the profile's own steps timed again, just before a live run on the idle machine: how fast this
    shared machine runs right now (its speed drifts: the idle single-stream ITL went from 6.1-7.7 ms to 7.5-8.8 ms
    within five minutes). The simulator of that run scales its step times by it (step_factor), prefill and decode
    separately.

    The factor is this harness's time now over this harness's time just after profiling (`baseline`), not over
    the profile's own figure: the harness times decode steps about 13% slower than the profiler does (another
    KV layout; measured 10 s after a profile, prefill x0.999, decode x1.129), a bias that cancels only between
    two timings of the same harness. The profile's figures are kept beside it for the record."""

    POINTS = (("prefill", ((0, 128),), ()), ("prefill", ((0, 512),), ()), ("prefill", ((512, 64),), ()),
              ("decode", (), (128,)), ("decode", (), (512,)), ("decode", (), (512,) * 4))

    def __init__(self, model: Path, prof, repeats: int = 5, baseline: list[float] | None = None) -> None:
        import random

        import torch

        from tandem.engine.config import EngineConfig
        from tandem.engine.model_runner import ModelRunner
        from tandem.engine.profiling.grids import Point
        from tandem.engine.profiling.timing import Bench

        torch.set_num_threads(1)
        runner = ModelRunner(EngineConfig(model=str(model), num_kv_blocks=512))
        for t in runner.kv_caches:
            t.fill_(0)
        self.bench = Bench(runner, random.Random(0))
        self.repeats = repeats
        self.points = []
        for kind, pf, dec in self.POINTS:
            pt = Point(kind, pf, dec)
            ref = next((m["seconds"] for m in prof.measurements if m["split"] == "train" and m["kind"] == kind
                        and [tuple(x) for x in m["prefills"]] == list(pf) and tuple(m["decodes"]) == dec), None)
            if ref is not None:
                self.points.append((pt, ref))
        for pt, _ in self.points:
            self.bench.run(pt)
        if baseline is not None and len(baseline) != len(self.points):
            raise ValueError(f"a speed baseline of {len(baseline)} points for {len(self.points)}")
        self.baseline = list(baseline) if baseline is not None else self._times()

    def _times(self) -> list[float]:
        """Median seconds of each point over `repeats` interleaved passes."""
        runs: list[list[float]] = [[] for _ in self.points]
        for _ in range(self.repeats):
            for i, (pt, _) in enumerate(self.points):
                runs[i].append(self.bench.run(pt))
        return [statistics.median(r) for r in runs]

    def measure(self) -> dict:
        now = self._times()
        out: dict = {"points": []}
        for kind in ("prefill", "decode"):
            ratios, vs_profile = [], []
            for (pt, ref), base, t in zip(self.points, self.baseline, now):
                if pt.kind == kind:
                    ratios.append(t / base)
                    vs_profile.append(t / ref)
                    out["points"].append({**pt.to_dict(), "profile_s": ref, "baseline_s": base, "now_s": t})
            out[kind] = statistics.median(ratios) if ratios else 1.0
            out[kind + "_vs_profile"] = statistics.median(vs_profile) if vs_profile else 1.0
        return out


def speed_check(model: Path, prof, profile: Path, fresh: bool) -> SpeedCheck:
    """The run's SpeedCheck, its baseline timed now when the profile was just made (and kept beside it), else read
    from beside the profile when it was kept for this very profile, else timed now (drift since profiling lost)."""
    import hashlib

    digest = hashlib.sha256(profile.read_bytes()).hexdigest()
    keep = profile.with_name(profile.stem + "-speed-baseline.json")
    if not fresh and keep.is_file():
        saved = json.loads(keep.read_text())
        if saved.get("profile_sha256") == digest:
            log(f"speed baseline: reusing {keep.name}")
            return SpeedCheck(model, prof, baseline=saved["seconds"])
    if not fresh:
        log("speed baseline: none kept for this profile; timed now (drift since profiling is not seen)")
    sc = SpeedCheck(model, prof)
    keep.write_text(json.dumps({"profile_sha256": digest, "seconds": sc.baseline,
                                "points": [pt.to_dict() for pt, _ in sc.points]}, indent=1) + "\n")
    return sc


def probe_sessions(slo):
    """The calibration probe (never the workload): (A) twelve sessions one after the other on the idle server (two
    passes over 64 .. 640 new tokens), a first round of that many tokens then one of 48, 32 output tokens each; (B) one session decoding 800 tokens
    while eight 384-token prefills arrive 0.75 s apart (their prefill worker computes beside the stream)."""
    from tandem.workload.session import Round, Session

    idle = []
    for i, n in enumerate(PROBE_FIRST * 2):                    # two passes: a burst of other load hits few rounds
        idle.append(Session(f"probe-idle-{i}", 3.5 * i, [Round(n, 32, 0.3), Round(PROBE_NEXT, 32)], slo))
    t_b = 3.5 * len(idle) + 2.0
    busy = [Session("probe-stream", t_b, [Round(32, 800)], slo)]
    for j in range(8):
        busy.append(Session(f"probe-beside-{j}", t_b + 0.5 + 0.75 * j, [Round(384, 2)], slo))
    return idle + busy


PROBE_FIRST = (64, 128, 256, 384, 512, 640)
PROBE_NEXT = 48
IDLE_CPU_WINDOW_S = 5.0     # the serving processes' idle CPU is measured over this long before the probe


def _ttfts(records, prefix: str) -> dict[tuple[str, int], float]:
    return {(s.session_id, r.index): r.ttft_s for s in records if s.session_id.startswith(prefix)
            for r in s.rounds if r.ttft_s is not None}


def calibrate(model: Path, profile: Path, args, work: Path, hop: dict, speed: SpeedCheck) -> dict:
    """Measure the runtime block on the probe (see probe_sessions) and fit its constants with the simulator.
    Always on the ampd 1P+1D server (CALIBRATION_POLICY), whichever policy is compared: the block describes the
    runtime on this host, and the probe's prefill-beside-a-decode-stream needs a prefill and a decode worker."""
    from tandem.perf.step_model import Profile
    from tandem.workload.session import SLO

    lay = layout(CALIBRATION_POLICY)
    prof = Profile.from_json(profile)
    st = prof.step_model
    slo = SLO(args.slo_ttft, args.slo_itl)
    probe = probe_sessions(slo)
    s_now = speed.measure()
    factor = {"prefill": s_now["prefill"], "decode": s_now["decode"]}
    with live_server(model, profile, args, work / "serve-calibration.log", lay) as (url, pid):
        replay(url, model, warmup_sessions(probe, slo), args.seed)
        cpu0, t = _cpu_s(pid) + _own_cpu_s(), time.perf_counter()
        time.sleep(IDLE_CPU_WINDOW_S)                  # the serving processes' CPU with no request: heartbeats,
        idle_rate = (_cpu_s(pid) + _own_cpu_s() - cpu0) / (time.perf_counter() - t)   # workers' states relayed
        cpu0 = _cpu_s(pid) + _own_cpu_s()
        t = time.perf_counter()
        res = replay(url, model, probe, args.seed)
        probe_wall = time.perf_counter() - t
        cpu_total = _cpu_s(pid) + _own_cpu_s() - cpu0
        cpu_host = max(0.0, cpu_total - idle_rate * probe_wall)
        log(f"calibration probe: {len(probe)} sessions in {probe_wall:.1f} s; serving CPU {cpu_total:.2f} s, of "
            f"which {idle_rate * probe_wall:.2f} s the idle rate ({idle_rate * 100:.1f}% of a core)")
    bad = check_replayed(probe, res)
    if bad:
        raise RuntimeError(f"the calibration probe did not replay cleanly: {bad[0]}")
    raw = [{"session": m.session_id, "round": m.index, "prompt_tokens": m.prompt_tokens_sent, "ttft_s": m.ttft_s,
            "itls_s": m.itls_s} for m in res.rounds]

    # 1. the worker loop's gap: a round's mean ITL on the idle server (one stream) minus the mean profiled decode
    #    step (at this moment's speed) over its contexts (means, not single gaps: tokens reach the client in clumps)
    gaps = []
    for m in res.rounds:
        if m.session_id.startswith("probe-idle") and len(m.itls_s) >= 2:
            pred = statistics.mean(st.decode_time(1, m.prompt_tokens_sent + j) for j in range(1, len(m.itls_s) + 1))
            gaps.append(statistics.mean(m.itls_s) - pred * factor["decode"])
    step_gap = max(0.0, statistics.median(gaps))

    # 2. the serving processes' own CPU (coordinator + HTTP server, and this client) per token streamed: it shares
    #    the host's cores with the engines' steps. What they spend idle (a few % of a core, spread evenly over
    #    time) is taken out first: counted per token, it would crowd into the busy stretches the tokens come in.
    tokens = sum(m.output_tokens for m in res.rounds if m.ok)
    rt = {"hop_s": hop["hop_s"], "step_gap_s": step_gap, "request_s": 0.0, "output_s": 0.0, "msg_s": 0.0,
          "cores": int(os.cpu_count() or 0), "host_token_s": cpu_host / max(tokens, 1), "host_round_s": 0.0,
          "step_factor": factor}

    # 3. the per-round request/response latency: idle TTFT minus the simulated path without it (hops, prefill,
    #    KV export/wire/import, steps between), the median over the idle rounds
    real = _ttfts(res.records, "probe-")

    def sim_ttfts(runtime: dict) -> dict:
        p = with_runtime(profile, runtime, work / "profile-calibrating.json")
        return _ttfts(run_sim(probe, p, args.seed, lay).records, "probe-")

    sim0 = sim_ttfts(rt)
    idle_keys = sorted(k for k in real if k[0].startswith("probe-idle"))
    resid = {k: real[k] - sim0[k] for k in idle_keys}
    rt["request_s"] = max(0.0, statistics.median(resid.values()))

    # 4. prefill steps beside the decode stream: the factor that makes the simulated prefills beside the stream
    #    as slow on average as the measured ones (bisection; 1 = no slow-down)
    beside = [k for k in real if k[0].startswith("probe-beside")]
    target = statistics.mean(real[k] for k in beside)

    def miss(f: float) -> float:
        s = sim_ttfts({**rt, "interference": {"prefill": f}})
        return statistics.mean(s[k] for k in beside) - target

    lo, hi = 1.0, 3.0
    before = miss(lo)
    if before >= 0:
        f_pre = 1.0
    else:
        for _ in range(14):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if miss(mid) < 0 else (lo, mid)
        f_pre = (lo + hi) / 2
    rt["interference"] = {"prefill": f_pre, "decode": 1.0}

    # 5. decode steps beside those prefills, read directly off the stream: its inter-token gaps while a prefill
    #    beside it runs (from that request's send to its first token) against its other gaps (medians)
    ms = {(m.session_id, m.index): m for m in res.rounds}
    stream = ms[("probe-stream", 0)]
    t_tok = stream.sent_s + stream.ttft_s + np.cumsum(stream.itls_s)
    windows = [(ms[(k[0], 0)].sent_s, ms[(k[0], 0)].sent_s + ms[(k[0], 0)].ttft_s) for k in beside]
    inside = [g for t, g in zip(t_tok, stream.itls_s) if any(a <= t - g and t <= b for a, b in windows)]
    outside = [g for t, g in zip(t_tok, stream.itls_s) if not any(a < t and t - g < b for a, b in windows)]
    f_dec = max(1.0, statistics.median(inside) / statistics.median(outside)) if inside and outside else 1.0
    rt["interference"]["decode"] = f_dec
    sim1 = sim_ttfts(rt)
    check = {
        "probe": {"policy": lay.policy, "deploy": lay.deploy, "serve_args": list(lay.serve_args),
                  "date": datetime.date.today().isoformat(), "load_avg_1min": os.getloadavg()[0]},
        "speed": s_now,
        "idle_residual_s": {f"{k[0]} r{k[1]}": resid[k] for k in idle_keys},
        "idle_itl_gap_s": {"median": statistics.median(gaps), "min": min(gaps), "max": max(gaps), "n": len(gaps)},
        "host_cpu_s": cpu_host, "host_cpu_total_s": cpu_total, "host_idle_cpu_rate": idle_rate,
        "probe_wall_s": probe_wall, "probe_tokens": tokens,
        "beside_ttft_real_mean_s": target, "beside_ttft_sim_mean_s_before_fit": before + target,
        "stream_gaps_beside_prefill_s": {"n": len(inside), "median": statistics.median(inside) if inside else None},
        "stream_gaps_otherwise_s": {"n": len(outside), "median": statistics.median(outside) if outside else None},
        "ttft_after_fit_real_sim_s": {f"{k[0]} r{k[1]}": [real[k], sim1[k]] for k in sorted(real)},
        "echo_hop": hop,
        "raw": raw,
    }
    rt["source"] = ("benchmarks/sim_to_real.py calibration on the live server "
                    f"({datetime.date.today().isoformat()}): hop_s = half an echo round trip over the runtime's "
                    "transport; step_factor = the profile's steps timed again just before, over the same timing just after "
                    "profiling (machine speed); on an "
                    "idle-server probe: step_gap_s = median over rounds of the single-stream mean ITL minus the "
                    "profiled decode step, host_token_s = CPU seconds of the coordinator/HTTP process and the client "
                    "per output token beyond their idle rate (cores = the host's), request_s = median idle TTFT minus the simulated "
                    "remote-prefill path (request and response latency together; output_s 0), interference.prefill "
                    "fitted so simulated prefills beside a decode stream take as long as measured, "
                    "interference.decode = that stream's median inter-token gap while those prefills run over its "
                    "median gap otherwise")
    return {"runtime": rt, "check": check}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    slope, icpt = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(icpt), float(slope)

