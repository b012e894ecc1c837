"""Optimus on the CPU engine: the trained tiny SDAR model's output
tokens/s against batch size for AR-like decoding, plain block diffusion, fixed streaming chunks and the elastic
chunk, and the held-out accuracy of each decoding mode.

    python benchmarks/optimus_engine.py                       # batch 1..64, 3+ alternating runs each (~20 min)
    python benchmarks/optimus_engine.py --quick --out /tmp/o  # batch 1, 8, 32, one run (~2 min)
    python benchmarks/optimus_engine.py --requests-per-slot 4 --eval-per-task 0 --out /tmp/o   # closed loop at b

Systems (one LLMEngine each, float32, co-located, the same checkpoint; the core sizes every window):

- `ar`: one token a step, left to right (`dllm_unmasking_strategy=sequential`, 32 denoising steps per block, a
  streaming chunk of 1: the next position, with the previous token's K/V write riding along) - autoregressive
  decoding of the same model, 2 rows a step (Optimus §6 counts that as its minimum feasible chunk, 2 not 1: it
  counts the write in the chunk, tandem's c counts the masked positions and its T(c, b) every row);
- `bd32`: the whole 32-position block recomputed every step (`dllm_chunk=block`);
- `c4`, `c8`, `c16`: streaming chunks of fixed size; `elastic`: Optimus's c* each step, T(c, b) fitted on the
  engine's own forward at start and N_commit learnt from the commits.

Throughput: b requests (held-out prompts of the six tasks, taken round-robin across the tasks), 64 output tokens
each (ignore_eos, so every system makes the same number of tokens), submitted together; output tokens / wall time of
the run (prefill included, a few % of it). With `--requests-per-slot K`, a closed loop instead: b slots each send K
requests back to back (the next when the last ends), so the batch stays at b but for the last wave's drain. The
systems alternate within each repetition; the median of the repetitions is reported.
Accuracy: greedy exact match on the held-out examples with one right answer, decoded by each system's engine path
(block_state.py windows through generate_cached, which the engine equals token for token - tests/test_engine_
diffusion.py), default threshold 0.9. Writes results.json, table.md and throughput.png to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.bench.provenance import report_meta
from tandem.cli.common import csv_list, nonneg_float, positive_int

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
SYSTEMS = {                       # name -> (dllm_chunk, extra EngineConfig fields)
    "ar": ("1", {"dllm_unmasking_strategy": "sequential", "dllm_denoising_steps": 32}),
    "bd32": ("block", {}),
    "c4": ("4", {}),
    "c8": ("8", {}),
    "c16": ("16", {}),
    "elastic": ("elastic", {}),
}
FIXED = ("c4", "c8", "c16")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
OUTPUT_TOKENS = 64
MIN_SECONDS = 1.5           # measured time each system's runs at a batch size total at least (short runs repeat)
MAX_REPS = 40


def _prompts(n: int, seed: int = 99) -> list[list[int]]:
    from tokenizers import Tokenizer

    from tandem.engine.diffusion.tasks import eval_set
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    by_task: dict[str, list] = {}
    for e in eval_set(max(1, -(-n // 6)), seed=seed):       # grouped by task: taken round-robin, so every b and
        by_task.setdefault(e.task, []).append(e)             # every stretch of a run sees the same mix of tasks
    pool = [tok.encode(e.prompt).ids for group in zip(*by_task.values()) for e in group]
    return [pool[i % len(pool)] for i in range(n)]


def _engine(system: str, max_num_seqs: int):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    chunk, extra = SYSTEMS[system]
    return LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", dllm_chunk=chunk,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=512,
                                  num_kv_blocks=max(64, max_num_seqs * 8), **extra))


def throughput(system: str, b: int, warmup: bool = False, per_slot: int = 1) -> dict:
    """One run: b requests of OUTPUT_TOKENS tokens on a fresh engine, or with `per_slot` K > 1 a closed loop of b
    slots each sending its next request when its last one ends, K each (b·K in all: the batch stays at b until the
    last wave drains); `warmup`: after an untimed batch of b other held-out prompts, as on a server already running.
    Tokens/s, steps and mean commits a step."""
    from tandem.engine.sampling_params import SamplingParams
    eng = _engine(system, b)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    if warmup:
        for i, p in enumerate(_prompts(b, seed=98)):
            eng.add_request(f"warm{i}", p, params)
        while eng.has_unfinished_requests():
            eng.step()
        eng.stats.dllm_commits.clear()
        eng.stats.dllm_chunks.clear()
    queue = _prompts(b * per_slot)
    for i in range(b):
        eng.add_request(str(i), queue[i], params)
    sent = b
    t0 = time.perf_counter()
    tokens = steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
                if sent < len(queue):            # the slot's next request
                    eng.add_request(str(sent), queue[sent], params)
                    sent += 1
        steps += 1
    wall = time.perf_counter() - t0
    commits = eng.stats.dllm_commits
    chunks = eng.stats.dllm_chunks
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "steps": steps,
            "commits_per_window": sum(k * n for k, n in commits.items()) / max(1, sum(commits.values())),
            "mean_chunk": sum(k * n for k, n in chunks.items()) / max(1, sum(chunks.values()))}


def accuracy(n_per_task: int) -> dict:
    """Held-out exact match of each system's decoding (the engine's windows, run through the loop), and every
    window's (masked positions offered, tokens committed) for the commit model."""
    from tokenizers import Tokenizer

    from tandem.engine.diffusion.evaluate import evaluate
    from tandem.engine.diffusion.generate import generate_cached
    from tandem.engine.diffusion.tasks import eval_set
    from tandem.engine.diffusion.unmasking import DllmConfig
    from tandem.engine.loader import load_model
    model, _ = load_model(ASSET, dtype="float32")
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    ex = eval_set(n_per_task)
    out: dict = {}
    windows: dict[str, list] = {}

    def recording(name: str, chunk: int | None):
        def run(model, prompts, params, cfg):
            outs = generate_cached(model, prompts, params, cfg, chunk=chunk)
            windows[name] += [(m, k) for o in outs for m, k in zip(o.masked_per_step, o.commits_per_step)]
            return outs
        return run
    runs = [(n, DllmConfig(dllm_confidence_threshold=0.9), c) for n, c in
            (("bd32", None), ("c32", 32), ("c16", 16), ("c8", 8), ("c4", 4), ("c2", 2))]
    runs.append(("ar", DllmConfig(32, "sequential", 32, 0.9), 1))
    for name, cfg, chunk in runs:
        windows[name] = []
        rep = evaluate(model, tok, ex, cfg, decode=recording(name, chunk))
        out[name] = {"accuracy": rep.predictable.accuracy, "committed_per_step": rep.overall.committed_per_step,
                     "by_task": {t: s.accuracy for t, s in rep.tasks.items()}}
    return {"accuracy": out, "commit_model": commit_model(windows)}


def commit_model(windows: dict[str, list]) -> dict:
    """The stretch-model check: the simulator's stretch model (tandem.perf.dllm.StretchModel) fitted to the tiny
    model's BD32 commits per step (mean, std), against the commits it measured per window of m masked positions in
    the streaming runs (dynamic strategy)."""
    from tandem.perf.dllm import StretchModel
    bd = [k for m, k in windows["bd32"] if m > 0]
    mean = statistics.fmean(bd)
    std = statistics.pstdev(bd)
    fit = StretchModel.fit(mean, std)
    pairs = [p for name in ("c32", "c16", "c8", "c4", "c2") for p in windows[name] if p[0] > 0]
    rows = {}
    for m in (1, 2, 4, 8, 16, 32):
        ks = [k for mm, k in pairs if mm == m]
        rows[str(m)] = {"measured": statistics.fmean(ks) if ks else None, "windows": len(ks),
                        "stretch_model": fit.mean(m)}
    return {"bd32_mean": mean, "bd32_std": std, "pi": fit.pi, "p": fit.p, "by_window": rows}


def _plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for system in SYSTEMS:
        xs = [b for b in res["batches"] if str(b) in res["throughput"][system]]
        ax.plot(xs, [res["throughput"][system][str(b)]["median"] for b in xs], marker="o", label=system,
                lw=2.2 if system == "elastic" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title("tiny SDAR on this CPU: decoding modes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(res: dict) -> str:
    rows = ["| batch | " + " | ".join(SYSTEMS) + " | best fixed | elastic / best fixed |",
            "|---" * (len(SYSTEMS) + 3) + "|"]
    for b in res["batches"]:
        t = {s: res["throughput"][s][str(b)]["median"] for s in SYSTEMS}
        best = max(FIXED, key=lambda s: t[s])
        rows.append(f"| {b} | " + " | ".join(f"{t[s]:.0f}" for s in SYSTEMS)
                    + f" | {best} | {t['elastic'] / t[best]:.3f} |")
    g = res["geomean"]
    rows.append("| geomean | " + " | ".join(f"{g[s]:.0f}" for s in SYSTEMS) + " | | |")
    return "\n".join(rows)


def _measure(batches: list[int], reps: int, min_seconds: float, warmup: bool, per_slot: int) -> dict:
    """Each system's runs at each batch size: `reps` repetitions, then more while any system's runs at that b total
    under `min_seconds` of measured time (at most MAX_REPS): a run at one sequence lasts 50 ms, and the median of
    five such runs moved by 5-10% between benchmark runs. The systems alternate within every repetition."""
    from rich.progress import Progress
    runs: dict[str, dict[str, list[dict]]] = {s: {str(b): [] for b in batches} for s in SYSTEMS}
    with Progress() as bar:
        task = bar.add_task("engine runs", total=reps * len(batches) * len(SYSTEMS))
        for b in batches:
            done = 0
            while done < reps or (done < MAX_REPS and min(sum(r["wall_s"] for r in runs[s][str(b)])
                                                           for s in SYSTEMS) < min_seconds):
                if done >= reps:
                    bar.update(task, total=bar.tasks[0].total + len(SYSTEMS))
                for system in SYSTEMS:                 # alternating: every system once per (repetition, batch)
                    runs[system][str(b)].append(throughput(system, b, warmup, per_slot))
                    bar.advance(task)
                done += 1
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/optimus_engine")
    ap.add_argument("--batches", type=csv_list(positive_int), default=list(BATCHES))
    ap.add_argument("--reps", type=positive_int, default=3, help="repetitions at each batch size, at least")
    ap.add_argument("--min-seconds", type=nonneg_float, default=MIN_SECONDS,
                    help=f"more repetitions (up to {MAX_REPS}) until each system's runs at a batch size total this "
                         f"much measured time (default: {MIN_SECONDS:g}; 0: --reps only)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    ap.add_argument("--eval-per-task", type=int, default=100, help="held-out examples per task (0: skip)")
    ap.add_argument("--quick", action="store_true", help="batches 1, 8, 32; one run; 30 examples per task")
    ap.add_argument("--warmup", action="store_true",
                    help="each engine first serves an untimed batch of b other held-out prompts (a server already "
                         "running: elastic's N_commit has seen windows before the timed batch)")
    ap.add_argument("--requests-per-slot", type=positive_int, default=1, metavar="K",
                    help="closed loop: each of the b slots sends K requests back to back, the next when its last ends "
                         "(default 1: b requests submitted together)")
    ap.add_argument("--accuracy-only", action="store_true",
                    help="keep --out's throughput results, measure accuracy and the commit model again")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.reps, a.eval_per_task, a.min_seconds = [1, 8, 32], 1, 30, 0.0
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if a.accuracy_only:
        res = json.loads((out / "results.json").read_text())
        res.update(accuracy(a.eval_per_task))
        res["meta_accuracy"] = report_meta("benchmarks/optimus_engine.py", argv, time.perf_counter() - t_start)
        return _write(res, out)
    runs = _measure(a.batches, a.reps, a.min_seconds, a.warmup, a.requests_per_slot)
    res: dict = {"batches": a.batches, "output_tokens": OUTPUT_TOKENS, "threads": a.threads, "warmup": a.warmup,
                 "requests_per_slot": a.requests_per_slot, "min_seconds": a.min_seconds, "throughput": {}}
    for system in SYSTEMS:
        res["throughput"][system] = {}
        for b in a.batches:
            xs = runs[system][str(b)]
            tps = [r["tokens_per_s"] for r in xs]
            res["throughput"][system][str(b)] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps),
                                                 "reps": len(tps), "steps": xs[0]["steps"],
                                                 "commits_per_window": xs[0]["commits_per_window"],
                                                 "mean_chunk": xs[0]["mean_chunk"]}
    res["geomean"] = {s: math.exp(statistics.fmean(math.log(res["throughput"][s][str(b)]["median"])
                                                    for b in a.batches)) for s in SYSTEMS}
    best_single = max(FIXED, key=lambda s: res["geomean"][s])
    res["elastic_vs_best_fixed_each"] = {str(b): res["throughput"]["elastic"][str(b)]["median"]
                                         / max(res["throughput"][s][str(b)]["median"] for s in FIXED)
                                         for b in a.batches}
    res["elastic_vs_best_single_fixed_geomean"] = res["geomean"]["elastic"] / res["geomean"][best_single]
    res["best_single_fixed"] = best_single
    if a.eval_per_task:
        res.update(accuracy(a.eval_per_task))
    res["meta"] = report_meta("benchmarks/optimus_engine.py", argv, time.perf_counter() - t_start)
    return _write(res, out)


def _write(res: dict, out: Path) -> int:
    """results.json, table.md and throughput.png; the table printed."""
    (out / "results.json").write_text(json.dumps(res, indent=1))
    table = _table(res)
    if "accuracy" in res:
        table += "\n\n| decoding | held-out exact match | tokens committed / step |\n|---|---|---|\n"
        table += "\n".join(f"| {k} | {v['accuracy']:.3f} | {v['committed_per_step']:.2f} |"
                           for k, v in res["accuracy"].items())
        cm = res["commit_model"]
        table += (f"\n\nCommits per window of m masked positions (streaming runs) against the stretch model fitted to "
                  f"BD32's {cm['bd32_mean']:.2f} +- {cm['bd32_std']:.2f} (pi {cm['pi']:.3f}, p {cm['p']:.3f}):\n\n"
                  "| m | measured | windows | stretch model |\n|---|---|---|---|\n")
        table += "\n".join(f"| {m} | {r['measured']:.2f} | {r['windows']} | {r['stretch_model']:.2f} |"
                            if r["measured"] is not None else f"| {m} | - | 0 | {r['stretch_model']:.2f} |"
                            for m, r in cm["by_window"].items())
    (out / "table.md").write_text(table + "\n")
    _plot(res, out / "throughput.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
