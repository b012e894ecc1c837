"""Measures how much slower a step runs while a second engine process on this host steps beside it."""
from __future__ import annotations

import dataclasses
import random
import statistics
from typing import Callable

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.profiling.grids import Point
from tandem.engine.profiling.timing import Bench


# Steps the interference measurement times (victims) and what the co-running engine process repeats.
_VICTIMS = {"prefill": [Point("prefill", ((0, 256),)), Point("prefill", ((512, 64),))],
            "decode": [Point("decode", decodes=(512,)), Point("decode", decodes=(512,) * 4)]}
_CORUN = {"decode": Point("decode", decodes=(512, 512)), "prefill": Point("prefill", ((0, 256),))}


def _corunner(cfg_dict: dict, threads: int | None, kind: str, ready, stop) -> None:
    """Child process: load the engine and run `_CORUN[kind]` steps back to back until told to stop."""
    if threads:
        torch.set_num_threads(threads)
    cfg = EngineConfig(**cfg_dict)
    runner = ModelRunner(cfg)
    bench = Bench(runner, random.Random(1))
    p = _CORUN[kind]
    for _ in range(3):
        bench.run(p)
    ready.set()
    while not stop.is_set():
        bench.run(p)


def measure_interference(cfg: EngineConfig, bench: Bench, threads: int | None, rounds: int = 5,
                         progress: Callable[[int, int], None] | None = None) -> dict:
    """How much slower a step runs while another engine process on this host steps (CPU: shared cores,
    caches, memory bandwidth). In a 1P+1D deployment a prefill step overlaps the decode worker's steps and a
    decode step the prefill worker's, so prefill steps are timed beside a process repeating a decode step
    (2 sequences, context 512) and decode steps beside one repeating a 256-token prefill chunk. Factor =
    median co-run time / median solo time over `_VICTIMS`, solo and co-run rounds alternating."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    fits = [p for ps in _VICTIMS.values() for p in ps
            if p.tokens <= bench.runner.cfg.max_num_batched_tokens and p.blocks(bench.runner.block_size) * 2
            <= bench.runner.num_blocks and all(h + n <= (cfg.max_model_len or 1 << 30) for h, n in p.prefills)]
    solo: dict[Point, list[float]] = {p: [] for p in fits}
    co: dict[Point, list[float]] = {p: [] for p in fits}
    total, done = 2 * rounds * 2, 0
    cfg_dict = dataclasses.asdict(cfg)
    for victim_kind, co_kind in (("prefill", "decode"), ("decode", "prefill")):
        pts = [p for p in fits if p.kind == victim_kind]
        if not pts:
            continue
        ready, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_corunner, args=(cfg_dict, threads, co_kind, ready, stop), daemon=True)
        for r in range(rounds):
            for p in pts:
                solo[p].append(bench.run(p))
            done += 1
            if r == 0:
                proc.start()
                if not ready.wait(120):
                    proc.kill()
                    raise RuntimeError("the co-running engine process did not start")
            for p in pts:
                co[p].append(bench.run(p))
            done += 1
            if progress:
                progress(done, total)
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    out: dict = {"source": "measured: steps timed beside a second engine process stepping (1 thread each)",
                 "points": []}
    for kind in ("prefill", "decode"):
        ratios = []
        for p in fits:
            if p.kind == kind and solo[p] and co[p]:
                a, b = statistics.median(solo[p]), statistics.median(co[p])
                ratios.append(b / a)
                out["points"].append({**p.to_dict(), "solo_s": a, "corun_s": b, "factor": b / a})
        out[kind] = max(1.0, statistics.median(ratios)) if ratios else 1.0
    return out
