"""Independent check of tandem's measured GPU cost model against Microsoft Vidur's profiled A100 operators.

tandem's measured model (`tandem/perf/measured/`) prices a layer from aiconfigurator's vLLM 0.14 tables. Those
tables are the only input, so checking the model against the same tables would be circular. Vidur (MIT,
github.com/microsoft/vidur at 7d47513) profiled the same layer shapes on A100s on its own, with a different engine
and different kernels. It timed one TP rank of a Llama-3-70B block op by op (`mlp.csv`) and NCCL all-reduces inside
a DGX node (`all_reduce.csv`). Agreement between the two is evidence that the measured model is right. A gap points
at the op to look at.

For TP2 and TP4, Llama-3-70B (tandem's `llama-3.1-70b`, which has the same shapes) on `a100-80g` and a set of token
counts, each op is compared three ways: Vidur's median, tandem measured and tandem roofline. The ops are the QKV, O,
gate/up and down GEMMs, the elementwise kernels summed, and one all-reduce. The same comparison is made for the
per-layer sum (5 ops + 2 all-reduces) and for a decode step without attention, LM head or host time (80 layers).

- **Vidur**: the raw `time_stats.<op>.median` rows at that exact token count. Duplicate rows are averaged.
  Elementwise = input_layernorm + post_attention_layernorm + attn_rope + mlp_act + add. The all-reduce is read at
  tokens x 8192 x 2 bytes. When that size is a CSV row, the row is used as is. Otherwise the value is interpolated
  log-log between the two nearest sizes. Past the CSV's 64 MiB it is extrapolated at the last row's bandwidth.
  These are raw profiles, not Vidur's random-forest predictions. Vidur's predictor adds 0.02 ms of CPU launch per
  all-reduce, which is reported separately in results.json.
- **tandem measured**: the same pieces `tandem.perf.measured.step.token_tables` adds up. GEMMs come from
  `op_tables("a100_sxm", "vllm").gemm("bfloat16")`. The 4 elementwise kernels are priced at the `streaming_fit`
  floor + bytes / bandwidth. The all-reduce is `all_reduce(tp, graph=True)`: the CUDA-graph time, which matches
  Vidur's kernel-only timing.
- **tandem roofline** (`Roofline("llama-3.1-70b", "a100-80g", tp)`), taken op by op:
  - a GEMM costs max(2mnk / (peak x mfu), weight bytes / (HBM x mbu));
  - the elementwise kernels cost the roofline's per-layer activation traffic (`_m_act / layers`, which also covers
    the GEMMs' activations);
  - the all-reduce is `allreduce_time`.
  These per-op terms are summed for the layer. That sum bounds the roofline's own step from above, because the
  roofline takes max(total compute, total memory).

    python benchmarks/vidur_check.py [--out docs/results/vidur_check] [--tokens 1,8,32,128,512,2048,8192]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.bench.vidur import TOKENS, TPS, compare
from tandem.bench.vidur_report import write_report


def main(argv: list[str] | None = None) -> int:
    """Compare, print the table and write the report; 1 when nothing could be compared."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results/vidur_check"))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--tps", default=",".join(map(str, TPS)), help="comma-separated TP degrees (2 and/or 4)")
    a = ap.parse_args(argv)
    rows = compare(tuple(int(x) for x in a.tps.split(",")), tuple(int(x) for x in a.tokens.split(",")))
    if not rows:
        print("nothing to compare", file=sys.stderr)
        return 1
    print(write_report(rows, a.out))
    print(f"wrote {a.out / 'table.md'}, {a.out / 'results.json'}, {a.out / 'per_op.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
