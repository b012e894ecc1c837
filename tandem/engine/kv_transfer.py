"""Copy a sequence's KV between paged caches: gather token rows into one contiguous payload, scatter it back.

Used by the runtime to move KV between workers (a remote prefill reads the session's history from its
decode worker, then sends the new KV back, AMPD §3). The payload is one contiguous tensor
[layers, 2, tokens, kv_heads, head_dim] whose bytes travel as a zero-copy transport frame.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KVTransferError(ValueError):
    """A payload that does not match the receiving cache (shape, dtype or room)."""


@dataclass
class KVPayload:
    """KV of `num_tokens` consecutive positions of one sequence, all layers."""

    num_tokens: int
    dtype: str
    shape: tuple[int, ...]          # (layers, 2, num_tokens, kv_heads, head_dim)
    data: torch.Tensor              # contiguous, on the CPU

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def buffer(self) -> memoryview:
        """The payload's bytes without a copy (for a transport frame)."""
        return memoryview(self.data.view(torch.uint8).numpy()).cast("B") if self.data.numel() else memoryview(b"")

    @classmethod
    def from_buffer(cls, buf, num_tokens: int, dtype: str, shape: tuple[int, ...]) -> "KVPayload":
        """Rebuild a payload from received bytes (no copy; the tensor aliases `buf`)."""
        if dtype not in _DTYPES:
            raise KVTransferError(f"unknown KV dtype {dtype!r}")
        dt = _DTYPES[dtype]
        n = 1
        for s in shape:
            n *= s
        raw = torch.frombuffer(bytearray(buf) if isinstance(buf, bytes) else buf, dtype=torch.uint8) \
            if n else torch.empty(0, dtype=torch.uint8)
        if raw.numel() != n * torch.empty(0, dtype=dt).element_size():
            raise KVTransferError(f"KV payload has {raw.numel()} bytes, its header says {tuple(shape)} of {dtype}")
        return cls(num_tokens, dtype, tuple(shape), raw.view(dt).view(*shape) if n else torch.empty(shape, dtype=dt))


def _slots(block_table: list[int], block_size: int, start: int, end: int, device) -> torch.Tensor:
    pos = torch.arange(start, end, dtype=torch.long)
    blocks = torch.tensor(block_table, dtype=torch.long)
    if end > len(block_table) * block_size:
        raise KVTransferError(f"positions up to {end} need {-(-end // block_size)} blocks, the table has "
                              f"{len(block_table)}")
    return (blocks[pos // block_size] * block_size + pos % block_size).to(device)


def export_kv(kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int,
              end: int) -> KVPayload:
    """Gather positions [start, end) of a sequence from every layer's paged cache."""
    n = end - start
    c0 = kv_caches[0]
    shape = (len(kv_caches), 2, n, c0.shape[-2], c0.shape[-1])
    dtype = next(k for k, v in _DTYPES.items() if v == c0.dtype)
    if n <= 0:
        return KVPayload(0, dtype, shape, torch.empty(shape, dtype=c0.dtype))
    slots = _slots(block_table, block_size, start, end, c0.device)
    out = torch.empty(shape, dtype=c0.dtype, device=c0.device)
    for i, kv in enumerate(kv_caches):
        flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
        torch.index_select(flat, 1, slots, out=out[i])
    return KVPayload(n, dtype, shape, out.cpu().contiguous())


def import_kv(kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int,
              payload: KVPayload) -> None:
    """Scatter a payload into positions [start, start + num_tokens) of a sequence's blocks."""
    c0 = kv_caches[0]
    want = (len(kv_caches), 2, payload.num_tokens, c0.shape[-2], c0.shape[-1])
    if tuple(payload.shape) != want or _DTYPES.get(payload.dtype) != c0.dtype:
        raise KVTransferError(f"KV payload {tuple(payload.shape)} {payload.dtype} does not fit this cache "
                              f"({want} {c0.dtype})")
    if payload.num_tokens == 0:
        return
    slots = _slots(block_table, block_size, start, start + payload.num_tokens, c0.device)
    data = payload.data.to(c0.device)
    for i, kv in enumerate(kv_caches):
        flat = kv.view(2, -1, kv.shape[-2], kv.shape[-1])
        flat.index_copy_(1, slots, data[i])


class SwapSpace:
    """KV of sequences preempted by swap, in host memory: the core's swaps carried out on one set of paged caches
    (each tensor-parallel rank keeps its own heads' copy)."""

    def __init__(self) -> None:
        self.held: dict[str, KVPayload] = {}         # session -> its swapped-out KV

    def apply(self, kv_caches: list[torch.Tensor], swaps: list, block_size: int) -> None:
        """Carry out `swaps` (core Swap actions) in order: OUT copies a sequence's blocks here, IN copies them back
        into its new blocks, bit for bit, DROP forgets them."""
        from tandem.core.types import SwapKind
        for sw in swaps:
            if sw.kind is SwapKind.OUT:
                self.held[sw.session_id] = export_kv(kv_caches, list(sw.blocks), block_size, 0,
                                                     len(sw.blocks) * block_size)
            elif sw.kind is SwapKind.IN:
                import_kv(kv_caches, list(sw.blocks), block_size, 0, self.held.pop(sw.session_id))
            else:
                self.held.pop(sw.session_id, None)

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(p.nbytes for p in self.held.values())
