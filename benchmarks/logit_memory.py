"""Logit decomposition's effect on the activation peak and the KV pool.

    python benchmarks/logit_memory.py [--tokens 256,512,1024,2048] [--max-num-seqs 256]
                                      [--all-rows-tokens 64,128,256,512] [--max-num-logits 32] [--budget-gib 4]
                                      [--out docs/results/logit_memory]

Two random checkpoints with the tiny Qwen3 body (hidden 128, 4 layers, 4 heads / 2 KV heads, float32) and a real
vocabulary: 32768 ids (SDAR's) and 151936 (Qwen3's), tied embeddings, made here offline. For each vocabulary and each
max_num_batched_tokens (two sweeps: `max_num_seqs` 256, vLLM's default, so 256 logit rows whatever the token
budget; and max_num_seqs = max_num_batched_tokens, every token of the step sampled, as a diffusion step needs logits at
every position of its windows), the engine's start-up memory profile (tandem/engine/memory_profile.py: the worst-case dummy
step, `max_num_seqs` rows sampled with top-k/top-p/min-p, penalties and 20 logprobs, prompt logprobs on every prefill
position) measures the activation peak with every logit row at once (monolithic) and with the LM head on
`max_num_logits` rows at a time (decomposed); the KV pool each leaves under a fixed CPU byte budget is
budget - weights - persistent buffers - (peak + guard), the engine's own rule (memory_profile.kv_budget). Each runner
is built with memory_profile=True and a one-block pool, so the benchmark allocates no large pool; the sizing is the
function the engine applies. One torch thread. Writes results.json, table.md and logit_memory.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.memory_profile import guard_bytes, kv_budget
from tandem.engine.model_runner import ModelRunner
from tandem.engine.tiny_model import widen_vocab

VOCABS = (32768, 151936)
MIB = 1 << 20


def vocab_model(out: Path, vocab: int, seed: int = 0) -> str:
    """The tiny Qwen3 with a real-sized vocabulary (tandem.engine.tiny_model.widen_vocab)."""
    return widen_vocab(out, vocab, seed)


def measure(path: str, tokens: int, seqs: int, cap: int, budget: int) -> dict:
    """One profile: both peaks, the guard bands, and the KV pool each mode leaves under `budget`."""
    t0 = time.perf_counter()
    r = ModelRunner(EngineConfig(model=path, max_num_batched_tokens=tokens, max_num_seqs=seqs, max_num_logits=cap,
                                 memory_profile=True, num_kv_blocks=1))
    start_s = time.perf_counter() - t0
    m = r.memory
    per_block = r.kv_pool_bytes                      # one block
    cpu = torch.device("cpu")
    kv_dec = kv_budget(m, cpu, 0.9, budget)          # the running mode: decomposed
    kv_mono = kv_dec - m.kv_gain_bytes               # the same budget, the monolithic guarded peak
    return {"vocab": r.model_config.vocab_size, "max_num_batched_tokens": tokens, "max_num_seqs": seqs,
            "logit_rows": m.logit_rows, "prompt_logprob_rows": m.prompt_logprob_rows, "max_num_logits": cap,
            "weight_bytes": m.weight_bytes, "persistent_bytes": m.persistent_bytes,
            "peak_monolithic_bytes": m.monolithic_peak_bytes, "peak_decomposed_bytes": m.decomposed_peak_bytes,
            "guard_monolithic_bytes": guard_bytes(m.monolithic_peak_bytes),
            "guard_decomposed_bytes": guard_bytes(m.decomposed_peak_bytes),
            "kv_pool_monolithic_bytes": max(0, kv_mono // per_block * per_block),
            "kv_pool_decomposed_bytes": max(0, kv_dec // per_block * per_block),
            "kv_gain_bytes": m.kv_gain_bytes, "kv_block_bytes": per_block,
            "logits_bytes": m.logit_rows * r.model_config.vocab_size * 4,
            "profile_s": round(m.seconds, 2), "start_s": round(start_s, 2)}


def table(rows: list[dict], budget: int) -> str:
    """The markdown table of BENCHMARKS.md."""
    head = ("| vocab | max_num_batched_tokens | max_num_seqs | logit rows | logits alone MiB | peak monolithic MiB | peak decomposed "
            "MiB | ratio | KV pool monolithic MiB | KV pool decomposed MiB | KV gain MiB | profile s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    out = []
    for r in rows:
        pool_m, pool_d = r["kv_pool_monolithic_bytes"], r["kv_pool_decomposed_bytes"]
        out.append(f"| {r['vocab']:,} | {r['max_num_batched_tokens']:,} | {r['max_num_seqs']} | {r['logit_rows']} | "
                   f"{r['logits_bytes'] / MIB:.1f} | {r['peak_monolithic_bytes'] / MIB:.1f} | "
                   f"{r['peak_decomposed_bytes'] / MIB:.1f} | "
                   f"{r['peak_monolithic_bytes'] / r['peak_decomposed_bytes']:.1f}x | "
                   f"{pool_m / MIB:.1f} | {pool_d / MIB:.1f} | {(pool_d - pool_m) / MIB:+.1f} | {r['profile_s']} |")
    return head + "\n".join(out) + f"\n\nKV pools under a CPU budget of {budget / MIB:,.0f} MiB.\n"


def plot(rows: list[dict], out: Path, budget: int) -> None:
    """Peaks (left) and KV pools (right) against max_num_batched_tokens, one line per vocabulary, mode and sweep."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for vocab, color in zip(sorted({r["vocab"] for r in rows}), ("tab:blue", "tab:red")):
        for sweep, marker in (("seqs256", "o"), ("all_rows", "^")):
            rs = [r for r in rows if r["vocab"] == vocab and r["sweep"] == sweep]
            if not rs:
                continue
            x = [r["max_num_batched_tokens"] for r in rs]
            what = "256 rows" if sweep == "seqs256" else "every token a row"
            for mode, style in (("monolithic", "-"), ("decomposed", "--")):
                label = f"{vocab:,} ids, {what}, {mode}"
                a.plot(x, [r[f"peak_{mode}_bytes"] / MIB for r in rs], style + marker, color=color, label=label)
                b.plot(x, [r[f"kv_pool_{mode}_bytes"] / MIB for r in rs], style + marker, color=color, label=label)
    cap = rows[0]["max_num_logits"]
    a.set(xscale="log", yscale="log", xlabel="max_num_batched_tokens", ylabel="activation peak (MiB)",
          title=f"worst-case step's activation peak (decomposed: {cap} rows at a time)")
    b.set(xscale="log", xlabel="max_num_batched_tokens", ylabel="KV pool (MiB)",
          title=f"KV pool under a {budget / MIB:,.0f} MiB CPU budget")
    for ax in (a, b):
        ax.set_xticks(sorted({r["max_num_batched_tokens"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "logit_memory.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,512,1024,2048", help="max_num_batched_tokens values")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="max_num_seqs of the --tokens sweep")
    ap.add_argument("--all-rows-tokens", default="64,128,256,512",
                    help="max_num_batched_tokens of the sweep where every token is a logit row ('' for none)")
    ap.add_argument("--max-num-logits", type=int, default=32)
    ap.add_argument("--budget-gib", type=float, default=4.0, help="CPU byte budget for weights + activations + KV")
    ap.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    ap.add_argument("--out", default="docs/results/logit_memory")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    all_rows = [int(t) for t in args.all_rows_tokens.split(",") if t]
    budget = int(args.budget_gib * (1 << 30))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in (int(v) for v in args.vocabs.split(",")):
            path = vocab_model(Path(tmp) / f"v{vocab}", vocab)
            grid = [("seqs256", t, args.max_num_seqs) for t in tokens] + [("all_rows", t, t) for t in all_rows]
            for sweep, t, seqs in grid:
                r = dict(sweep=sweep, **measure(path, t, seqs, args.max_num_logits, budget))
                rows.append(r)
                print(f"vocab {vocab:>6} tokens {t:>5} seqs {seqs:>4}: peak {r['peak_monolithic_bytes'] / MIB:8.1f} -> "
                      f"{r['peak_decomposed_bytes'] / MIB:7.1f} MiB, KV pool {r['kv_pool_monolithic_bytes'] / MIB:8.1f}"
                      f" -> {r['kv_pool_decomposed_bytes'] / MIB:8.1f} MiB ({r['profile_s']} s)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": platform.machine(),
            "python": sys.version.split()[0], "torch": torch.__version__, "threads": 1, "budget_bytes": budget}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "table.md").write_text(table(rows, budget))
    plot(rows, out, budget)
    print(table(rows, budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
