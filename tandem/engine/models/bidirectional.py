"""Bidirectional (no mask) attention over a paged prefix cache, for LLaDA-style masked-diffusion models.

Each sequence of a step has contiguous query positions ctx .. ctx+n-1; its queries see its cached prefix (positions
0 .. ctx-1, read from the paged cache through its block table) and every query of the same sequence, in both
directions. The first `num_write` queries (positions ctx .. ctx+num_write-1) have their K/V written into the cache.
So a full forward over the canvas is ctx 0 (writing the prefix to keep, as Fast-dLLM's prefix cache does), and a
cached step is the active block and the masks after it on ctx = the block's start, writing nothing.

Backends, chosen at run time per step: on CUDA in float16/bfloat16 with flash-attn importable (and the loader not told
`sdpa`), one non-causal `flash_attn_varlen_func` call over the whole step; otherwise (CPU, float32, no flash-attn) one
`scaled_dot_product_attention` call per sequence with no mask (on CUDA, PyTorch's SDPA takes its own flash or
memory-efficient kernel for an unmasked call).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import write_kv
from tandem.engine.attention.metadata import QueryShape


@dataclass
class BidirectionalMetadata(QueryShape):
    """One step of S sequences, query tokens of all sequences concatenated in order (contiguous positions each)."""

    query_lens: list[int]             # host, len S: query tokens per sequence
    ctx_lens: list[int]               # host, len S: cached prefix tokens each sequence's queries read
    num_write: list[int]              # host, len S: leading queries whose K/V are written into the cache
    positions: torch.Tensor           # int64 [T] position of every query token
    block_tables: torch.Tensor        # int32 [S, max_blocks] KV pages per sequence, padded with 0
    write_rows: torch.Tensor          # int64 [W] rows (in the flattened batch) of the written queries
    slot_mapping: torch.Tensor        # int64 [W] their cache slots
    block_size: int                   # the KV cache's page size
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    backend: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, query_lens: Sequence[int], ctx_lens: Sequence[int], num_write: Sequence[int],
              block_tables: Sequence[Sequence[int]] | None, block_size: int,
              device: torch.device | str = "cpu") -> "BidirectionalMetadata":
        """Validate one step's per-sequence query counts, cached prefixes and writes, and build its tensors.

        Without a KV cache (block_tables None) every ctx_len and num_write must be 0: a full recomputation."""
        S = len(query_lens)
        if len(ctx_lens) != S or len(num_write) != S or (block_tables is not None and len(block_tables) != S):
            raise ValueError("query_lens, ctx_lens, num_write and block_tables need one entry per sequence")
        if block_size < 1:
            raise ValueError(f"the KV page size must be >= 1, got {block_size}")
        rows: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        width = max([1] + [len(b) for b in block_tables or []])
        table = torch.zeros((S, width), dtype=torch.int32)
        start = 0
        for i, (n, ctx, nw) in enumerate(zip(query_lens, ctx_lens, num_write)):
            n, ctx, nw = int(n), int(ctx), int(nw)
            if n < 1 or ctx < 0 or not 0 <= nw <= n:
                raise ValueError(f"sequence {i}: needs >= 1 query, ctx_len >= 0 and 0 <= num_write <= queries "
                                 f"(got {n}, {ctx}, {nw})")
            positions.extend(range(ctx, ctx + n))
            if block_tables is None:
                if ctx or nw:
                    raise ValueError(f"sequence {i}: ctx_len and num_write must be 0 without a KV cache")
            else:
                pages = list(block_tables[i])
                if len(pages) * block_size < ctx + nw:
                    raise ValueError(f"sequence {i} reads/writes {ctx + nw} cached tokens but has only "
                                     f"{len(pages)} KV pages of {block_size}")
                table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
                for p in range(ctx, ctx + nw):
                    rows.append(start + p - ctx)
                    slots.append(pages[p // block_size] * block_size + p % block_size)
            start += n
        dev = torch.device(device)
        return cls(query_lens=[int(n) for n in query_lens], ctx_lens=[int(c) for c in ctx_lens],
                   num_write=[int(w) for w in num_write],
                   positions=torch.tensor(positions, dtype=torch.long, device=dev), block_tables=table.to(dev),
                   write_rows=torch.tensor(rows, dtype=torch.long, device=dev),
                   slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), block_size=int(block_size))


def _prefix(kv: torch.Tensor, meta: BidirectionalMetadata, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's cached K and V (positions 0 .. ctx-1), gathered by whole pages: [ctx, Hkv, D] each."""
    ctx, bs = meta.ctx_lens[i], kv.shape[2]
    npages = -(-ctx // bs)
    pages = meta.block_tables[i, :npages].long()
    hkv, d = kv.shape[3], kv.shape[4]
    return (kv[0].index_select(0, pages).reshape(npages * bs, hkv, d)[:ctx],
            kv[1].index_select(0, pages).reshape(npages * bs, hkv, d)[:ctx])


def _keys(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: BidirectionalMetadata, i: int, start: int,
          n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's keys and values: its cached prefix, then its queries' K/V of this step."""
    ks, vs = k[start:start + n], v[start:start + n]
    if meta.ctx_lens[i]:
        pk, pv = _prefix(kv, meta, i)
        ks, vs = torch.cat([pk.to(k.dtype), ks]), torch.cat([pv.to(v.dtype), vs])
    return ks, vs


def _flash_varlen() -> Callable | None:
    """flash_attn_varlen_func when flash-attn imports, else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


class BidirectionalBackend:
    """Unmasked attention of each sequence's queries over its cached prefix and its own queries (module docstring)."""

    name = "bidirectional"

    def __init__(self, use_flash: bool | None = None, varlen: Callable | None = None) -> None:
        """use_flash: None picks flash-attn on CUDA half precision when it imports, False never; `varlen` stands in
        for flash_attn_varlen_func (a test double on the CPU)."""
        self.use_flash = use_flash
        self._varlen = varlen
        self._injected = varlen is not None
        self._looked = False

    def _flash(self, q: torch.Tensor) -> Callable | None:
        """The varlen kernel to use for this step, or None for the SDPA path."""
        if self.use_flash is False:
            return None
        if self._injected:
            return self._varlen
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return None
        if not self._looked:
            self._varlen, self._looked = _flash_varlen(), True
        return self._varlen

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: BidirectionalMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv [2, pages, page_size, Hkv, D] (empty: no cache) -> out [T, Hq, D]."""
        if not isinstance(meta, BidirectionalMetadata):
            raise TypeError("the bidirectional backend needs BidirectionalMetadata")
        if meta.write_rows.numel():
            write_kv(k.index_select(0, meta.write_rows), v.index_select(0, meta.write_rows), kv, meta.slot_mapping)
        varlen = self._flash(q)
        if varlen is not None:
            return self._forward_varlen(varlen, q, k, v, kv, meta, scale)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        start = 0
        for i, n in enumerate(meta.query_lens):
            ks, vs = _keys(k, v, kv, meta, i, start, n)
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1).unsqueeze(0),
                                               ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                               scale=scale, enable_gqa=gqa)
            out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def _forward_varlen(self, varlen: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                        meta: BidirectionalMetadata, scale: float) -> torch.Tensor:
        """One non-causal varlen call: every sequence's queries against its prefix + queries, packed."""
        lens = meta.scratch.get("bidirectional")
        if lens is None:
            qlens = torch.tensor([0] + meta.query_lens, dtype=torch.int32)
            klens = torch.tensor([0] + [c + n for c, n in zip(meta.ctx_lens, meta.query_lens)], dtype=torch.int32)
            lens = meta.scratch["bidirectional"] = (qlens.cumsum(0, dtype=torch.int32).to(q.device),
                                                    klens.cumsum(0, dtype=torch.int32).to(q.device),
                                                    max(meta.query_lens), int(klens.max()))
        cu_q, cu_k, max_q, max_k = lens
        if any(meta.ctx_lens):
            parts, start = [], 0
            for i, n in enumerate(meta.query_lens):
                parts.append(_keys(k, v, kv, meta, i, start, n))
                start += n
            k = torch.cat([p[0] for p in parts])
            v = torch.cat([p[1] for p in parts])
        return varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=False)
