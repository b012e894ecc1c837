"""Offline throughput: tandem's engine against transformers `generate()` on the same checkpoint, same run.

    python benchmarks/engine_throughput.py [--requests 64] [--output-len 128] [--out docs/results/engine]

A ~30M-parameter Qwen3-architecture tiny checkpoint (made here, offline), 64 requests with prompt
lengths uniform in [32, 512] and 128 output tokens each (greedy; EOS masked until the 128th token:
min_tokens in tandem, min_new_tokens in transformers, so both produce the same tokens). transformers runs
the same prompts in batches of 1, 8, 16, 32 and 64 (length-sorted, left-padded: its best case) and
the best setting is the baseline. tandem runs with its defaults (max_num_seqs 256, block_size 16)
and max_num_batched_tokens 2048; on CPU float32 its linears use oneDNN-packed weights, so it also
runs once with torch's default GEMM (`TANDEM_CPU_GEMM=torch`, the one transformers uses) to show
what the kernel alone is worth. A per-op profile of one 64-sequence decode step (context 350-450)
and one 2048-token prefill chunk splits the model's time into linear layers, attention (KV write,
gather, SDPA) and the rest. Prints a table, writes results.json, table.md and throughput.png.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab - 8, (k,), generator=g).tolist() for k in lens]


def _gemm(kind: str | None):
    """Select tandem's CPU GEMM (None: leave as is); returns the previous setting."""
    from tandem.engine.models import layers

    prev = layers.ONEDNN_LINEAR
    if kind is not None:
        layers.ONEDNN_LINEAR = kind == "onednn" and layers._onednn_usable()
    return prev


def run_tandem(path: str, prompts: list[list[int]], out_len: int, gemm: str | None = None) -> dict:
    from tandem import LLM, SamplingParams

    prev = _gemm(gemm)
    try:
        llm = LLM(path, max_num_batched_tokens=2048)
        # min_tokens masks EOS (and its greedy argmax) for all out_len tokens, as transformers' min_new_tokens does
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len)
        llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        st = llm.engine.stats
        st.steps, st.schedule_s, st.execute_s = 0, 0.0, 0.0
        runner, kinds = llm.engine.runner, {"prefill": [], "decode": []}

        def timed(batch, _execute=runner.execute):   # model time of steps with / without prefill tokens
            t = time.perf_counter()
            out = _execute(batch)
            kinds["prefill" if max(batch.query_lens, default=1) > 1 else "decode"].append(time.perf_counter() - t)
            return out

        runner.execute = timed
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        del runner.execute
    finally:
        if prev is not None:
            _gemm("onednn" if prev else "torch")
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "steps": st.steps,
            "schedule_ms_per_step": 1e3 * st.schedule_s / st.steps, "execute_ms_per_step": 1e3 * st.execute_s / st.steps,
            "schedule_share": st.schedule_s / (st.schedule_s + st.execute_s),
            **{f"{k}_steps": len(v) for k, v in kinds.items()},
            **{f"{k}_step_ms": 1e3 * sum(v) / max(1, len(v)) for k, v in kinds.items()},
            "token_ids": [o.token_ids for o in outs]}


_LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise")
_ATTN_OPS = ("aten::scaled_dot_product_attention", "aten::index_select", "aten::index_copy_")


def profile_steps(path: str, reps: int = 3) -> dict:
    """Per-op split of one 64-sequence decode step (context 350-450) and one 2048-token prefill chunk.

    Returns per step kind: wall ms (median of `reps`), and the profiled ms in linear layers, attention (KV write,
    gather, SDPA; top-level ops only) and everything else.
    """
    from torch.profiler import ProfilerActivity, profile

    from tandem import SamplingParams
    from tandem.engine.config import EngineConfig
    from tandem.engine.model_input import ModelInput
    from tandem.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=path))
    bs = runner.block_size
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(1)

    def batch(specs: list[tuple[int, int]]) -> "ModelInput":
        b, nxt = ModelInput(), 0
        for hist, n in specs:          # (cached tokens, new tokens) per sequence, blocks laid out one after another
            nb = -(-(hist + n) // bs)
            b.add(torch.randint(3, 400, (n,), generator=g).tolist(), hist, list(range(nxt, nxt + nb)))
            nxt += nb
            b.sample_rows.append(len(b.query_lens) - 1)
            b.params.append(sp)
            b.generators.append(None)
            b.output_tokens.append([])
            b.prompt_tokens.append([1])
        return b

    steps = {"decode 64 seqs x ctx 350-450": batch([(349 + (i * 100) // 64, 1) for i in range(64)]),
             "prefill chunk 2048 tokens": batch([(212, 300), (0, 480), (0, 272), (0, 500), (0, 400), (0, 96)])}
    out = {}
    for name, b in steps.items():
        for _ in range(2):
            runner.execute(b)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.execute(b)
            times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.execute(b)
        split = {"linear": 0.0, "attention": 0.0, "other": 0.0}
        events = [e for e in prof.events() if e.cpu_parent is None]       # top-level ops: no double counting
        for e in events:
            key = "linear" if e.name in _LINEAR_OPS else "attention" if e.name in _ATTN_OPS else "other"
            split[key] += e.cpu_time_total / 1e3
        total = sum(split.values())
        out[name] = {"wall_ms": 1e3 * sorted(times)[len(times) // 2],
                     **{f"{k}_share": v / total for k, v in split.items()}}
    return out


def run_hf(path: str, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    tokens = 0
    outs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            group = [prompts[i] for i in order[s:s + batch]]
            width = max(map(len, group))
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for r, p in enumerate(group):        # left padding, as decoder-only generate() needs
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False, pad_token_id=0)
            tokens += (out.shape[1] - width) * len(group)
            for r, i in enumerate(order[s:s + batch]):
                outs[i] = out[r, width:].tolist()
    wall = time.perf_counter() - t0
    return {"batch": batch, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "token_ids": [outs[i] for i in range(len(prompts))]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--hf-batches", default="1,8,16,32,64")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="docs/results/engine")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-op step profile")
    ap.add_argument("--no-torch-gemm", action="store_true",
                    help="skip the extra tandem run on torch's default GEMM (TANDEM_CPU_GEMM=torch)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.progress import Progress

    from tandem.engine.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_model(tmp, arch="qwen3", size="30m", seed=0)
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        prompts = _prompts(args.requests, args.min_prompt, args.max_prompt, cfg["vocab_size"], seed=0)
        batches = [int(b) for b in args.hf_batches.split(",")]
        hf = []
        ours_torch = None
        with Progress(transient=True) as bar:
            task = bar.add_task("benchmark", total=3 + len(batches))
            ours = run_tandem(tmp, prompts, args.output_len)
            bar.advance(task)
            if not args.no_torch_gemm and _gemm(None):
                ours_torch = run_tandem(tmp, prompts, args.output_len, gemm="torch")
            bar.advance(task)
            steps = None if args.no_profile else profile_steps(tmp)
            bar.advance(task)
            for b in batches:
                hf.append(run_hf(tmp, prompts, args.output_len, b))
                bar.advance(task)
        params = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"])
                     .load_file(str(Path(tmp) / "model.safetensors")).values())
    best = max(hf, key=lambda r: r["tokens_per_s"])
    same = ours_torch is None or ours_torch.pop("token_ids") == ours["token_ids"]
    for r in hf:                                 # requests whose greedy tokens equal tandem's
        got = r.pop("token_ids")
        r["same_tokens_as_tandem"] = sum(a == b for a, b in zip(got, ours["token_ids"]))
    ours.pop("token_ids")
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        "model": f"tiny qwen3 30m ({params / 1e6:.1f}M parameters, fp32)", "requests": args.requests,
        "prompt_lens": [args.min_prompt, args.max_prompt], "output_len": args.output_len,
        "tandem": ours, "tandem_torch_gemm": ours_torch, "same_tokens_both_gemms": same,
        "step_profile": steps, "transformers": hf, "best_transformers_batch": best["batch"],
        "speedup": ours["tokens_per_s"] / best["tokens_per_s"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    setting = "continuous batching, max_num_batched_tokens 2048, max_num_seqs 256, block_size 16"
    gemm = "oneDNN GEMM" if _gemm(None) else "torch's default GEMM"
    n = args.requests
    lines = ["| system | setting | output tokens/s | wall s | vs best transformers | same greedy tokens as tandem |",
             "|---|---|---|---|---|---|",
             f"| tandem | {setting}, {gemm} | {ours['tokens_per_s']:.0f} | {ours['wall_s']:.1f} | "
             f"{result['speedup']:.2f}x | - |"]
    if ours_torch is not None:
        lines.append(f"| tandem | same, torch's default GEMM (TANDEM_CPU_GEMM=torch) | {ours_torch['tokens_per_s']:.0f} | "
                     f"{ours_torch['wall_s']:.1f} | {ours_torch['tokens_per_s'] / best['tokens_per_s']:.2f}x | "
                     f"{n if same else 'no'}/{n} |")
    lines += [f"| transformers generate() | batch {r['batch']} | {r['tokens_per_s']:.0f} | {r['wall_s']:.1f} | "
              f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x | {r['same_tokens_as_tandem']}/{n} |" for r in hf]
    table = "\n".join(lines)
    summary = (f"speedup over the best transformers setting (batch {best['batch']}): {result['speedup']:.2f}x; "
               f"tandem per step: scheduling {ours['schedule_ms_per_step']:.2f} ms, model {ours['execute_ms_per_step']:.2f} ms "
               f"({100 * ours['schedule_share']:.1f}% scheduling) over {ours['steps']} steps: "
               f"{ours['prefill_steps']} steps with prefill tokens ({ours['prefill_step_ms']:.0f} ms each), "
               f"{ours['decode_steps']} decode-only steps ({ours['decode_step_ms']:.1f} ms each)")
    if steps:
        summary += ("\n\n| tandem step | wall ms | linear layers | attention (KV write, gather, SDPA) | other |\n"
                    "|---|---|---|---|---|\n")
        summary += "\n".join(f"| {k} | {v['wall_ms']:.1f} | " + " | ".join(
            f"{v['wall_ms'] * v[f'{c}_share']:.0f} ms ({100 * v[f'{c}_share']:.0f}%)" for c in ("linear", "attention", "other"))
            + " |" for k, v in steps.items())
    (out / "table.md").write_text(f"{result['model']}; {result['machine']}; {result['date']}\n\n{table}\n\n{summary}\n")
    _plot(result, out / "throughput.png")
    print(table)
    print(summary)
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, vals, colors = ["tandem"], [result["tandem"]["tokens_per_s"]], ["tab:blue"]
    if result.get("tandem_torch_gemm"):
        names.append("tandem\ntorch GEMM")
        vals.append(result["tandem_torch_gemm"]["tokens_per_s"])
        colors.append("tab:cyan")
    names += [f"HF b={r['batch']}" for r in result["transformers"]]
    vals += [r["tokens_per_s"] for r in result["transformers"]]
    colors += ["tab:gray"] * len(result["transformers"])
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.bar(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['model']}: {result['requests']} requests, {result['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
