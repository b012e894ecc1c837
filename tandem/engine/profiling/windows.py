"""The diffusion windows `tandem profile` times on a block-diffusion checkpoint, and Optimus's T(c, b) fitted to them.

A window step is b sequences computing c positions each over a cached context (whole blocks read from the KV pool),
its inputs built, the forward run and every row through the LM head and greedy sampling (WindowTimer's whole
steps: the same code as the engine's start-up measurement). The training grid crosses window sizes with batch sizes
up to the token budget; a random held-out set of (c, b) off the grid gives the fit's error. The head's share per row
is timed apart and taken out before the fit, so that T prices a step's unsampled rows (its K/V writes) by their
forward alone.
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable

from tandem.engine.diffusion.window_timing import WindowTimer
from tandem.engine.model_runner import ModelRunner
from tandem.engine.profiling.timing import measure_rounds
from tandem.perf.batch_shape import BatchShape
from tandem.perf.step_model import rel_errors
from tandem.perf.window_profile import WindowLatencyProfile
from tandem.policy.optimus.latency import ChunkLatency

CONTEXT = 512               # cached tokens per window (ShareGPT's prompt and half an answer), within max_len
QUICK_TOKENS = 256          # --quick: the largest step b·c
HEAD_FLOOR = 0.05           # a sample's forward, its head taken out, is at least this share of it (timing noise)


@dataclass(frozen=True)
class WindowPoint:
    """One window step: b sequences, c query positions each."""

    c: int
    b: int

    @property
    def tokens(self) -> int:
        return self.c * self.b

    def shape(self, context: int) -> BatchShape:
        """The BatchShape the worker core gives this step (b windows of c rows over `context` cached tokens each)."""
        s = BatchShape()
        for _ in range(self.b):
            s.add_window(context, self.c)
        return s


def _sizes(block: int, quick: bool) -> list[int]:
    """Window sizes measured: powers of two up to the block and the block itself (fewer with --quick)."""
    pows = [1 << k for k in range(int(math.log2(block)) + 1)]
    sizes = pows[::2] if quick else pows
    return sorted(set(sizes) | {block})


def window_grid(block: int, budget: int, max_seqs: int, quick: bool = False) -> list[WindowPoint]:
    """Every window size by powers-of-two batches, b·c within the budget (QUICK_TOKENS with --quick)."""
    cap = min(budget, QUICK_TOKENS) if quick else budget
    return [WindowPoint(c, 1 << k) for c in _sizes(block, quick) for k in range(int(math.log2(max(1, cap))) + 1)
            if (1 << k) * c <= cap and (1 << k) <= max_seqs]


def window_heldout(count: int, block: int, budget: int, max_seqs: int, rng: random.Random,
                   quick: bool = False, exclude: frozenset[WindowPoint] = frozenset()) -> list[WindowPoint]:
    """Random (c, b) off the grid: c uniform in 1..block, b log-uniform up to the budget's room."""
    cap = min(budget, QUICK_TOKENS) if quick else budget
    out: list[WindowPoint] = []
    for _ in range(100 * count):
        if len(out) >= count:
            break
        c = rng.randint(1, min(block, cap))
        top = max(1, min(max_seqs, cap // c))
        p = WindowPoint(c, int(round(math.exp(rng.uniform(0.0, math.log(top))))))
        if p not in exclude and p not in out:
            out.append(p)
    return out


def window_context(block: int, max_len: int) -> int:
    """The cached context of every measured window: CONTEXT, within max_len with room for a block, whole blocks."""
    return max(0, min(CONTEXT, max_len - block) // block * block)


def measure_window_latency_profile(runner: ModelRunner, block: int, budget: int, max_seqs: int, max_len: int,
                                   repeats: int, rng: random.Random, quick: bool, heldout: int,
                                   progress: Callable[[int, int], None] | None = None
                                   ) -> tuple[WindowLatencyProfile, list[dict]]:
    """Time the window grid and a held-out set, fit ChunkLatency on the grid; the section and the step rows (kind
    `window`, with their BatchShape fields) the step-time model is also fitted to."""
    context = window_context(block, max_len)
    timer = WindowTimer(runner.model, block, runner.device, context=context, kv_caches=runner.kv_caches,
                        kv_block_size=runner.block_size, num_blocks=runner.num_blocks, repeats=1)
    train = window_grid(block, budget, max_seqs, quick)
    held = window_heldout(heldout, block, budget, max_seqs, rng, quick, frozenset(train))
    jobs = [("train", p) for p in train] + [("heldout", p) for p in held]
    rng.shuffle(jobs)
    for p in (WindowPoint(block, 1), WindowPoint(1, 8)):     # warm-up
        timer([p.c] * p.b)
    runs = measure_rounds(lambda p: timer([p.c] * p.b), [p for _, p in jobs], repeats, 1.0, rng, progress)
    samples = [{"split": split, "c": p.c, "b": p.b, "tokens": p.tokens, "seconds": statistics.median(rs), "runs": rs}
               for (split, p), rs in zip(jobs, runs)]
    section = fit_window_latency(samples, block, context, head_s=timer.per_row())
    rows = [{"split": s["split"], "kind": "window", "prefills": [], "decodes": [],
             "window": {"c": s["c"], "b": s["b"], "context": context},
             **dataclasses.asdict(WindowPoint(s["c"], s["b"]).shape(context)), "seconds": s["seconds"], "runs": s["runs"]}
            for s in samples]
    return section, rows


def fit_window_latency(samples: list[dict], block: int, context: int, head_s: float = 0.0) -> WindowLatencyProfile:
    """ChunkLatency fitted to the training samples (whole steps, every row sampled) less `head_s` per row, with that
    head charge apart; each sample's prediction, and the train and held-out errors."""
    sec = WindowLatencyProfile((), ((0.0, 0.0),), 0.0, block, context, samples)
    c, b, y = sec.points("train")
    fwd = [max(yi - head_s * ci * bi, HEAD_FLOOR * yi) for ci, bi, yi in zip(c, b, y)]
    m = dataclasses.replace(ChunkLatency.fit([ci * bi for ci, bi in zip(c, b)], fwd, seqs=b), head_s=head_s)
    for s in samples:
        s["predicted"] = m(int(s["c"]), int(s["b"]))
    hc, hb, hy = sec.points("heldout")
    sec.breakpoints, sec.coefs, sec.floor_s, sec.per_seq_s = m.breakpoints, m.coefs, m.floor_s, m.per_seq_s
    sec.head_s = m.head_s
    sec.train_error = rel_errors([m(ci, bi) for ci, bi in zip(c, b)], y)
    sec.heldout_error = rel_errors([m(ci, bi) for ci, bi in zip(hc, hb)], hy)
    return sec


__all__ = ["WindowPoint", "window_grid", "window_heldout", "window_context", "measure_window_latency_profile",
           "fit_window_latency"]
