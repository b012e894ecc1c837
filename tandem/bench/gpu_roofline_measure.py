"""The GPU roofline benchmark's measurements on CUDA: the random checkpoint, the decode sweep, the step anatomy and
the profiles, each analysed against the roofline."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tandem.bench.gpu_roofline import analyse_profile, gpu_key, model_spec


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


def decode_sweep(model_dir: Path, args: argparse.Namespace, tick: Callable[[str], None]) -> dict:
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


def step_anatomy(model_dir: Path, args: argparse.Namespace, tick: Callable[[str], None]) -> dict:
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


def run_profile(model_dir: Path, args: argparse.Namespace, eager: bool, tick: Callable[[str], None]) -> dict:
    """`tandem profile`'s grid on CUDA, with or without CUDA graphs; saved as profile_<mode>.json under --out."""
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


def measure(args: argparse.Namespace) -> dict:
    """Everything the benchmark measures on the GPU, with a progress bar; results.json is rewritten after each stage."""
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


