"""Block-diffusion decoding inside the engine: the worker core's step plan (prefill chunks, each decoding sequence's
window size and commit cap) turned into one block-diffusion forward, and its candidates sampled and committed per
request (block_state.py); the engine streams each request's longest committed prefix.

The core decides everything about a step (which sequences, how many positions each computes and may commit: Optimus's
chunk, elastic or fixed, or the whole block); this module only builds the windows the core sized, runs them, and
reports what each sequence committed back to the core.

In dLLM-Serve mode (the engine's `dllm_admission`) the core plans phases instead of windows: a sequence's step is
FULL or REFRESH (the whole sequence recomputed; REFRESH packs its sparse KV) or REUSE (the active block against the
packed KV), built and committed by refresh.py's per-sequence step (the decoding loop generate_refresh runs the same
one). Each request's packed KV lives in the engine's paged KV pool, in the blocks the core reserved for it at
admission (⌈ρ·(P + G)⌉ positions per head: PagedSparseKV), so the pool, the memory budget and admission agree.

A LLaDA-style (bidirectional) model runs only in that mode (`canvas`): each request is a llada_generate.CanvasState
(the prompt, then G rounded up to whole blocks of masks, blocks from the prompt's end; the core's span `canvas`), and
the same per-sequence step makes a Refresh the whole canvas and a Reuse the active block and the masks after it over
the packed prefix: Fast-dLLM's prefix cache, dense at ρ = 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import torch

from tandem.engine.diffusion.block_state import BlockState, Window, build_step, prefill_window
from tandem.engine.diffusion.llada_generate import CanvasState
from tandem.engine.diffusion.refresh import PhaseWindow, build_phase_step, commit_window, phase_window
from tandem.engine.diffusion.sparse_attention import SparseKVBackend
from tandem.engine.diffusion.sparse_kv import PagedSparseKV, SparseKVConfig
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.sampling_params import SamplingParams, check_diffusion
from tandem.policy.dllm_serve import Phase

@dataclass
class DiffusionBatch:
    """One step's windows, the block table of each, who owns them, and which are decode windows."""

    windows: list[Window | PhaseWindow] = field(default_factory=list)   # PhaseWindows only in dLLM-Serve mode
    tables: list[list[int]] = field(default_factory=list)
    owners: list[str | None] = field(default_factory=list)     # session id of a decode window, None for a prefill
    tokens: int = 0
    phased: bool = False                                       # dLLM-Serve phases (PhaseWindows)


class DiffusionDecoder:
    """The engine's diffusion side: per-session decoding states, and each step's forward and commits."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], kv_block_size: int, block: int,
                 streaming: bool, defaults: DllmConfig, eos: Sequence[int], max_model_len: int,
                 device: torch.device, max_num_logits: int | None = None,
                 sparse: SparseKVConfig | None = None, canvas: bool = False) -> None:
        """Decode with the model over the engine's KV pool; with `sparse`, in dLLM-Serve's phases (set kv_slots);
        `canvas`: a LLaDA-style bidirectional model (phases only)."""
        if canvas and sparse is None:
            raise ValueError("a LLaDA-style canvas is decoded in dLLM-Serve phases: give `sparse`")
        self.model, self.kv_caches, self.kv_block_size = model, kv_caches, kv_block_size
        self.block, self.streaming, self.defaults = block, streaming, defaults
        self.eos = frozenset(eos)
        self.max_model_len, self.device = max_model_len, device
        self.max_num_logits = max_num_logits
        self.states: dict[str, BlockState] = {}
        self.sparse = sparse                                   # dLLM-Serve mode: the selection options
        self.canvas = canvas                                   # LLaDA: CanvasStates, bidirectional attention
        self.backend = SparseKVBackend(sparse, bidirectional=canvas) if sparse is not None else None
        self.kv_slots: Callable[[int, int], int] | None = None   # (P, G) -> the buffer the core reserves per request
        self.buffers: dict[str, PagedSparseKV] = {}
        self.packed: dict[str, int] = {}                       # session -> the block start of its last Refresh
        self.layers = list(range(len(kv_caches)))              # the sparse backend's kv entries: layer indices

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
        block to decode (its tokens are computed with its windows)."""
        end = start + n
        if final:
            end = end // self.block * self.block
        if end > start:
            batch.windows.append(prefill_window(start, tokens[start:end]))
            batch.tables.append(table)
            batch.owners.append(None)
            batch.tokens += end - start

    def decode(self, batch: DiffusionBatch, sid: str, state: BlockState, c: int, rows: int, table: list[int],
               streaming: bool | None = None) -> None:
        """A decoding sequence's window as the core sized it: the whole block in block mode, else c masked positions
        besides the K/V writes and prompt tokens it carries; `rows`, the core's count of the window's positions, must
        be the window's (RuntimeError otherwise: the core would price and budget another step than the one run).
        `streaming`: the sequence's own mode, as the core decided it (None: the decoder's)."""
        w = state.window(c, reuse=self.streaming if streaming is None else streaming)
        if len(w.positions) != rows:
            raise RuntimeError(f"session {sid!r}: the core planned a window of {rows} positions, the decoding state "
                               f"has {len(w.positions)}")
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

    def start_phases(self, sid: str, tokens: list[int], params: SamplingParams, table: list[int],
                     max_tokens: int) -> BlockState:
        """dLLM-Serve mode: the decoding state of a request the core just admitted (nothing of it is cached; its
        first step recomputes it; `max_tokens`: its G, the core's) and its packed-KV buffer over the KV blocks the
        core reserved (`table`)."""
        if self.canvas:
            params = params.clone()
            params.max_tokens = max_tokens
            gen_length = -(-max_tokens // self.block) * self.block
            st = CanvasState(tokens, params, self.options(params), self.block, self.model.mask_token_id, self.eos,
                             gen_length, self.device)
        else:
            st = BlockState(tokens, params, self.options(params), self.block, self.model.mask_token_id, self.eos,
                            self.max_model_len, self.device)
        self.buffers[sid] = PagedSparseKV(self.kv_caches, table, self.kv_block_size, self.kv_slots(st.P, st.max_tokens))
        self.states[sid] = st
        return st

    def phase(self, batch: DiffusionBatch, sid: str, state: BlockState, phase: Phase) -> None:
        """dLLM-Serve mode: the sequence's step in the phase the core planned (RuntimeError when the core plans a
        Reuse of a block this engine has not packed: the two would disagree on the block's boundaries)."""
        if phase is Phase.REUSE and self.packed.get(sid) != state.start:
            raise RuntimeError(f"session {sid!r}: a Reuse step planned for the block at {state.start}, which no "
                               f"Refresh packed")
        if phase is Phase.REFRESH:
            self.packed[sid] = state.start
        w = phase_window(state, phase, self.buffers[sid])
        batch.phased = True
        batch.windows.append(w)
        batch.tables.append([])
        batch.owners.append(sid)
        batch.tokens += len(w.ids)

    @torch.inference_mode()
    def execute(self, batch: DiffusionBatch) -> dict[str, int]:
        """Run the step's forward (writing the K/V it writes) and commit every decode window's candidates; returns
        the tokens each session committed."""
        if not batch.windows:
            return {}
        if batch.phased:
            ids, meta, rows = build_phase_step(batch.windows, self.block, self.backend, self.device)
            hidden = self.model(ids, None, self.layers, meta).index_select(0, rows)
            work = [(sid, len(w.cand), partial(commit_window, self.states[sid], w))
                    for sid, w in zip(batch.owners, batch.windows)]
        else:
            ids, meta, rows = build_step(batch.windows, batch.tables, self.kv_block_size, self.block, self.device)
            hidden = self.model(ids, None, self.kv_caches, meta).index_select(0, rows)
            work = [(sid, len(w.rows), partial(self.states[sid].apply, w))
                    for sid, w in zip(batch.owners, batch.windows) if sid is not None]
        return self._commit(hidden, work)

    def _commit(self, hidden: torch.Tensor, work: list[tuple[str, int, Callable[[torch.Tensor], int]]]
                ) -> dict[str, int]:
        """Each sequence's candidate rows (k of them, in order in `hidden`) sampled and committed by its function;
        the LM head over groups of sequences of at most max_num_logits rows (unless one sequence has more), each
        group's logits freed before the next."""
        committed: dict[str, int] = {}
        cap = self.max_num_logits
        off, i = 0, 0
        while i < len(work):
            j, n = i, 0
            while j < len(work) and (j == i or cap is None or n + work[j][1] <= cap):
                n += work[j][1]
                j += 1
            logits = self.model.compute_logits(hidden[off:off + n]) if n else None
            a = 0
            for sid, k, fn in work[i:j]:
                committed[sid] = fn(logits[a:a + k] if k else torch.empty(0))
                a += k
            off += n
            i = j
        return committed

    def drop(self, sid: str) -> None:
        """Forget a session's decoding state (its round ended, was aborted or failed) and its packed-KV view."""
        self.states.pop(sid, None)
        self.buffers.pop(sid, None)
        self.packed.pop(sid, None)
