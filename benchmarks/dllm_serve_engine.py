"""On the CPU engine: dLLM-Serve (logit decomposition + phase-multiplexed admission over
head-centric sparse KV) against the monolithic static baseline, at an equal CPU memory budget.

    python benchmarks/dllm_serve_engine.py                     # about 5 min on the 2-core development machine
    python benchmarks/dllm_serve_engine.py --budget-mib auto   # the budget sweep below, about 4x as long

Everything runs in this process on the real engine (LLMEngine, the trained tiny SDAR model of
tandem/engine/diffusion/assets/tiny-sdar, float32, CPU, one torch thread as `tandem serve` runs a worker), offline with arrival times: requests are added when the
wall clock passes their Poisson arrival time, and the engine steps meanwhile (no HTTP). The rules, fixed before
measuring:

- **Memory budget**: `cpu_memory_budget_bytes` = the budget (default 1 GiB, `--budget-mib`) for weights,
  activations and KV in every system; the KV pool is what the engine's logit-aware memory profile leaves (budget -
  weights - persistent buffers - (the worst-case step's activation peak + guard)). The profile samples every row of a `max_num_batched_tokens` step
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
- **Budget sweep** (`--budget-mib auto`: how the ratios depend on whether memory or compute binds), the rule fixed
  before measuring: B_min = the smallest multiple of 64 MiB at which the baseline can serve the workload at all,
  found by baseline_budget's probing at 64, 128, 192, ... MiB. "Serve at all" is stricter than "the engine starts":
  its token budget (on the probing's 64-token grid) must hold every request's Refresh peak (P + G in blocks, up to
  288 tokens here; the engine aborts a request whose peak exceeds it) and its KV pool the largest request's dense
  buffer. Then four budgets spaced geometrically from B_min to 1024 MiB, B_min * (1024 / B_min) ** (i / 3) for
  i = 0..3, each rounded up to a multiple of 64 MiB, duplicates dropped (about doubling from one to the next when
  B_min is near 128 MiB). Every budget runs the same three systems, rates and requests; dLLM-Serve's settings stay
  as above (a system whose engine does not start within a budget is reported as such, not tuned).

Writes docs/results/dllm_serve_engine/{results.json, table.md, plot.png} for the default budget alone, and
docs/results/dllm_serve_engine/budget_sweep/{results.json, table.md, plot.png} for any other budgets (`--out`).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

from tandem.bench.provenance import report_meta
from tandem.cli.common import csv_list, positive_float, positive_int

ASSET = Path(__file__).resolve().parents[1] / "tandem" / "engine" / "diffusion" / "assets" / "tiny-sdar"
OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "dllm_serve_engine"
BUDGET = 1 << 30                # the default budget, bytes
BUDGET_STEP = 64 << 20          # budgets are multiples of 64 MiB
SWEEP_POINTS = 4                # budgets of the `auto` sweep, B_min to BUDGET
PROBE_TOKENS = 256              # the token budget of the activation-peak probe (profiled at BUDGET)
MAX_MODEL_LEN = 320
OUTPUT_TOKENS = 64
PROMPT_RANGE = (32, 224)
COMMON = dict(model=str(ASSET), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
              dllm_unmasking_strategy="low_confidence_static", dllm_denoising_steps=32)
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


class BudgetError(Exception):
    """A memory budget the benchmark cannot run at (the baseline cannot serve the workload within it)."""


def _engine(budget: int, **kw):
    """The engine of COMMON plus `kw` within a CPU memory budget of `budget` bytes."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(**COMMON, cpu_memory_budget_bytes=budget, **kw))


@functools.cache
def _row_profile() -> dict:
    """The baseline's monolithic activation peak per query row and its fixed bytes, profiled once at PROBE_TOKENS
    within BUDGET (the peak does not depend on the budget), and the engine's phase schedule (for the workload's
    needs)."""
    from tandem.engine.memory_profile import guard_bytes
    eng = _engine(BUDGET, **SYSTEMS["baseline"], max_num_batched_tokens=PROBE_TOKENS)
    probe = eng.runner.memory
    return {"per_row_bytes": probe.monolithic_peak_bytes / PROBE_TOKENS,
            "fixed_bytes": probe.weight_bytes + probe.persistent_bytes,
            "guard_at_probe": guard_bytes(probe.peak_bytes), "phases": eng.core.dllm.phases,
            "block_size": eng.config.block_size}


def workload_needs(prompts: list[list[int]]) -> tuple[int, int]:
    """What the baseline needs to serve every request: the largest Refresh peak (query tokens, P + G in blocks) and
    the largest dense KV buffer (positions, in whole KV blocks)."""
    prof = _row_profile()
    ph, bs = prof["phases"], prof["block_size"]
    peak = max(ph.peak_tokens(len(p), OUTPUT_TOKENS) for p in prompts)
    kv = max(-(-ph.kv_tokens(len(p), OUTPUT_TOKENS) // bs) * bs for p in prompts)
    return peak, kv


def baseline_budget(budget: int, prompts: list[list[int]], step: int = 64) -> tuple[int, dict]:
    """The largest max_num_batched_tokens (a multiple of `step`) whose monolithic engine starts within `budget`
    bytes with a KV pool that holds the workload's largest buffer: extrapolated from the activation peak profiled at
    PROBE_TOKENS (linear in the rows), then stepped down until it does, but not below the workload's largest Refresh
    peak (a smaller token budget aborts requests); returns it and the probes. BudgetError if none does."""
    from tandem.engine.config import EngineError
    prof = _row_profile()
    per_row = prof["per_row_bytes"]
    need_tokens, need_kv = workload_needs(prompts)
    floor = -(-need_tokens // step) * step
    room = budget - prof["fixed_bytes"] - MAX_MODEL_LEN * 4 * 1024
    t = max(int(room / (per_row * 1.1)) // step * step, floor)
    tried, why = {}, "none"
    while t >= floor:
        try:
            eng = _engine(budget, **SYSTEMS["baseline"], max_num_batched_tokens=t)
        except EngineError as e:
            tried[t] = str(e)[:120]
            why = str(e).split(":")[0]
        else:
            pool = eng.runner.num_blocks * eng.config.block_size
            if pool >= need_kv:
                tried[t] = "starts"
                return t, {"per_row_bytes": per_row, "probes": tried, "guard_at_probe": prof["guard_at_probe"],
                           "min_tokens": floor, "max_kv_positions": need_kv}
            tried[t] = why = f"starts, but its KV pool of {pool} positions is below the largest buffer, {need_kv}"
        t -= step
    raise BudgetError(f"{budget / 2**20:g} MiB is too small for the baseline to serve the workload (a token budget "
                      f">= {floor} and a KV pool of >= {need_kv} positions): {why}")


def min_budget(prompts: list[list[int]]) -> tuple[int, dict]:
    """B_min: the smallest multiple of BUDGET_STEP within which baseline_budget finds a token budget (searched
    upwards from BUDGET_STEP); returns it and each budget's outcome."""
    tried = {}
    b = BUDGET_STEP
    while b <= BUDGET:
        try:
            t, _ = baseline_budget(b, prompts)
        except BudgetError as e:
            tried[b >> 20] = str(e)
            b += BUDGET_STEP
            continue
        tried[b >> 20] = f"baseline token budget {t}"
        return b, tried
    raise BudgetError(f"the baseline cannot serve the workload within {BUDGET >> 20} MiB")


def sweep_budgets(b_min: int, top: int = BUDGET, points: int = SWEEP_POINTS) -> list[int]:
    """The rule of the docstring: `points` budgets spaced geometrically from b_min to top, each rounded up to a
    multiple of BUDGET_STEP, duplicates dropped (bytes, ascending)."""
    out = []
    for i in range(points):
        b = b_min * (top / b_min) ** (i / (points - 1)) if points > 1 else top
        b = min(top, math.ceil(round(b) / BUDGET_STEP) * BUDGET_STEP)
        if b not in out:
            out.append(b)
    return out


def budget_arg(text: str) -> list[int] | str:
    """`--budget-mib`: `auto` (the sweep's rule) or a comma-separated list of positive budgets in MiB; bytes."""
    if text.strip().lower() == "auto":
        return "auto"
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise argparse.ArgumentTypeError(f"expected 'auto' or a comma-separated list of MiB, got {text!r}")
    out = []
    for t in items:
        try:
            v = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of MiB: {t!r}") from None
        if not math.isfinite(v) or v <= 0 or v != int(v):
            raise argparse.ArgumentTypeError(f"a budget is a positive whole number of MiB, got {t!r}")
        out.append(int(v) << 20)
    return out


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


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
                if o.outputs[0].finish_reason == "abort":
                    raise BudgetError(f"request {o.request_id} aborted: {o.error}")
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
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=96)
    ap.add_argument("--rates", type=csv_list(positive_float), default=[8.0, 16.0, 32.0], metavar="R1,R2",
                    help="Poisson arrival rates, requests/s (default: 8,16,32: from about the baseline's capacity "
                         "to four times it)")
    ap.add_argument("--systems", type=csv_list(str), default=list(SYSTEMS))
    ap.add_argument("--budget-mib", type=budget_arg, default=[BUDGET], metavar="M1,M2|auto",
                    help=f"CPU memory budgets per engine, MiB (default: {BUDGET >> 20}); 'auto': the sweep's rule "
                         f"(the module doc); several budgets write the sweep's layout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: 1, tandem serve's)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: docs/results/dllm_serve_engine for the default budget, its "
                         "budget_sweep/ otherwise)")
    args = ap.parse_args(argv)
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"argument --systems: unknown {', '.join(unknown)} (one of {', '.join(SYSTEMS)})")
    try:
        return _main(args, argv)
    except BudgetError as e:
        ap.exit(1, f"{ap.prog}: error: --budget-mib: {e}\n")


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Fix the budgets (each checked against the baseline before anything is measured), measure each, write."""
    import torch
    from tqdm import tqdm
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    prompts = _prompts(args.requests, args.seed)
    rule = None
    budgets = args.budget_mib
    if budgets == "auto":
        b_min, tried = min_budget(prompts)
        budgets = sweep_budgets(b_min)
        rule = {"b_min_mib": b_min >> 20, "b_min_search": tried, "budgets_mib": [b >> 20 for b in budgets]}
    sweep = budgets != [BUDGET]
    token_budgets = {b: baseline_budget(b, prompts) for b in budgets}       # BudgetError before any measuring
    bar = tqdm(total=len(budgets) * len(args.rates) * len(args.systems) * args.requests, desc="requests",
               file=sys.stderr)
    reports = {}
    for b in budgets:
        reports[b] = measure_budget(b, token_budgets[b], prompts, args, bar)
    bar.close()
    out = args.out or (OUT / "budget_sweep" if sweep else OUT)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(requests=args.requests, output_tokens=OUTPUT_TOKENS, prompt_range=PROMPT_RANGE, seed=args.seed)
    if not sweep:
        (t_b, probe), = token_budgets.values()
        report = dict(reports[BUDGET], meta=report_meta("benchmarks/dllm_serve_engine.py", argv,
                                                         time.perf_counter() - t_start, budget_bytes=BUDGET,
                                                         **meta, baseline_probe=probe))
        report = {k: report[k] for k in ("meta", "memory", "results", "ratios")}
        write(out, report, table(report), plot)
        return 0
    report = {"meta": report_meta("benchmarks/dllm_serve_engine.py", argv, time.perf_counter() - t_start,
                                  budgets_mib=[b >> 20 for b in budgets], rule=rule, **meta),
              "budgets": {str(b >> 20): dict(reports[b], baseline_probe=token_budgets[b][1]) for b in budgets}}
    write(out, report, sweep_table(report), sweep_plot)
    return 0


def measure_budget(budget: int, baseline_tokens: tuple[int, dict], prompts: list[list[int]],
                   args: argparse.Namespace, bar) -> dict:
    """Every system at every rate within one memory budget: {memory, results, ratios}. A system whose engine does
    not start within the budget is recorded in memory as {"error": why} and not run."""
    from tandem.engine.config import EngineError
    engines = {"baseline": dict(max_num_batched_tokens=baseline_tokens[0])}
    memory, results = {}, {}
    for rate in args.rates:
        arrivals = _arrivals(len(prompts), rate, args.seed)
        for name in args.systems:
            try:
                eng = _engine(budget, **SYSTEMS[name], **engines.get(name, {}))
            except EngineError as e:
                memory[name] = {"error": str(e)}
                bar.update(len(prompts))
                continue
            memory[name] = _memory(eng, name, prompts)
            bar.set_postfix_str(f"{budget >> 20} MiB: {name} @ {rate}/s")
            results[f"{name}@{rate}"] = dict(run(eng, prompts, arrivals, bar), system=name, rate=rate)
            del eng
    return {"memory": memory, "results": results, "ratios": _ratios(results, args.rates)}


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n Poisson arrival times (seconds from the first, which is 0) at `rate` requests/s."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


def _memory(eng, name: str, prompts: list[list[int]]) -> dict:
    """One engine's memory figures: its token budget, logit cap, ρ, activation peak and reserve, KV pool."""
    mem = eng.runner.memory
    return {"max_num_batched_tokens": eng.config.max_num_batched_tokens, "max_num_logits": eng.config.max_num_logits,
            "kv_retention_ratio": SYSTEMS[name]["kv_retention_ratio"], "activation_peak_bytes": mem.peak_bytes,
            "activation_reserved_bytes": mem.reserved_bytes, "kv_pool_bytes": mem.kv_pool_bytes,
            "weights_bytes": mem.weight_bytes, "persistent_bytes": mem.persistent_bytes,
            "kv_pool_tokens": eng.runner.num_blocks * eng.config.block_size,
            "static_batch_bound": _static_bound(eng, prompts)}


def write(out: Path, report: dict, text: str, plotter) -> None:
    """results.json, table.md and plot.png under `out`; prints the table."""
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "table.md").write_text(text)
    plotter(report, out / "plot.png")
    print(text)


def _static_bound(eng, prompts: list[list[int]]) -> float:
    """Requests of the mean prompt that fit at once by the token budget alone (each reserving its Refresh peak)."""
    ph = eng.core.dllm.phases
    peak = statistics.mean(ph.peak_tokens(len(p), OUTPUT_TOKENS) for p in prompts)
    return eng.config.max_num_batched_tokens / peak


def _ratios(results: dict, rates: list[float]) -> dict:
    """Each dLLM-Serve variant's figures over the baseline's at the same rate (where both ran)."""
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


def _memory_row(labels: list[str], x: dict, caps: bool) -> str:
    """One engine's memory figures as a table row after its labels; `caps` adds its logit cap and retention ratio."""
    if "error" in x:
        return "| " + " | ".join([*labels, f"does not start: {x['error'][:80]}"]) + " |" + " |" * (5 if caps else 3)
    cells = [str(x["max_num_batched_tokens"])]
    if caps:
        cells += [str(x["max_num_logits"] or "-"), str(x["kv_retention_ratio"])]
    cells += [f"{x['activation_reserved_bytes'] / 2**20:.1f}", f"{x['kv_pool_bytes'] / 2**20:.1f}",
              f"{x['static_batch_bound']:.1f}"]
    return "| " + " | ".join([*labels, *cells]) + " |"


def table(report: dict) -> str:
    m = report["meta"]
    lines = [f"`{m['command']}` on {m['machine']}, {m['date']}, commit {m['commit']}, {m['wall_s']:.0f} s; "
             f"CPU memory budget {m['budget_bytes'] >> 20} MiB per engine, {m['requests']} requests "
             f"of {m['output_tokens']} tokens, prompts {m['prompt_range'][0]}-{m['prompt_range'][1]}", "",
             "| system | token budget | logit cap | ρ | activation reserve (MiB) | KV pool (MiB) | requests of "
             "the mean peak the token budget holds |", "|---|---|---|---|---|---|---|"]
    for name, x in report["memory"].items():
        lines.append(_memory_row([name], x, caps=True))
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


def sweep_table(report: dict) -> str:
    """The sweep's tables: each budget's memory split, every budget x rate x system's figures, and the ratios."""
    m = report["meta"]
    rule = m.get("rule")
    lines = [f"`{m['command']}` on {m['machine']}, {m['date']}, commit {m['commit']}, {m['wall_s']:.0f} s; "
             f"CPU memory budgets {', '.join(str(b) for b in m['budgets_mib'])} MiB per engine, {m['requests']} "
             f"requests of {m['output_tokens']} tokens, prompts {m['prompt_range'][0]}-{m['prompt_range'][1]}"]
    if rule:
        lines += ["", f"Budgets by the rule (module doc): B_min = {rule['b_min_mib']} MiB, the smallest multiple of 64 "
                      f"MiB within which the baseline serves every request; {SWEEP_POINTS} points geometric from "
                      f"B_min to {BUDGET >> 20} MiB, rounded up to 64 MiB: {rule['budgets_mib']}."]
    lines += ["", "| budget (MiB) | system | token budget | activation reserve (MiB) | KV pool (MiB) | requests of "
              "the mean peak the token budget holds |", "|---|---|---|---|---|---|"]
    for b, rep in report["budgets"].items():
        for name, x in rep["memory"].items():
            lines.append(_memory_row([str(b), name], x, caps=False))
    lines += ["", "| budget (MiB) | system @ rate (req/s) | max running | mean running | throughput (tok/s) | "
              "P50 latency (s) | P99 latency (s) |", "|---|---|---|---|---|---|---|"]
    for b, rep in report["budgets"].items():
        for key, r in rep["results"].items():
            lines.append(f"| {b} | {key} | {r['max_running']} | {r['mean_running']:.1f} | "
                         f"{r['throughput_tok_s']:.0f} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} |")
    lines += ["", "| budget (MiB) | ratio vs baseline | max running | mean running | throughput | P99 latency |",
              "|---|---|---|---|---|---|"]
    for b, rep in report["budgets"].items():
        for key, r in rep["ratios"].items():
            lines.append(f"| {b} | {key} | {r['max_running']:.2f}x | {r['mean_running']:.2f}x | "
                         f"{r['throughput']:.2f}x | {r['p99_latency']:.2f}x |")
    return "\n".join(lines) + "\n"


def sweep_plot(report: dict, path: Path) -> None:
    """Per dLLM-Serve variant (rows): the throughput ratio vs budget with the issue's 1.6x, and the mean (solid) and
    max (dashed) running-requests ratios vs budget; one line per rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    budgets = report["budgets"]
    xs = [int(b) for b in budgets]
    variants = [v for v in ("dllm-serve", "dllm-serve-delay0")
                if any(k.startswith(v + "@") for rep in budgets.values() for k in rep["ratios"])]
    rates = sorted({r["rate"] for rep in budgets.values() for r in rep["results"].values()})
    fig, axes = plt.subplots(max(1, len(variants)), 2, figsize=(11, 3.6 * max(1, len(variants))), squeeze=False)
    for row, v in zip(axes, variants):
        for i, rate in enumerate(rates):
            c = f"C{i}"
            ratio = [budgets[b]["ratios"].get(f"{v}@{rate}") for b in budgets]
            pts = [(x, r) for x, r in zip(xs, ratio) if r is not None]
            row[0].plot([x for x, _ in pts], [r["throughput"] for _, r in pts], "o-", color=c, label=f"{rate:g}/s")
            row[1].plot([x for x, _ in pts], [r["mean_running"] for _, r in pts], "o-", color=c,
                        label=f"{rate:g}/s mean")
            row[1].plot([x for x, _ in pts], [r["max_running"] for _, r in pts], "s--", color=c,
                        label=f"{rate:g}/s max")
        row[0].axhline(1.6, color="k", ls=":", label="1.6x (the paper)")
        row[0].axhline(1.0, color="grey", lw=0.8)
        row[0].set_ylabel(f"{v} / baseline")
        row[0].set_title(f"{v}: throughput ratio")
        row[1].set_title(f"{v}: running-requests ratio (mean -, max --)")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
            ax.set_xlabel("CPU memory budget per engine (MiB)")
            ax.set_ylim(bottom=0)
        row[0].set_ylim(top=max(1.8, row[0].get_ylim()[1]))        # the 1.6x line always inside
        row[0].legend(fontsize=8)
        row[1].legend(fontsize=7, ncol=2)
    fig.suptitle("tiny SDAR on the CPU engine (2 cores, 1 torch thread): dLLM-Serve vs the static baseline by budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
