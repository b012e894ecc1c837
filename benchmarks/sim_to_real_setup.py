"""Sim-to-real setup and the two sides: checkpoint, profile, workload file, the live server and its replay, the
simulator run (benchmarks/sim_to_real.py)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

from tandem.bench.serve_process import TANDEM, serve_subprocess

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION_POLICY = "ampd"       # the runtime block is measured on the ampd 1P+1D probe, whatever is compared
METRICS = [("ttft_initial", "TTFT initial"), ("ttft_incremental", "TTFT incremental"),
           ("ttft_all", "TTFT all rounds"), ("itl", "ITL (round mean)")]
QUANTILES = ("p50", "p95")
TOLERANCE = 0.15


def log(msg: str) -> None:
    print(f"[sim-to-real {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ setup


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a policy runs: the live server's worker arguments and the simulated deployment (two worker
    processes either way)."""

    policy: str
    deploy: str
    serve_args: tuple[str, ...]
    label: str


def layout(policy: str) -> Layout:
    from tandem.policy.presets import get_policy

    spec = get_policy(policy)
    if spec.disaggregated:
        return Layout(spec.name, "P:tp1x1,D:tp1x1", ("--prefill-workers", "1", "--decode-workers", "1"), "1P+1D")
    return Layout(spec.name, "C:tp1x2", ("--colocated", "2"), "2 co-located workers")


def raise_priority(nice: int) -> str:
    """Put this process (and so the profiler, server and bench it starts) in a new session whose scheduler
    autogroup has nice `nice`. With autogroups (Linux's default) processes of other sessions compete as whole
    groups whatever their own nice, so on the shared 2-core machine other jobs took about a third of every
    measured step (the 30m profile's held-out median error went from 15% to 3%). Returns what was done."""
    try:
        if os.getsid(0) != os.getpid():
            os.setsid()
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
        with open("/proc/self/autogroup") as f:
            return f.read().strip()
    except OSError as e:
        return f"not raised ({e.strerror or e})"


def ensure_model(size: str) -> Path:
    path = ROOT / "models" / f"tiny-qwen3-{size}"
    if not (path / "config.json").is_file():
        log(f"making the {size} checkpoint: tandem tiny-model --arch qwen3 --size {size} --out {path}")
        subprocess.run([*TANDEM, "tiny-model", "--arch", "qwen3", "--size", size, "--out", str(path)], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def ensure_profile(model: Path, out: Path, reuse: bool) -> Path:
    if reuse and out.is_file():
        log(f"reusing the profile {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
        return out
    cmd = [*TANDEM, "profile", "--model", str(model), "--threads", "1", "--out", str(out), "--no-progress"]
    log("profiling: tandem " + " ".join(cmd[3:]))
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    log(f"profiled in {time.perf_counter() - t:.0f} s")
    return out


def make_workload(args, path: Path, max_len: int):
    """ToolBench-shaped sessions, scaled down: inputs x scale_in, outputs x scale_out, tool gaps x scale_tool,
    rounds cut once a session's context would pass max_len. Written to `path`; returns the sessions read back."""
    from tandem.workload.generators import generate
    from tandem.workload.session import SLO, Round, dump_sessions, load_sessions

    base = generate("toolbench", args.sessions, args.rate, args.seed, slo=SLO(args.slo_ttft, args.slo_itl))
    out = []
    for s in base:
        rounds, ctx = [], 0
        for r in s.rounds:
            n_in = max(1, round(r.input_tokens * args.scale_in))
            n_out = max(1, round(r.output_tokens * args.scale_out))
            if ctx + n_in + n_out > max_len - 8:
                break
            ctx += n_in + n_out
            rounds.append(Round(n_in, n_out, round(r.tool_s * args.scale_tool, 4)))
        if rounds:
            rounds[-1] = dataclasses.replace(rounds[-1], tool_s=0.0)
            out.append(dataclasses.replace(s, arrival_s=round(s.arrival_s, 4), rounds=rounds))
    dump_sessions(out, path)
    return load_sessions(path)


# ------------------------------------------------------------------------------------------ live


@contextlib.contextmanager
def live_server(model: Path, profile: Path, args, logfile: Path, lay: Layout):
    """`tandem serve` (the layout's workers and policy) in a subprocess; yields its URL and pid once /health
    answers; stops it (and its workers)."""
    serve_args = ["--model", str(model), *lay.serve_args, "--policy", lay.policy, "--perf", str(profile),
                  "--slo-ttft", str(args.slo_ttft), "--slo-itl", str(args.slo_itl), "--threads", "1"]
    with serve_subprocess(serve_args, logfile, cwd=ROOT, log=log) as served:
        yield served


def bench_config(url: str, model: Path, seed: int):
    from tandem.bench.bench_options import BenchConfig
    from tandem.engine.tokenizer import Tokenizer

    return BenchConfig(url=url, endpoint="completions", tokenizer=Tokenizer.from_pretrained(str(model)), seed=seed,
                       scale=1.0)


def warmup_sessions(sessions, slo):
    """A few sessions, one after the other, before anything is measured: the first forward passes of a fresh
    engine (weight packing, allocator growth) and the first KV transfers are several times slower than later
    ones (a 116-token first prefill took 470 ms instead of 50), and the profile is measured warm too."""
    from tandem.workload.session import Round, Session

    firsts = sorted(s.rounds[0].input_tokens for s in sessions)
    later = sorted(r.input_tokens for s in sessions for r in s.rounds[1:]) or [16]
    out, t = [], 0.0
    for i, n in enumerate([firsts[0], firsts[len(firsts) // 2], firsts[-1]]):
        rounds = [Round(n, 8, 0.05), Round(later[len(later) // 2], 8, 0.05), Round(later[-1], 8)]
        out.append(Session(f"warmup-{i}", t, rounds, slo))
        t += 3.0
    return out


def replay(url: str, model: Path, sessions, seed: int):
    from tandem.bench.serve_client import run_bench
    return asyncio.run(run_bench(sessions, bench_config(url, model, seed)))


def check_replayed(sessions, res) -> list[str]:
    """What the bench sent and got must be the session file: same rounds, exact new tokens and outputs."""
    problems = []
    by_id = {s.session_id: s for s in sessions}
    for m in res.rounds:
        r = by_id[m.session_id].rounds[m.index]
        if m.error:
            problems.append(f"{m.session_id} round {m.index}: {m.error}")
        if m.new_input_tokens != r.input_tokens or m.max_tokens != r.output_tokens:
            problems.append(f"{m.session_id} round {m.index}: sent {m.new_input_tokens}/{m.max_tokens} tokens, "
                            f"file has {r.input_tokens}/{r.output_tokens}")
        elif m.ok and m.output_tokens != r.output_tokens:
            problems.append(f"{m.session_id} round {m.index}: got {m.output_tokens} tokens, asked {r.output_tokens}")
    for rec in res.records:
        if len(rec.rounds) != len(by_id[rec.session_id].rounds):
            problems.append(f"{rec.session_id}: ran {len(rec.rounds)} of {len(by_id[rec.session_id].rounds)} rounds")
    return problems


# ------------------------------------------------------------------------------------------ sim


def run_sim(sessions, profile: Path, seed: int, lay: Layout):
    from tandem.sim.cluster import SimConfig, simulate

    cfg = SimConfig(model="profiled", gpu="cpu", gpus=2, deploy=lay.deploy, policy=lay.policy, seed=seed,
                    perf=str(profile))
    return simulate(sessions, cfg)


def with_runtime(profile: Path, runtime: dict | None, out: Path) -> Path:
    """A copy of the profile with `runtime` as its runtime block (None: none)."""
    d = json.loads(profile.read_text())
    d["runtime"] = runtime
    out.write_text(json.dumps(d, indent=1) + "\n")
    return out

