"""LAPS's bucketed short-prefill path on the CPU engine against the same batches unpadded.

    python benchmarks/laps_buckets_cpu.py [--requests 64] [--runs 3] [--out docs/results/laps_buckets_cpu]

A random ~30M-parameter Qwen3 checkpoint (made here, offline) in float32 serves as a prefill worker. 64 short
prompts (every one < 256 tokens: the later-round input lengths of the `chat-multiturn` workload, LAPS's length mix)
are submitted at once; the worker runs them as AWD batches. `laps` pads each batch to its (length, batch) bucket
(the shape a CUDA graph would be captured for on a GPU); `laps-no-graph` runs the very same batches unpadded. The
two alternate, `--runs` times each; throughput is prompt tokens over the model's step time (AWD's waiting window
excluded: it is the same for both). KV and first tokens are compared between the two, entry for entry. Writes
results.json, table.md and a PNG.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tiny_model import make_tiny_model
from tandem.workload.generators import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def short_prompts(n: int, seed: int, vocab: int = 400) -> list[list[int]]:
    """n prompts whose lengths are chat-multiturn's later-round inputs under 256 tokens (random token ids)."""
    lens: list[int] = []
    for s in generate("chat-multiturn", 4 * n, 1.0, seed=seed):
        lens += [r.input_tokens for r in s.rounds[1:] if r.input_tokens < 256]
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=k).tolist() for k in lens[:n]]


def run(path: str, policy: str, prompts: list[list[int]]) -> dict:
    """Prefill every prompt on a fresh prefill engine of `policy`: step time, steps and padding, outputs."""
    eng = LLMEngine(EngineConfig(model=path, policy=policy, num_kv_blocks=2048, max_model_len=1024,
                                 max_num_batched_tokens=2048), role="prefill", worker_id=0)
    for i, p in enumerate(prompts):
        eng.add_prefill(f"r{i}", p, GREEDY, f"s{i}", l_hist=0)
    model_s, steps, rows = 0.0, 0, 0
    left = set(range(len(prompts)))
    out = {}
    while left:
        prep = eng.prepare_step()
        t0 = time.perf_counter()
        res = eng.execute_step(prep)
        if prep.batch is not None:
            model_s += time.perf_counter() - t0
            steps += 1
            rows += max(prep.batch.pad_to, len(prep.batch.token_ids))
        eng.finish_step(prep, res)
        eng.core_events.clear()
        for i in list(left):
            if eng.requests[f"r{i}"].first_token is not None:
                payload, tok, _ = eng.export_new_kv(f"r{i}")
                out[i] = (payload.data.clone(), tok)
                left.discard(i)
    tokens = sum(len(p) for p in prompts)
    return {"policy": policy, "model_s": model_s, "steps": steps, "rows": rows, "tokens": tokens,
            "tok_per_s": tokens / model_s, "outputs": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="alternating runs per path (default: 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/laps_buckets_cpu")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.runs < 1:
        print("laps_buckets_cpu: --requests and --runs must be >= 1", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(1)                          # as a worker process runs (one thread per worker)
    prompts = short_prompts(a.requests, a.seed)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_model(d, arch="qwen3", size="30m", seed=0)
        runs = {"laps": [], "laps-no-graph": []}
        for k in range(a.runs):
            for policy in (("laps", "laps-no-graph") if k % 2 == 0 else ("laps-no-graph", "laps")):
                r = run(d, policy, prompts)
                runs[policy].append(r)
                print(f"run {k + 1} {policy}: {r['tok_per_s']:.0f} prompt tok/s over {r['steps']} steps, "
                      f"{r['rows']} rows for {r['tokens']} tokens", file=sys.stderr)
    ref = runs["laps-no-graph"][0]["outputs"]
    identical = all(torch.equal(r["outputs"][i][0], ref[i][0]) and r["outputs"][i][1] == ref[i][1]
                    for rs in runs.values() for r in rs for i in ref)
    med = {p: statistics.median(r["tok_per_s"] for r in rs) for p, rs in runs.items()}
    summary = {
        "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
        "requests": a.requests, "prompt_tokens": runs["laps"][0]["tokens"],
        "lengths": {"min": min(map(len, prompts)), "median": statistics.median(map(len, prompts)),
                    "max": max(map(len, prompts))},
        "runs": {p: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for p, rs in runs.items()},
        "median_tok_per_s": med, "ratio_bucketed_over_unbucketed": med["laps"] / med["laps-no-graph"],
        "outputs_identical": identical,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["| path | prompt tok/s (median, min-max) | steps | rows computed | prompt tokens |", "|---|---|---|---|---|"]
    for p, rs in runs.items():
        t = [r["tok_per_s"] for r in rs]
        lines.append(f"| {p} | {med[p]:.0f} ({min(t):.0f}-{max(t):.0f}) | {rs[0]['steps']} | {rs[0]['rows']} | "
                     f"{rs[0]['tokens']} |")
    lines.append(f"\nbucketed / unbucketed: {summary['ratio_bucketed_over_unbucketed']:.3f}; "
                 f"KV and first tokens identical: {identical}")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(runs)
    ax.bar(names, [med[p] for p in names], color=["tab:red", "tab:green"])
    for i, p in enumerate(names):
        ax.plot([i] * len(runs[p]), [r["tok_per_s"] for r in runs[p]], "k.")
    ax.set_ylabel("prompt tokens/s (model step time)")
    ax.set_title(f"{a.requests} short prefills, CPU, 1 thread")
    fig.tight_layout()
    fig.savefig(out / "laps_buckets_cpu.png", dpi=120)
    print("\n".join(lines))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
