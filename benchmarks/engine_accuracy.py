"""Held-out accuracy of the engine's own decoding at each batch size: what a server running
the elastic chunk gives, against plain block diffusion and fixed streaming chunks.

    python benchmarks/engine_accuracy.py                          # b = 1-256; 400 a task (~4.5 min)
    python benchmarks/engine_accuracy.py --batches 1,64 --per-task 100 --out /tmp/acc

chunk_accuracy.py measures each decoding mode apart (generate_cached, which the engine equals token for token);
elastic's windows depend on the load, so its accuracy is a property of the batch it runs in. Here every system is an
LLMEngine (float32, the committed tiny SDAR, budget 4,096 tokens, max_num_seqs = b) given all the held-out prompts
of copy, reverse, sort and count at once: b decode together and the rest wait, so the batch stays at b. Greedy,
threshold 0.9, 64 tokens at most, ending at EOS. Exact match: the request stopped and its text before the EOS is
the answer. Δ: the system's exact match minus BD32's at the same b, in points; p: McNemar's exact test on the
examples where exactly one of the two is right. Writes results.json, table.md and accuracy.png to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chunk_accuracy import TASKS, check_per_task, mcnemar_p  # noqa: E402
from optimus_engine import _engine, ASSET  # noqa: E402

from tandem.bench.provenance import report_meta
from tandem.bench.report import save_log2_plot, write_report  # noqa: E402
from tandem.cli.common import csv_list, positive_int  # noqa: E402

SYSTEMS = ("bd32", "c4", "c8", "c16", "elastic")
BATCHES = (1, 4, 16, 64, 128, 256)
MAX_TOKENS = 64


def decode_all(system: str, b: int, prompts: list[list[int]]) -> tuple[list[tuple[list[int], str | None]], float]:
    """Every prompt through one engine of `system` at max_num_seqs b: (token ids, finish reason) in prompt order,
    and the mean window the engine ran."""
    from tandem.engine.sampling_params import SamplingParams
    eng = _engine(system, b)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outs: dict[int, tuple[list[int], str | None]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[int(o.request_id)] = (list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
    chunks = eng.stats.dllm_chunks
    return [outs[i] for i in range(len(prompts))], sum(k * n for k, n in chunks.items()) / max(1, sum(chunks.values()))


def measure(per_task: int, batches: list[int], progress) -> dict:
    """Exact match of every system at every b, with its difference to BD32's at that b."""
    from tokenizers import Tokenizer

    from tandem.engine.diffusion.tasks import eval_set
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    eos_id = json.loads((ASSET / "config.json").read_text())["eos_token_id"]
    eos = set(eos_id) if isinstance(eos_id, list) else {eos_id}
    examples = eval_set(per_task, tasks=TASKS)
    prompts = [tok.encode(e.prompt).ids for e in examples]
    res: dict = {}
    for b in batches:
        res[str(b)] = {}
        base = None
        for system in SYSTEMS:
            outs, mean_chunk = decode_all(system, b, prompts)
            exact = []
            for (ids, reason), ex in zip(outs, examples):
                if ids and ids[-1] in eos:
                    ids = ids[:-1]
                exact.append(reason == "stop" and tok.decode(ids) == ex.answer)
            row = {"accuracy": sum(exact) / len(exact), "mean_chunk": mean_chunk}
            if base is None:
                base = exact
            else:
                row["delta_points"] = 100 * (row["accuracy"] - sum(base) / len(base))
                row["p"] = mcnemar_p(exact, base)
            res[str(b)][system] = row
            progress()
    return res


def table(res: dict) -> str:
    """Markdown: one row per b, BD32's exact match then each system's difference (p) and mean window."""
    lines = ["| batch | BD32 | " + " | ".join(f"{s}: Δ points (p), mean window" for s in SYSTEMS[1:]) + " |",
             "|---|---:|" + "---:|" * (len(SYSTEMS) - 1)]
    for b in res["batches"]:
        r = res["accuracy"][str(b)]
        cells = [f"{r[s]['delta_points']:+.1f} ({r[s]['p']:.2g}), {r[s]['mean_chunk']:.1f}" for s in SYSTEMS[1:]]
        lines.append(f"| {b} | {r['bd32']['accuracy']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Exact match against batch size, one line per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system in SYSTEMS:
        ax.plot(res["batches"], [res["accuracy"][str(b)][system]["accuracy"] for b in res["batches"]], "o-",
                label=system, lw=2.2 if system == "elastic" else 1.2)
    ax.set_title("tiny SDAR on the engine: accuracy under load")
    ax.grid(alpha=0.3)
    save_log2_plot(fig, ax, res["batches"], "batch size (max_num_seqs; all prompts submitted)",
                   "held-out exact match", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=csv_list(positive_int), default=list(BATCHES))
    ap.add_argument("--per-task", type=positive_int, default=400, help="held-out examples per task")
    ap.add_argument("--out", default="docs/results/engine_accuracy")
    a = ap.parse_args(argv)
    check_per_task(ap, a.per_task)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from rich.progress import Progress
    with Progress() as bar:
        task = bar.add_task("batch sizes x systems", total=len(a.batches) * len(SYSTEMS))
        acc = measure(a.per_task, a.batches, lambda: bar.advance(task))
    res = {"batches": a.batches, "per_task": a.per_task, "tasks": list(TASKS), "systems": list(SYSTEMS),
           "accuracy": acc, "meta": report_meta("benchmarks/engine_accuracy.py", argv, time.perf_counter() - t0)}
    write_report(a.out, res, table(res), plot, "accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
