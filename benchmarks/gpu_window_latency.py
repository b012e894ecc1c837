"""Device check: Optimus's T(c, b) measured on CUDA at engine start-up, cost per sequence included.

    python benchmarks/gpu_window_latency.py             # on a GPU machine; prints one JSON line per measurement
    tandem profile --model tandem/engine/diffusion/assets/tiny-sdar --quick --device cuda --out p.json   # the profile's

The results of the H200 run are in docs/results/gpu_window_latency/.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.engine.diffusion.window_timing import measure_window_latency
from tandem.engine.loader import load_model

ASSET = "tandem/engine/diffusion/assets/tiny-sdar"
SHAPES = ((1, 256), (32, 8), (4, 64), (16, 16), (32, 64))      # (c, b) the fit is printed at


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=ASSET)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2, help="measurements, each a fresh fit")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    model = load_model(args.model, device=device)[0]
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        lat = measure_window_latency(model, 32, 2048, device, max_seqs=256)
        print(json.dumps({"took_s": round(time.perf_counter() - t0, 3), "breakpoints": lat.breakpoints,
                          "coefs": lat.coefs, "per_seq_ms": lat.per_seq_s * 1e3,
                          "T_ms": {f"{c}x{b}": round(lat(c, b) * 1e3, 3) for c, b in SHAPES}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
