"""KV block accounting for one worker: a fixed pool of fixed-size blocks, ref-counted, with a prefix cache.

Blocks whose content is known are registered under a chained hash (the hash of the block's tokens
and of every block before it, as vLLM and the Mooncake trace's `hash_ids` do). A freed block keeps
its hash until it is handed out again, so a later sequence with the same prefix can take it back
instead of recomputing it. Free blocks are reused least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class OutOfBlocks(Exception):
    """Raised when an allocation cannot be satisfied from the free pool."""


class BlockManager:
    """Free pool plus per-owner block tables; the executor maps block ids to KV tensor slots."""

    __slots__ = ("block_size", "num_blocks", "_free", "_ref", "_hash_of", "_by_hash", "tables",
                 "prefix_hits", "prefix_queries", "removed")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("a block manager needs a positive number of blocks and block size")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}          # block -> chained hash of its (complete) content
        self._by_hash: dict[int, int] = {}          # chained hash -> block
        self.tables: dict[object, list[int]] = {}
        self.prefix_hits = 0                        # blocks served from the prefix cache
        self.prefix_queries = 0                     # blocks looked up in it
        self.removed: list[int] | None = None       # when a list: hashes forgotten by reuse (KV events)

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any owner (cached-but-unused ones included: they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc / 100)."""
        return 1.0 - len(self._free) / self.num_blocks

    def extra_blocks(self, owner: object, num_tokens: int) -> int:
        """Blocks `owner` still needs so that it can hold `num_tokens` tokens in total."""
        have = len(self.tables.get(owner, ()))
        need = -(-num_tokens // self.block_size) - have
        return need if need > 0 else 0

    def _take(self) -> int:
        """Hand out the least recently freed block, forgetting any content it cached."""
        b, _ = self._free.popitem(last=False)
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._by_hash[h]
            if self.removed is not None:
                self.removed.append(h)
        self._ref[b] = 1
        return b

    def grow(self, owner: object, num_tokens: int) -> None:
        """Make `owner`'s table hold `num_tokens` tokens; raises OutOfBlocks without side effects."""
        table = self.tables.get(owner)
        if table is None:
            table = self.tables[owner] = []
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            if not table:
                del self.tables[owner]
            raise OutOfBlocks(need)
        take = self._take
        for _ in range(need):
            table.append(take())

    def free(self, owner: object) -> int:
        """Drop all of `owner`'s references; blocks nobody references return to the pool. Returns how many."""
        table = self.tables.pop(owner, None)
        if not table:
            return 0
        ref, free = self._ref, self._free
        for b in reversed(table):                   # tail blocks are evicted first
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        return len(table)

    def held(self, owner: object) -> int:
        return len(self.tables.get(owner, ()))

    # ---------------------------------------------------------------- prefix cache
    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks caching the longest leading run of `hashes` (not yet taken: see `share`)."""
        out = []
        by_hash = self._by_hash
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            out.append(b)
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(out)
        return out

    def share(self, owner: object, blocks: Sequence[int]) -> None:
        """Append cached `blocks` (from `match_prefix`) to `owner`'s table, taking a reference on each."""
        table = self.tables.setdefault(owner, [])
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1
            table.append(b)

    def register(self, owner: object, index: int, h: int) -> None:
        """Record that block `index` of `owner`'s table now holds the complete content hashed `h`."""
        b = self.tables[owner][index]
        if h in self._by_hash or b in self._hash_of:
            return                                  # the same content is cached already (or this block is)
        self._by_hash[h] = b
        self._hash_of[b] = h
