"""The engine on a GPU against the roofline: every profiled step's time over the roofline prediction, and CUDA graphs.

    python benchmarks/gpu_roofline.py [--model-dir models/qwen3-8b-random] [--max-len 4096] [--out DIR]
    python benchmarks/gpu_roofline.py --from-profile DIR/profile_graphs.json --from-profile DIR/profile_eager.json \
        --sweep-from DIR/results.json --out docs/results/gpu_roofline        # re-analysis, no GPU needed

On a CUDA machine, in one run:
1. a random checkpoint of Qwen3-8B's shape in bfloat16 (`tandem tiny-model --size 8b`, weights drawn on the GPU,
   seed 0), reused when --model-dir already holds one;
2. decode steps of 1, 8, 32, 64, 128, 256 sequences at one context (--decode-ctx, 1024) through the engine's
   ModelRunner, replayed as CUDA graphs and run eagerly (the runner's graphs set aside: what --enforce-eager runs)
   in alternation, medians of --decode-reps; the capture time and graph pool of the engine's default sizes; and three
   what-ifs named as such (graphs whose static block table is only as wide as the context, the same with 1 GiB key
   chunks, eager decode groups of 256 MiB instead of the CPU-sized 4 MiB);
3. `tandem profile`'s grid (prefill, decode and mixed steps up to --max-len tokens, the engine's max_model_len set to
   --max-len too), once with CUDA graphs (the engine's default) and once with enforce_eager, each saved as
   profile_<mode>.json;
4. every measured step against `Roofline(model, gpu, tp=1).step_time` of the same BatchShape (model: the perf
   catalogue's entry of the checkpoint's shape; gpu: from the device name or --gpu): measured / predicted by kind.
Writes table.md, results.json and gpu_roofline.png under --out (and prints the table). Without CUDA (and without
--from-profile) it prints one line and exits 2. The heavy part runs once on the GPU machine; --from-profile remakes
the table and the plot from the saved profiles (and --sweep-from: the decode sweep of an earlier results.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.bench.gpu_roofline_measure import measure
from tandem.bench.gpu_roofline_report import saved_results, write_report


def _ints(s: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not xs or xs[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return xs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path("models/qwen3-8b-random"),
                   help="the random checkpoint: reused if it holds one of --size, else written (default: %(default)s)")
    p.add_argument("--size", default="8b", choices=("0.6b", "8b"), help="Qwen3 shape (default: %(default)s)")
    p.add_argument("--gpu", default=None, help="perf catalogue GPU of the roofline (default: from the device name)")
    p.add_argument("--max-len", type=int, default=4096,
                   help="longest sequence profiled, and the engine's max_model_len (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default: %(default)s)")
    p.add_argument("--heldout", type=int, default=24, help="random held-out steps per profile (default: %(default)s)")
    p.add_argument("--decode-batches", type=_ints, default=[1, 8, 32, 64, 128, 256],
                   help="decode sweep batch sizes (default: 1,8,32,64,128,256)")
    p.add_argument("--decode-ctx", type=int, default=1024, help="decode sweep context (default: %(default)s)")
    p.add_argument("--decode-reps", type=int, default=10, help="timed runs per sweep cell (default: %(default)s)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the decode sweep")
    p.add_argument("--no-anatomy", dest="anatomy", action="store_false",
                   help="skip the step anatomy (wall time against GPU kernel time, torch.profiler)")
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=["graphs", "eager"],
                   help="profiles to run: graphs, eager or both (default: graphs,eager)")
    p.add_argument("--from-profile", type=Path, action="append", default=[], metavar="FILE",
                   help="re-analyse a saved profile.json (repeatable) instead of measuring; no GPU needed")
    p.add_argument("--sweep-from", type=Path, action="append", default=[], metavar="RESULTS",
                   help="with --from-profile: take the environment, decode sweep and step anatomy from this "
                        "results.json (repeatable: later files add what earlier ones lack)")
    p.add_argument("--out", type=Path, default=Path("docs/results/gpu_roofline"), help="report directory")
    args = p.parse_args(argv)
    if any(m not in ("graphs", "eager") for m in args.modes):
        p.error(f"--modes takes graphs and/or eager, got {','.join(args.modes)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure on CUDA, or re-analyse saved profiles; write and print the report. 2 when there is no CUDA device."""
    args = parse_args(argv)
    if args.from_profile:
        res = saved_results(args.from_profile, args.sweep_from, args.gpu)
    else:
        import torch
        if not torch.cuda.is_available():
            print("gpu_roofline: skipped: no CUDA device (torch.cuda.is_available() is False); "
                  "use --from-profile FILE to re-analyse a saved profile", file=sys.stderr)
            return 2
        res = measure(args)
    print(write_report(res, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
