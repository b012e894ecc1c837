"""Block-diffusion decoding inside the engine: the worker core's step plan (prefill chunks, each decoding sequence's
window size and commit cap) turned into one block-diffusion forward, and its candidates sampled and committed per
request (block_state.py); the engine streams each request's longest committed prefix.

The core decides everything about a step (which sequences, how many positions each computes and may commit: Optimus's
chunk, elastic or fixed, or the whole block); this module only builds the windows the core sized, runs them, and
reports what each sequence committed back to the core.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tandem.engine.diffusion.block_state import BlockState, Window, build_step, prefill_window
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.sampling_params import SamplingParams, check_diffusion
from tandem.policy.optimus.latency import ChunkLatency

@dataclass
class DiffusionBatch:
    """One step's windows, the block table of each, who owns them, and which are decode windows."""

    windows: list[Window] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    owners: list[str | None] = field(default_factory=list)     # session id of a decode window, None for a prefill
    tokens: int = 0


class DiffusionDecoder:
    """The engine's diffusion side: per-session decoding states, and each step's forward and commits."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], kv_block_size: int, block: int,
                 streaming: bool, defaults: DllmConfig, eos: Sequence[int], max_model_len: int,
                 device: torch.device, max_num_logits: int | None = None) -> None:
        self.model, self.kv_caches, self.kv_block_size = model, kv_caches, kv_block_size
        self.block, self.streaming, self.defaults = block, streaming, defaults
        self.eos = frozenset(eos)
        self.max_model_len, self.device = max_model_len, device
        self.max_num_logits = max_num_logits
        self.states: dict[str, BlockState] = {}

    def options(self, params: SamplingParams) -> DllmConfig:
        """The request's decoding options: its own where it sets them, else the engine's (ValueError names one)."""
        d = self.defaults
        check_diffusion(params, self.block)
        steps = params.dllm_denoising_steps if params.dllm_denoising_steps is not None else d.dllm_denoising_steps
        return DllmConfig(self.block, params.dllm_unmasking_strategy or d.dllm_unmasking_strategy, steps,
                          params.dllm_confidence_threshold if params.dllm_confidence_threshold is not None
                          else d.dllm_confidence_threshold)

    # ------------------------------------------------------------------ a step
    def prefill(self, batch: DiffusionBatch, tokens: list[int], start: int, n: int, final: bool,
                table: list[int]) -> None:
        """A prefill chunk [start, start+n) of a sequence, whole blocks only: the last, partial block is the first
        block to decode (its tokens are computed with its first window)."""
        end = start + n
        if final:
            end = end // self.block * self.block
        if end > start:
            batch.windows.append(prefill_window(start, tokens[start:end]))
            batch.tables.append(table)
            batch.owners.append(None)
            batch.tokens += end - start

    def decode(self, batch: DiffusionBatch, sid: str, state: BlockState, q: int, cap: int, free: int,
               table: list[int]) -> None:
        """A decoding sequence's window of the sizes the core chose (whole block in block mode): q positions, at
        most cap of them masked, and `free` prompt tokens besides."""
        w = state.window(q, cap, reuse=self.streaming, free=free)
        batch.windows.append(w)
        batch.tables.append(table)
        batch.owners.append(sid)
        batch.tokens += len(w.positions)

    def start(self, sid: str, tokens: list[int], params: SamplingParams) -> BlockState:
        """The decoding state of a sequence whose prompt (the whole conversation) was just prefilled."""
        st = BlockState(tokens, params, self.options(params), self.block, self.model.mask_token_id, self.eos,
                        self.max_model_len, self.device)
        st.prefilled()
        self.states[sid] = st
        return st

    @torch.inference_mode()
    def execute(self, batch: DiffusionBatch) -> dict[str, int]:
        """Run the step's forward (writing the K/V it writes) and commit every decode window's candidates; returns
        the tokens each session committed."""
        if not batch.windows:
            return {}
        ids, meta, rows = build_step(batch.windows, batch.tables, self.kv_block_size, self.block, self.device)
        hidden = self.model(ids, None, self.kv_caches, meta).index_select(0, rows)
        committed: dict[str, int] = {}
        cap = self.max_num_logits
        off = 0
        group: list[tuple[str, Window, int]] = []        # decode windows whose logits are computed together
        n_rows = 0
        for sid, w in zip(batch.owners, batch.windows):
            if sid is None:
                continue
            if group and cap is not None and n_rows + len(w.rows) > cap:
                off = self._commit_group(hidden, group, off, committed)
                group, n_rows = [], 0
            group.append((sid, w, len(w.rows)))
            n_rows += len(w.rows)
        if group:
            self._commit_group(hidden, group, off, committed)
        return committed

    def _commit_group(self, hidden: torch.Tensor, group: list[tuple[str, Window, int]], off: int,
                      committed: dict[str, int]) -> int:
        """The LM head over a group of windows' candidate rows (at most max_num_logits unless one window is more),
        each window's sampled and committed from its slice; returns the next row offset."""
        n = sum(k for _, _, k in group)
        logits = self.model.compute_logits(hidden[off:off + n]) if n else None
        a = 0
        for sid, w, k in group:
            state = self.states[sid]
            c = state.apply(w, logits[a:a + k] if k else torch.empty(0))
            committed[sid] = c
            a += k
        return off + n

    def drop(self, sid: str) -> None:
        """Forget a session's decoding state (its round ended, was aborted or failed)."""
        self.states.pop(sid, None)


def measure_window_latency(model: torch.nn.Module, block: int, max_tokens: int, device: torch.device,
                           clock: Callable[[], float] = time.perf_counter, repeats: int = 2,
                           head_rows: int = 256) -> ChunkLatency:
    """Optimus's T(c, b) fitted on this engine's own step: windows of `block` positions over no cache, b·c query
    tokens at the sizes ChunkLatency samples, plus the LM head over every row (a window samples its masked positions,
    most of its rows: linear in the rows, timed once on `head_rows`); best of `repeats`; the KV pool is not touched."""
    def timed(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, clock() - t0)
        return best

    def windows(x: int):
        wins = []
        for s in range(0, x, block):
            k = min(block, x - s)
            wins.append(Window(list(range(k)), [0] * k, [], [], 0, [], [], True))
        return build_step(wins, [[0]] * len(wins), 1, block, device)

    with torch.inference_mode():
        rows = max(1, min(head_rows, max_tokens))
        ids, meta, _ = windows(rows)
        hidden = model(ids, None, None, meta)
        per_row = timed(lambda: model.compute_logits(hidden)) / rows

        def step(x: int) -> float:
            ids, meta, _ = windows(x)
            return max(timed(lambda: model(ids, None, None, meta)) + per_row * x, 1e-6)
        return ChunkLatency.sample(step, max_tokens=max(2, max_tokens))
