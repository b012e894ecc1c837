"""Bit-identity check of the measured step timers between two trees: every table a timer builds and `step_time` over
a grid of batch shapes, for several models (dense, GQA, MoE, MLA; bf16 and fp8) x GPUs (measured and derived) x tp
(and ep) degrees x frameworks, plus the routing-cost fits; each value is dumped as a SHA-256 of its float64 bytes.

    PYTHONPATH=/path/to/old/tree python benchmarks/measured_identity.py --out old.json
    PYTHONPATH=/path/to/new/tree python benchmarks/measured_identity.py --out new.json
    python benchmarks/measured_identity.py --compare old.json new.json

A change that only makes the timers faster to build must report every entry identical (errors compared as text).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

MODELS = ("llama-3.1-70b", "qwen3-32b", "qwen2.5-14b", "llada-8b", "qwen3-235b-a22b", "mixtral-8x7b",
          "ling-2.0-16b", "deepseek-v3")
GPUS = ("h100", "h200", "h20", "a100-80g", "l40s", "rtx4090")
TPS = (1, 2, 4, 8)
FRAMEWORKS = ("vllm", "sglang", "trtllm")
ROWS = (1, 2, 3, 7, 16, 31, 64, 100, 255, 256, 1000, 2047, 2048)     # attention-table batch rows filled


def digest(values) -> str:
    """SHA-256 of values as float64 (bit-exact: -0.0, NaN payloads and every last bit count)."""
    a = np.ascontiguousarray(np.asarray(values, dtype=np.float64))
    return hashlib.sha256(a.tobytes() + str(a.shape).encode()).hexdigest()[:24]


def shapes():
    """A grid of BatchShapes: decode, prefill (with history), mixed, CUDA-graph and diffusion-window steps."""
    from tandem.perf.batch_shape import BatchShape

    out = []
    for n in (1, 3, 17, 64, 255, 1000, 2048, 5000):
        for ctx in (1, 100, 4096, 100000, 300000):
            out.append(BatchShape(num_decode=n, decode_ctx_tokens=n * ctx))
    for new in (1, 7, 512, 8192, 40000):
        for hist in (0, 1000, 50000):
            for chunks in (1, 3, 300):
                s = BatchShape()
                for _ in range(chunks):
                    s.add_prefill(hist, max(1, new // chunks))
                out.append(s)
                mixed = BatchShape(s.prefill_tokens, s.prefill_attn_pairs, s.prefill_kv_read_tokens, s.num_prefill,
                                   40, 40 * 3000)
                out.append(mixed)
                out.append(BatchShape(s.prefill_tokens, s.prefill_attn_pairs, s.prefill_kv_read_tokens,
                                      s.num_prefill, graph=True))
    for n, ctx, rows in ((1, 1000, 32), (4, 40000, 128), (64, 2000, 2048), (3, 0, 48)):
        s = BatchShape()
        s.add_windows(n, ctx, rows)
        out.append(s)
    return out


def timer_digests(timer) -> dict[str, str]:
    """Every table of one MeasuredStep, its scalars, its attention grids and rows, and step_time over `shapes`."""
    d = {}
    for name in ("_body_graph", "_body_eager", "_head", "_kv_up", "_bmm"):
        v = getattr(timer, name)
        d[name] = "None" if v is None else digest(v)
    d["scalars"] = repr((timer._launch, timer._graph_tokens, timer._graph_decode_only, timer._overhead, timer._L,
                         timer._mla, timer.label))
    d["ovh"] = repr(timer.ovh)
    for name in ("_dec", "_pre"):
        tab = getattr(timer, name)
        g = tab.grid
        d[f"{name}.grid"] = ",".join([digest(a) for a in g.axes] + [digest(g.log_values), repr(g.exponents),
                                     "None" if g.measured is None else digest(g.measured)])
        d[f"{name}.rows"] = digest([tab.fill(b) for b in ROWS if b <= tab.b_max])
    d["step_time"] = digest([timer.step_time(s) for s in shapes()])
    d["step_time_args"] = digest([timer.step_time_args(s.prefill_tokens, s.prefill_attn_pairs,
                                                       s.prefill_kv_read_tokens, s.num_prefill, s.num_decode,
                                                       s.decode_ctx_tokens, s.graph, s.decode_kv_shared)
                                  for s in shapes()])
    return d


def fits_digest(model: str, gpu: str, tps: tuple[int, ...], framework: str) -> str:
    """The routing-cost fits (AMPD's T_pre / T_dec / T_kv) of workers of these degrees, as JSON text."""
    from tandem.perf.costs import choose_cost_model, routing_costs
    from tandem.perf.models import get_model

    choice = choose_cost_model("measured", gpu, framework)
    d = routing_costs(get_model(model), gpu, tps, choice).to_dict()
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:24]


def dump(models, gpus, frameworks) -> dict:
    """Digests of every (model, gpu, framework, tp, ep) timer, and of the fits over the degrees that built."""
    from tandem.perf.measured.step import MeasuredStep
    from tandem.perf.models import get_model

    out: dict = {}
    for model in models:
        spec = get_model(model)
        for gpu in gpus:
            for fw in frameworks:
                ok = []
                for tp in TPS:
                    eps = sorted({1, tp}) if spec.is_moe else [1]
                    for ep in eps:
                        key = f"{model}/{gpu}/{fw}/tp{tp}/ep{ep}"
                        try:
                            out[key] = timer_digests(MeasuredStep(model, gpu, tp, fw, ep=ep))
                        except Exception as e:                     # noqa: BLE001 - errors are compared as text
                            out[key] = f"{type(e).__name__}: {e}"
                            continue
                        if ep == 1:
                            ok.append(tp)
                if ok:
                    try:
                        out[f"{model}/{gpu}/{fw}/fits{ok}"] = fits_digest(model, gpu, tuple(ok), fw)
                    except Exception as e:                         # noqa: BLE001
                        out[f"{model}/{gpu}/{fw}/fits{ok}"] = f"{type(e).__name__}: {e}"
    for model in ("llama-3.1-70b", "qwen3-235b-a22b"):             # fp8 weights and KV cache (fp8 GEMMs, quantisation)
        spec = get_model(model).with_precision("fp8", "fp8")
        for gpu in ("h100", "h200", "h20"):
            for tp in TPS:
                key = f"{model}+fp8/{gpu}/vllm/tp{tp}"
                try:
                    out[key] = timer_digests(MeasuredStep(spec, gpu, tp, "vllm"))
                except Exception as e:                             # noqa: BLE001
                    out[key] = f"{type(e).__name__}: {e}"
    for model in ("llama-3.1-70b", "deepseek-v3"):                 # a measured GPU derived from another's tables
        for tp in (4, 8):
            key = f"{model}/h200<-h100/vllm/tp{tp}"
            try:
                out[key] = timer_digests(MeasuredStep(model, "h200", tp, "vllm", donor="h100"))
            except Exception as e:                                 # noqa: BLE001
                out[key] = f"{type(e).__name__}: {e}"
    return out


def compare(a_path: str, b_path: str) -> int:
    """Print every entry that differs; 0 when all are identical."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    bad = 0
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            bad += 1
            x, y = a.get(key), b.get(key)
            if isinstance(x, dict) and isinstance(y, dict):
                diff = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
                print(f"DIFF {key}: {', '.join(diff)}")
            else:
                print(f"DIFF {key}: {x!r} != {y!r}")
    print(f"{len(set(a) | set(b))} entries, {bad} differ")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write this tree's digests here")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two dumps")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--gpus", default=",".join(GPUS))
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give --out FILE or --compare OLD NEW")
    t = time.perf_counter()
    out = dump(args.models.split(","), args.gpus.split(","), args.frameworks.split(","))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    errors = sum(isinstance(v, str) and ":" in v and "/fits" not in k for k, v in out.items())
    print(f"{len(out)} entries ({errors} errors) in {time.perf_counter() - t:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
