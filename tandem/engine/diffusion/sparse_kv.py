"""dLLM-Serve §4.5 head-centric sparse KV for block diffusion: which cached positions each KV head keeps, and the
dense per-request buffer they are packed into.

At a Refresh step the active block's mean query (per query head, after q_norm and RoPE) scores every cached position
outside the block, q̄_h · k_j / sqrt(D); a 1-D max-pool of kernel `kv_pool_kernel` (stride 1, padding kernel // 2:
a position scores the best of its neighbourhood) smooths each head's scores; then, L the cached positions and
ρ = `kv_retention_ratio`, ⌊ρ·L⌋ positions (at least one) are kept:

- `head` (dLLM-Serve's head-centric selection): each KV head keeps its own top positions; a KV head shared by a group
  of query heads (GQA) scores a position by the group's best, as dLLM-Serve's code does;
- `uniform` (Sparse-dLLM, the baseline): the pooled scores summed over all query heads rank the positions once
  (the paper's Eq. 5: pool per head, then sum; dLLM-Serve's code sums first, then pools), and every head keeps the
  same top positions.

Ties go to the earlier position. The kept keys and values are packed per layer and head, in position order, into a
buffer of a fixed number of slots per head (⌈ρ·(P + G)⌉: PhaseSchedule.kv_tokens, what admission reserves),
allocated when the request starts and never resized. The index map is not kept: keys carry their RoPE positions,
so attention over the packed keys needs none.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.engine.sparse_kv_config import DEFAULT_POOL_KERNEL, DEFAULT_RETENTION, SELECTIONS, SparseKVConfig


def position_scores(q_block: Tensor, k_cached: Tensor, scale: float) -> Tensor:
    """Block queries [n, Hq, D] and cached keys [L, Hkv, D] -> float32 scores [Hq, L] of the block's mean query."""
    hq, hkv = q_block.shape[1], k_cached.shape[1]
    q_mean = q_block.float().mean(dim=0)                                   # [Hq, D]
    k = k_cached.float().repeat_interleave(hq // hkv, dim=1)               # [L, Hq, D]: query head h reads KV h // g
    return torch.einsum("hd,lhd->hl", q_mean, k) * scale


def pool_scores(scores: Tensor, kernel: int) -> Tensor:
    """Each row of scores [H, L] max-pooled over a window of `kernel` positions centred on each position."""
    if kernel == 1:
        return scores
    return F.max_pool1d(scores[:, None, :], kernel, stride=1, padding=kernel // 2)[:, 0, :]


def select_positions(scores: Tensor, num_kv_heads: int, keep: int, kernel: int, selection: str) -> Tensor:
    """Raw scores [Hq, L] -> the kept positions [Hkv, keep] (int64, ascending) of each KV head."""
    if selection not in SELECTIONS:
        raise ValueError(f"kv_selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    hq, n = scores.shape
    if not 0 < keep <= n:
        raise ValueError(f"cannot keep {keep} of {n} cached positions")
    pooled = pool_scores(scores, kernel)
    if selection == "head":
        per_head = pooled.view(num_kv_heads, hq // num_kv_heads, n).amax(dim=1)
    else:
        per_head = pooled.sum(dim=0, keepdim=True).expand(num_kv_heads, n)
    top = torch.sort(per_head, dim=1, descending=True, stable=True).indices[:, :keep]   # equal scores: earlier first
    return top.sort(dim=1).values


class SparseKVBuffer:
    """One request's packed KV: [layers, 2, Hkv, capacity, D], the first `lengths[layer]` slots of each head in use."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        """Allocate the whole buffer now; its size never changes."""
        if capacity < 1:
            raise ValueError(f"a sparse KV buffer needs at least one slot per head, got {capacity}")
        self.data = torch.zeros(num_layers, 2, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.lengths = [0] * num_layers

    @property
    def capacity(self) -> int:
        """Slots per layer and head."""
        return self.data.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds for the request's whole life."""
        return self.data.numel() * self.data.element_size()

    def pack(self, layer: int, k: Tensor, v: Tensor, keep: Tensor) -> None:
        """Keys and values [L, Hkv, D] of the cached positions; store the positions keep [Hkv, n] of each head."""
        n = keep.shape[1]
        if n > self.capacity:
            raise ValueError(f"{n} kept positions exceed the buffer's {self.capacity} slots per head")
        idx = keep[:, :, None].expand(-1, -1, k.shape[2])
        self.data[layer, 0, :, :n] = k.transpose(0, 1).gather(1, idx).to(self.data.dtype)
        self.data[layer, 1, :, :n] = v.transpose(0, 1).gather(1, idx).to(self.data.dtype)
        self.lengths[layer] = n

    def clear(self, layer: int) -> None:
        """Nothing cached at this layer (a Refresh with no positions outside the active block)."""
        self.lengths[layer] = 0

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        """The kept keys and values of a layer, [Hkv, n, D] each."""
        n = self.lengths[layer]
        return self.data[layer, 0, :, :n], self.data[layer, 1, :, :n]


class PagedSparseKV:
    """A request's packed KV inside the engine's paged KV pool: slot s of every head at KV block table[s // bs],
    offset s % bs (the blocks the core reserved at admission), with SparseKVBuffer's pack/read/clear."""

    def __init__(self, kv_caches: list[Tensor], table: list[int], kv_block_size: int, capacity: int) -> None:
        """Slots 0..capacity-1 over the request's blocks (ValueError when they hold fewer)."""
        if capacity < 1:
            raise ValueError(f"a sparse KV buffer needs at least one slot per head, got {capacity}")
        if len(table) * kv_block_size < capacity:
            raise ValueError(f"{capacity} KV slots do not fit the {len(table)} blocks of {kv_block_size} reserved")
        self.caches = kv_caches
        dev = kv_caches[0].device
        slots = torch.arange(capacity, device=dev)
        self.blocks = torch.tensor(table, dtype=torch.long, device=dev)[slots // kv_block_size]
        self.rows = self.blocks * kv_block_size + slots % kv_block_size   # each slot's row in a layer's flat pool
        self.lengths = [0] * len(kv_caches)

    @property
    def capacity(self) -> int:
        """Slots per layer and head."""
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's slots the buffer uses (K and V, every layer and head)."""
        c = self.caches[0]
        return len(self.caches) * 2 * self.capacity * c.shape[3] * c.shape[4] * c.element_size()

    def pack(self, layer: int, k: Tensor, v: Tensor, keep: Tensor) -> None:
        """Keys and values [L, Hkv, D] of the cached positions; store the positions keep [Hkv, n] of each head."""
        n = keep.shape[1]
        if n > self.capacity:
            raise ValueError(f"{n} kept positions exceed the buffer's {self.capacity} slots per head")
        idx = keep[:, :, None].expand(-1, -1, k.shape[2])
        pool, rows = _flat_pool(self.caches[layer]), self.rows[:n]
        pool[0].index_copy_(0, rows, k.transpose(0, 1).gather(1, idx).transpose(0, 1).to(pool.dtype))
        pool[1].index_copy_(0, rows, v.transpose(0, 1).gather(1, idx).transpose(0, 1).to(pool.dtype))
        self.lengths[layer] = n

    def clear(self, layer: int) -> None:
        """Nothing cached at this layer (a Refresh with no positions outside the active block)."""
        self.lengths[layer] = 0

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        """The kept keys and values of a layer, [Hkv, n, D] each (gathered from the pool)."""
        pool, rows = _flat_pool(self.caches[layer]), self.rows[:self.lengths[layer]]
        return pool[0].index_select(0, rows).transpose(0, 1), pool[1].index_select(0, rows).transpose(0, 1)


def _flat_pool(cache: Tensor) -> Tensor:
    """A layer's pool [2, blocks, block size, Hkv, D] as a view [2, slots, Hkv, D] (RuntimeError if it is not
    contiguous), so a request's slots are one index_select or index_copy_ (cheaper than indexing by block and offset)."""
    return cache.view(2, -1, *cache.shape[3:])


def buffer_bytes(num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of a SparseKVBuffer of `capacity` slots per head, without allocating it."""
    return num_layers * 2 * num_kv_heads * capacity * head_dim * torch.empty(0, dtype=dtype).element_size()


__all__ = ["DEFAULT_POOL_KERNEL", "DEFAULT_RETENTION", "SELECTIONS", "PagedSparseKV", "SparseKVBuffer",
           "SparseKVConfig",
           "buffer_bytes", "pool_scores", "position_scores", "select_positions"]
