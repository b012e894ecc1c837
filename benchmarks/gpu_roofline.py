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
import datetime
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

KINDS = ("prefill", "decode", "mixed")
SHAPE_FIELDS = ("prefill_tokens", "prefill_attn_pairs", "prefill_kv_read_tokens", "num_prefill", "num_decode",
                "decode_ctx_tokens")
GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("H20", "h20"), ("A100", "a100-80g"), ("L40S", "l40s"),
             ("4090", "rtx4090"))


# --------------------------------------------------------------------------- analysis (no GPU)

def gpu_key(device_name: str) -> str | None:
    """The perf catalogue's GPU for a CUDA device name ('NVIDIA H100 80GB HBM3' -> 'h100'), or None."""
    for needle, key in GPU_NAMES:
        if needle.lower() in device_name.lower():
            return key
    return None


def model_spec(model_config: dict):
    """The perf catalogue's ModelSpec of the profiled checkpoint's shape, or one built from its numbers."""
    from tandem.perf.models import MODELS, ModelSpec
    mc = model_config
    shape = (mc["layers"], mc["hidden"], mc["heads"], mc["kv_heads"], mc["head_dim"], mc["intermediate"], mc["vocab"])
    for spec in MODELS.values():
        if not spec.is_moe and (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim,
                                spec.intermediate, spec.vocab) == shape:
            return spec
    untied = ModelSpec("checkpoint", *shape, max_context=mc.get("max_position_embeddings", 131072))
    # the engine counts the q/k norms too; a tied checkpoint has one vocab x hidden matrix fewer
    tied = mc.get("params", untied.params) < untied.params - untied.vocab * untied.hidden // 2
    return ModelSpec("checkpoint", *shape, max_context=untied.max_context, tied_embeddings=tied)


def _summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {"n": 0}


def analyse_profile(prof: dict, gpu: str | None = None) -> dict:
    """Every measured step of a profile.json against the roofline: rows and the ratio's summary by kind."""
    from tandem.perf.batch_shape import BatchShape
    from tandem.perf.roofline import Roofline
    device = prof.get("device", {})
    gpu = gpu or gpu_key(device.get("name", ""))
    if gpu is None:
        raise ValueError(f"cannot tell the GPU of device {device.get('name')!r}: give --gpu")
    spec = model_spec(prof["model_config"])
    roof = Roofline(spec, gpu, tp=1)
    rows = []
    for r in prof["measurements"]:
        shape = BatchShape(*(r[f] for f in SHAPE_FIELDS))
        b = roof.breakdown(shape)
        rows.append({"kind": r["kind"], "split": r.get("split"), **{f: r[f] for f in SHAPE_FIELDS},
                     "measured_s": r["seconds"], "roofline_s": b["total"], "bound": b["bound"],
                     "ratio": r["seconds"] / b["total"]})
    by_kind = {k: _summary([x["ratio"] for x in rows if x["kind"] == k]) for k in KINDS}
    by_bound = {k: _summary([x["ratio"] for x in rows if x["bound"] == k]) for k in ("compute", "memory")}
    opts = prof.get("options", {})
    return {"mode": "eager" if opts.get("enforce_eager") else "graphs", "gpu": gpu, "model": spec.name,
            "device": device, "torch_version": prof.get("torch_version"), "created": prof.get("created"),
            "wall_s": prof.get("wall_s"), "profiled_max_len": opts.get("profiled_max_len"),
            "max_model_len": prof.get("max_model_len"), "block_size": prof.get("block_size"),
            "num_blocks": prof.get("num_blocks"), "heldout_error": prof.get("heldout_error"),
            "all": _summary([x["ratio"] for x in rows]), "by_kind": by_kind, "by_bound": by_bound, "rows": rows}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def table_md(res: dict) -> str:
    """The report: environment, measured/roofline by kind for each profile, the decode sweep."""
    env = res.get("env", {})
    out = ["# Engine on a GPU against the roofline (benchmarks/gpu_roofline.py)", ""]
    if env:
        out += [f"- device: {env.get('device')}; torch {env.get('torch')} (CUDA {env.get('cuda')}); "
                f"flash_attn importable: {env.get('flash_attn')}; attention backend: {env.get('attention_backend')}",
                f"- checkpoint: {env.get('checkpoint')}", ""]
    for p in res.get("profiles", []):
        out += [f"## Profile, decode {'as CUDA graphs' if p['mode'] == 'graphs' else 'eager (enforce_eager)'}: "
                f"measured / roofline ({p['model']} on {p['gpu']}, tp1)", "",
                f"{len(p['rows'])} steps up to {p['profiled_max_len']} tokens, max_model_len {p['max_model_len']}, "
                f"blocks of {p['block_size']}; profile wall {p['wall_s']:.0f} s. Roofline = max(compute at MFU 0.7, "
                f"memory at MBU 0.8) + 2 ms step overhead.", "",
                "| steps | n | median | min | max |", "|---|---|---|---|---|"]
        for name, s in [*p["by_kind"].items(), *(("bound: " + k, v) for k, v in p["by_bound"].items()),
                        ("all", p["all"])]:
            if s["n"]:
                out.append(f"| {name} | {s['n']} | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} |")
        he = p.get("heldout_error") or {}
        if he.get("median") is not None:
            out += ["", f"The profiler's own fitted step model on the {he['n']} held-out steps: relative error median "
                        f"{100 * he['median']:.1f}%, p90 {100 * he['p90']:.1f}%, max {100 * he['max']:.1f}%."]
        out.append("")
    sw = res.get("decode_sweep")
    if sw:
        cap = sw["capture"]
        out += [f"## Decode steps at context {sw['ctx']} (ms, median of {sw['reps']}; max_model_len "
                f"{sw['max_model_len']}, blocks of {sw['block_size']})", "",
                f"Engine graphs: {cap['sizes']} sizes ({cap['first']}..{cap['last']}) captured in "
                f"{cap['capture_s']:.1f} s, graph pool {cap['pool_bytes'] / 2**20:.0f} MiB reserved "
                f"({cap['allocated_bytes'] / 2**20:.0f} MiB allocated); decode attention in the graph: "
                f"{cap['attention']}.", ""]
        names = list(sw["variants"])
        head = ["batch", *names, "speed-up graphs/eager", "roofline", "graphs / roofline", "eager / roofline"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, b in enumerate(sw["batches"]):
            v = {n: sw["variants"][n]["median_s"][i] for n in names}
            roof = sw["roofline_s"][i]
            out.append("| " + " | ".join([str(b), *(_ms(v[n]) for n in names), f"{v['eager'] / v['graphs']:.2f}x",
                                          _ms(roof), f"{v['graphs'] / roof:.2f}", f"{v['eager'] / roof:.2f}"]) + " |")
        out.append("")
        for n in names:
            if sw["variants"][n].get("note"):
                out.append(f"- {n}: {sw['variants'][n]['note']}")
        out.append("")
    an = res.get("anatomy")
    if an:
        out += [f"## Where a step's time goes (context {an['ctx']}, max_model_len {an['max_model_len']})", "",
                f"One tiny CUDA op issued from Python costs {an['host_op_us']:.1f} us on this host. GPU kernel time "
                f"and counts per step from torch.profiler; wall time without the profiler (median of 10).", "",
                "| step | mode | wall ms | GPU kernels ms | kernels | kernel launches | roofline ms |",
                "|---|---|---|---|---|---|---|"]
        for c in an["cases"]:
            out.append(f"| {c['step']} | {c['mode']} | {c['wall_ms']:.2f} | {c['gpu_kernel_ms']:.2f} | "
                       f"{c['kernels']:.0f} | {c['launches']:.0f} | {c['roofline_ms']:.2f} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def plot(res: dict, path: Path) -> None:
    """Measured against roofline for every step (both profiles), and the decode sweep against batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    sw = res.get("decode_sweep")
    fig, axes = plt.subplots(1, 2 if sw else 1, figsize=(13 if sw else 6.5, 5.2), squeeze=False)
    ax = axes[0][0]
    colors = {"prefill": "tab:blue", "decode": "tab:red", "mixed": "tab:green"}
    markers = {"graphs": "o", "eager": "x"}
    lo, hi = float("inf"), 0.0
    for p in res.get("profiles", []):
        for k in KINDS:
            rows = [r for r in p["rows"] if r["kind"] == k]
            if rows:
                xs, ys = [1e3 * r["roofline_s"] for r in rows], [1e3 * r["measured_s"] for r in rows]
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
                ax.scatter(xs, ys, s=14, c=colors[k], marker=markers[p["mode"]], alpha=0.6,
                           label=f"{k} ({p['mode']})")
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = roofline")
        ax.plot([lo, hi], [2 * lo, 2 * hi], "k--", lw=0.6, label="2x roofline")
    ax.set(xscale="log", yscale="log", xlabel="roofline step time (ms)", ylabel="measured step time (ms)")
    title = res.get("profiles", [{}])[0].get("model", "") if res.get("profiles") else ""
    ax.set_title(f"every profiled step, {title} on {res.get('env', {}).get('device', 'the GPU')}", fontsize=9)
    ax.legend(fontsize=7)
    for a in (ax.xaxis, ax.yaxis):
        a.set_major_formatter(plain)
        a.set_minor_formatter(NullFormatter())
    if sw:
        ax = axes[0][1]
        for n, v in sw["variants"].items():
            ax.plot(sw["batches"], [1e3 * s for s in v["median_s"]], marker="o", ms=4, label=n,
                    ls="-" if n in ("graphs", "eager") else ":")
        ax.plot(sw["batches"], [1e3 * s for s in sw["roofline_s"]], "k-", lw=1.5, label="roofline")
        ax.set(xscale="log", yscale="log", xlabel="decode batch size", ylabel="step time (ms)",
               title=f"decode steps at context {sw['ctx']}")
        ax.set_xticks(sw["batches"])
        for a in (ax.xaxis, ax.yaxis):
            a.set_major_formatter(plain)
            a.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(res: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    md = table_md(res)
    (out / "table.md").write_text(md + "\n")
    plot(res, out / "gpu_roofline.png")
    return md


# --------------------------------------------------------------------------- measurement (CUDA)

def _env(model_dir: Path, gen: dict) -> dict:
    import torch

    from tandem.engine.attention.registry import flash_available, get_backend
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "torch": torch.__version__, "cuda": torch.version.cuda,
            "flash_attn": flash_available(), "attention_backend": get_backend(None, "cuda").name,
            "python": sys.version.split()[0], "checkpoint": gen, "date": datetime.date.today().isoformat()}


def make_checkpoint(model_dir: Path, size: str) -> dict:
    """The random bf16 checkpoint (made on the GPU, seed 0), or the one already in model_dir."""
    from tandem.engine.tiny_model import make_tiny_model, model_config, parameter_count
    want = model_config("qwen3", size, "bfloat16")
    cfg = model_dir / "config.json"
    if cfg.is_file() and all(json.loads(cfg.read_text()).get(k) == want[k]
                             for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")):
        return {"dir": str(model_dir), "size": size, "reused": True, "params": parameter_count("qwen3", size)}
    t0 = time.perf_counter()
    make_tiny_model(model_dir, "qwen3", size, seed=0, dtype="bfloat16", shards=4, init_device="cuda")
    return {"dir": str(model_dir), "size": size, "reused": False, "params": parameter_count("qwen3", size),
            "write_s": round(time.perf_counter() - t0, 1)}


def decode_sweep(model_dir: Path, args, tick) -> dict:
    """Decode steps at one context: engine graphs, eager, and the what-ifs, in alternation on one runner."""
    import torch

    from tandem.engine.attention import sdpa
    from tandem.engine.config import EngineConfig
    from tandem.engine.cuda_graphs import DecodeGraphs
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.profiling.grids import Point
    from tandem.engine.profiling.timing import Bench

    batches, ctx, bs = args.decode_batches, args.decode_ctx, args.block_size
    need = max(batches) * -(-(ctx + 1) // bs) + 64
    cfg = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", block_size=bs,
                       max_model_len=args.max_len, max_num_seqs=max(batches), num_kv_blocks=need)
    runner = ModelRunner(cfg)                     # captures the engine's default sizes for max_num_seqs
    g = runner.graphs
    capture = {"sizes": len(g.sizes), "first": g.sizes[0], "last": g.sizes[-1], "capture_s": g.capture_s,
               "pool_bytes": g.pool_bytes, "allocated_bytes": g.allocated_bytes,
               "attention": "flash-attn paged" if g.attention.paged else "gather + SDPA (flash-attn absent)"}
    tick("captured the engine's graphs")
    for t in runner.kv_caches:
        t.fill_(0)
    width = -(-(ctx + 1) // bs) * bs
    narrow = DecodeGraphs(runner.model, runner.kv_caches, bs, width, batches, scratch_block=runner.num_blocks)
    narrow.capture()
    wide_chunks = DecodeGraphs(runner.model, runner.kv_caches, bs, width, batches, scratch_block=runner.num_blocks,
                               gather_bytes=1 << 30)
    wide_chunks.capture()
    tick("captured the what-if graphs")
    variants = {
        "graphs": (g, None, ""),
        "eager": (None, None, ""),
        f"what-if: graphs, table width {width}": (narrow, None, f"CUDA graphs of these batch sizes whose static "
                                                  f"block table spans {width} tokens instead of max_model_len "
                                                  f"{args.max_len}"),
        f"what-if: graphs, width {width}, 1 GiB chunks": (wide_chunks, None, "as the previous, gathered keys "
                                                          "chunked by 1 GiB instead of 64 MiB"),
        "what-if: eager, 256 MiB groups": (None, 256 << 20, "eager, sdpa decode groups of 256 MiB of K+V instead "
                                           "of DECODE_GROUP_BYTES (4 MiB, sized for a CPU cache)"),
    }
    bench = Bench(runner, random.Random(0))
    points = [Point("decode", decodes=(ctx,) * b) for b in batches]
    default_group = sdpa.DECODE_GROUP_BYTES
    times = {n: [[] for _ in batches] for n in variants}
    order = [(n, i) for n in variants for i in range(len(batches))]
    rng = random.Random(1)
    try:
        for rep in range(args.decode_reps + 2):          # two warm-up rounds, not kept
            rng.shuffle(order)
            for name, i in order:
                graphs, group, _ = variants[name]
                runner.graphs = graphs
                sdpa.DECODE_GROUP_BYTES = group or default_group
                t = bench.run(points[i])
                if rep >= 2:
                    times[name][i].append(t)
            tick(f"decode sweep round {rep + 1}/{args.decode_reps + 2}")
    finally:
        runner.graphs = g
        sdpa.DECODE_GROUP_BYTES = default_group
    roof = _roofline(args.gpu, runner)
    res = {"ctx": ctx, "batches": batches, "reps": args.decode_reps, "max_model_len": args.max_len, "block_size": bs,
           "capture": capture, "what_if_capture_s": {"narrow": narrow.capture_s, "narrow_1gib": wide_chunks.capture_s},
           "variants": {n: {"median_s": [statistics.median(ts) for ts in times[n]], "runs_s": times[n],
                            "note": variants[n][2]} for n in variants},
           "roofline_s": [roof.step_time(p.shape()) for p in points],
           "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    del runner, g, narrow, wide_chunks, bench
    gc.collect()
    torch.cuda.empty_cache()
    return res


def host_op_us(n: int = 5000) -> float:
    """Microseconds per tiny CUDA op issued from Python (dispatch + launch; the GPU work is ~nothing)."""
    import torch
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def _gpu_profile(run, reps: int) -> dict:
    """torch.profiler over `reps` calls of run(): GPU kernel time and kernel count per call, launches per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    kernel_us, kernels, launches, graph_launches = 0.0, 0, 0, 0
    for e in prof.events():
        if getattr(e.device_type, "name", str(e.device_type)).upper().endswith("CUDA"):
            kernel_us += e.time_range.elapsed_us()
            kernels += 1
        elif e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += 1
        elif e.name in ("cudaGraphLaunch", "cuGraphLaunch"):
            graph_launches += 1
    return {"gpu_kernel_ms": kernel_us / 1e3 / reps, "kernels": kernels / reps, "launches": launches / reps,
            "graph_launches": graph_launches / reps}


def step_anatomy(model_dir: Path, args, tick) -> dict:
    """Where a step's time goes: wall time of whole steps (graphs and eager) against the GPU kernel time inside
    them (torch.profiler), and the host's cost of one tiny CUDA op."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.profiling.grids import Point
    from tandem.engine.profiling.timing import Bench

    ctx, bs = args.decode_ctx, args.block_size
    cfg = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", block_size=bs,
                       max_model_len=args.max_len, max_num_seqs=64, cuda_graph_sizes=(1, 64),
                       num_kv_blocks=64 * -(-(ctx + 1) // bs) + 256)
    runner = ModelRunner(cfg)
    for t in runner.kv_caches:
        t.fill_(0)
    g = runner.graphs
    bench = Bench(runner, random.Random(0))
    cases = [("decode x1", Point("decode", decodes=(ctx,))), ("decode x64", Point("decode", decodes=(ctx,) * 64)),
             ("prefill 512", Point("prefill", ((0, 512),))), ("prefill 2048", Point("prefill", ((0, 2048),)))]
    out = {"host_op_us": host_op_us(), "ctx": ctx, "max_model_len": args.max_len, "cases": []}
    tick(f"anatomy: {out['host_op_us']:.1f} us per tiny CUDA op")
    for name, p in cases:
        for mode in (("graphs", "eager") if p.kind == "decode" else ("eager",)):
            runner.graphs = g if mode == "graphs" else None
            for _ in range(3):
                bench.run(p)
            wall = statistics.median(bench.run(p) for _ in range(10))
            prof = _gpu_profile(lambda: bench.run(p), 3)
            out["cases"].append({"step": name, "mode": mode, "wall_ms": 1e3 * wall, **prof,
                                 "roofline_ms": 1e3 * _roofline(args.gpu, runner).step_time(p.shape())})
            tick(f"anatomy: {name} {mode}: wall {1e3 * wall:.1f} ms, GPU kernels {prof['gpu_kernel_ms']:.1f} ms")
    runner.graphs = g
    bench = runner = g = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _roofline(gpu: str, runner):
    from tandem.perf.roofline import Roofline
    mc = runner.model_config
    return Roofline(model_spec({"layers": mc.num_hidden_layers, "hidden": mc.hidden_size,
                                "heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads,
                                "head_dim": mc.head_dim, "intermediate": mc.intermediate_size,
                                "vocab": mc.vocab_size, "params": sum(x.numel() for x in runner.model.parameters())}),
                    gpu, tp=1)


def run_profile(model_dir: Path, args, eager: bool, tick) -> dict:
    import torch

    from tandem.engine.profiling.options import ProfileOptions
    from tandem.engine.profiling.run import profile
    opt = ProfileOptions(device="cuda", dtype="bfloat16", max_len=args.max_len, max_model_len=args.max_len,
                         block_size=args.block_size, enforce_eager=eager, measure_link=False,
                         measure_interference=False, heldout=args.heldout)
    last = [0.0]

    def progress(stage: str, done: int, total: int) -> None:
        if time.perf_counter() - last[0] > 2 or done == total:
            last[0] = time.perf_counter()
            tick(f"profile ({'eager' if eager else 'graphs'}): {stage} {done}/{total}")

    prof = profile(str(model_dir), opt, progress)
    path = args.out / f"profile_{'eager' if eager else 'graphs'}.json"
    prof.to_json(path)
    gc.collect()
    torch.cuda.empty_cache()
    return json.loads(path.read_text())


def measure(args) -> dict:
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if args.gpu is None:
        args.gpu = gpu_key(torch.cuda.get_device_name(0))
        if args.gpu is None:
            raise SystemExit(f"gpu_roofline: cannot tell the GPU of {torch.cuda.get_device_name(0)!r}: give --gpu")
    args.out.mkdir(parents=True, exist_ok=True)
    stages = 2 + (1 if args.sweep else 0) + (1 if args.anatomy else 0) + len(args.modes)
    res: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    cols = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn())
    with Progress(*cols, transient=False) as bar:
        task = bar.add_task("checkpoint", total=stages)

        def tick(msg: str) -> None:
            bar.update(task, description=msg)
            bar.console.log(msg)

        def step(msg: str) -> None:
            bar.advance(task)
            tick(msg)

        gen = make_checkpoint(args.model_dir, args.size)
        res["env"] = _env(args.model_dir, gen)
        step(f"checkpoint {'reused' if gen['reused'] else 'written'}: {gen}")
        res["profiles"] = []
        if args.sweep:
            try:
                res["decode_sweep"] = decode_sweep(args.model_dir, args, tick)
            except Exception as e:                      # record it and go on with the profiles
                res["decode_sweep_error"] = f"{type(e).__name__}: {e}"
                gc.collect()
                torch.cuda.empty_cache()
            (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
            step("decode sweep done" if "decode_sweep" in res else f"decode sweep failed: {res['decode_sweep_error']}")
        if args.anatomy:
            try:
                res["anatomy"] = step_anatomy(args.model_dir, args, tick)
            except Exception as e:
                res["anatomy_error"] = f"{type(e).__name__}: {e}"
            (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
            step("step anatomy done" if "anatomy" in res else f"step anatomy failed: {res['anatomy_error']}")
        for mode in args.modes:
            try:
                prof = run_profile(args.model_dir, args, mode == "eager", tick)
                res["profiles"].append(analyse_profile(prof, args.gpu))
            except Exception as e:
                res.setdefault("profile_errors", {})[mode] = f"{type(e).__name__}: {e}"
                gc.collect()
                torch.cuda.empty_cache()
            (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
            step(f"profile {mode} done")
        step("report")
    return res


# --------------------------------------------------------------------------- command line

def _ints(s: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not xs or xs[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return xs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    args = parse_args(argv)
    if args.from_profile:
        res: dict = {}
        for f in args.sweep_from:
            old = json.loads(f.read_text())
            res.update({k: old[k] for k in ("args", "env", "decode_sweep", "anatomy") if k in old and k not in res})
        res["profiles"] = [analyse_profile(json.loads(f.read_text()), args.gpu) for f in args.from_profile]
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
