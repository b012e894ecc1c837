"""Held-out accuracy of Optimus's streaming chunks against plain block diffusion, per
checkpoint, with a paired test of each difference.

    python benchmarks/chunk_accuracy.py                                   # the committed tiny SDAR (~2 min)
    python benchmarks/chunk_accuracy.py --models A,B --out /tmp/acc       # other checkpoints (tandem tiny-model)

Each checkpoint decodes the same held-out examples (greedy, block 32, low_confidence_dynamic at 0.9, 64 new tokens)
with BD32 (`generate_cached` without a chunk: the whole block every step) and with streaming chunks c (the engine's
windows: c masked positions, decoded positions' K/V reused; the engine equals this loop token for token). Tasks:
copy, reverse, sort and count, --per-task examples each (`add` has only 106 held-out prompts, `words` no right
answer). A difference is the chunk's exact match minus BD32's, in points; p is the two-sided exact binomial test of
the examples where exactly one of the two is right (McNemar's), so the noise of a few hundred examples shows.
Writes results.json, table.md and accuracy.png to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tandem.bench.provenance import report_meta
from tandem.bench.report import save_log2_plot, write_report
from tandem.cli.common import csv_list, positive_int

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
TASKS = ("copy", "reverse", "sort", "count")
CHUNKS = (4, 8, 16, 32)


def mcnemar_p(a: list[bool], b: list[bool]) -> float:
    """Two-sided exact binomial p of the discordant pairs of two paired exact-match lists (1.0 when none)."""
    from scipy.stats import binomtest

    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n = only_a + only_b
    return float(binomtest(only_a, n, 0.5).pvalue) if n else 1.0


def measure(model_dir: Path, per_task: int, chunks: list[int], progress) -> dict:
    """BD32's and each chunk's exact match on the held-out set, per task, with the paired difference to BD32."""
    from tokenizers import Tokenizer

    from tandem.engine.diffusion.evaluate import evaluate
    from tandem.engine.diffusion.generate import generate_cached
    from tandem.engine.diffusion.tasks import eval_set
    from tandem.engine.diffusion.unmasking import DllmConfig
    from tandem.engine.loader import load_model

    model, _ = load_model(model_dir, dtype="float32")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    examples = eval_set(per_task, tasks=TASKS)
    cfg = DllmConfig(dllm_confidence_threshold=0.9)
    rows: dict[str, dict] = {}
    base = None
    for chunk in [None, *chunks]:
        name = "bd32" if chunk is None else f"c{chunk}"
        rep = evaluate(model, tok, examples, cfg,
                       decode=lambda m, p, params, c, k=chunk: generate_cached(m, p, params, c, chunk=k))
        row = {"accuracy": rep.predictable.accuracy, "committed_per_step": rep.overall.committed_per_step,
               "by_task": {t: s.accuracy for t, s in rep.tasks.items()}}
        if base is None:
            base = rep.exact
        else:
            row["delta_points"] = 100 * (row["accuracy"] - rows["bd32"]["accuracy"])
            row["p"] = mcnemar_p(rep.exact, base)
        rows[name] = row
        progress()
    info = model_dir / "training.json"
    made = json.loads(info.read_text()) if info.is_file() else {}
    return {"model": str(model_dir), "training": {k: made.get(k) for k in ("command", "seconds")}
            | {"train_config": {k: made.get("train_config", {}).get(k) for k in ("seed", "steps", "ar_steps",
                                                                                   "threads")}},
            "examples": len(examples), "rows": rows}


def table(res: dict) -> str:
    """Markdown: one row per checkpoint, BD32's exact match then each chunk's difference (p)."""
    chunks = res["chunks"]
    lines = ["| checkpoint | BD32 | " + " | ".join(f"c{c}: Δ points (p)" for c in chunks) + " |",
             "|---|---:|" + "---:|" * len(chunks)]
    for m in res["models"]:
        r = m["rows"]
        cells = [f"{r[f'c{c}']['delta_points']:+.1f} ({r[f'c{c}']['p']:.2g})" for c in chunks]
        lines.append(f"| {Path(m['model']).name} | {r['bd32']['accuracy']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Accuracy against the chunk per checkpoint, BD32 as a dashed line of the same colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, m in enumerate(res["models"]):
        colour = f"C{i}"
        r = m["rows"]
        ax.plot(res["chunks"], [r[f"c{c}"]["accuracy"] for c in res["chunks"]], "o-", color=colour,
                label=Path(m["model"]).name)
        ax.axhline(r["bd32"]["accuracy"], color=colour, ls="--", lw=0.8)
    save_log2_plot(fig, ax, res["chunks"], "streaming chunk c (dashed: BD32)", "held-out exact match", path,
                   legend_size=7)


def check_per_task(ap: argparse.ArgumentParser, per_task: int) -> None:
    """A one-line usage error (exit 2) when the held-out set has fewer than `per_task` examples of a task."""
    from tandem.engine.diffusion.tasks import eval_set
    try:
        eval_set(per_task, tasks=TASKS)
    except ValueError as e:
        ap.error(f"--per-task {per_task}: {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=csv_list(str), default=[str(ASSET)], metavar="DIR[,DIR...]",
                    help="SDAR checkpoints (default: the committed tiny SDAR)")
    ap.add_argument("--per-task", type=positive_int, default=400, help="held-out examples per task")
    ap.add_argument("--chunks", type=csv_list(positive_int), default=list(CHUNKS))
    ap.add_argument("--out", default="docs/results/chunk_accuracy")
    a = ap.parse_args(argv)
    dirs = [Path(d) for d in a.models]
    for d in dirs:
        if not (d / "config.json").is_file():
            ap.error(f"--models: {d} is not a checkpoint (no config.json)")
    check_per_task(ap, a.per_task)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from rich.progress import Progress
    with Progress() as bar:
        task = bar.add_task("checkpoints x decodings", total=len(dirs) * (1 + len(a.chunks)))
        models = [measure(d, a.per_task, a.chunks, lambda: bar.advance(task)) for d in dirs]
    res = {"chunks": a.chunks, "per_task": a.per_task, "tasks": list(TASKS), "models": models,
           "meta": report_meta("benchmarks/chunk_accuracy.py", argv, time.perf_counter() - t0)}
    write_report(a.out, res, table(res), plot, "accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
