"""Where a CPU engine step's time goes, per ISA: the offline engine-vs-vLLM workload with timers around its parts.

    python benchmarks/cpu_step_profile.py [--isa native,avx2] [--threads 1] [--gemm onednn,torch]
        [--out docs/results/cpu_step_profile]

One process per (ISA, GEMM path): the 64-request offline workload of benchmarks/engine_vs_vllm.py (prompts of
32-512 tokens, 128 greedy output tokens each, block size 32) through `tandem.LLM`, with timers around
step preparation (StepExecutor.prepare), the model's linears (Linear.matmul), the paged decode and prefill
attention kernels, the attention backend's other work (KV write, metadata), the LM head and sampling
(compute_logits_phase) and step finishing; "rest of forward" is the forward's time outside the linears and the
attention backend (norms, rotary, residuals, embedding). Steps are split into decode-only steps and steps with a
prefill chunk. With one thread the parts are synchronous, so they add up to the step, and the timers read the
thread's CPU time (time.thread_time), which other processes on a shared machine barely disturb; with more threads
they read wall-clock time. --isa avx2 caps torch,
oneDNN, MKL and tandem's C kernels as engine_vs_vllm.py --isa avx2 does (tandem/bench/host.py); --gemm torch sets
TANDEM_CPU_GEMM=torch (F.linear: MKL's sgemm). Prints a table and writes results.json and table.md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("prepare", "linears", "decode attention kernel", "prefill attention kernel", "attention other",
         "rest of forward", "logits + sampling", "finish", "unaccounted")


def _child(threads: int) -> dict:
    """Run the workload once in this process with the timers installed; per step kind, ms per step of each part."""
    import torch
    torch.set_num_threads(threads)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import engine_vs_vllm as evv

    from tandem import LLM, SamplingParams
    from tandem.engine import model_runner, step_executor
    from tandem.engine.attention import native, sdpa
    from tandem.engine.models import layers

    clock = time.thread_time if threads == 1 else time.perf_counter
    acc: dict[str, float] = defaultdict(float)
    stack: list[str] = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = clock()
            stack.append(name)
            try:
                return fn(*a, **k)
            finally:
                stack.pop()
                acc[name] += clock() - t0
        return wrapper

    layers.Linear.matmul = timed("linears", layers.Linear.matmul)
    sdpa.native.paged_decode = timed("decode attention kernel", native.paged_decode)
    sdpa.native.paged_prefill = timed("prefill attention kernel", native.paged_prefill)
    sdpa.SdpaBackend.forward = timed("attention backend", sdpa.SdpaBackend.forward)
    model_runner.ModelRunner.forward = timed("forward", model_runner.ModelRunner.forward)
    model_runner.ModelRunner.compute_logits_phase = timed("logits + sampling",
                                                          model_runner.ModelRunner.compute_logits_phase)
    step_executor.StepExecutor.finish = timed("finish", step_executor.StepExecutor.finish)
    kinds: dict[str, dict[str, float]] = {"decode": defaultdict(float), "prefill": defaultdict(float)}
    counts = {"decode": 0, "prefill": 0}
    orig_prepare, orig_execute = step_executor.StepExecutor.prepare, step_executor.StepExecutor.execute
    state: dict = {}

    def prepare(self, plan, t0):
        acc.clear()
        state["t0"] = clock()
        p0 = clock()
        prep = orig_prepare(self, plan, t0)
        acc["prepare"] += clock() - p0
        batch = getattr(prep, "batch", None)
        state["kind"] = "prefill" if batch is not None and any(q > 1 for q in batch.query_lens) else "decode"
        return prep

    def execute(self, prep):
        return orig_execute(self, prep)

    step_executor.StepExecutor.prepare = prepare
    step_executor.StepExecutor.execute = execute
    orig_finish = step_executor.StepExecutor.finish

    def finish(self, prep, out):
        r = orig_finish(self, prep, out)
        total = clock() - state.pop("t0", clock())
        kind = state.get("kind", "decode")
        parts = {"prepare": acc["prepare"], "linears": acc["linears"],
                 "decode attention kernel": acc["decode attention kernel"],
                 "prefill attention kernel": acc["prefill attention kernel"],
                 "attention other": acc["attention backend"] - acc["decode attention kernel"]
                 - acc["prefill attention kernel"],
                 "rest of forward": acc["forward"] - acc["linears"] - acc["attention backend"],
                 "logits + sampling": acc["logits + sampling"] - 0.0, "finish": acc["finish"]}
        parts["unaccounted"] = total - sum(parts.values())
        for k, v in parts.items():
            kinds[kind][k] += v
        kinds[kind]["total"] += total
        counts[kind] += 1
        return r

    step_executor.StepExecutor.finish = timed("finish", finish)
    vocab = json.loads((evv.MODEL_DIR / "config.json").read_text())["vocab_size"]
    prompts = evv.offline_prompts(vocab)
    llm = LLM(str(evv.MODEL_DIR), block_size=evv.OFFLINE_BLOCK_SIZE, enable_prefix_caching=True,
              kv_cache_memory_bytes=evv.KV_GIB << 30, **evv.LIMITS)
    n = evv.OFFLINE["output_len"]
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for k in kinds:
        kinds[k].clear()
        counts[k] = 0
    t0, c0 = time.perf_counter(), clock()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n))
    wall, busy = time.perf_counter() - t0, clock() - c0
    toks = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": toks / wall, "wall_s": wall, "tokens_per_busy_s": toks / busy, "steps": counts,
            "ms_per_step": {k: {p: 1e3 * v / max(counts[k], 1) for p, v in d.items()} for k, d in kinds.items()},
            "s_total": {k: dict(d) for k, d in kinds.items()},
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "attention_vector_floats": native.vector_width(), "gemm": "onednn" if layers.ONEDNN_LINEAR else "torch"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        print("RESULT " + json.dumps(_child(int(argv[1]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="native,avx2")
    ap.add_argument("--gemm", default="onednn")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/results/cpu_step_profile")
    a = ap.parse_args(argv)
    from tandem.bench.host import describe_host, isa_cap_env
    from tandem.engine.attention.isa import parse_isa_cap
    try:
        caps = [(name, parse_isa_cap(name)) for name in a.isa.split(",")]
    except ValueError as e:
        ap.error(str(e))
    gemms = [g.strip() for g in a.gemm.split(",") if g.strip()]
    if not gemms or any(g not in ("onednn", "torch") for g in gemms):
        ap.error(f"--gemm must list onednn and/or torch, got {a.gemm!r}")
    results = []
    for name, cap in caps:
        for g in gemms:
            env = {**os.environ, **isa_cap_env(cap), "TANDEM_CPU_GEMM": g,
                   "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_child", str(a.threads)], env=env,
                               capture_output=True, text=True)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if r.returncode != 0 or line is None:
                print(f"cpu_step_profile.py: {name}/{g} failed: {r.stderr.strip()[-400:]}", file=sys.stderr)
                return 1
            res = json.loads(line[7:])
            res.update(isa=name, host=describe_host(cap).as_dict())
            results.append(res)
            print(f"{name:6} gemm={g:6} {res['tokens_per_s']:.0f} tok/s ({res['tokens_per_busy_s']:.0f} per "
                  f"{'CPU' if a.threads == 1 else 'wall'} second of the timers), vector floats {res['attention_vector_floats']}, "
                  f"torch {res['torch_cpu_capability']}", flush=True)
    lines = ["| ISA | GEMM | tok/s (wall) | tok/s (timers' clock) | step kind | steps | " + " | ".join(PARTS) + " | step ms |",
             "|---|---|---|---|---|---|" + "---|" * (len(PARTS) + 1)]
    for res in results:
        for kind in ("decode", "prefill"):
            ms = res["ms_per_step"][kind]
            lines.append(f"| {res['isa']} | {res['gemm']} | {res['tokens_per_s']:.0f} | {res['tokens_per_busy_s']:.0f} | {kind} | {res['steps'][kind]} | "
                         + " | ".join(f"{ms.get(p, 0):.2f}" for p in PARTS) + f" | {ms.get('total', 0):.2f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": "python benchmarks/cpu_step_profile.py " + " ".join(argv),
                                                  "threads": a.threads, "runs": results}, indent=2) + "\n")
    (out / "table.md").write_text(f"host: {results[0]['host']['line']}; {a.threads} thread(s)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
