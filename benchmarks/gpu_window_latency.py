"""Device check: T(c, b) on CUDA, measured at engine start (with the per-sequence probes) and by tandem profile."""
import json, sys, time, torch
from tandem.engine.loader import load_model
from tandem.engine.diffusion.window_timing import measure_window_latency
m = load_model("tandem/engine/diffusion/assets/tiny-sdar", device="cuda")[0]
for i in range(2):
    t = time.perf_counter()
    lat = measure_window_latency(m, 32, 2048, torch.device("cuda"), max_seqs=256)
    print(json.dumps({"took_s": round(time.perf_counter() - t, 3), "breakpoints": lat.breakpoints, "coefs": lat.coefs,
                      "per_seq_ms": lat.per_seq_s * 1e3,
                      "T_ms": {f"{c}x{b}": round(lat(c, b) * 1e3, 3) for c, b in ((1, 256), (32, 8), (4, 64), (16, 16), (32, 64))}}))
