"""CPU float32 GEMM paths for a linear layer, same run: F.linear, oneDNN's packed matmul (what tandem's Linear uses on
CPU) and torch.mm on a pre-transposed weight, at decode- and prefill-sized row counts.

    python benchmarks/cpu_gemm.py [--threads 1] [--rows 1,8,34,64,290,2048] [--calls 60] [--out docs/results/cpu_gemm]

The weight shapes are the 30m checkpoint's four linears (hidden 512, intermediate 1920: qkv 512x1024, o 512x512,
gate_up 512x3840, down 1920x512). Each cell is the median of --calls calls after 5 warm-up calls. Prints a table and
writes results.json, table.md and cpu_gemm.png under --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

SHAPES = ((512, 1024), (512, 512), (512, 3840), (1920, 512))      # (in, out) of qkv, o, gate_up, down
PATHS = ("F.linear", "oneDNN packed", "mm on W^T")


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 or v > 1 << 16 for v in vals):
        print(f"cpu_gemm.py: error: {name} must be a comma-separated list of integers in 1..65536, got {text!r}",
              file=sys.stderr)
        sys.exit(2)
    return vals


def _median_ms(f, calls: int) -> float:
    for _ in range(5):
        f()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def measure(rows: list[int], calls: int) -> list[dict]:
    """One record per (rows, shape): each path's median milliseconds."""
    import torch
    import torch.nn.functional as F

    out = []
    with torch.inference_mode():
        for m in rows:
            for k, n in SHAPES:
                x, w = torch.randn(m, k), torch.randn(n, k)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                wt = w.t().contiguous()
                ms = {"F.linear": _median_ms(lambda: F.linear(x, w), calls),
                      "oneDNN packed": _median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                                             [], ""), calls),
                      "mm on W^T": _median_ms(lambda: torch.mm(x, wt), calls)}
                out.append({"rows": m, "in": k, "out": n, "ms": ms})
    return out


def plot(res: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = sorted({r["rows"] for r in res})
    for p in ("F.linear", "mm on W^T"):
        ratio = [statistics.fmean(r["ms"]["oneDNN packed"] / r["ms"][p] for r in res if r["rows"] == m) for m in rows]
        ax.plot(rows, ratio, marker="o", label=f"{p}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("speed relative to oneDNN packed (mean over shapes)")
    ax.set_title("CPU float32 linear layers, 30m model's shapes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,34,64,290,2048")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", default="docs/results/cpu_gemm")
    args = ap.parse_args(argv)
    rows = _ints(args.rows, "--rows")
    if not 1 <= args.threads <= 256 or not 1 <= args.calls <= 10000:
        print("cpu_gemm.py: error: --threads must be in 1..256 and --calls in 1..10000", file=sys.stderr)
        return 2
    import torch
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        print("cpu_gemm.py: this torch build has no oneDNN linear; nothing to compare", file=sys.stderr)
        return 0
    torch.set_num_threads(args.threads)
    res = measure(rows, args.calls)
    lines = ["| rows | in x out | " + " | ".join(f"{p} ms" for p in PATHS) + " | mm on W^T vs oneDNN |",
             "|---|---|---|---|---|---|"]
    for r in res:
        ms = r["ms"]
        lines.append(f"| {r['rows']} | {r['in']}x{r['out']} | " + " | ".join(f"{ms[p]:.3f}" for p in PATHS)
                     + f" | {ms['oneDNN packed'] / ms['mm on W^T']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": platform.processor() or platform.machine(),
            "threads": args.threads, "torch": torch.__version__, "calls": args.calls}
    (out / "results.json").write_text(json.dumps({"meta": meta, "cells": res}, indent=1) + "\n")
    (out / "table.md").write_text(f"{meta}\n\n{table}\n")
    plot(res, out / "cpu_gemm.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
