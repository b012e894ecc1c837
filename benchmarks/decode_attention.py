"""CPU decode attention: the C paged decode kernel against the gather + SDPA path it replaced, same run.

    python benchmarks/decode_attention.py [--threads 1,2] [--runs 3] [--out docs/results/decode_attention]

Two measurements, each alternating the two paths (TANDEM_CPU_ATTENTION=native / sdpa):
1. one layer's attention over a decode step of 64 sequences at context 350-450 (the 30m model's shape: 8 query
   heads, 4 KV heads, head dim 64, blocks of 16): milliseconds per call, median of --reps calls, per thread count;
2. the whole engine offline on the workload of benchmarks/engine_throughput.py (64 requests, prompts of 32-512
   tokens, 128 greedy output tokens each, EOS masked) on a random 30m Qwen3 checkpoint: output tokens/s, each run
   in a fresh process, --runs per path and thread count; the greedy tokens of both paths are compared.
Prints a table and writes results.json, table.md and decode_attention.png under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.host import describe_host

PATHS = ("native", "sdpa")


def _layer(threads: int, reps: int) -> float:
    """Median ms of one layer's attention over the 64-sequence decode step (in this process)."""
    import torch

    from tandem.engine.attention.metadata import AttnMetadata, allocate_kv_cache
    from tandem.engine.attention.sdpa import SdpaBackend
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 8, 4, 64, 16
    lens = [349 + (i * 100) // 64 for i in range(64)]
    tables, nxt = [], 1
    for n in lens:
        k = -(-n // bs)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    kv = allocate_kv_cache(1, nxt, bs, hkv, d, torch.float32, "cpu")[0]
    kv.normal_(generator=g)
    q, k, v = (torch.randn(len(lens), h, d, generator=g) for h in (hq, hkv, hkv))
    be, meta = SdpaBackend(), AttnMetadata.build([1] * len(lens), lens, tables, bs, "cpu")
    be.forward(q, k, v, kv, meta, d ** -0.5)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        be.forward(q, k, v, kv, meta, d ** -0.5)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _offline(path: str, threads: int) -> dict:
    """Output tokens/s of the offline workload (in this process) and its greedy tokens."""
    import random

    import torch

    from tandem import LLM, SamplingParams
    torch.set_num_threads(threads)
    r = random.Random(0)
    llm = LLM(path, max_num_batched_tokens=2048)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[r.randrange(3, vocab - 8) for _ in range(r.randint(32, 512))] for _ in range(64)]
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sp = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall, "wall_s": wall,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def _child(kind: str, path: str, threads: int, reps: int, mode: str) -> dict:
    env = {**os.environ, "TANDEM_CPU_ATTENTION": mode, "OMP_NUM_THREADS": str(threads)}
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import decode_attention as b; "
            f"print(json.dumps(b._layer({threads}, {reps}) if {kind!r} == 'layer' else b._offline({path!r}, "
            f"{threads})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"decode_attention: a {kind} run failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="thread counts (default: 1,2)")
    p.add_argument("--runs", type=int, default=3, help="offline runs per path and thread count (default: 3)")
    p.add_argument("--reps", type=int, default=30, help="timed attention calls per layer measurement (default: 30)")
    p.add_argument("--out", default="docs/results/decode_attention", help="output directory")
    a = p.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",")]
        if not threads or min(threads) < 1 or a.runs < 1 or a.reps < 1:
            raise ValueError
    except ValueError:
        print(f"decode_attention: --threads must be positive integers, --runs and --reps >= 1 (got {a.threads!r},"
              f" {a.runs}, {a.reps})", file=sys.stderr)
        return 2
    from rich.progress import Progress

    from tandem.engine.attention import native
    from tandem.engine.tiny_model import make_tiny_model
    if native.load() is None:
        print(f"decode_attention: the kernel is unavailable here ({native.unavailable_reason()})", file=sys.stderr)
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"layer_ms": {}, "offline_tok_s": {}, "same_tokens": {}}
    with tempfile.TemporaryDirectory() as tmp, Progress() as bar:
        model = str(make_tiny_model(Path(tmp) / "m30", "qwen3", "30m", seed=0))
        task = bar.add_task("runs", total=len(threads) * 2 * (1 + a.runs))
        for t in threads:
            for mode in PATHS:                                           # attention alone, alternating
                res["layer_ms"].setdefault(str(t), {})[mode] = _child("layer", model, t, a.reps, mode)
                bar.advance(task)
            runs: dict[str, list] = {m: [] for m in PATHS}
            for _ in range(a.runs):
                for mode in PATHS:
                    runs[mode].append(_child("offline", model, t, a.reps, mode))
                    bar.advance(task)
            res["offline_tok_s"][str(t)] = {m: [r["tok_s"] for r in runs[m]] for m in PATHS}
            res["same_tokens"][str(t)] = sum(x == y for x, y in zip(runs["native"][0]["tokens"],
                                                                    runs["sdpa"][0]["tokens"]))
    res["machine"] = {"cpu": describe_host().cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = ["| threads | layer attention ms: kernel / gather+SDPA (ratio) | offline tok/s kernel, median (min-max) "
            "| offline tok/s gather+SDPA | ratio | same greedy tokens |", "|---|---|---|---|---|---|"]
    for t in threads:
        lm, ot = res["layer_ms"][str(t)], res["offline_tok_s"][str(t)]
        med = {m: statistics.median(ot[m]) for m in PATHS}
        rows.append(f"| {t} | {lm['native']:.2f} / {lm['sdpa']:.2f} ({lm['sdpa'] / lm['native']:.2f}x) | "
                    f"{med['native']:.0f} ({min(ot['native']):.0f}-{max(ot['native']):.0f}) | "
                    f"{med['sdpa']:.0f} ({min(ot['sdpa']):.0f}-{max(ot['sdpa']):.0f}) | "
                    f"{med['native'] / med['sdpa']:.2f}x | {res['same_tokens'][str(t)]}/64 |")
    table = "\n".join(rows)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    _plot(res, threads, out / "decode_attention.png")
    return 0


def _plot(res: dict, threads: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(threads))
    for i, (mode, label) in enumerate((("native", "C paged kernel"), ("sdpa", "gather + SDPA"))):
        a1.bar([j + 0.4 * i for j in x], [res["layer_ms"][str(t)][mode] for t in threads], 0.4, label=label)
        med = [statistics.median(res["offline_tok_s"][str(t)][mode]) for t in threads]
        lo = [m - min(res["offline_tok_s"][str(t)][mode]) for m, t in zip(med, threads)]
        hi = [max(res["offline_tok_s"][str(t)][mode]) - m for m, t in zip(med, threads)]
        a2.bar([j + 0.4 * i for j in x], med, 0.4, yerr=[lo, hi], capsize=4, label=label)
    for ax, title in ((a1, "one layer's decode attention (ms, lower is better)"),
                      (a2, "offline output tokens/s (higher is better)")):
        ax.set_xticks([j + 0.2 for j in x], [f"{t} thread(s)" for t in threads])
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
