"""What reproducible greedy decoding costs: the engine's throughput on a mixed load of greedy and sampled requests
under the old default (`dllm_chunk=elastic`: Optimus's windows for every request) and the new one (`auto`: greedy
and seeded requests decode whole blocks, the others elastic windows), with plain block diffusion for all beside them.

    python benchmarks/dllm_determinism.py                 # batches 8 and 32, half greedy, 3 alternating runs (~10 min)
    python benchmarks/dllm_determinism.py --quick         # batch 16, one run

One LLMEngine per run (the committed tiny SDAR, float32, CPU, co-located, the core sizes every window): b slots each
send K requests back to back (a closed loop: the batch stays at b), held-out prompts of the six tasks round-robin,
every `--greedy-every`-th request greedy (temperature 0) and the others sampled (temperature 0.8, no seed), 64 output
tokens each (ignore_eos: every system makes the same tokens' worth of work). Before the timed loop each engine
serves an untimed batch of b requests of the same mix, as a server already running (elastic's commit estimate is past
its warm-up). The systems alternate within each repetition; the median of the repetitions is reported, and the ratio
auto / elastic is of medians measured in this same run. Throughput is output tokens per second of the process's CPU
time (one torch thread; the engine loop is the only work of the process), which a busy shared machine disturbs far
less than wall time; tokens per wall second are reported beside it. Also checked: the greedy requests' outputs under
`auto` are the same in every run and batch (their tokens do not depend on the load).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.bench.host import cpu_model
from tandem.bench.provenance import report_meta
from tandem.cli.common import csv_list, positive_int

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
SYSTEMS = {"elastic": "elastic", "auto": "auto", "block": "block"}   # name -> dllm_chunk
OLD, NEW = "elastic", "auto"
BATCHES = (8, 32)
OUTPUT_TOKENS = 64
SAMPLED_TEMPERATURE = 0.8


def _prompts(n: int, seed: int) -> list[list[int]]:
    """n held-out prompts, the six tasks taken round-robin."""
    from tokenizers import Tokenizer

    from tandem.engine.diffusion.tasks import eval_set
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    by_task: dict[str, list] = {}
    for e in eval_set(max(1, -(-n // 6)), seed=seed):
        by_task.setdefault(e.task, []).append(e)
    pool = [tok.encode(e.prompt).ids for group in zip(*by_task.values()) for e in group]
    return [pool[i % len(pool)] for i in range(n)]


def _params(i: int, greedy_every: int):
    """Request i's sampling: greedy every `greedy_every`-th, else sampled without a seed."""
    from tandem.engine.sampling_params import SamplingParams
    greedy = i % greedy_every == 0
    return SamplingParams(temperature=0.0 if greedy else SAMPLED_TEMPERATURE, max_tokens=OUTPUT_TOKENS,
                          ignore_eos=True), greedy


def run(system: str, b: int, per_slot: int, greedy_every: int) -> dict:
    """One closed-loop run of b slots x per_slot requests on a fresh engine after an untimed batch of b; tokens/s,
    the decoding modes the requests reported, and the greedy requests' outputs by prompt index."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig(model=str(ASSET), dtype="float32", device="cpu", dllm_chunk=SYSTEMS[system],
                                 max_num_seqs=b, max_num_batched_tokens=4096, max_model_len=512,
                                 num_kv_blocks=max(64, b * 8)))
    for i, p in enumerate(_prompts(b, seed=98)):
        eng.add_request(f"warm{i}", p, _params(i, greedy_every)[0])
    while eng.has_unfinished_requests():
        eng.step()
    queue = _prompts(b * per_slot, seed=99)
    kinds: dict[str, bool] = {}

    def send(i: int) -> None:
        params, greedy = _params(i, greedy_every)
        kinds[str(i)] = greedy
        eng.add_request(str(i), queue[i], params)
    for i in range(b):
        send(i)
    sent, tokens, modes = b, 0, {}
    greedy_out: dict[str, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
                key = ("greedy" if kinds[o.request_id] else "sampled", o.dllm_chunk)
                modes[key] = modes.get(key, 0) + 1
                if kinds[o.request_id]:
                    greedy_out[o.request_id] = list(o.outputs[0].token_ids)
                if sent < len(queue):
                    send(sent)
                    sent += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens_per_cpu_s": tokens / cpu, "tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "cpu_s": cpu,
            "modes": {f"{k[0]}:{k[1]}": n for k, n in sorted(modes.items(), key=str)}, "greedy": greedy_out}


def _table(res: dict) -> str:
    rows = [f"CPU: {res['cpu']}; torch threads {res['threads']}; {res['requests_per_slot']} requests a slot, "
            f"1 in {res['greedy_every']} greedy, {OUTPUT_TOKENS} tokens each; median of {res['reps']} runs: output "
            f"tokens per CPU second (per wall second)", "",
            "| batch | " + " | ".join(SYSTEMS) + f" | {NEW} / {OLD} (CPU) | {NEW} / {OLD} (wall) |",
            "|---" * (len(SYSTEMS) + 3) + "|"]
    for b in res["batches"]:
        t = {s: res["throughput"][s][str(b)] for s in SYSTEMS}
        rows.append(f"| {b} | " + " | ".join(f"{t[s]['median']:.0f} ({t[s]['wall_median']:.0f})" for s in SYSTEMS)
                    + f" | {t[NEW]['median'] / t[OLD]['median']:.3f} | "
                      f"{t[NEW]['wall_median'] / t[OLD]['wall_median']:.3f} |")
    rows.append("")
    rows.append(f"greedy outputs under {NEW}: {res['greedy_reproducible']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/dllm_determinism")
    ap.add_argument("--batches", type=csv_list(positive_int), default=list(BATCHES))
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--requests-per-slot", type=positive_int, default=2, metavar="K")
    ap.add_argument("--greedy-every", type=positive_int, default=2, metavar="G",
                    help="every G-th request is greedy, the others sampled (default 2: half)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1)")
    ap.add_argument("--quick", action="store_true", help="batch 16, one run")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.reps = [16], 1
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    runs: dict[str, dict[str, list[dict]]] = {s: {str(b): [] for b in a.batches} for s in SYSTEMS}
    for b in a.batches:
        for _ in range(a.reps):
            for system in SYSTEMS:                  # alternating: every system once per (repetition, batch)
                runs[system][str(b)].append(run(system, b, a.requests_per_slot, a.greedy_every))
                r = runs[system][str(b)][-1]
                print(f"batch {b} {system}: {r['tokens_per_cpu_s']:.0f} tokens/CPU s, {r['tokens_per_s']:.0f} "
                      f"tokens/s {r['modes']}", flush=True)
    res: dict = {"cpu": cpu_model(), "threads": a.threads, "batches": a.batches, "reps": a.reps,
                 "requests_per_slot": a.requests_per_slot, "greedy_every": a.greedy_every, "throughput": {}}
    for system in SYSTEMS:
        res["throughput"][system] = {}
        for b in a.batches:
            tps = [r["tokens_per_cpu_s"] for r in runs[system][str(b)]]
            wall = [r["tokens_per_s"] for r in runs[system][str(b)]]
            res["throughput"][system][str(b)] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps),
                                                 "runs": tps, "wall_median": statistics.median(wall),
                                                 "wall_runs": wall, "modes": runs[system][str(b)][0]["modes"]}
    same = {}                                        # prompt index -> the greedy outputs of every auto run
    for b in a.batches:
        for r in runs[NEW][str(b)]:
            for rid, ids in r["greedy"].items():
                same.setdefault((b, rid), set()).add(tuple(ids))
    varied = sum(len(v) > 1 for v in same.values())
    res["greedy_reproducible"] = (f"{len(same) - varied} of {len(same)} greedy requests identical in every run"
                                  if a.reps > 1 else "one run: not compared")
    res["meta"] = report_meta("benchmarks/dllm_determinism.py", argv, time.perf_counter() - t_start)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    table = _table(res)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
