"""Copy a sequence's KV between paged caches: gather token rows into one contiguous payload, scatter it back.

Used by the runtime to move KV between workers (a remote prefill reads the session's history from its
decode worker, then sends the new KV back, AMPD §3). The payload is one contiguous tensor
[layers, 2, tokens, kv_heads, head_dim] whose bytes travel as a zero-copy transport frame; kv_heads is every KV head
of the model, whatever the workers' tensor-parallel degrees (engine/parallel/kv_group.py regroups it by rank).

A transfer longer than `kv_part_tokens` travels as several messages (`split_kv`), each of whole blocks, so the
receiving socket can cap every frame at `kv_message_max_bytes` (a few MiB to tens of MiB) instead of a whole
context's KV; `KVAssembly` joins the parts on the receiving side.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_PART_BYTES = 16 << 20          # one KV message carries at most this many payload bytes (whole blocks, >= 1 block)
KV_FRAMING_BYTES = 64 << 10       # room above the payload for the message's header frame and framing


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


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a KV dtype ("float32", "float16", "bfloat16")."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise KVTransferError(f"KV dtype {dtype} cannot be transferred (only {', '.join(_DTYPES)})")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one token's K and V over all layers: what a transfer costs per position."""
    if dtype not in _DTYPES:
        raise KVTransferError(f"unknown KV dtype {dtype!r}")
    for name, v in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or v < 1:
            raise KVTransferError(f"{name} must be a positive integer, got {v!r}")
    return layers * 2 * kv_heads * head_dim * torch.empty(0, dtype=_DTYPES[dtype]).element_size()


def kv_part_tokens(block_size: int, bytes_per_token: int, max_model_len: int,
                   part_bytes: int = KV_PART_BYTES) -> int:
    """Tokens one KV message carries at most: as many whole blocks as fit in `part_bytes` (at least one block),
    never more blocks than the longest sequence has."""
    if block_size < 1 or bytes_per_token < 1 or max_model_len < 1 or part_bytes < 1:
        raise KVTransferError(f"block_size, bytes_per_token, max_model_len and part_bytes must be positive, got "
                              f"{block_size}, {bytes_per_token}, {max_model_len}, {part_bytes}")
    blocks = min(max(1, part_bytes // (block_size * bytes_per_token)), -(-max_model_len // block_size))
    return blocks * block_size


def kv_message_max_bytes(block_size: int, layers: int, kv_heads: int, head_dim: int, dtype: str, max_model_len: int,
                         part_bytes: int = KV_PART_BYTES) -> int:
    """The largest frame a legitimate KV message of this deployment has, plus framing headroom: the KV inbox's cap."""
    bpt = kv_bytes_per_token(layers, kv_heads, head_dim, dtype)
    return kv_part_tokens(block_size, bpt, max_model_len, part_bytes) * bpt + KV_FRAMING_BYTES


def split_kv(payload: KVPayload, part_tokens: int) -> list[tuple[int, KVPayload]]:
    """(token offset, part) pairs of at most `part_tokens` tokens each; the payload itself when it fits in one."""
    if part_tokens < 1:
        raise KVTransferError(f"part_tokens must be >= 1, got {part_tokens}")
    if payload.num_tokens <= part_tokens:
        return [(0, payload)]
    parts = []
    for start in range(0, payload.num_tokens, part_tokens):
        data = payload.data[:, :, start:start + part_tokens].contiguous()
        parts.append((start, KVPayload(int(data.shape[2]), payload.dtype, tuple(data.shape), data)))
    return parts


class KVAssembly:
    """The parts of one transfer, copied in order into one payload of `total_tokens` tokens.

    The geometry is the receiving worker's wire geometry (every KV head, whatever its TP degree; never the sender's
    word), and `total_tokens` is checked against `max_tokens` before anything is allocated, so a peer cannot make
    this hold more than one sequence's KV."""

    def __init__(self, total_tokens: int, geometry: tuple[int, int, int, str], max_tokens: int) -> None:
        layers, kv_heads, head_dim, dtype = geometry
        if not 0 < total_tokens <= max_tokens:
            raise KVTransferError(f"a transfer of {total_tokens} tokens (at most {max_tokens} here)")
        self.total, self.filled, self.dtype = total_tokens, 0, dtype
        self.data = torch.empty((layers, 2, total_tokens, kv_heads, head_dim), dtype=_DTYPES[dtype])

    def add(self, offset: int, part: KVPayload) -> KVPayload | None:
        """Copy one part in (parts come in order); the whole payload once the last part is in, else None."""
        n = part.num_tokens
        want = (*self.data.shape[:2], n, *self.data.shape[3:])
        if offset != self.filled:
            raise KVTransferError(f"a KV part at token {offset}, expected {self.filled}")
        if n < 1 or offset + n > self.total:
            raise KVTransferError(f"a KV part of {n} tokens at {offset} overruns its transfer of {self.total}")
        if tuple(part.shape) != want or part.dtype != self.dtype:
            raise KVTransferError(f"a KV part {tuple(part.shape)} {part.dtype} does not fit this cache "
                                  f"({want} {self.dtype})")
        self.data[:, :, offset:offset + n].copy_(part.data)
        self.filled += n
        if self.filled < self.total:
            return None
        return KVPayload(self.total, self.dtype, tuple(self.data.shape), self.data)


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
    dtype = dtype_name(c0.dtype)
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
