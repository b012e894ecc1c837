"""What every attention backend is and shares: the backend protocol and the paged-cache KV write."""
from __future__ import annotations

from collections.abc import Iterable
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


def online_softmax_attention(qf: torch.Tensor, chunks: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention of scaled float32 queries qf [..., Q, D] over key chunks, each (K/V [2, ..., Lc, D] float32,
    visibility mask [..., Q, Lc]), merged by an online softmax so only one chunk's scores exist at a time; every
    query must see a key of the first chunk. Shared by the graph-safe static backends."""
    run_max = den = acc = None              # running max, softmax denominator and weighted sum of V per query
    for kb, mask in chunks:
        s = torch.matmul(qf, kb[0].transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        new_max = m if run_max is None else torch.maximum(run_max, m)
        p = torch.exp(s - new_max)
        if run_max is None:
            den, acc = p.sum(-1, keepdim=True), torch.matmul(p, kb[1])
        else:
            alpha = torch.exp(run_max - new_max)
            den = den * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, kb[1])
        run_max = new_max
    return acc / den
