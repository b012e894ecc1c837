"""The timing harness of `tandem profile`: builds a ModelInput for a Point and times its execution in rounds.

A step's time is the building of its ModelInput plus `ModelRunner.execute` (forward, KV write, greedy
sampling of one row per sequence). History is KV already in the pool: a step's block table points at
blocks whose contents do not matter for timing.
"""
from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

import torch

from tandem.engine.model_input import ModelInput
from tandem.engine.model_runner import ModelRunner
from tandem.engine.profiling.grids import Point
from tandem.engine.sampling_params import SamplingParams


AGREE = 1.1             # runs within 10% of each other need no more runs
EXTRA_ROUNDS = 4        # more runs (up to repeats + 4) for cheap steps whose runs disagree
CHEAP_S = 0.25          # a step is cheap while all its runs so far took less than this together
P = TypeVar("P")


class Bench:
    """Builds a ModelInput for a Point (random tokens, scattered distinct blocks) and times its execution."""

    def __init__(self, runner: ModelRunner, rng: random.Random) -> None:
        self.runner = runner
        self.rng = rng
        vocab = runner.model_config.vocab_size
        self.tokens = [rng.randrange(vocab) for _ in range(1 << 16)]
        self.blocks = list(range(runner.num_blocks))
        rng.shuffle(self.blocks)
        self.params = SamplingParams(temperature=0.0)
        self.cuda = runner.device.type == "cuda"

    def _table(self, start: int, n_tokens: int) -> tuple[list[int], int]:
        nb = -(-n_tokens // self.runner.block_size)
        return self.blocks[start:start + nb], start + nb

    def batch(self, p: Point) -> ModelInput:
        """One step's input: each prefill chunk and each decode is its own sequence and samples a row."""
        b = ModelInput()
        off = self.rng.randrange(max(1, self.runner.num_blocks - p.blocks(self.runner.block_size) + 1))
        toks, nt = self.tokens, len(self.tokens)
        for h, n in p.prefills:
            table, off = self._table(off, h + n)
            s = (h * 7919) % (nt - n) if nt > n else 0
            b.add(toks[s:s + n], h, table)
            self._sample(b)
        for c in p.decodes:
            table, off = self._table(off, c + 1)
            b.add([toks[c % nt]], c, table)
            self._sample(b)
        return b

    def _sample(self, b: ModelInput) -> None:
        b.sample_rows.append(len(b.query_lens) - 1)
        b.params.append(self.params)
        b.generators.append(None)
        b.output_tokens.append([])
        b.prompt_tokens.append([])

    def run(self, p: Point) -> float:
        """Seconds of one step: building its input and executing it (synchronised on CUDA)."""
        t0 = time.perf_counter()
        batch = self.batch(p)
        self.runner.execute(batch)
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter() - t0

    def measure(self, points: list[Point], repeats: int, budget_s: float,
                progress: Callable[[int, int], None] | None = None) -> list[list[float]]:
        """Timed runs of every step in rounds (measure_rounds)."""
        return measure_rounds(self.run, points, repeats, budget_s, self.rng, progress)


def measure_rounds(run: Callable[[P], float], points: list[P], repeats: int, budget_s: float, rng: random.Random,
                   progress: Callable[[int, int], None] | None = None) -> list[list[float]]:
    """Timed runs of every step, in rounds over all of them (each round in a fresh random order), so
    that a burst of load on a shared machine hits one run of many steps rather than every run of a few.

    `repeats` rounds, except that after two rounds a step that already took budget_s is skipped when
    its runs agree within AGREE; then up to EXTRA_ROUNDS more rounds for cheap steps (under CHEAP_S
    so far) whose runs still disagree, since scheduling jitter weighs most on short steps."""
    runs: list[list[float]] = [[] for _ in points]
    spent = [0.0] * len(points)
    rounds = repeats + EXTRA_ROUNDS
    total = rounds * len(points)
    done = 0
    for r in range(rounds):
        order = list(range(len(points)))
        rng.shuffle(order)
        for i in order:
            done += 1
            rs = runs[i]
            agree = bool(rs) and max(rs) <= AGREE * min(rs)
            if r >= repeats:
                if agree or spent[i] >= CHEAP_S:
                    continue
            elif r >= 2 and spent[i] >= budget_s and agree:
                continue
            t = run(points[i])
            rs.append(t)
            spent[i] += t
            if progress and (done % 8 == 0 or done == total):
                progress(done, total)
    if progress:
        progress(total, total)
    return runs
