"""CPU prefill attention: the C paged prefill kernel against the SDPA path it replaced, same run.

    python benchmarks/prefill_attention.py [--threads 1,2] [--reps 20] [--out docs/results/prefill_attention]

Two measurements, the two paths alternating within each repetition:
1. one layer's attention (the 30m model's shape: 8 query heads, 4 KV heads, head dim 64, blocks of 16) over one
   prefill chunk: fresh prompts of 64-2048 tokens, and chunks of 256 and 512 after a cached prefix of 768 tokens (the
   SDPA path gathers the prefix first): milliseconds per call, median of --reps, per thread count;
2. the engine's prefill step: one 256-token prompt (max_tokens 1) through `LLMEngine` on the random 30m Qwen3
   checkpoint, milliseconds per request, median of --reps, the paths alternating in one process.
Prints a table and writes results.json, table.md and prefill_attention.png under --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = [(n, 0) for n in (64, 128, 256, 512, 1024, 2048)] + [(256, 768), (512, 768)]   # (chunk, cached prefix)
PATHS = ("native", "sdpa")


def _use(path: str) -> None:
    """Route prefill chunks to the kernel or to SDPA (the decode kernel is untouched: no decode rows here)."""
    from tandem.engine.attention import native
    if path == "sdpa":
        native.supports_prefill = lambda q, kv: False
    else:
        native.supports_prefill = _ORIGINAL


def _layer_inputs(n: int, prefix: int):
    import torch

    from tandem.engine.attention.metadata import AttnMetadata, allocate_kv_cache
    g = torch.Generator().manual_seed(n + prefix)
    hq, hkv, d, bs = 8, 4, 64, 16
    L = n + prefix
    nblk = -(-L // bs)
    kv = allocate_kv_cache(1, nblk + 1, bs, hkv, d, torch.float32, "cpu")[0]
    kv.normal_(generator=g)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, kv, lambda: AttnMetadata.build([n], [L], [list(range(1, nblk + 1))], bs, "cpu"), d ** -0.5


def layer_times(reps: int) -> dict:
    """Median ms per call of each path on each case (this process's thread count)."""
    from tandem.engine.attention.sdpa import SdpaBackend
    out = {}
    for n, prefix in CASES:
        q, k, v, kv, meta, scale = _layer_inputs(n, prefix)
        times = {p: [] for p in PATHS}
        for _ in range(reps):
            for p in PATHS:
                _use(p)
                be, m = SdpaBackend(), meta()
                t = time.perf_counter()
                be.forward(q, k, v, kv, m, scale)
                times[p].append(time.perf_counter() - t)
        _use("native")
        out[f"{n}+{prefix}"] = {p: 1e3 * statistics.median(ts[1:]) for p, ts in times.items()}
    return out


def engine_times(reps: int) -> dict:
    """Median ms of a 256-token prompt's prefill step (one request, one output token) per path."""
    import random

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    sys.path.insert(0, str(REPO / "benchmarks"))
    import engine_vs_vllm as evv
    evv.ensure_model()
    eng = LLMEngine(EngineConfig(model=str(evv.MODEL_DIR), max_num_batched_tokens=2048, enable_prefix_caching=False))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = {p: [] for p in PATHS}
    for i in range(reps + 1):
        for p in PATHS:
            _use(p)
            eng.add_request(f"{p}{i}", [rng.randrange(3, 440) for _ in range(256)], sp)
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            if i:
                times[p].append(time.perf_counter() - t)
    _use("native")
    return {p: 1e3 * statistics.median(ts) for p, ts in times.items()}


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    fresh = [c for c in CASES if c[1] == 0]
    for th, r in res["layer"].items():
        for p, style in zip(PATHS, ("-o", "--s")):
            ax.plot([n for n, _ in fresh], [r[f"{n}+0"][p] for n, _ in fresh], style, label=f"{p}, {th} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (fresh prefill)")
    ax.set_ylabel("ms per layer (median)")
    ax.set_title("CPU prefill attention: C kernel vs SDPA (8 q / 4 kv heads, d 64)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(REPO / "docs/results/prefill_attention"))
    args = ap.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
        if not threads or min(threads) < 1 or args.reps < 2:
            raise ValueError
    except ValueError:
        print(f"error: --threads takes positive integers (got {args.threads!r}) and --reps at least 2", file=sys.stderr)
        return 2
    import torch
    from rich.progress import track

    from tandem.engine.attention import native
    if native.load() is None or not native.supports_prefill(torch.zeros(1, 8, 64), torch.zeros(2, 1, 16, 4, 64)):
        print(f"the prefill kernel is unavailable here: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    global _ORIGINAL
    _ORIGINAL = native.supports_prefill
    res = {"machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "torch": torch.__version__}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "layer": {}}
    for th in track(threads, description="layer attention"):
        torch.set_num_threads(th)
        res["layer"][th] = layer_times(args.reps)
    torch.set_num_threads(1)
    res["engine_256_prefill_ms"] = engine_times(args.reps)
    rows = ["| case (chunk + cached prefix) | threads | native ms | sdpa ms | sdpa / native |", "|---|---|---|---|---|"]
    for th, r in res["layer"].items():
        for case, t in r.items():
            rows.append(f"| {case} | {th} | {t['native']:.3f} | {t['sdpa']:.3f} | {t['sdpa'] / t['native']:.2f}x |")
    e = res["engine_256_prefill_ms"]
    rows.append(f"| engine: one 256-token prefill step | 1 | {e['native']:.1f} | {e['sdpa']:.1f} | "
                f"{e['sdpa'] / e['native']:.2f}x |")
    table = "\n".join(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "table.md").write_text(table + "\n")
    plot(res, out / "prefill_attention.png")
    print(table)
    print(f"wrote {out}/results.json, table.md, prefill_attention.png")
    return 0


_ORIGINAL = None

if __name__ == "__main__":
    sys.exit(main())
