"""Leave-one-out interpolation error of the measured operator tables (GEMM, context and generation attention) on a
GPU under a framework, and the derived-GPU check: one GPU's operators predicted from another's tables.

    python benchmarks/measured_tables.py                         # H100 and H200, vLLM and SGLang
    python benchmarks/measured_tables.py --derive h200:h100      # also predict H200 from H100, per op
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from tandem.perf.measured.derive import derived_tables
from tandem.perf.measured.ops import HeadShape, op_tables
from tandem.perf.measured.source import SYSTEMS

HEADS = [HeadShape(h, kv, 128) for h, kv in ((8, 1), (16, 2), (32, 4), (32, 8), (64, 8))]


def loo(gpu: str, framework: str) -> dict[str, np.ndarray]:
    """Relative errors of each interior table value predicted from its two neighbours, along every axis."""
    ops = op_tables(SYSTEMS[gpu], framework)
    out = {}
    for dt in ("bfloat16", "fp8"):
        g = ops.gemm(dt)
        out[f"gemm {dt}"] = np.concatenate([g.leave_one_out(ax) for ax in range(3)])
    ctx, gen = [], []
    for hs in HEADS:
        c, d = ops.context_attention(hs, "bfloat16"), ops.generation_attention(hs, "bfloat16")
        ctx += [c.leave_one_out(ax) for ax in range(2)]
        gen += [d.leave_one_out(ax) for ax in range(2)]
    out["context attention"] = np.concatenate(ctx)
    out["generation attention"] = np.concatenate(gen)
    return out


def derive_check(target: str, donor: str, framework: str) -> dict[str, np.ndarray]:
    """Per op: the target's measured table against the same shapes derived from the donor's table."""
    real, fake = op_tables(SYSTEMS[target], framework), derived_tables(donor, target, framework)
    out = {}
    for dt in ("bfloat16", "fp8"):
        g = real.gemm(dt)
        pts = np.meshgrid(*g.axes, indexing="ij")
        out[f"gemm {dt}"] = np.abs(fake.gemm(dt)(*pts) / np.exp(g.log_values) - 1).ravel()
    for name, fr, ff in (("context attention", real.context_attention, fake.context_attention),
                         ("generation attention", real.generation_attention, fake.generation_attention)):
        errs = []
        for hs in HEADS:
            g = fr(hs, "bfloat16")
            pts = np.meshgrid(*g.axes, indexing="ij")
            errs.append(np.abs(ff(hs, "bfloat16")(*pts) / np.exp(g.log_values) - 1).ravel())
        out[name] = np.concatenate(errs)
    for n in (2, 4, 8):
        g = real.all_reduce(n, True)
        out[f"all-reduce tp{n}"] = np.abs(fake.all_reduce(n, True)(g.axes[0]) / np.exp(g.log_values) - 1)
    return out


def show(title: str, errs: dict[str, np.ndarray]) -> None:
    print(f"\n{title}\n\n| operator | points | median | p90 |\n|---|---|---|---|")
    for k, e in errs.items():
        print(f"| {k} | {len(e)} | {100 * np.median(e):.1f}% | {100 * np.quantile(e, 0.9):.1f}% |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="h100,h200")
    ap.add_argument("--frameworks", default="vllm,sglang")
    ap.add_argument("--derive", default="h200:h100", help="TARGET:DONOR pairs, comma-separated ('' for none)")
    a = ap.parse_args(argv)
    for fw in a.frameworks.split(","):
        for gpu in a.gpus.split(","):
            show(f"Leave-one-out, {gpu} {fw}", loo(gpu, fw))
        for pair in filter(None, a.derive.split(",")):
            t, d = pair.split(":")
            show(f"{t} derived from {d} ({fw}) against {t}'s own tables", derive_check(t, d, fw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
