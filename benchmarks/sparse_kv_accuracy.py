"""Head-centric vs uniform sparse KV on the trained tiny SDAR model.

    python benchmarks/sparse_kv_accuracy.py [--n 100] [--ratios 1,0.75,0.5,0.25,0.125] [--blocks 32,16]
                                            [--delay-step 1] [--out docs/results/sparse_kv] [--no-progress]

The committed checkpoint (tandem/engine/diffusion/assets/tiny-sdar, float32, one torch thread) decodes `--n`
held-out examples of each predictable task (copy, reverse, sort, count, add; tasks.eval_set, seed 1234: the set of
docs/diffusion.md's table) greedily, 64 new tokens at most, with Refresh/Reuse phases (refresh.generate_refresh:
delay_step 1 as dLLM-Serve, no refresh interval, max-pool kernel 3) at each KV retention ratio ρ, selecting the
kept positions per KV head (`head`, dLLM-Serve) or one set for all heads (`uniform`, Sparse-dLLM). ρ = 1 keeps the
whole cache (the dense result both selections share). Settings: the model's block of 32 and a block of 16, each with
one token committed a step (low_confidence_static: dLLM-Serve's evaluation, which runs as many steps as tokens) and
with low_confidence_dynamic at 0.9 (tandem's default). The comparison is paired (the same examples): the examples
only head-centric gets right, those only uniform gets right, and an exact two-sided sign test on them. KV bytes per
request: the mean of each request's fixed buffer (⌈ρ·(P + 64)⌉ positions per layer and KV head) at the run's dtype.
Writes results.json (each run's per-example exact matches as a string of 0/1 in eval_set order), table.md and
plot.png.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from tandem.bench.provenance import report_meta
from tandem.engine.diffusion import TINY_SDAR
from tandem.engine.diffusion.evaluate import evaluate
from tandem.engine.diffusion.refresh import generate_refresh
from tandem.engine.diffusion.sparse_kv import SELECTIONS, SparseKVConfig
from tandem.engine.diffusion.tasks import PREDICTABLE, eval_set
from tandem.engine.diffusion.unmasking import DllmConfig

UNMASKING = {"one token a step": "low_confidence_static", "dynamic 0.9": "low_confidence_dynamic"}
KIB = 1024


def sign_test(a: int, b: int) -> float:
    """Exact two-sided sign test of a wins against b (ties dropped): P(a split at least this uneven | p = 1/2)."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def run_one(model, tok, examples, block: int, strategy: str, ratio: float, selection: str, delay: int) -> dict:
    """One setting: accuracy (overall and per task), per-example exact matches, phases and KV bytes."""
    outs: list = []

    def decode(m, prompts, params, cfg):
        """generate_refresh at this ratio and selection, keeping its outputs for the phase and KV statistics."""
        res = generate_refresh(m, prompts, params, cfg, SparseKVConfig(ratio, kv_selection=selection),
                               delay_step=delay)
        outs.extend(res)
        return res

    cfg = DllmConfig(dllm_block_length=block, dllm_unmasking_strategy=strategy)
    t0 = time.perf_counter()
    rep = evaluate(model, tok, examples, cfg, decode=decode)
    d = rep.as_dict()
    reuse = [c for o in outs for p, c in zip(o.phases, o.context_per_step) if p == "reuse"]
    steps = sum(len(o.phases) for o in outs)
    return {"block": block, "strategy": strategy, "ratio": ratio, "selection": selection,
            "accuracy": d["overall"]["accuracy"], "tasks": {t: r["accuracy"] for t, r in d["tasks"].items()},
            "exact": "".join("1" if x else "0" for x in rep.exact), "steps": steps,
            "committed_per_step": d["overall"]["committed_per_step"],
            "reuse_share": round(len(reuse) / max(1, steps), 4),
            "reuse_with_context_share": round(sum(c > 0 for c in reuse) / max(1, len(reuse)), 4),
            "mean_reuse_context": round(sum(reuse) / max(1, len(reuse)), 2),
            "kv_bytes_mean": round(sum(o.kv_bytes for o in outs) / len(outs), 1),
            "kv_slots_mean": round(sum(o.kv_slots for o in outs) / len(outs), 2),
            "wall_s": round(time.perf_counter() - t0, 2)}


def paired(rows: list[dict]) -> list[dict]:
    """Per setting and ratio < 1: head-centric against uniform on the same examples."""
    out = []
    key = {(r["block"], r["strategy"], r["ratio"], r["selection"]): r for r in rows}
    for (block, strat, ratio, sel), h in key.items():
        if sel != "head" or ratio == 1.0:
            continue
        u = key[(block, strat, ratio, "uniform")]
        dense = key[(block, strat, 1.0, "head")]
        a = sum(x > y for x, y in zip(h["exact"], u["exact"]))          # "1" > "0": only head-centric right
        b = sum(y > x for x, y in zip(h["exact"], u["exact"]))
        out.append({"block": block, "strategy": strat, "ratio": ratio, "head": h["accuracy"], "uniform": u["accuracy"],
                    "dense": dense["accuracy"], "diff": round(h["accuracy"] - u["accuracy"], 4), "head_only": a,
                    "uniform_only": b, "p_sign": round(sign_test(a, b), 4), "kv_bytes": h["kv_bytes_mean"],
                    "head_ge_uniform": h["accuracy"] >= u["accuracy"]})
    return out


def table_md(rows: list[dict], pairs: list[dict], meta: dict, n_examples: int, bytes_per_pos: int) -> str:
    """The report: provenance, the paired table per setting, the phase statistics."""
    name = {v: k for k, v in UNMASKING.items()}
    lines = [f"# Head-centric vs uniform sparse KV, tiny SDAR (`{meta['command']}`)", "",
             f"{meta['machine']}; {meta['date']}; commit {meta['commit']}; {meta['wall_s']:.0f} s; "
             f"{n_examples} held-out examples (copy, reverse, sort, count, add); greedy, 64 new tokens; "
             f"delay_step {meta['delay_step']}, kernel 3; KV {bytes_per_pos} B a position (all layers, K+V, "
             f"float32; half in bfloat16).", "",
             "| block | unmasking | ρ | KV / request | head-centric | uniform | head − uniform | only head / only uniform "
             "| sign test p |", "|---|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        lines.append(f"| {p['block']} | {name[p['strategy']]} | {p['ratio']} | {p['kv_bytes'] / KIB:.1f} KiB | "
                     f"{p['head']:.3f} | {p['uniform']:.3f} | {p['diff']:+.3f} | {p['head_only']} / "
                     f"{p['uniform_only']} | {p['p_sign']:.3g} |")
    dense = [r for r in rows if r["ratio"] == 1.0 and r["selection"] == "head"]
    lines += ["", "ρ = 1 (the whole cache, either selection):", "",
              "| block | unmasking | accuracy | KV / request | steps | Reuse steps | Reuse steps with cached context "
              "| mean cached positions at a Reuse |", "|---|---|---|---|---|---|---|---|"]
    for r in dense:
        lines.append(f"| {r['block']} | {name[r['strategy']]} | {r['accuracy']:.3f} | "
                     f"{r['kv_bytes_mean'] / KIB:.1f} KiB | {r['steps']} | {r['reuse_share']:.1%} | "
                     f"{r['reuse_with_context_share']:.1%} | {r['mean_reuse_context']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path, blocks: list[int]) -> None:
    """Accuracy against ρ, head-centric and uniform, one panel per block and unmasking rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(blocks), len(UNMASKING), figsize=(5 * len(UNMASKING), 3.6 * len(blocks)),
                             squeeze=False)
    for i, block in enumerate(blocks):
        for j, (label, strat) in enumerate(UNMASKING.items()):
            ax = axes[i][j]
            for sel, style in zip(SELECTIONS, ("o-", "s--")):
                pts = sorted((r["ratio"], r["accuracy"]) for r in rows
                             if r["block"] == block and r["strategy"] == strat and r["selection"] == sel)
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=sel)
            kv = sorted({(r["ratio"], r["kv_bytes_mean"]) for r in rows if r["block"] == block})
            ax.set_xticks([x for x, _ in kv], [f"{x:g}\n{b / KIB:.0f} KiB" for x, b in kv], fontsize=7)
            ax.set_title(f"block {block}, {label}", fontsize=10)
            ax.set_ylabel("held-out exact match")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("tiny SDAR: head-centric vs uniform sparse KV (x: retention ρ, KV per request)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run every setting, write the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="held-out examples per task")
    ap.add_argument("--ratios", default="1,0.75,0.5,0.25,0.125", help="KV retention ratios (1 = dense)")
    ap.add_argument("--blocks", default="32,16", help="decoding block lengths")
    ap.add_argument("--delay-step", type=int, default=1, help="dLLM-Serve's delay_step")
    ap.add_argument("--out", default="docs/results/sparse_kv")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        ratios = sorted({float(x) for x in args.ratios.split(",")} | {1.0}, reverse=True)
        blocks = [int(x) for x in args.blocks.split(",")]
        for r in ratios:
            SparseKVConfig(r)
        if args.n < 1 or args.delay_step < 0 or min(blocks) < 2:
            raise ValueError("--n >= 1, --delay-step >= 0 and blocks >= 2")
    except ValueError as e:
        print(f"sparse_kv_accuracy: {e}", file=sys.stderr)
        return 2
    from rich.progress import Progress
    from tokenizers import Tokenizer

    from tandem.engine.loader import load_model

    torch.set_num_threads(1)
    model, _ = load_model(TINY_SDAR, dtype="float32")
    tok = Tokenizer.from_file(str(TINY_SDAR / "tokenizer.json"))
    examples = eval_set(args.n, 1234, PREDICTABLE)
    grid = [(b, s, r, sel) for b in blocks for s in UNMASKING.values() for r in ratios
            for sel in (SELECTIONS if r < 1.0 else ("head",))]
    rows = []
    t0 = time.time()
    with Progress(disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("settings", total=len(grid))
        for b, s, r, sel in grid:
            bar.update(task, description=f"block {b} {s[15:]} ρ={r:g} {sel}")
            rows.append(run_one(model, tok, examples, b, s, r, sel, args.delay_step))
            bar.advance(task)
    pairs = paired(rows)
    mc = model.config
    bytes_per_pos = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 4
    meta = report_meta("benchmarks/sparse_kv_accuracy.py", argv, round(time.time() - t0, 1),
                       delay_step=args.delay_step, examples=len(examples), threads=1, dtype="float32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "kv_bytes_per_position": bytes_per_pos,
                                                  "pairs": pairs, "runs": rows}, indent=1))
    (out / "table.md").write_text(table_md(rows, pairs, meta, len(examples), bytes_per_pos))
    plot(rows, out, blocks)
    print((out / "table.md").read_text())
    print(f"report: {out}/ (table.md, results.json, plot.png) — {len(grid)} settings in {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
