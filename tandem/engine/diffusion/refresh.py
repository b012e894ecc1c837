"""Block-diffusion decoding with dLLM-Serve's Refresh and Reuse phases and head-centric sparse KV, for SDAR (the
per-sequence step below also serves LLaDA-style canvases in the engine: llada_generate.CanvasState, span `canvas`).

The phases are the core's (tandem/policy/dllm_serve/phases.py, `PhaseSpec.phase_at`, dLLM-Serve's SparseConfig
semantics): the active block's step j is

- `full` for j < `delay_step`: the whole sequence recomputed with dense attention, nothing cached;
- `refresh` for j = `delay_step` (and, with `refresh_interval` k > 0, for j = delay_step + i·k): the whole sequence
  recomputed with dense attention, and each layer's cached positions (everything before the active block) scored
  by the block's mean query, selected per head and packed into the request's buffer (sparse_kv, sparse_attention);
- `reuse` otherwise: only the active block is computed, against the packed buffer.

For SDAR the whole sequence is prompt + committed blocks + active block (`RefreshSpan.ALIGNED`: SDAR's blocks at
absolute positions; later positions do not exist yet). Each request's buffer holds ⌈ρ·(P + G)⌉ positions per head
and layer (`PhaseSchedule.kv_tokens`, what the core's admission reserves), G its max_tokens, allocated at the start
and never resized; a Refresh keeps ⌊ρ·L⌋ of the L cached positions. Sampling, commits and stopping are the other
loops' (block_state.BlockState), so with refresh at every step (delay_step 0, refresh_interval 1) this gives
generate_reference's tokens at any ratio, and at ratio 1 with Reuse steps generate_cached's (the packed buffer is
then the whole cache, in position order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tandem.engine.diffusion.block_state import BlockState
from tandem.engine.diffusion.generate import DiffusionOutput, model_device, setup
from tandem.engine.diffusion.sparse_attention import SeqStep, SparseKVBackend, sparse_step_metadata
from tandem.engine.diffusion.sparse_kv import PagedSparseKV, SparseKVBuffer, SparseKVConfig
from tandem.engine.diffusion.unmasking import DllmConfig
from tandem.engine.models.sdar import BlockDiffusionMetadata
from tandem.engine.sampling_params import SamplingParams
from tandem.policy.dllm_serve.phases import DEFAULT_DELAY_STEP, Phase, PhaseSchedule, PhaseSpec, RefreshSpan


@dataclass
class RefreshOutput(DiffusionOutput):
    """A DiffusionOutput with each step's phase and the request's fixed KV buffer."""

    phases: list[str] = field(default_factory=list)     # each denoise step's phase: full, refresh or reuse
    context_per_step: list[int] = field(default_factory=list)   # positions before the active block at each step
    kv_slots: int = 0                                    # buffer positions per layer and KV head: ⌈ρ·(P + G)⌉
    kv_bytes: int = 0                                    # the buffer's bytes, held for the request's life


@dataclass
class PhaseWindow:
    """What one sequence computes in a Refresh/Reuse step: how it attends, its positions and tokens, and which of
    its rows (the active block's masked positions, `cand`) are sampled. The loop below and the engine
    (engine_step.DiffusionDecoder) both build a step from these."""

    step: SeqStep
    positions: range
    ids: list[int]
    rows: list[int]                 # offsets in `ids` of the candidates' rows
    cand: list[int]                 # offsets in the active block of the masked positions sampled


def phase_window(seq: BlockState, phase: Phase, buffer: SparseKVBuffer | PagedSparseKV) -> PhaseWindow:
    """The step of a sequence in `phase`: full-length (FULL, REFRESH: the whole sequence, `seq.canvas()`, dense;
    REFRESH also packs `buffer`) or the canvas from the active block on against `buffer` (REUSE: SDAR's block; a
    LLaDA canvas's block and the masks after it, Fast-dLLM's prefix cache)."""
    full = phase.full_length
    first = 0 if full else seq.start
    cand = seq.candidates()
    ids = seq.canvas()[first:]
    rows = [seq.start - first + j for j in cand]
    return PhaseWindow(SeqStep(buffer, full, phase is Phase.REFRESH, seq.start, seq.B),
                       range(first, first + len(ids)), ids, rows, cand)


def build_phase_step(windows: Sequence[PhaseWindow], block: int, backend: SparseKVBackend,
                     device: torch.device) -> tuple[torch.Tensor, BlockDiffusionMetadata, torch.Tensor]:
    """One forward's inputs for these windows: token ids [T], the metadata carrying the sparse backend, and the
    candidates' rows [R] in window order."""
    ids: list[int] = []
    rows: list[int] = []
    for w in windows:
        rows.extend(len(ids) + r for r in w.rows)
        ids.extend(w.ids)
    meta = sparse_step_metadata([w.step for w in windows], [w.positions for w in windows], block, backend, device)
    return (torch.tensor(ids, dtype=torch.long, device=device), meta,
            torch.tensor(rows, dtype=torch.long, device=device))


def commit_window(seq: BlockState, win: PhaseWindow, logits: torch.Tensor) -> int:
    """Sample and commit a window's candidates from their logits [len(cand), V]; the tokens committed."""
    return seq.step(logits, win.cand) if win.cand else 0


@dataclass
class _Request:
    """A sequence's decoding state, its packed KV buffer and its step within the active block."""

    seq: BlockState
    buffer: SparseKVBuffer
    block_step: int = 0


@torch.inference_mode()
def generate_refresh(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     cfg: DllmConfig | None = None, sparse: SparseKVConfig | None = None,
                     delay_step: int = DEFAULT_DELAY_STEP, refresh_interval: int = 0,
                     eos_token_ids: Sequence[int] | None = None) -> list[RefreshOutput]:
    """Decode a batch of prompts in Refresh/Reuse phases over per-request sparse KV; one forward per step."""
    cfg, block, eos, max_len = setup(model, params, cfg, eos_token_ids)
    sparse = sparse or SparseKVConfig()
    schedule = PhaseSchedule(PhaseSpec(block, delay_step, refresh_interval, RefreshSpan.ALIGNED,
                                       sparse.kv_retention_ratio))
    dev, mc = model_device(model), model.config
    dtype = next(model.parameters()).dtype
    reqs = []
    for p in prompts:
        s = BlockState(p, params, cfg, block, model.mask_token_id, eos, max_len, dev)
        buf = SparseKVBuffer(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                             schedule.kv_tokens(s.P, s.max_tokens), dtype, dev)
        s.out = RefreshOutput([], "", kv_slots=buf.capacity, kv_bytes=buf.nbytes)
        reqs.append(_Request(s, buf))
    backend = SparseKVBackend(sparse)
    layers = list(range(mc.num_hidden_layers))          # each layer's kv entry: its index (sparse_attention)
    while True:
        live = [r for r in reqs if not r.seq.done]
        if not live:
            return [r.seq.out for r in reqs]
        wins = []
        for r in live:
            phase = schedule.spec.phase_at(r.block_step)
            wins.append(phase_window(r.seq, phase, r.buffer))
            r.seq.out.phases.append(phase.value)
            r.seq.out.context_per_step.append(r.seq.start)
        ids, meta, rows = build_phase_step(wins, block, backend, dev)
        logits = model.compute_logits(model(ids, None, layers, meta).index_select(0, rows))
        off = 0
        for r, w in zip(live, wins):
            blocks = r.seq.out.num_blocks
            commit_window(r.seq, w, logits[off:off + len(w.cand)])
            off += len(w.cand)
            r.block_step = 0 if r.seq.out.num_blocks != blocks else r.block_step + 1


__all__ = ["PhaseWindow", "RefreshOutput", "build_phase_step", "commit_window", "generate_refresh", "phase_window"]
