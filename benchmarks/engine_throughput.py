"""Offline throughput: tandem's engine against transformers `generate()` on the same checkpoint, same run.

    python benchmarks/engine_throughput.py [--requests 64] [--output-len 128] [--out docs/results/engine]

A ~30M-parameter Qwen3-architecture tiny checkpoint (made here, offline), 64 requests with prompt
lengths uniform in [32, 512] and 128 output tokens each (EOS ignored, greedy). transformers runs
the same prompts in batches of 1, 8, 16, 32 and 64 (length-sorted, left-padded: its best case) and
the best setting is the baseline. Prints a table, writes results.json, table.md and throughput.png.
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


def run_tandem(path: str, prompts: list[list[int]], out_len: int) -> dict:
    from tandem import LLM, SamplingParams

    llm = LLM(path, max_num_batched_tokens=2048)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    st = llm.engine.stats
    st.steps, st.schedule_s, st.execute_s = 0, 0.0, 0.0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "steps": st.steps,
            "schedule_ms_per_step": 1e3 * st.schedule_s / st.steps, "execute_ms_per_step": 1e3 * st.execute_s / st.steps,
            "schedule_share": st.schedule_s / (st.schedule_s + st.execute_s)}


def run_hf(path: str, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    tokens = 0
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
    wall = time.perf_counter() - t0
    return {"batch": batch, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--hf-batches", default="1,8,16,32,64")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="docs/results/engine")
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
        with Progress(transient=True) as bar:
            task = bar.add_task("benchmark", total=1 + len(batches))
            ours = run_tandem(tmp, prompts, args.output_len)
            bar.advance(task)
            for b in batches:
                hf.append(run_hf(tmp, prompts, args.output_len, b))
                bar.advance(task)
        params = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"])
                     .load_file(str(Path(tmp) / "model.safetensors")).values())
    best = max(hf, key=lambda r: r["tokens_per_s"])
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        "model": f"tiny qwen3 30m ({params / 1e6:.1f}M parameters, fp32)", "requests": args.requests,
        "prompt_lens": [args.min_prompt, args.max_prompt], "output_len": args.output_len,
        "tandem": ours, "transformers": hf, "best_transformers_batch": best["batch"],
        "speedup": ours["tokens_per_s"] / best["tokens_per_s"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| system | setting | output tokens/s | wall s |", "|---|---|---|---|",
             f"| tandem | continuous batching, chunked prefill 2048 | {ours['tokens_per_s']:.0f} | {ours['wall_s']:.1f} |"]
    lines += [f"| transformers generate() | batch {r['batch']} | {r['tokens_per_s']:.0f} | {r['wall_s']:.1f} |" for r in hf]
    table = "\n".join(lines)
    summary = (f"speedup over the best transformers setting (batch {best['batch']}): {result['speedup']:.2f}x; "
               f"tandem per step: scheduling {ours['schedule_ms_per_step']:.2f} ms, model {ours['execute_ms_per_step']:.2f} ms "
               f"({100 * ours['schedule_share']:.1f}% scheduling) over {ours['steps']} steps")
    (out / "table.md").write_text(f"{result['model']}; {result['machine']}; {result['date']}\n\n{table}\n\n{summary}\n")
    _plot(result, out / "throughput.png")
    print(table)
    print(summary)
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["tandem"] + [f"HF b={r['batch']}" for r in result["transformers"]]
    vals = [result["tandem"]["tokens_per_s"]] + [r["tokens_per_s"] for r in result["transformers"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, vals, color=["tab:blue"] + ["tab:gray"] * len(result["transformers"]))
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['model']}: {result['requests']} requests, {result['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
