"""Attention of a Refresh/Reuse step over per-request sparse KV (dLLM-Serve §4.5 and §5.3), as a backend for SDAR
(block-causal) and LLaDA-style (bidirectional) models.

Each sequence of a step runs one of two ways (`SeqStep`):

- **full-length** (a Refresh, or a delay step before it): the whole sequence is recomputed densely, without the
  paged cache: for SDAR prompt + committed blocks + active block under its block-causal mask (BlockDiffusionBackend),
  for LLaDA the whole canvas (prompt, committed blocks, active block and the masks after it) with no mask
  (BidirectionalBackend); at a Refresh (`pack`) each layer then scores the positions before the active block with
  the block's mean query, selects (sparse_kv.select_positions) and packs them into the request's buffer, replacing
  what it held;
- **Reuse**: the active block's positions (LLaDA: and the masked canvas after it, Fast-dLLM's prefix cache) are the
  queries; their keys are that layer's packed positions (each head its own) and the queries' own K/V, all visible
  (an SDAR block sees itself both ways and everything before it; a LLaDA position sees everything).

The backend rides on the step's metadata (`.backend`, which the attention layers use instead of the model's own
backend) and each layer's entry of `kv_caches` is its layer index, so the model is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.engine.diffusion.sparse_kv import SparseKVBuffer, SparseKVConfig, position_scores, select_positions
from tandem.engine.models.bidirectional import BidirectionalBackend, BidirectionalMetadata
from tandem.engine.models.sdar import BlockDiffusionBackend, BlockDiffusionMetadata

_PLAN = "sparse_kv"


@dataclass
class SeqStep:
    """How one sequence attends in a step."""

    buffer: SparseKVBuffer
    full: bool                  # the whole sequence recomputed (dense); else a Reuse of the active block
    pack: bool = False          # full-length only: a Refresh, which selects and packs the cached positions
    cached: int = 0             # full-length only: positions before the active block (its first `cached` rows)
    block: int = 0              # full-length only: the active block's rows after them, whose mean query scores the
                                # cached positions (0: every later row; a LLaDA canvas has masks after the block)


@dataclass
class _Plan:
    """A step's per-sequence plan, row offsets, and the dense sub-step of its full-length sequences."""

    steps: list[SeqStep]
    starts: list[int]
    full_rows: Tensor
    full_meta: BlockDiffusionMetadata | BidirectionalMetadata | None


class SparseKVBackend:
    """Dense attention for full-length sequences (block-causal, or bidirectional), packed sparse KV + the step's own
    queries for Reuse ones."""

    name = "sparse_kv"

    def __init__(self, cfg: SparseKVConfig, bidirectional: bool = False) -> None:
        """Select by `cfg` at every Refresh; `bidirectional`: a LLaDA-style model (no mask anywhere)."""
        self.cfg = cfg
        self.bidirectional = bidirectional
        self.dense = BidirectionalBackend() if bidirectional else BlockDiffusionBackend()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv: int, meta: BlockDiffusionMetadata | BidirectionalMetadata,
                scale: float) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv = the layer's index -> out [T, Hq, D]; packs buffers at Refreshes."""
        plan: _Plan = meta.scratch[_PLAN]
        layer = int(kv)
        out = torch.empty_like(q)
        if plan.full_meta is not None:
            rows = plan.full_rows
            out[rows] = self.dense.forward(q[rows], k[rows], v[rows], torch.empty(0, device=q.device),
                                           plan.full_meta, scale)
        for st, a, n in zip(plan.steps, plan.starts, meta.query_lens):
            if st.full:
                if st.pack:
                    end = a + st.cached + st.block if st.block else a + n
                    self._pack(q[a + st.cached:end], k[a:a + st.cached], v[a:a + st.cached], st.buffer, layer, scale)
                continue
            kb, vb = st.buffer.read(layer)
            ks = torch.cat([kb, k[a:a + n].transpose(0, 1).to(kb.dtype)], dim=1).to(q.dtype)
            vs = torch.cat([vb, v[a:a + n].transpose(0, 1).to(vb.dtype)], dim=1).to(q.dtype)
            o = F.scaled_dot_product_attention(q[a:a + n].transpose(0, 1)[None], ks[None], vs[None], scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[1])
            out[a:a + n] = o[0].transpose(0, 1)
        return out

    def _pack(self, q_block: Tensor, k_cached: Tensor, v_cached: Tensor, buffer: SparseKVBuffer, layer: int,
              scale: float) -> None:
        """Score the cached positions with the block's mean query and pack each head's kept ones."""
        n = k_cached.shape[0]
        keep = self.cfg.num_keep(n)
        if keep == 0:
            buffer.clear(layer)
            return
        if keep == n:                                    # everything kept (ρ = 1, the dense cache): no scoring
            idx = torch.arange(n, device=k_cached.device).expand(k_cached.shape[1], n)
        else:
            idx = select_positions(position_scores(q_block, k_cached, scale), k_cached.shape[1], keep,
                                   self.cfg.kv_pool_kernel, self.cfg.kv_selection)
        buffer.pack(layer, k_cached, v_cached, idx)


def _dense_metadata(positions: Sequence[Sequence[int]], block: int, backend: SparseKVBackend,
                    device: torch.device) -> BlockDiffusionMetadata | BidirectionalMetadata:
    """Cache-free metadata of sequences at `positions` for the backend's model (contiguous positions when
    bidirectional)."""
    S = len(positions)
    if not backend.bidirectional:
        return BlockDiffusionMetadata.build(positions, [0] * S, [0] * S, None, 1, block, device)
    meta = BidirectionalMetadata.build([len(p) for p in positions], [0] * S, [0] * S, None, 1, device)
    meta.positions = torch.tensor([q for p in positions for q in p], dtype=torch.long, device=device)
    return meta


def sparse_step_metadata(steps: Sequence[SeqStep], positions: Sequence[Sequence[int]], block: int,
                         backend: SparseKVBackend, device: torch.device
                         ) -> BlockDiffusionMetadata | BidirectionalMetadata:
    """The metadata of one step of sequences at `positions` (full-length: 0 .. the sequence's end; Reuse: the block
    and, on a LLaDA canvas, the masks after it)."""
    meta = _dense_metadata(positions, block, backend, device)
    meta.backend = backend
    starts, rows, acc = [], [], 0
    for st, n in zip(steps, meta.query_lens):
        starts.append(acc)
        if st.full:
            rows.extend(range(acc, acc + n))
        acc += n
    full = [p for st, p in zip(steps, positions) if st.full]
    sub = _dense_metadata(full, block, backend, device) if full else None
    meta.scratch[_PLAN] = _Plan(list(steps), starts, torch.tensor(rows, dtype=torch.long, device=device), sub)
    return meta


__all__ = ["SeqStep", "SparseKVBackend", "sparse_step_metadata"]
