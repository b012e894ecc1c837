"""Per-step attention metadata of a flattened batch, and the paged KV cache tensors it indexes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch


class QueryShape:
    """The sequences and query tokens of a step's attention metadata (any with a `query_lens` of S entries)."""

    query_lens: Sequence[int]

    @property
    def num_seqs(self) -> int:
        """Number of sequences S in the step."""
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """Number of query tokens T in the step."""
        return int(sum(self.query_lens))


@dataclass
class AttnMetadata(QueryShape):
    """One step's flattened batch of S sequences: query tokens of all sequences concatenated in order."""

    query_lens: list[int]          # host, len S: new (query) tokens per sequence this step (1 for decode)
    seq_lens: list[int]            # host, len S: total KV length per sequence after this step (cached + new)
    query_start_loc: torch.Tensor  # int32 [S+1] cumulative query lens (device)
    seq_lens_t: torch.Tensor       # int32 [S] (device)
    block_tables: torch.Tensor     # int32 [S, max_blocks] physical KV block ids per sequence, padded with 0
    slot_mapping: torch.Tensor     # int64 [T] where each query token's K/V is written: block*block_size + offset
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Backends cache per-step derived tensors here (computed at the first layer, reused by the others).
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # A backend every layer uses for this step instead of its own (the CUDA-graph decode path, static_decode.py).
    backend: Any = field(default=None, repr=False, compare=False)

    @staticmethod
    def positions(query_lens: Sequence[int], seq_lens: Sequence[int],
                  device: torch.device | str = "cpu") -> torch.Tensor:
        """The position of every query token (int64 [T]): seq_len - query_len .. seq_len - 1 per sequence."""
        return torch.from_numpy(_positions(np.asarray(query_lens, np.int64), np.asarray(seq_lens, np.int64))).to(device)

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttnMetadata":
        """Validate a step's host-side batch description and build its device tensors (slot mapping included)."""
        S = len(query_lens)
        if len(seq_lens) != S or len(block_tables) != S:
            raise ValueError(f"query_lens, seq_lens and block_tables must have one entry per sequence "
                             f"(got {S}, {len(seq_lens)}, {len(block_tables)})")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        q = np.asarray(query_lens, dtype=np.int64).reshape(S)
        s = np.asarray(seq_lens, dtype=np.int64).reshape(S)
        if S and (q.min() < 1 or (s < q).any()):
            raise ValueError("every sequence needs query_len >= 1 and seq_len >= query_len")
        widths = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=S)
        need = -(-s // block_size)
        if (widths < need).any():
            i = int(np.argmax(widths < need))
            raise ValueError(f"sequence {i} has seq_len {int(s[i])} but only {int(widths[i])} KV blocks "
                             f"of {block_size} tokens")
        max_blocks = int(widths.max()) if S else 0
        table = np.zeros((S, max(max_blocks, 1)), dtype=np.int32)
        if S:
            flat = np.fromiter((b for row in block_tables for b in row), dtype=np.int64, count=int(widths.sum()))
            rows = np.repeat(np.arange(S), widths)
            cols = np.arange(flat.size) - np.repeat(np.cumsum(widths) - widths, widths)
            table[rows, cols] = flat
        pos = _positions(q, s)
        seq_of_tok = np.repeat(np.arange(S), q)
        slots = table[seq_of_tok, pos // block_size].astype(np.int64) * block_size + pos % block_size
        qsl = np.zeros(S + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        dev = torch.device(device)
        return cls(
            query_lens=[int(x) for x in query_lens], seq_lens=[int(x) for x in seq_lens],
            query_start_loc=_to(qsl, dev), seq_lens_t=_to(s.astype(np.int32), dev),
            block_tables=_to(table, dev), slot_mapping=_to(slots, dev), block_size=int(block_size),
            max_query_len=int(q.max()) if S else 0, max_seq_len=int(s.max()) if S else 0,
        )


def _positions(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    starts = np.cumsum(q) - q
    return np.arange(int(q.sum()), dtype=np.int64) - np.repeat(starts, q) + np.repeat(s - q, q)


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (K and V), to size the pool from a memory budget."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] K/V tensor per layer. On CPU the zeros are the
    kernel's (calloc'd memory, mapped on first write), not written here: a worker starts without touching its whole
    pool (1 GiB by default: 0.4 s unloaded, several seconds on a busy 2-core machine, the most of a replacement's
    start) and holds only the pages its KV has used."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type != "cpu" or 0 in shape:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return [torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape) for _ in range(num_layers)]
