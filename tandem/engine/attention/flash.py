"""The CUDA attention backend on flash-attn 2's `flash_attn_varlen_func` (imported lazily).

Causal masks in flash-attn align to the bottom right when seqlen_q < seqlen_k, which is exactly "query i of a
sequence sits at position seq_len - query_len + i". The paged path passes the block table; flash-attn 2 needs
blocks of a multiple of 256 tokens for it, so with smaller blocks the sequences' KV is gathered contiguously.
Half precision only: float32 steps fall back to the sdpa backend.
"""
from __future__ import annotations

import torch

from tandem.engine.attention.metadata import AttnMetadata
from tandem.engine.attention.base import write_kv

PAGED_BLOCK_MULTIPLE = 256


class FlashBackend:
    """Varlen flash attention over the paged KV cache (paged when block_size % 256 == 0, else gathered)."""

    name = "flash"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as e:  # pragma: no cover - needs the CUDA package
            raise ValueError(f"attention backend 'flash' needs the flash_attn package ({e})") from None
        self._varlen = flash_attn_varlen_func
        self._fallback = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttnMetadata, scale: float) -> torch.Tensor:  # pragma: no cover - needs a GPU
        """Write k/v at meta.slot_mapping, then run causal varlen attention of every sequence over its KV."""
        if q.dtype not in (torch.float16, torch.bfloat16):
            if self._fallback is None:
                from tandem.engine.attention.sdpa import SdpaBackend
                self._fallback = SdpaBackend()
            return self._fallback.forward(q, k, v, kv, meta, scale)
        write_kv(k, v, kv, meta.slot_mapping)
        st = meta.scratch.get("flash")
        if st is None:
            st = meta.scratch["flash"] = _state(meta, q.device)
        cu_q = meta.query_start_loc
        if st["no_prefix"]:       # every sequence is a fresh prefill: its keys are exactly this step's k, v
            return self._varlen(q, k, v, cu_q, cu_q, meta.max_query_len, meta.max_query_len,
                                softmax_scale=scale, causal=True)
        if meta.block_size % PAGED_BLOCK_MULTIPLE == 0:
            return self._varlen(q, kv[0], kv[1], cu_q, st["cu_k"], meta.max_query_len, meta.max_seq_len,
                                softmax_scale=scale, causal=True, block_table=meta.block_tables)
        flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
        g = flat[:, st["slots"]]                                   # [2, sum(seq_lens), Hkv, D]
        return self._varlen(q, g[0], g[1], cu_q, st["cu_k"], meta.max_query_len, meta.max_seq_len,
                            softmax_scale=scale, causal=True)


def _state(meta: AttnMetadata, device: torch.device) -> dict:  # pragma: no cover - needs a GPU
    """Cumulative KV lengths and (for small blocks) the cache slot of every KV token of the step."""
    total = int(sum(meta.seq_lens))
    lens = meta.seq_lens_t.long()
    cu_k = torch.zeros(len(meta.seq_lens) + 1, dtype=torch.int32, device=device)
    cu_k[1:] = torch.cumsum(lens, 0)
    st = {"no_prefix": meta.query_lens == meta.seq_lens, "cu_k": cu_k}
    if meta.block_size % PAGED_BLOCK_MULTIPLE != 0:
        seq = torch.repeat_interleave(torch.arange(len(meta.seq_lens), device=device), lens, output_size=total)
        pos = torch.arange(total, device=device) - cu_k[:-1].long()[seq]
        bs = meta.block_size
        st["slots"] = meta.block_tables.long()[seq, pos // bs] * bs + pos % bs
    return st
