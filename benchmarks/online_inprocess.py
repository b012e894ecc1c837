"""The online workload of engine_vs_vllm.py driven in-process on tandem's LLMEngine (no server, no worker process):
what the engine alone achieves, to set against `tandem serve` and vLLM's server in the same conditions.

    python benchmarks/online_inprocess.py [--rate 4] [--requests 120] [--threads 1] [--out docs/results/online_inprocess]

Same arrivals and prompts as engine_vs_vllm.py's online runs (seeded Poisson, 256-token prompts, 64 output tokens,
ignore_eos, greedy, max_num_batched_tokens 2048, max_num_seqs 256), the same 30m checkpoint (made once under models/).
Requests are added when their arrival time has passed, between steps (as a worker adds them); TTFT runs from the
arrival to the step that produced the first token, TPOT is (last - first) / 63. Also reports each step's duration
by its composition (prefill tokens, decode sequences). Writes results.json, table.md and online_inprocess.png.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_vs_vllm as evv  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(xs, q)) * 1e3


def run(rate: float, n: int) -> dict:
    """Drive the engine through the arrivals on the wall clock; returns latencies and step records."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    lim = evv.LIMITS
    eng = LLMEngine(EngineConfig(model=str(evv.MODEL_DIR), max_num_batched_tokens=lim["max_num_batched_tokens"],
                                 max_num_seqs=lim["max_num_seqs"], max_model_len=lim["max_model_len"]))
    arrivals, prompts, warm = evv.online_load(rate, n)
    out_len = evv.ONLINE["output_len"]
    sp = SamplingParams(max_tokens=out_len, min_tokens=out_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(warm):
        eng.add_request(f"w{i}", p, sp)
    while eng.has_unfinished_requests():
        eng.step()
    t0, nxt = time.perf_counter(), 0
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps: list[tuple[float, int, int]] = []
    while nxt < n or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            eng.add_request(f"r{nxt}", prompts[nxt], sp)
            sent[f"r{nxt}"] = arrivals[nxt]
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        a = time.perf_counter()
        prep = eng.prepare_step()
        outs = eng.finish_step(prep, eng.execute_step(prep))
        b = time.perf_counter()
        if prep.plan is not None:
            steps.append((b - a, sum(k for _, k in prep.plan.prefill), len(prep.plan.decode)))
        for o in outs:
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, b - t0)
                last[o.request_id] = b - t0
    dur = max(last.values())
    ttft = [first[r] - sent[r] for r in sent]
    tpot = [(last[r] - first[r]) / (out_len - 1) for r in sent]
    by = collections.defaultdict(list)
    for d, p, k in steps:
        by[(p, k // 5 * 5)].append(d)
    return {"rate": rate, "requests": n, "achieved_rps": n / dur, "p50_ttft_ms": _pct(ttft, 50),
            "p99_ttft_ms": _pct(ttft, 99), "p50_tpot_ms": _pct(tpot, 50), "p99_tpot_ms": _pct(tpot, 99),
            "steps": len(steps), "mean_step_ms": statistics.fmean(d for d, _, _ in steps) * 1e3,
            "step_ms_by_shape": [{"prefill_tokens": p, "decodes_from": k, "n": len(v),
                                  "median_ms": statistics.median(v) * 1e3} for (p, k), v in sorted(by.items())]}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for p in sorted({c["prefill_tokens"] for c in res["step_ms_by_shape"]}):
        cells = [c for c in res["step_ms_by_shape"] if c["prefill_tokens"] == p and c["n"] >= 3]
        if cells:
            ax.plot([c["decodes_from"] for c in cells], [c["median_ms"] for c in cells], marker="o",
                    label=f"{p} prefill tokens")
    ax.set_xlabel("decode sequences in the step (bucket of 5)")
    ax.set_ylabel("step ms (median)")
    ax.set_title(f"in-process engine at {res['rate']:g} req/s: step time by composition")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/results/online_inprocess")
    args = ap.parse_args(argv)
    if not (0 < args.rate < 1e4) or not (1 <= args.requests <= 100_000) or not (1 <= args.threads <= 256):
        print("online_inprocess.py: error: --rate must be in (0, 1e4), --requests in 1..100000, --threads in 1..256",
              file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(args.threads)
    evv.ensure_model()
    res = run(args.rate, args.requests)
    line = (f"{res['rate']:g} req/s offered: {res['achieved_rps']:.2f} req/s, TTFT p50/p99 {res['p50_ttft_ms']:.0f}/"
            f"{res['p99_ttft_ms']:.0f} ms, TPOT p50/p99 {res['p50_tpot_ms']:.1f}/{res['p99_tpot_ms']:.1f} ms, "
            f"{res['steps']} steps of {res['mean_step_ms']:.1f} ms on average")
    print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "table.md").write_text(line + "\n\n| prefill tokens | decodes | steps | median ms |\n|---|---|---|---|\n" + "\n".join(
        f"| {c['prefill_tokens']} | {c['decodes_from']}-{c['decodes_from'] + 4} | {c['n']} | {c['median_ms']:.1f} |"
        for c in res["step_ms_by_shape"]) + "\n")
    plot(res, out / "online_inprocess.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
