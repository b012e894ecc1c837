"""Issue 17, acceptance 2 on the CPU engine: dLLM-Serve (logit decomposition + phase-multiplexed admission over
head-centric sparse KV) against the monolithic static baseline, at an equal CPU memory budget.

    python benchmarks/dllm_serve_engine.py          # about 5 min on the 2-core development machine

Everything runs in this process on the real engine (LLMEngine, the trained tiny SDAR model of
tandem/engine/diffusion/assets/tiny-sdar, float32, CPU, one torch thread as `tandem serve` runs a worker), offline with arrival times: requests are added when the
wall clock passes their Poisson arrival time, and the engine steps meanwhile (no HTTP). The rules, fixed before
measuring:

- **Memory budget**: `cpu_memory_budget_bytes` = BUDGET (1 GiB) for weights, activations and KV in every system; the
  KV pool is what the engine's logit-aware memory profile leaves (budget - weights - persistent buffers - (the
  worst-case step's activation peak + guard)). The profile samples every row of a `max_num_batched_tokens` step
  with temperature, top-k and top-p (what any request may ask), monolithic or `max_num_logits` rows at a time.
- **Baseline** (Fast-dLLM-like, the issue's "monolithic static baseline"): `dllm_admission static` (a batch formed
  when nothing runs, each request reserving its Refresh peak P + G rounded to blocks for its whole life, run to
  completion), no logit cap, dense KV (ρ = 1), delay_step 0 (one full-length step a block, Fast-dLLM's dual
  cache), and the largest `max_num_batched_tokens` (a multiple of 64) whose engine starts within the budget: with
  monolithic logits the activation peak grows with the token budget, so this is the largest batch that fits.
- **dLLM-Serve**: `dllm_admission phase`, `max_num_logits` 32 (one block of rows), ρ = 0.5 head-centric, kernel 3,
  delay_step 1 (dLLM-Serve's defaults), `max_num_batched_tokens` 2048 (vLLM's default budget; it fits the budget
  with room to spare once the logits are capped). **dLLM-Serve delay 0** is the same with delay_step 0, i.e. the
  baseline's full-length work per block.
- **Workload**: N requests, Poisson arrivals at RATES (requests/s), prompts of held-out task text cut to lengths
  uniform in [32, 224] tokens, 64 output tokens each (ignore_eos; dLLM-Serve's fixed generation length), greedy,
  one token a step (low_confidence_static with 32 steps a block of 32: dLLM-Serve's evaluation setting), seed 0.
  The same requests and arrival times for every system. Rates 8, 16, 32 requests/s: from about the baseline's
  capacity (a trial run: one request alone takes 0.25 s, a batch of 4 about 0.5 s) to four times it.
- **Figures**: concurrency = the most requests running at once and the mean per step; throughput = output tokens /
  (last finish - first arrival); latency = finish - arrival per request, P50 and P99; ratios dLLM-Serve / baseline.

Writes docs/results/dllm_serve_engine/{results.json, table.md, plot.png}.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tandem.bench.provenance import report_meta
from tandem.cli.common import csv_list, positive_float, positive_int

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "dllm_serve_engine"
BUDGET = 1 << 30
MAX_MODEL_LEN = 320
OUTPUT_TOKENS = 64
PROMPT_RANGE = (32, 224)
COMMON = dict(model=str(ASSET), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
              cpu_memory_budget_bytes=BUDGET, dllm_unmasking_strategy="low_confidence_static", dllm_denoising_steps=32)
SYSTEMS = {
    "baseline": dict(dllm_admission="static", kv_retention_ratio=1.0, dllm_delay_step=0),
    "dllm-serve": dict(dllm_admission="phase", kv_retention_ratio=0.5, dllm_delay_step=1, max_num_logits=32,
                       max_num_batched_tokens=2048),
    "dllm-serve-delay0": dict(dllm_admission="phase", kv_retention_ratio=0.5, dllm_delay_step=0, max_num_logits=32,
                              max_num_batched_tokens=2048),
}


def _prompts(n: int, seed: int) -> list[list[int]]:
    """n prompts of held-out task text (concatenated, then cut) of lengths uniform in PROMPT_RANGE."""
    from tokenizers import Tokenizer

    from tandem.engine.diffusion.tasks import eval_set
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    text = [t for e in eval_set(20, seed=seed) for t in tok.encode(e.prompt + " ").ids]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_tok = rng.randint(*PROMPT_RANGE)
        a = rng.randrange(len(text) - n_tok)
        out.append(text[a:a + n_tok])
    return out


def _engine(**kw):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(**COMMON, **kw))


def baseline_budget(step: int = 64) -> tuple[int, dict]:
    """The largest max_num_batched_tokens (a multiple of `step`) whose monolithic engine starts within BUDGET:
    extrapolated from the activation peak profiled at 256 tokens (linear in the rows), then stepped down until the
    engine starts; returns it and the probes."""
    from tandem.engine.config import EngineError
    from tandem.engine.memory_profile import guard_bytes
    probe = _engine(**SYSTEMS["baseline"], max_num_batched_tokens=256).runner.memory
    per_row = probe.monolithic_peak_bytes / 256
    room = BUDGET - probe.weight_bytes - probe.persistent_bytes - MAX_MODEL_LEN * 4 * 1024
    t = int(room / (per_row * 1.1)) // step * step
    tried = {}
    while t >= step:
        try:
            _engine(**SYSTEMS["baseline"], max_num_batched_tokens=t)
            tried[t] = "starts"
            return t, {"per_row_bytes": per_row, "probes": tried, "guard_at_probe": guard_bytes(probe.peak_bytes)}
        except EngineError as e:
            tried[t] = str(e)[:120]
            t -= step
    raise SystemExit("no token budget of the baseline fits the memory budget")


def run(eng, prompts: list[list[int]], arrivals: list[float], bar) -> dict:
    """Replay the requests at their arrival times (seconds from now) on the engine; per-request latency, throughput,
    concurrency."""
    from tandem.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    nxt, lat, tokens, running = 0, {}, 0, []
    last = t0
    while nxt < len(prompts) or eng.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(prompts) and t0 + arrivals[nxt] <= now:
            eng.add_request(str(nxt), prompts[nxt], params, arrival_time=t0 + arrivals[nxt])
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, t0 + arrivals[nxt] - time.perf_counter()))
            continue
        outs = eng.step()
        running.append(len(eng.core.running))
        for o in outs:
            if o.finished:
                m = o.metrics
                lat[int(o.request_id)] = m.finished_time - m.arrival_time
                tokens += len(o.outputs[0].token_ids)
                last = m.finished_time
                bar.update(1)
    span = last - (t0 + arrivals[0])
    lats = sorted(lat.values())
    stats = eng.core.dllm_stats()
    return {"requests": len(lat), "output_tokens": tokens, "span_s": span, "throughput_tok_s": tokens / span,
            "latency_p50_s": _pct(lats, 50), "latency_p99_s": _pct(lats, 99), "latency_mean_s": statistics.mean(lats),
            "max_running": max(running), "mean_running": statistics.mean(running), "steps": len(running),
            "phase_seq_steps": stats["seq_steps"], "admitted_while_running": stats["admitted_while_running"],
            "deferrals": stats["deferrals"], "mean_step_tokens": stats["mean_tokens"]}


def _pct(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of sorted xs."""
    k = max(0, min(len(xs) - 1, -(-len(xs) * q // 100) - 1))
    return xs[int(k)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=96)
    ap.add_argument("--rates", type=csv_list(positive_float), default=[8.0, 16.0, 32.0], metavar="R1,R2",
                    help="Poisson arrival rates, requests/s (default: 8,16,32: from about the baseline's capacity "
                         "to four times it)")
    ap.add_argument("--systems", type=csv_list(str), default=list(SYSTEMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1, tandem serve's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    import torch
    from tqdm import tqdm
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    prompts = _prompts(args.requests, args.seed)
    t_b, probe = baseline_budget()
    engines = {"baseline": dict(max_num_batched_tokens=t_b)}
    memory, results = {}, {}
    bar = tqdm(total=len(args.rates) * len(args.systems) * args.requests, desc="requests", file=sys.stderr)
    for rate in args.rates:
        rng = random.Random(args.seed)
        arrivals, t = [], 0.0
        for _ in prompts:
            arrivals.append(t)
            t += rng.expovariate(rate)
        for name in args.systems:
            eng = _engine(**SYSTEMS[name], **engines.get(name, {}))
            mem = eng.runner.memory
            memory[name] = {"max_num_batched_tokens": eng.config.max_num_batched_tokens,
                            "max_num_logits": eng.config.max_num_logits, "kv_retention_ratio": SYSTEMS[name]
                            ["kv_retention_ratio"], "activation_peak_bytes": mem.peak_bytes,
                            "activation_reserved_bytes": mem.reserved_bytes, "kv_pool_bytes": mem.kv_pool_bytes,
                            "weights_bytes": mem.weight_bytes, "persistent_bytes": mem.persistent_bytes,
                            "kv_pool_tokens": eng.runner.num_blocks * eng.config.block_size,
                            "static_batch_bound": _static_bound(eng, prompts)}
            bar.set_postfix_str(f"{name} @ {rate}/s")
            results[f"{name}@{rate}"] = dict(run(eng, prompts, arrivals, bar), system=name, rate=rate)
            del eng
    bar.close()
    report = {"meta": report_meta("benchmarks/dllm_serve_engine.py", argv, time.perf_counter() - t_start,
                                  budget_bytes=BUDGET, requests=args.requests, output_tokens=OUTPUT_TOKENS,
                                  prompt_range=PROMPT_RANGE, seed=args.seed, baseline_probe=probe),
              "memory": memory, "results": results, "ratios": _ratios(results, args.rates)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "table.md").write_text(table(report))
    plot(report, args.out / "plot.png")
    print(table(report))
    return 0


def _static_bound(eng, prompts: list[list[int]]) -> float:
    """Requests of the mean prompt that fit at once by the token budget alone (each reserving its Refresh peak)."""
    ph = eng.core.dllm.phases
    peak = statistics.mean(ph.peak_tokens(len(p), OUTPUT_TOKENS) for p in prompts)
    return eng.config.max_num_batched_tokens / peak


def _ratios(results: dict, rates: list[float]) -> dict:
    out = {}
    for rate in rates:
        b = results.get(f"baseline@{rate}")
        for name in ("dllm-serve", "dllm-serve-delay0"):
            r = results.get(f"{name}@{rate}")
            if b is None or r is None:
                continue
            out[f"{name}@{rate}"] = {"max_running": r["max_running"] / b["max_running"],
                                     "mean_running": r["mean_running"] / b["mean_running"],
                                     "throughput": r["throughput_tok_s"] / b["throughput_tok_s"],
                                     "p99_latency": r["latency_p99_s"] / b["latency_p99_s"]}
    return out


def table(report: dict) -> str:
    m = report["meta"]
    lines = [f"`{m['command']}` on {m['machine']}, {m['date']}, commit {m['commit']}, {m['wall_s']:.0f} s; "
             f"CPU memory budget {m['budget_bytes'] >> 20} MiB per engine, {m['requests']} requests "
             f"of {m['output_tokens']} tokens, prompts {m['prompt_range'][0]}-{m['prompt_range'][1]}", "",
             "| system | token budget | logit cap | ρ | activation reserve (MiB) | KV pool (MiB) | requests of "
             "the mean peak the token budget holds |", "|---|---|---|---|---|---|---|"]
    for name, x in report["memory"].items():
        lines.append(f"| {name} | {x['max_num_batched_tokens']} | {x['max_num_logits'] or '-'} | "
                     f"{x['kv_retention_ratio']} | {x['activation_reserved_bytes'] / 2**20:.1f} | "
                     f"{x['kv_pool_bytes'] / 2**20:.1f} | {x['static_batch_bound']:.1f} |")
    lines += ["", "| system @ rate (req/s) | max running | mean running | throughput (tok/s) | P50 latency (s) | "
              "P99 latency (s) | steps | full / refresh / reuse seq-steps |", "|---|---|---|---|---|---|---|---|"]
    for key, r in report["results"].items():
        ph = r["phase_seq_steps"]
        lines.append(f"| {key} | {r['max_running']} | {r['mean_running']:.1f} | {r['throughput_tok_s']:.0f} | "
                     f"{r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | {r['steps']} | "
                     f"{ph['full']} / {ph['refresh']} / {ph['reuse']} |")
    lines += ["", "| ratio vs baseline | max running | mean running | throughput | P99 latency |",
              "|---|---|---|---|---|"]
    for key, r in report["ratios"].items():
        lines.append(f"| {key} | {r['max_running']:.2f}x | {r['mean_running']:.2f}x | {r['throughput']:.2f}x | "
                     f"{r['p99_latency']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = list(report["memory"])
    rates = sorted({r["rate"] for r in report["results"].values()})
    for ax, key, label in zip(axes, ("mean_running", "throughput_tok_s", "latency_p99_s"),
                              ("mean running requests", "throughput (output tok/s)", "P99 latency (s)")):
        w = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [report["results"].get(f"{name}@{r}", {}).get(key, 0) for r in rates]
            ax.bar([j + i * w for j in range(len(rates))], ys, w, label=name)
        ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(rates))], [f"{r}/s" for r in rates])
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tiny SDAR on the CPU engine, {report['meta']['budget_bytes'] >> 20} MiB per engine, "
                 f"Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
