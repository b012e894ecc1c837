"""KV block accounting for one worker: a fixed pool of fixed-size blocks handed out to sequences."""
from __future__ import annotations


class OutOfBlocks(Exception):
    """Raised when an allocation cannot be satisfied from the free pool."""


class BlockManager:
    """Free list plus per-owner block tables; the executor maps block ids to KV tensor slots."""

    __slots__ = ("block_size", "num_blocks", "_free", "tables")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("a block manager needs a positive number of blocks and block size")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[object, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc / 100)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, owner: object, num_tokens: int) -> int:
        """Blocks `owner` still needs so that it can hold `num_tokens` tokens in total."""
        have = len(self.tables.get(owner, ()))
        need = -(-num_tokens // self.block_size) - have
        return need if need > 0 else 0

    def grow(self, owner: object, num_tokens: int) -> None:
        """Make `owner`'s table hold `num_tokens` tokens; raises OutOfBlocks without side effects."""
        table = self.tables.get(owner)
        if table is None:
            table = self.tables[owner] = []
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return
        free = self._free
        if need > len(free):
            if not table:
                del self.tables[owner]
            raise OutOfBlocks(need)
        if need == 1:
            table.append(free.pop())
        else:
            table.extend(free[-need:][::-1])
            del free[-need:]

    def free(self, owner: object) -> int:
        """Return all of `owner`'s blocks to the pool; returns how many were freed."""
        table = self.tables.pop(owner, None)
        if not table:
            return 0
        self._free.extend(reversed(table))
        return len(table)

    def held(self, owner: object) -> int:
        return len(self.tables.get(owner, ()))
