"""Decode attention that reads only device tensors of fixed shape: the attention of a CUDA-graphed decode step.

A captured graph replays the same kernels with the same shapes, so nothing here may depend on host values (Python
lists of lengths, the longest sequence of the step): every row attends over the whole width of its block table
(max_blocks_per_seq blocks) with keys j >= seq_len masked out, and K/V are written at slot_mapping first. With
flash-attn and blocks of a multiple of 256 tokens (what flash-attn 2's paged KV needs), `flash_attn_with_kvcache`
reads the paged cache in place and stops at each row's length. Otherwise (small blocks, float32, CPU) the blocks are
gathered and attended with SDPA, the G query heads sharing a KV head folded into SDPA's query dim as the sdpa backend
does; the key range is cut into chunks of at most `gather_bytes` of gathered K+V merged with an online softmax, so the
graph pool never holds a whole batch x max_model_len copy of a layer's K/V. The gather path reads max_model_len keys
per row whatever the row's length: fine for short max_model_len, and the reason to prefer 256-token blocks on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import online_softmax_attention, write_kv
from tandem.engine.attention.metadata import AttnMetadata

PAGED_BLOCK_MULTIPLE = 256          # flash-attn 2's page size requirement for block_table
GATHER_BYTES = 64 << 20             # gathered K+V per key chunk (bytes), across the batch


def flash_kvcache() -> Callable | None:
    """flash-attn's `flash_attn_with_kvcache`, or None when the package does not import."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


@dataclass
class _Keys:
    blocks: list[torch.Tensor]       # per chunk: int64 [B * nb] block ids, row-major (row b's chunk blocks)
    masks: list[torch.Tensor]        # per chunk: bool [B, 1, 1, nb * block_size], key j of the chunk < seq_len


class StaticDecodeBackend:
    """One query token per row; K/V written at meta.slot_mapping, read through meta.block_tables up to meta.seq_lens_t.

    Reads only meta's device tensors (slot_mapping, block_tables, seq_lens_t), never its host lists, so it is safe to
    capture in a CUDA graph. Set as `AttnMetadata.backend` so every layer uses it for that step."""

    name = "static_decode"

    def __init__(self, block_size: int, gather_bytes: int = GATHER_BYTES, use_flash: bool | None = None) -> None:
        kernel = flash_kvcache() if use_flash is not False and block_size % PAGED_BLOCK_MULTIPLE == 0 else None
        if use_flash and kernel is None:
            raise ValueError(f"flash_attn_with_kvcache needs flash_attn and blocks of a multiple of "
                             f"{PAGED_BLOCK_MULTIPLE} tokens (block_size {block_size})")
        self._flash = kernel
        self.gather_bytes = gather_bytes

    @property
    def paged(self) -> bool:
        """Whether flash-attn reads the paged cache in place (else: gather + SDPA)."""
        return self._flash is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:
        """q [B, Hq, D], k/v [B, Hkv, D], kv [2, blocks, block_size, Hkv, D] -> out [B, Hq, D]."""
        write_kv(k, v, kv, meta.slot_mapping)
        if self._flash is not None and q.dtype in (torch.float16, torch.bfloat16) and q.is_cuda:
            o = self._flash(q.unsqueeze(1), kv[0], kv[1], cache_seqlens=meta.seq_lens_t,
                            block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return o.squeeze(1)
        return self._gathered(q, kv, meta, scale)

    def _gathered(self, q: torch.Tensor, kv: torch.Tensor, meta: AttnMetadata, scale: float) -> torch.Tensor:
        """Gather + SDPA over the whole block-table width, in key chunks merged by an online softmax."""
        B, hq, d = q.shape
        hkv = kv.shape[3]
        keys = self._keys(meta, kv)
        qg = q.view(B, hkv, hq // hkv, d)
        if len(keys.blocks) == 1:
            kb = self._gather(kv, keys.blocks[0], B)
            o = F.scaled_dot_product_attention(qg, kb[0], kb[1], attn_mask=keys.masks[0], scale=scale)
            return o.reshape(B, hq, d)
        o = online_softmax_attention(qg.float() * scale, ((self._gather(kv, blocks, B).float(), mask)
                                                           for blocks, mask in zip(keys.blocks, keys.masks)))
        return o.to(q.dtype).reshape(B, hq, d)

    def _keys(self, meta: AttnMetadata, kv: torch.Tensor) -> _Keys:
        """The step's key chunks (block ids and masks), built at its first layer and kept in meta.scratch."""
        keys = meta.scratch.get("static_decode")
        if keys is not None:
            return keys
        table = meta.block_tables.long()
        B, width = table.shape
        bs = kv.shape[2]
        block_bytes = 2 * kv[0, 0].numel() * kv.element_size()                 # one block's K+V, one layer
        per_chunk = max(1, min(width, self.gather_bytes // max(1, B * block_bytes)))
        lens = meta.seq_lens_t.long()[:, None]
        blocks, masks = [], []
        for a in range(0, width, per_chunk):
            nb = min(per_chunk, width - a)
            blocks.append(table[:, a:a + nb].reshape(-1))
            j = torch.arange(a * bs, (a + nb) * bs, device=table.device)
            masks.append((j[None, :] < lens)[:, None, None, :])
        keys = meta.scratch["static_decode"] = _Keys(blocks, masks)
        return keys

    @staticmethod
    def _gather(kv: torch.Tensor, blocks: torch.Tensor, B: int) -> torch.Tensor:
        """K and V of `blocks` ([B * nb]) as [2, B, Hkv, nb * block_size, D]."""
        g = kv.index_select(1, blocks)                                           # [2, B*nb, bs, Hkv, D]
        return g.view(2, B, -1, kv.shape[3], kv.shape[4]).transpose(2, 3)
