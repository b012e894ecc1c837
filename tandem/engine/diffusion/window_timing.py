"""Timing a block-diffusion model's window steps: Optimus's T(c, b) measured on the engine's own forward.

One implementation serves both places that measure it: the engine at start-up (`measure_window_latency`: a quick fit
of the forward over windows of the block size, no cache, the LM head and sampling timed once and charged per sampled
row apart from it, and a cost per sequence from a few whole steps) and `tandem profile`
(`WindowTimer`'s whole steps: b windows of c positions over a cached context read from the KV pool, the step's
inputs built, the forward, the LM head and greedy sampling over every row, as the engine's step runs them; the head's
share per row is timed apart too, since a step's K/V writes run the forward but are not sampled).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import torch

from tandem.engine.diffusion.block_state import Window, build_step
from tandem.engine.diffusion.unmasking import sample_tokens
from tandem.policy.optimus.latency import ChunkLatency

Clock = Callable[[], float]


class WindowTimer:
    """Seconds of one diffusion step of given window sizes (one sequence each), optionally over a cached context."""

    def __init__(self, model: torch.nn.Module, block: int, device: torch.device, *, context: int = 0,
                 kv_caches: list[torch.Tensor] | None = None, kv_block_size: int = 1, num_blocks: int = 0,
                 clock: Clock = time.perf_counter, repeats: int = 2, head_rows: int = 256) -> None:
        """`context` cached tokens per window (whole diffusion blocks, read from `kv_caches`, each sequence on its own
        KV blocks cycling through the `num_blocks` of the pool); the LM head runs `head_rows` rows at a time; every
        timing is the best of `repeats`."""
        if context % block or context < 0:
            raise ValueError(f"a window's cached context is whole blocks of {block}, got {context}")
        if context and (kv_caches is None or num_blocks < 1):
            raise ValueError("a cached context needs the KV pool (kv_caches, num_blocks)")
        self.model, self.block, self.device, self.context = model, block, device, context
        self.kv_caches, self.kv_block_size, self.num_blocks = kv_caches, kv_block_size, num_blocks
        self.clock, self.repeats, self.head_rows = clock, repeats, max(1, head_rows)
        self._per_row: float | None = None

    def _inputs(self, sizes: Sequence[int]):
        """The step's token ids and metadata: window i computes positions context..context+c-1 of sequence i."""
        ctx = self.context
        per_seq = -(-ctx // self.kv_block_size) if ctx else 1
        n = max(1, self.num_blocks)
        wins, tables = [], []
        for i, c in enumerate(sizes):
            pos = list(range(ctx, ctx + c))
            wins.append(Window(pos, [0] * c, [], [], ctx, [], list(range(c)), True))
            tables.append([(i * per_seq + j) % n for j in range(per_seq)])
        return build_step(wins, tables, self.kv_block_size if ctx else 1, self.block, self.device)

    def _timed(self, fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(self.repeats):
            t0 = self.clock()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, self.clock() - t0)
        return best

    def _head(self, hidden: torch.Tensor, sizes: Sequence[int]) -> None:
        """The LM head over every row, `head_rows` at a time (each group's logits freed), and greedy sampling of each
        window's rows apart, as the engine's step samples each sequence."""
        ends = [0]
        for c in sizes:
            ends.append(ends[-1] + c)
        w = 0
        for s in range(0, hidden.shape[0], self.head_rows):
            logits = self.model.compute_logits(hidden[s:s + self.head_rows])
            while w < len(sizes) and ends[w] < s + logits.shape[0]:
                lo, hi = max(ends[w], s), min(ends[w + 1], s + logits.shape[0])
                sample_tokens(logits[lo - s:hi - s])
                if ends[w + 1] > hi:
                    break
                w += 1

    @torch.inference_mode()
    def per_row(self) -> float:
        """Seconds of the LM head and greedy sampling per sampled row, timed once on `head_rows` rows in windows of
        the block."""
        if self._per_row is None:
            sizes = _split(self.head_rows, self.block)
            ids, meta, _ = self._inputs(sizes)
            hidden = self.model(ids, None, self.kv_caches if self.context else None, meta)
            self._per_row = self._timed(lambda: self._head(hidden, sizes)) / self.head_rows
        return self._per_row

    @torch.inference_mode()
    def forward(self, sizes: Sequence[int]) -> float:
        """Seconds of the forward alone of a step of windows of these sizes (at least 1 µs)."""
        ids, meta, _ = self._inputs(sizes)
        kv = self.kv_caches if self.context else None
        return max(self._timed(lambda: self.model(ids, None, kv, meta)), 1e-6)

    @torch.inference_mode()
    def __call__(self, sizes: Sequence[int]) -> float:
        """Seconds of a whole step of windows of these sizes, as the engine's runs: the inputs built, the forward, the
        LM head and greedy sampling of every row (at least 1 µs)."""
        kv = self.kv_caches if self.context else None

        def step() -> None:
            ids, meta, _ = self._inputs(sizes)
            self._head(self.model(ids, None, kv, meta), sizes)
        return max(self._timed(step), 1e-6)


def _split(x: int, block: int) -> list[int]:
    """x query tokens as windows of `block` positions, the last one partial."""
    return [min(block, x - s) for s in range(0, x, block)]


PER_SEQ_PROBES = (1, 4, 8)      # k: k blocks' rows as k windows of the block against k·B windows of one position


@torch.inference_mode()
def measure_window_latency(model: torch.nn.Module, block: int, max_tokens: int, device: torch.device,
                           clock: Clock = time.perf_counter, repeats: int = 2, head_rows: int = 256,
                           context: int = 0, kv_caches: list[torch.Tensor] | None = None, kv_block_size: int = 1,
                           num_blocks: int = 0, max_seqs: int = 0) -> ChunkLatency:
    """Optimus's T(c, b) fitted on this engine's own step: the forward over windows of `block` positions (over
    `context` cached tokens from the KV pool when given, else no cache), b·c query tokens at the sizes ChunkLatency
    samples, and apart from it the LM head and sampling per sampled row (timed once on `head_rows`); best of
    `repeats`. With `max_seqs`, also the cost per sequence b·c does not see (building its window's inputs, sampling
    it, its attention): the median over a few row counts of whole steps of windows of one position against windows of
    the block, per extra sequence."""
    kw = dict(context=context, kv_caches=kv_caches, kv_block_size=kv_block_size, num_blocks=num_blocks, clock=clock,
              repeats=repeats, head_rows=max(1, min(head_rows, max_tokens)))
    timer = WindowTimer(model, block, device, **kw)
    fit = ChunkLatency.sample(lambda x: timer.forward(_split(x, block)), max_tokens=max(2, max_tokens))
    fit = dataclasses.replace(fit, head_s=timer.per_row())
    extra = [(timer([1] * (k * block)) - timer([block] * k)) / (k * block - k)
             for k in PER_SEQ_PROBES if k * block <= min(max_tokens, max_seqs)]
    return dataclasses.replace(fit, per_seq_s=max(0.0, statistics.median(extra))) if extra else fit


__all__ = ["WindowTimer", "measure_window_latency"]
