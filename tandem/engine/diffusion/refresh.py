"""Block-diffusion decoding with dLLM-Serve's Refresh and Reuse phases and head-centric sparse KV, for SDAR.

The phases are the core's (tandem/policy/dllm_serve/phases.py, `PhaseSpec.phase_at`, dLLM-Serve's SparseConfig
semantics): the active block's step j is

- `full` for j < `delay_step`: the whole sequence recomputed with dense attention, nothing cached;
- `refresh` for j = `delay_step` (and, with `refresh_interval` k > 0, for j = delay_step + i·k): the whole sequence
  recomputed with dense attention, and each layer's cached positions (everything before the active block) scored
  by the block's mean query, selected per head and packed into the request's buffer (sparse_kv, sparse_attention);
- `reuse` otherwise: only the active block is computed, against the packed buffer.

For SDAR the whole sequence is prompt + committed blocks + active block (`RefreshSpan.PREFIX`; later positions do
not exist yet). Each request's buffer holds ⌈ρ·(P + G)⌉ positions per head and layer (`PhaseSchedule.kv_tokens`,
what the core's admission reserves), G its max_tokens, allocated at the start and never resized; a Refresh keeps
⌊ρ·L⌋ of the L cached positions. Sampling, commits and stopping are the other loops' (generate._Seq), so with
refresh at every step (delay_step 0, refresh_interval 1) this gives generate_reference's tokens at any ratio, and at
ratio 1 with Reuse steps generate_cached's (the packed buffer is then the whole cache, in position order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from tandem.engine.diffusion.generate import DiffusionOutput, _device, _Seq, _setup
from tandem.engine.diffusion.sparse_attention import SeqStep, SparseKVBackend, sparse_step_metadata
from tandem.engine.diffusion.sparse_kv import SparseKVBuffer, SparseKVConfig
from tandem.engine.diffusion.unmasking import DllmConfig
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
class _Request:
    """A sequence's decoding state, its packed KV buffer and its step within the active block."""

    seq: _Seq
    buffer: SparseKVBuffer
    block_step: int = 0


@torch.inference_mode()
def generate_refresh(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     cfg: DllmConfig | None = None, sparse: SparseKVConfig | None = None,
                     delay_step: int = DEFAULT_DELAY_STEP, refresh_interval: int = 0,
                     eos_token_ids: Sequence[int] | None = None) -> list[RefreshOutput]:
    """Decode a batch of prompts in Refresh/Reuse phases over per-request sparse KV; one forward per step."""
    cfg, block, eos, max_len = _setup(model, params, cfg, eos_token_ids)
    sparse = sparse or SparseKVConfig()
    schedule = PhaseSchedule(PhaseSpec(block, delay_step, refresh_interval, RefreshSpan.PREFIX,
                                       sparse.kv_retention_ratio))
    dev, mc = _device(model), model.config
    dtype = next(model.parameters()).dtype
    reqs = []
    for p in prompts:
        s = _Seq(p, params, cfg, block, model.mask_token_id, eos, max_len, dev)
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
        steps, positions, ids, rows, cands = [], [], [], [], []
        for r in live:
            s = r.seq
            phase = schedule.spec.phase_at(r.block_step)
            first = 0 if phase.full_length else s.start
            steps.append(SeqStep(r.buffer, phase.full_length, phase is Phase.REFRESH, s.start))
            positions.append(range(first, s.start + block))
            cand = s.candidates()
            rows.extend(len(ids) + s.start - first + j for j in cand)
            ids.extend(s.prefix + s.block if phase.full_length else s.block)
            cands.append(cand)
            s.out.phases.append(phase.value)
            s.out.context_per_step.append(s.start)
        meta = sparse_step_metadata(steps, positions, block, backend, dev)
        hidden = model(torch.tensor(ids, dtype=torch.long, device=dev), None, layers, meta)
        logits = model.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev)))
        off = 0
        for r, cand in zip(live, cands):
            blocks = r.seq.out.num_blocks
            r.seq.step(logits[off:off + len(cand)], cand)
            off += len(cand)
            r.block_step = 0 if r.seq.out.num_blocks != blocks else r.block_step + 1


__all__ = ["RefreshOutput", "generate_refresh"]
