"""Host-tier copies under tensor parallelism: decode steps while sessions' KV goes to host memory, at tp=2.

    python benchmarks/host_tier_tp.py [--before REV] [--out docs/results/host_tier_tp]

A random ~30M-parameter Qwen3 (made here) on a tp=2 engine (two rank processes, one torch thread each). One request
decodes 200 tokens; meanwhile, every 20 of its steps, a new session's 960-token round (1 output token) is added:
its prefill runs in chunks beside the decode, then, under `hicache` (`--kv-offloading-size 0.5`), its prefix blocks
and then its idle context are copied to the host tier (60 blocks of 256 KiB over the two ranks each time). Timed:
every step that runs the decode alone (no prefill in its batch), from its plan to its token. Three runs:

- `untiered`: no host tier (no copies): the decode step's own time;
- `beside`: this tree: each rank copies its heads on its own copy threads beside the steps;
- `between`: with --before REV, the same measurement on the tree at REV (a `git archive` of it, run in a
  subprocess), where under tensor parallelism the copies ran between steps, before the next forward.

Each run repeats --repeats times (3), the runs interleaved; the table pools each run's repeats. Steps that started
copies are counted apart: under `between` they carry the ranks' copies. Writes results.json, table.md and
host_tier_tp.png (each run's decode-only step times in order, and their CDF).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SESSIONS, CONTEXT, EVERY, DECODE = 6, 2000, 25, 200
ENGINE = dict(num_kv_blocks=1024, max_model_len=2048, block_size=16, max_num_batched_tokens=256,
              tensor_parallel_size=2)
TIER_GIB = 1.0


def measure(model: str, tiered: bool) -> dict:
    """One run in this process (tandem from PYTHONPATH): the decode-only steps' wall times and the copy counters."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    torch.set_num_threads(1)
    kw = dict(policy="hicache", kv_offloading_size=TIER_GIB) if tiered else {}
    eng = LLMEngine(EngineConfig(model=model, **ENGINE, **kw))
    try:
        eng.add_request("warm", list(range(5, 69)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        eng.add_request("o", list(range(3, 35)), SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True),
                        session_id="o")
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        started = [0, 0.0]                           # copies started by the step being timed, seconds in start()
        if eng.tier is not None:
            start = eng.tier.start

            def counted(copies):
                started[0] += len(copies)
                t = time.perf_counter()
                start(copies)
                started[1] += time.perf_counter() - t
            eng.tier.start = counted
        steps, with_copies, in_start, added, tokens, t_start = [], [], [], 0, 0, time.perf_counter()
        while eng.has_unfinished_requests():
            if tokens >= EVERY * (added + 1) and added < SESSIONS:
                prompt = [10 + (added * 97 + k * 7) % 400 for k in range(CONTEXT)]
                eng.add_request(f"r{added}", prompt, one, session_id=f"s{added}")
                added += 1
            started[0], started[1] = 0, 0.0
            t0 = time.perf_counter()
            prep = eng.prepare_step()
            plan = prep.plan
            alone = plan is not None and not plan.prefill and [s.session_id for s in plan.decode] == ["o"]
            outs = eng.finish_step(prep, eng.execute_step(prep))
            dt = time.perf_counter() - t0
            if alone:
                steps.append(dt)
                with_copies.append(started[0])
                in_start.append(started[1])
            tokens += sum(1 for o in outs if o.request_id == "o")
        wall = time.perf_counter() - t_start
        tier = eng.tier
        if tier is not None:
            for _ in range(2000):                    # let the last copies end (not timed)
                if not tier.busy() and not eng.core.kv.tier.copies:
                    break
                eng.step()
        counters = dict(tier.counters) if tier is not None else {}
        return {"decode_alone_s": steps, "copies_started": with_copies, "start_s": in_start, "wall_s": wall, "sessions": added,
                "counters": counters}
    finally:
        eng.close()


def summary(steps: list[float]) -> dict:
    import numpy as np
    a = np.array(steps) * 1e3
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max()), "mean_ms": float(a.mean())}


def run_in(tree: str, model: str, tiered: bool) -> dict:
    """measure() in a subprocess with tandem from `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--measure", model, "--tiered", str(int(tiered)), "--json", f.name],
                       check=True, env=env)
        return json.loads(Path(f.name).read_text())


def pooled(runs: list[dict]) -> dict:
    """The repeats of one run, their decode-only steps concatenated in order."""
    return {"decode_alone_s": [t for r in runs for t in r["decode_alone_s"]],
            "copies_started": [k for r in runs for k in r["copies_started"]],
            "start_s": [t for r in runs for t in r["start_s"]], "repeats": runs}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ms = np.array(r["decode_alone_s"]) * 1e3
        ax1.plot(ms, label=name, lw=1)
        xs = np.sort(ms)
        ax2.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=name)
    ax1.set(xlabel="decode-only step (in order)", ylabel="step time (ms)", title="tp=2: decode steps as KV goes out")
    ax2.set(xlabel="step time (ms)", ylabel="fraction of steps", title="CDF")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a git revision whose tree runs the copies between steps (the comparison)")
    ap.add_argument("--out", default="docs/results/host_tier_tp")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--tiered", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        Path(args.json).write_text(json.dumps(measure(args.measure, bool(args.tiered))))
        return
    from tandem.engine.tiny_model import make_tiny_model
    here = str(Path(__file__).resolve().parents[1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        make_tiny_model(model, arch="qwen3", size="30m", seed=3)
        trees = {"untiered": (here, False), "beside": (here, True)}
        if args.before:
            tree = Path(tmp) / "before"
            tree.mkdir()
            archive = subprocess.run(["git", "-C", here, "archive", args.before], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
            trees["between"] = (str(tree), True)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.repeats):                # interleaved: the machine's load drifts over the runs
            for name, (where, tiered) in trees.items():
                runs[name].append(run_in(where, model, tiered))
    results = {name: pooled(rs) for name, rs in runs.items()}
    rows = ["| run | decode-only steps | p50 / p90 / p99 / max (ms) | mean (ms) | steps starting copies: n, mean / max "
            "(ms) | of which starting them (ms) | other steps: mean (ms) | run wall (s), each repeat | bytes offload / write "
            "(each repeat) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = summary(r["decode_alone_s"])
        r["summary"] = s
        c = runs[name][0]["counters"]
        copied = f"{c['offload_bytes'] / 2**20:.1f}M / {c['write_bytes'] / 2**20:.1f}M" if c else "-"
        starting = [t * 1e3 for t, k in zip(r["decode_alone_s"], r["copies_started"]) if k]
        other = [t * 1e3 for t, k in zip(r["decode_alone_s"], r["copies_started"]) if not k]
        r["starting_mean_ms"] = sum(starting) / len(starting) if starting else None
        r["other_mean_ms"] = sum(other) / len(other) if other else None
        start_cell = f"{len(starting)}, {r['starting_mean_ms']:.1f} / {max(starting):.1f}" if starting else "0, -"
        spent = [t * 1e3 for t, k in zip(r["start_s"], r["copies_started"]) if k]
        r["in_start_mean_ms"] = sum(spent) / len(spent) if spent else None
        spent_cell = f"{r['in_start_mean_ms']:.2f}" if spent else "-"
        walls = ", ".join(f"{x['wall_s']:.1f}" for x in runs[name])
        rows.append(f"| {name} | {s['n']} | {s['p50_ms']:.1f} / {s['p90_ms']:.1f} / {s['p99_ms']:.1f} / "
                    f"{s['max_ms']:.1f} | {s['mean_ms']:.2f} | {start_cell} | {spent_cell} | {r['other_mean_ms']:.1f} | "
                    f"{walls} | {copied} |")
    table = "\n".join(rows)
    print(table)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "before": args.before,
            "sessions": SESSIONS, "context": CONTEXT, "decode": DECODE, "repeats": args.repeats}
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    (out / "table.md").write_text(table + "\n")
    plot(results, out / "host_tier_tp.png")


if __name__ == "__main__":
    main()
