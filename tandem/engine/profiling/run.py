"""The `profile()` entry point: load the model, time the grids, measure the KV path, fit and assemble a Profile."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import random
import statistics
import time
from typing import Callable, Iterable

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.parallel.group import usable_cpus
from tandem.engine.profiling.collective import all_reduces_per_step, measure_all_reduce, step_sizes
from tandem.engine.profiling.device import load_avg, device_info, memory_bandwidth
from tandem.engine.profiling.grids import Point, block_aligned, heldout_grid, train_grid
from tandem.engine.profiling.interference import measure_interference
from tandem.engine.profiling.kv_path import measure_kv_link, measure_kv_path
from tandem.engine.profiling.options import QUICK_MAX_LEN, ProfileOptions
from tandem.engine.profiling.timing import Bench
from tandem.engine.profiling.windows import measure_window_latency_profile
from tandem.perf.batch_shape import BatchShape
from tandem.perf.collective import CollectiveCost
from tandem.perf.step_model import DEFAULT_KV_LINK, Profile, StepTimeModel

Progress = Callable[[str, int, int], None]      # (stage, done, total)
log = logging.getLogger(__name__)


def _param_count(runner: ModelRunner) -> int:
    return int(sum(p.numel() for p in runner.model.parameters()))


def profile(model: str, options: ProfileOptions | None = None, progress: Progress | None = None) -> Profile:
    """Load `model` in a ModelRunner, time the training and held-out grids, fit, and return the Profile."""
    opt = options or ProfileOptions()
    threads = torch.get_num_threads()
    if opt.threads is not None:
        torch.set_num_threads(opt.threads)
    try:
        return _profile(model, opt, progress)
    finally:
        torch.set_num_threads(threads)


def _profile(model: str, opt: ProfileOptions, progress: Progress | None) -> Profile:
    t_start = time.perf_counter()
    load_before = load_avg()
    cfg = EngineConfig(model=model, dtype=opt.dtype, device=opt.device, block_size=opt.block_size,
                       max_model_len=opt.max_model_len, max_num_batched_tokens=opt.max_num_batched_tokens,
                       max_num_seqs=opt.max_num_seqs,
                       kv_cache_memory_bytes=opt.kv_cache_memory_bytes, num_kv_blocks=opt.num_kv_blocks,
                       attention_backend=opt.attention_backend, seed=opt.seed, enforce_eager=opt.enforce_eager,
                       cuda_graph_sizes=opt.cuda_graph_sizes, tensor_parallel_size=opt.tensor_parallel_size)
    if progress:
        progress("loading model", 0, 1)
    runner = ModelRunner(cfg)           # at tp>1 the other ranks are processes, as the engine runs them
    try:
        return _measure(model, opt, progress, cfg, runner, t_start, load_before)
    finally:
        runner.close()


def _measure(model: str, opt: ProfileOptions, progress: Progress | None, cfg: EngineConfig, runner: ModelRunner,
             t_start: float, load_before: float | None) -> Profile:
    tp = runner.tp.size
    mc = runner.model_config
    capacity = runner.num_blocks * runner.block_size
    engine_max_len = cfg.max_model_len or mc.max_position_embeddings
    max_len = min(engine_max_len, capacity)
    if opt.max_len is not None:
        max_len = min(max_len, opt.max_len)
    if opt.quick:
        max_len = min(max_len, QUICK_MAX_LEN)
    if max_len < 2:
        raise ValueError(f"cannot profile sequences of at most {max_len} token(s)")
    budget = min(cfg.max_num_batched_tokens, max_len - 1)
    max_seqs = min(cfg.max_num_seqs, 64 if opt.quick else cfg.max_num_seqs)
    rng = random.Random(opt.seed)
    bs = runner.block_size
    train = train_grid(budget, max_len, max_seqs, capacity, quick=opt.quick, block_size=bs)
    held = heldout_grid(opt.n_heldout, budget, max_len, max_seqs, capacity, rng, block_size=bs)
    held = [p for p in held if p not in set(train)]
    warm = [Point("prefill", ((0, min(budget, 256)),)), Point("decode", decodes=(min(255, max_len - 1),) * min(8, max_seqs)),
            Point("mixed", ((min(64, max_len // 2), min(64, budget - 4)),), (min(63, max_len - 1),) * 4)]
    dblock = mc.diffusion_block_size            # a block-diffusion model: whole-block prefills here, windows apart
    if dblock:
        train, held, warm = (block_aligned(g, dblock, budget, max_len, capacity, bs) for g in (train, held, warm))
        if not train:
            raise ValueError(f"no whole-block prefill of {dblock} tokens fits a budget of {budget} tokens")

    bench = Bench(runner, rng)
    # Touch the whole KV pool once: a fresh allocation is mapped lazily, and the first write to every
    # page would otherwise be charged to whichever measured step reaches it first.
    for t in getattr(runner, "kv_caches", []):
        t.fill_(0)
    for i, p in enumerate(warm * 2):
        bench.run(p)
        if progress:
            progress("warming up", i + 1, 2 * len(warm))

    # Train and held-out steps are measured together, in random order, so that drifts in the machine's
    # load spread over every kind of step instead of biasing one.
    jobs = [("train", p) for p in train] + [("heldout", p) for p in held]
    rng.shuffle(jobs)
    comm0 = (runner.tp.comm.all_reduces, runner.tp.comm.all_reduce_s)
    runs = bench.measure([p for _, p in jobs], opt.n_repeats, opt.point_budget_s,
                         (lambda d, t: progress("measuring steps", d, t)) if progress else None)
    in_steps = comm_in_steps(runner, comm0, sum(len(rs) for rs in runs), sum(sum(rs) for rs in runs))
    rows: list[dict] = []
    for (split_name, p), rs in zip(jobs, runs):
        rows.append({"split": split_name, **p.to_dict(), **dataclasses.asdict(p.shape()),
                     "seconds": statistics.median(rs), "runs": rs})
    windows = None
    if dblock:
        windows, wrows = measure_window_latency_profile(
            runner, dblock, budget, max_seqs, max_len, opt.n_repeats, rng, opt.quick, max(4, opt.n_heldout // 2),
            (lambda d, t: progress("diffusion windows", d, t)) if progress else None)
        rows += wrows

    def split(name: str) -> tuple[list[BatchShape], list[float]]:
        sel = [r for r in rows if r["split"] == name]
        return [_shape(r) for r in sel], [r["seconds"] for r in sel]

    tr_s, tr_y = split("train")
    ho_s, ho_y = split("heldout")
    if progress:
        progress("fitting", 0, 1)
    meta = {"model": model, "device": device_info(runner.device)["name"]}
    step = StepTimeModel.from_samples(tr_s, tr_y, budget, segments=opt.segments, meta=meta)
    held_err = step.errors(ho_s, ho_y)
    held_err["by_kind"] = {k: step.errors([s for s, r in zip(ho_s, _rows(rows, "heldout")) if r["kind"] == k],
                                          [y for y, r in zip(ho_y, _rows(rows, "heldout")) if r["kind"] == k])
                           for k in ("prefill", "decode", "mixed", "window")}
    step.meta["heldout_error"] = {k: v for k, v in held_err.items() if k != "by_kind"}
    for r in rows:
        r["predicted"] = step.step_time(_shape(r))

    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize
    link = None
    if opt.measure_link:
        if progress:
            progress("KV path", 0, 1)
        if tp > 1:                                           # the driver's export path is the tp1 engine's
            link = measure_kv_link()
        else:
            try:
                link = measure_kv_path(runner, rng, max_tokens=min(max_len, budget))
            except Exception:                                # no ZeroMQ here: the bare socket pair
                link = measure_kv_link()
        if progress:
            progress("KV path", 1, 1)
    interference = None
    if opt.measure_interference and runner.device.type == "cpu" and not opt.quick and not dblock and tp == 1:
        # its co-runs are autoregressive tp1 engines
        interference = measure_interference(cfg, bench, opt.threads,
                                            progress=(lambda d, t: progress("interference", d, t)) if progress else None)
    collective = None
    if opt.measure_collective and runner.device.type == "cpu":
        if progress:
            progress("all-reduces", 0, 1)
        collective = measure_collective(runner, tp, itemsize, budget, opt.quick, in_steps)
        if progress:
            progress("all-reduces", 1, 1)
    ampd = step.ampd_cost_model(max_len, capacity, kv_bytes, cfg.max_num_seqs, link,
                                meta={"model": model, "gpu": meta["device"]}, tp=tp)
    if progress:
        progress("fitting", 1, 1)
    model_cfg = {"architecture": mc.architecture, "layers": mc.num_hidden_layers, "hidden": mc.hidden_size,
                 "intermediate": mc.intermediate_size, "heads": mc.num_attention_heads,
                 "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size,
                 "max_position_embeddings": mc.max_position_embeddings, "params": _param_count(runner),
                 "dtype": str(runner.dtype).removeprefix("torch.")}
    opts = dataclasses.asdict(opt)
    opts.update(repeats=opt.n_repeats, heldout=len(held), train_points=len(train), profiled_max_len=max_len,
                load_avg_before=load_before, load_avg_after=load_avg())
    return Profile(
        model=str(model), device={**device_info(runner.device),
                                  "memory_bandwidth_bytes_per_s": memory_bandwidth(runner.device)},
        torch_version=torch.__version__,
        engine=dataclasses.asdict(cfg), model_config=model_cfg, step_model=step, ampd=ampd,
        num_blocks=runner.num_blocks, block_size=runner.block_size, kv_bytes_per_token=kv_bytes,
        max_model_len=engine_max_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs, heldout_error=held_err, train_error=step.meta["train_error"],
        kv_link=link or dict(DEFAULT_KV_LINK), interference=interference, dllm_latency=windows,
        measurements=rows, options=opts, wall_s=time.perf_counter() - t_start,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        tensor_parallel_size=tp, collective=collective)


def comm_in_steps(runner: ModelRunner, before: tuple[int, float], runs: int, step_s: float) -> dict | None:
    """At tp>1: the all-reduces the driver made in the timed steps (count and seconds per step, share of the step,
    waiting for the other ranks included); None at tp1."""
    if runner.tp.size == 1 or runs == 0:
        return None
    n, s = runner.tp.comm.all_reduces - before[0], runner.tp.comm.all_reduce_s - before[1]
    return {"steps": runs, "all_reduces_per_step": n / runs, "all_reduce_s_per_step": s / runs,
            "share_of_step": s / step_s if step_s > 0 else None}


def measure_collective(runner: ModelRunner, tp: int, itemsize: int, max_tokens: int, quick: bool,
                       in_steps: dict | None) -> CollectiveCost | None:
    """All-reduces of `tp` ranks (at tp1: of every 2..cores ranks, up to 8) timed on this host, and the count one
    step makes, counted from the loaded model; None when this host has one core (no second rank to run)."""
    mc = runner.model_config
    counts = [tp] if tp > 1 else list(range(2, min(usable_cpus(), 8) + 1))
    if not counts:
        return None
    bpt = mc.hidden_size * itemsize
    sizes = step_sizes(bpt, max_tokens, quick)
    try:
        fits = {n: measure_all_reduce(n, sizes, repeats=20 if quick else 40) for n in counts}
    except RuntimeError as e:
        if tp > 1:
            raise
        log.warning("%s: the profile prices tp1 workers only", e)     # a tp1 profile stands without it
        return None
    return CollectiveCost(all_reduces_per_step(runner.model), bpt, "gloo", fits, in_steps)


def _rows(rows: Iterable[dict], split: str) -> list[dict]:
    return [r for r in rows if r["split"] == split]


def _shape(r: dict) -> BatchShape:
    return BatchShape(r["prefill_tokens"], r["prefill_attn_pairs"], r["prefill_kv_read_tokens"], r["num_prefill"],
                      r["num_decode"], r["decode_ctx_tokens"])
