"""Tensor parallelism on CPU: tp=1 against tp=2 of the same checkpoint, same run.

    python benchmarks/tp_cpu.py [--size 30m] [--requests 16] [--output-len 32] [--json out.json] [--plot out.png]

A tiny Qwen3 checkpoint (made here, offline; `--size 1m` or `30m`), `--requests` prompts of 64..256 tokens, greedy,
`--output-len` tokens each. For each TP degree: offline throughput (output tokens / s of `LLM.generate`), the mean
step time (the engine's execute time / steps) and, for tp=2, the driver's time inside all-reduces per step (waiting
for the other rank included) and its share of the step. Then the float-order tolerance: the max |logit| difference
between tp=1 and tp=2 over one 128-token prefill, and how many of 16 seeded samples (temperature 1.0) come out
different. Beside each degree's measured mean step: the prediction of the same recorded steps by the step timers
`tandem profile` gives the simulator (a quick tp1 profile at 1 thread, which prices a tp2 step as its sharded compute
divided by 2 plus the 2-rank gloo all-reduces it measured on this host, their count taken from the model; a quick
tp2 profile, its ranks as processes, as the engine runs them) and by the runtime's nominal CPU roofline at that
degree (tandem.runtime.costs; compute divided by tp, no all-reduce term), with the error in percent. Nothing is
tuned to the tp2 measurement. Prints the CPU model, its vector extensions (lscpu: avx2, avx512f), the cores and the
load average, so a reader can judge the figures: several processes share this machine's cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import torch

from tandem.engine.llm import LLM
from tandem.engine.model_input import ModelInput
from tandem.engine.parallel.group import usable_cpus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.profiling import ProfileOptions, profile
from tandem.engine.tiny_model import make_tiny_model
from tandem.runtime.costs import serving_cost_model
from tandem.bench.tp_predict import error_pct, mean_predicted_s, record_steps


def cpu_info() -> dict[str, object]:
    """CPU model and the vector extensions that matter to the GEMMs (lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {"model": fields.get("Model name", "?").strip(), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "cores": usable_cpus(), "load_avg": os.getloadavg()}


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(64, 257, (n,), generator=g).tolist()
    return [torch.randint(3, vocab - 8, (k,), generator=g).tolist() for k in lens]


@torch.inference_mode()
def prefill_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The logits of every position of one prefill of `tokens` on a fresh engine (KV in its first blocks)."""
    runner = llm.engine.runner
    batch = ModelInput()
    batch.add(tokens, 0, list(range(-(-len(tokens) // runner.block_size))))
    return runner.model.compute_logits(runner.forward(batch))


def kv_bytes_per_token(engine) -> int:
    """KV bytes one token takes over all ranks (what a worker reports to the runtime's cost model)."""
    mc = engine.model_config
    return int(engine.runner.kv_caches[0].element_size() * 2 * mc.num_hidden_layers * mc.num_key_value_heads
               * mc.head_dim)


def predictions(path: str, rows: list[dict[str, object]], profile_threads: int = 1) -> tuple[list[dict], dict]:
    """Beside each measured row: the mean predicted step of the same recorded steps by the `tandem profile` step
    timers the simulator would price that worker with (a quick tp1 profile at `profile_threads`, which at tp2 is
    the sharded compute plus its measured all-reduces; a quick tp2 profile, ranks as processes) and by the runtime's
    nominal CPU roofline at the row's tp (tandem.bench.tp_predict). Also what the profiles measured of the
    all-reduces."""
    t0 = time.perf_counter()
    prof1 = profile(path, ProfileOptions(quick=True, threads=profile_threads))
    t1 = time.perf_counter()
    prof2 = profile(path, ProfileOptions(quick=True, tensor_parallel_size=2))
    t2 = time.perf_counter()
    first = rows[0]
    nominal = serving_cost_model(path, int(first["kv_bytes_per_token"]), int(first["max_model_len"]),
                                 tps=sorted({int(r["tp"]) for r in rows}))
    out = []
    for r in rows:
        recs, tp = r["records"], int(r["tp"])
        measured = sum(x.seconds for x in recs) / len(recs)
        cells: dict[str, object] = {}
        for name, prof in (("tp1_profile", prof1), ("tp2_profile", prof2)):
            s = mean_predicted_s(recs, timer=prof.step_timer(tp)) if prof.refusal(tp) is None else None
            cells[f"{name}_ms"] = None if s is None else 1e3 * s
            cells[f"{name}_err_pct"] = None if s is None else error_pct(s, measured)
        nom_s = mean_predicted_s(recs, cost=nominal, tp=tp)
        coll = prof1.collective
        ar_s = (sum(coll.step_seconds(x.shape.prefill_tokens + x.shape.num_decode, tp) for x in recs) / len(recs)
                if coll is not None and (tp == 1 or tp in coll.fits) else None)
        out.append({"tp": tp, "threads": r["threads"], "steps": len(recs), "measured_ms": 1e3 * measured,
                    **cells, "nominal_ms": 1e3 * nom_s, "nominal_err_pct": error_pct(nom_s, measured),
                    "predicted_all_reduce_ms": None if ar_s is None else 1e3 * ar_s,
                    "prefill_steps": sum(1 for x in recs if x.chunks),
                    "mean_prefill_tokens": sum(x.shape.prefill_tokens for x in recs) / len(recs),
                    "mean_decode_rows": sum(x.shape.num_decode for x in recs) / len(recs)})
    c1, c2 = prof1.collective, prof2.collective
    info = {"tp1_profile_s": t1 - t0, "tp2_profile_s": t2 - t1,
            "tp1_collective": None if c1 is None else c1.to_dict(), "tp2_collective": None if c2 is None else c2.to_dict(),
            "tp1_heldout_median": prof1.heldout_error.get("median"), "tp2_heldout_median": prof2.heldout_error.get("median")}
    return out, info


def plot(preds: list[dict], path: str) -> None:
    """Measured mean step beside each prediction, per row (tp, threads per rank): grouped bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("measured", "measured_ms"), ("tp1 profile (at tp2: + all-reduces)", "tp1_profile_ms"),
              ("tp2 profile", "tp2_profile_ms"), ("nominal roofline", "nominal_ms")]
    labels = [f"tp{p['tp']}, {p['threads']} thread(s)" if p["tp"] == 1 else "tp2, 1 thread a rank" for p in preds]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.2
    for k, (name, key) in enumerate(series):
        xs = [i + (k - 1.5) * width for i in range(len(preds))]
        ax.bar(xs, [p[key] or 0.0 for p in preds], width, label=name)
    ax.set_xticks(range(len(preds)), labels)
    ax.set_ylabel("mean step (ms), same recorded steps")
    ax.set_title("qwen3 30m on 2 CPU cores: measured step vs profile and roofline predictions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(path: str, tp: int, prompts: list[list[int]], out_len: int, threads: int | None = None) -> dict[str, object]:
    """Throughput, step time and all-reduce time of one TP degree (tp=1 on `threads` torch threads when given: the
    control for a rank's one thread), and what the tolerance figures need."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(path, tensor_parallel_size=tp)
    try:
        logits = prefill_logits(llm, prompts[0][:128])
        seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=out_len, ignore_eos=True)
                  for i in range(16)]
        samples = [o.token_ids for o in llm.generate([p[:64] for p in prompts[:1]] * 16, seeded)]
        eng = llm.engine
        comm = eng.runner.tp.comm
        ar0, n0, steps0, ex0 = comm.all_reduce_s, comm.all_reduces, eng.stats.steps, eng.stats.execute_s
        records = record_steps(eng)
        greedy = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        wall = time.perf_counter() - t0
        steps = eng.stats.steps - steps0
        step_s = (eng.stats.execute_s - ex0) / steps
        ar_s = (comm.all_reduce_s - ar0) / steps
        return {"tp": tp, "threads": threads or torch.get_num_threads(), "wall_s": wall, "tok_s": sum(len(o.token_ids) for o in outs) / wall, "steps": steps,
                "step_ms": 1e3 * step_s, "all_reduce_ms": 1e3 * ar_s, "all_reduces_per_step": (comm.all_reduces - n0)
                / steps, "greedy": [o.token_ids for o in outs], "logits": logits, "samples": samples,
                "records": records, "kv_bytes_per_token": kv_bytes_per_token(eng), "max_model_len": eng.max_model_len}
    finally:
        llm.close()
        torch.set_num_threads(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="30m", choices=["1m", "30m"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--plot", default=None, help="draw the predictions beside the measured steps into this PNG")
    ap.add_argument("--plot-from", default=None, help="only draw --plot from a --json file of an earlier run")
    args = ap.parse_args()
    if args.plot_from:
        plot(json.load(open(args.plot_from))["predictions"], args.plot or "tp_cpu.png")
        return
    info = cpu_info()
    print(f"CPU: {info['model']}; avx2 {info['avx2']}, avx512f {info['avx512f']}; {info['cores']} cores usable; "
          f"load average {', '.join(f'{x:.1f}' for x in info['load_avg'])}")
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, arch="qwen3", size=args.size, seed=0)
        vocab = json.load(open(os.path.join(tmp, "config.json")))["vocab_size"]
        prompts = _prompts(args.requests, vocab)
        rows = [run(tmp, 1, prompts, args.output_len), run(tmp, 2, prompts, args.output_len),
                run(tmp, 1, prompts, args.output_len, threads=1)]
        preds, pinfo = predictions(tmp, rows)
    one, two = rows[0], rows[1]
    print(f"\nqwen3 {args.size}, {args.requests} requests x {args.output_len} output tokens (prompts 64..256), greedy")
    print("| tp | threads per rank | output tok/s | steps | step ms | all-reduce ms/step | all-reduces/step | "
          "all-reduce share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = r["all_reduce_ms"] / r["step_ms"] if r["tp"] > 1 else 0.0
        threads = r["threads"] if r["tp"] == 1 else max(1, usable_cpus() // 2)
        print(f"| {r['tp']} | {threads} | {r['tok_s']:.1f} | {r['steps']} | {r['step_ms']:.2f} | {r['all_reduce_ms']:.2f} | "
              f"{r['all_reduces_per_step']:.0f} | {share:.0%} |")
    print(f"tp2 / tp1 throughput: {two['tok_s'] / one['tok_s']:.2f}x; step time {two['step_ms'] / one['step_ms']:.2f}x")
    dl = (one["logits"] - two["logits"]).abs()
    same_greedy = sum(a == b for a, b in zip(one["greedy"], two["greedy"]))
    same_seeded = sum(a == b for a, b in zip(one["samples"], two["samples"]))
    flat = [(a, b) for x, y in zip(one["samples"], two["samples"]) for a, b in zip(x, y)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                  for x, y in zip(one["samples"], two["samples"])]
    print(f"float order: max |logit tp1 - tp2| {dl.max().item():.2e} (mean {dl.mean().item():.2e}, logits' max "
          f"|value| {one['logits'].abs().max().item():.1f}) over a 128-token prefill; greedy sequences identical "
          f"{same_greedy}/{len(one['greedy'])}; seeded (temperature 1.0) identical {same_seeded}/16, tokens equal "
          f"{sum(a == b for a, b in flat)}/{len(flat)}; first divergence at {[d for d in first_diff if d is not None]}")
    print(f"\npredicted step beside the measured one, over the same steps (quick `tandem profile` at tp1 on 1 thread, "
          f"{pinfo['tp1_profile_s']:.0f} s, held-out median error {100 * pinfo['tp1_heldout_median']:.0f}%; at tp2, ranks as "
          f"processes, {pinfo['tp2_profile_s']:.0f} s, {100 * pinfo['tp2_heldout_median']:.0f}%; nominal cost model):")
    print("| tp | threads per rank | steps | measured ms | tp1 profile ms (error) | tp2 profile ms (error) | "
          "nominal roofline ms (error) |")
    print("|---|---|---|---|---|---|---|")

    def cell(p: dict, name: str) -> str:
        v = p[f"{name}_ms"]
        return f"refused at tp{p['tp']}" if v is None else f"{v:.1f} ({p[f'{name}_err_pct']:+.0f}%)"
    for r, p in zip(rows, preds):
        threads = r["threads"] if r["tp"] == 1 else max(1, usable_cpus() // 2)
        print(f"| {p['tp']} | {threads} | {p['steps']} | {p['measured_ms']:.1f} | {cell(p, 'tp1_profile')} | "
              f"{cell(p, 'tp2_profile')} | {p['nominal_ms']:.1f} ({p['nominal_err_pct']:+.0f}%) |")
    m2, m1 = preds[1], preds[2]
    print(f"steps (tp2 run): {m2['steps']}, {m2['prefill_steps']} with prefill chunks; per step on average "
          f"{m2['mean_prefill_tokens']:.0f} prefill tokens and {m2['mean_decode_rows']:.1f} decode rows")
    for key, label in (("tp1_collective", "tp1 profile"), ("tp2_collective", "tp2 profile")):
        c = pinfo[key]
        if c is None:
            print(f"{label}: no all-reduce measured")
            continue
        f = next(x for x in c["fits"] if x["ranks"] == 2)
        print(f"{label}: {c['all_reduces_per_step']} all-reduces a step (counted from the model), "
              f"{c['bytes_per_token']} B a query token; 2-rank gloo all-reduce {1e6 * f['latency_s']:.0f} us + "
              f"{1e9 * f['per_byte_s']:.3f} ns/B (fitted to {', '.join(f'{b} B: {1e6 * s:.0f} us' for b, s in f['samples'])})")
        if c.get("in_steps"):
            st = c["in_steps"]
            print(f"  in its tp2 steps: {st['all_reduces_per_step']:.0f} all-reduces a step, "
                  f"{1e3 * st['all_reduce_s_per_step']:.2f} ms a step ({st['share_of_step']:.0%} of the step, waiting "
                  f"for the other rank included)")
    print(f"tp2 run: all-reduces measured {two['all_reduce_ms']:.2f} ms a step; the tp1 profile's fit prices the same "
          f"steps' all-reduces at {m2['predicted_all_reduce_ms']:.2f} ms; the rest of the step measured "
          f"{two['step_ms'] - two['all_reduce_ms']:.1f} ms, the tp1 profile's sharded compute "
          f"{m2['tp1_profile_ms'] - m2['predicted_all_reduce_ms']:.1f} ms")
    print(f"tp2 / tp1 (one thread) step time: measured {m2['measured_ms'] / m1['measured_ms']:.2f}x; tp1 profile + "
          f"all-reduces {m2['tp1_profile_ms'] / m1['tp1_profile_ms']:.2f}x; nominal roofline "
          f"{m2['nominal_ms'] / m1['nominal_ms']:.2f}x (compute and KV reads divided by tp, no all-reduce term)")
    if args.plot:
        plot(preds, args.plot)
    if args.json:
        keep = [{k: v for k, v in r.items() if k not in ("greedy", "logits", "samples", "records")} for r in rows]
        json.dump({"cpu": info, "rows": keep, "predictions": preds, "profiles": pinfo, "max_logit_diff": dl.max().item(), "seeded_identical": same_seeded},
                  open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
