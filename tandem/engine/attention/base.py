"""What every attention backend is and shares: the backend protocol and the paged-cache KV write."""
from __future__ import annotations

from typing import Protocol

import torch

from tandem.engine.attention.metadata import AttnMetadata


class AttentionBackend(Protocol):
    """Writes a step's K/V into the paged cache, then runs causal attention of each sequence over its whole KV."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv [2, blocks, block_size, Hkv, D] -> out [T, Hq, D]."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter a step's K and V rows into the paged cache at their slots (shared by every backend)."""
    flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv.dtype))
