"""KV block accounting for one worker: a fixed pool of fixed-size blocks, ref-counted, with a prefix cache.

Blocks whose content is known are registered under a chained hash (the hash of the block's tokens
and of every block before it, as vLLM and the Mooncake trace's `hash_ids` do). A freed block keeps
its hash until it is handed out again, so a later sequence with the same prefix can take it back
instead of recomputing it. Free blocks are reused least recently freed first.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import partial
from itertools import repeat
from operator import is_not

_not_none = partial(is_not, None)
COMPACT_ENTRIES = 4096
"""Consumed entries at the front of the free list after which (once they are half of it) they are dropped."""

_drain = deque(maxlen=0).extend                    # runs an iterator (a C-level map) to its end, keeping nothing


class OutOfBlocks(Exception):
    """Raised when an allocation cannot be satisfied from the free pool."""


class BlockManager:
    """Free pool plus per-owner block tables; the executor maps block ids to KV tensor slots.

    The free pool is the never-used blocks `_fresh`..num_blocks-1 (in id order, handed out first) followed by a FIFO
    list of freed blocks read from `_head` (least recently freed first): a whole prompt's blocks are handed out as one
    slice and a table's blocks go back as one extend; a new pool allocates nothing per block. Only blocks with cached
    content can be shared, so reference counts are kept for them alone (any other held block has exactly one owner). A free block taken back
    by the prefix cache (`share`) leaves a dead entry behind, counted per block in `_dead` (a block's dead entries
    come before its live one); `_stale` counts them all, and while it is 0 a take is a plain slice."""

    __slots__ = ("block_size", "num_blocks", "_fresh", "_fifo", "_head", "_nfree", "_dead", "_stale", "_ref",
                 "_hash_of", "_by_hash", "tables", "prefix_hits", "prefix_queries", "_shared", "removed")

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("a block manager needs a positive number of blocks and block size")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._fresh = 0                             # blocks from here to num_blocks - 1 were never handed out
        self._fifo: list[int] = []                  # freed entries in freeing order, live and dead
        self._head = 0                              # index in _fifo of the oldest entry not yet consumed
        self._nfree = num_blocks
        self._dead: dict[int, int] = {}             # block -> its dead entries at or past the head
        self._stale = 0                             # all dead entries at or past the head
        self._ref: dict[int, int] = {}              # references counted by share/register (absent: 0)
        self._hash_of: dict[int, int] = {}          # block -> chained hash of its (complete) content
        self._by_hash: dict[int, int] = {}          # chained hash -> block
        self.tables: dict[object, list[int]] = {}
        self.prefix_hits = 0                        # blocks served from the prefix cache
        self.prefix_queries = 0                     # blocks looked up in it
        self._shared = 0                            # blocks with more than one reference
        self.removed: list[int] | None = None       # when a list: hashes forgotten by reuse (KV events)

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any owner (cached-but-unused ones included: they are evictable)."""
        return self._nfree

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc / 100)."""
        return 1.0 - self._nfree / self.num_blocks

    def free_blocks(self) -> list[int]:
        """The free blocks in the order they will be handed out (least recently freed first)."""
        dead = dict(self._dead)
        out = list(range(self._fresh, self.num_blocks))
        for b in self._fifo[self._head:]:
            d = dead.get(b)
            if d:
                dead[b] = d - 1
            else:
                out.append(b)
        return out

    def extra_blocks(self, owner: object, num_tokens: int) -> int:
        """Blocks `owner` still needs so that it can hold `num_tokens` tokens in total."""
        have = len(self.tables.get(owner, ()))
        need = -(-num_tokens // self.block_size) - have
        return need if need > 0 else 0

    def _take(self, n: int) -> list[int]:
        """Hand out the `n` (<= num_free) least recently freed blocks, in that order, forgetting any content they
        cached: never-used blocks first, then a slice of the free list (the simulator allocates whole prompts at
        once)."""
        fresh, end = self._fresh, self.num_blocks
        if fresh < end:                             # never-used blocks: no content, no dead entries
            k = n if n <= end - fresh else end - fresh
            self._fresh = fresh + k
            if k == n:
                self._nfree -= n
                return list(range(fresh, fresh + n))
            return list(range(fresh, end)) + self._take_freed(n - k, k)
        return self._take_freed(n)

    def _take_freed(self, n: int, fresh: int = 0) -> list[int]:
        """`_take` from the list of freed blocks, `fresh` never-used blocks having been handed out before them."""
        fifo, head = self._fifo, self._head
        if not self._stale:
            taken = fifo[head:head + n]
            head += n
        else:                                       # skip the dead entries, one at a time
            dead, taken = self._dead, []
            while len(taken) < n:
                b = fifo[head]
                head += 1
                d = dead.get(b)
                if d:
                    self._stale -= 1
                    if d == 1:
                        del dead[b]
                    else:
                        dead[b] = d - 1
                else:
                    taken.append(b)
        if head >= COMPACT_ENTRIES and head * 2 >= len(fifo):   # drop the consumed front now and then
            del fifo[:head]
            head = 0
        self._head = head
        self._nfree -= n + fresh
        hash_of = self._hash_of
        if hash_of:                                 # their references are 0 already: they were free
            gone = list(filter(_not_none, map(hash_of.pop, taken, repeat(None))))
            if gone:
                _drain(map(self._by_hash.__delitem__, gone))
                if self.removed is not None:        # hashes forgotten by reuse (KV events)
                    self.removed.extend(gone)
        return taken

    def grow(self, owner: object, num_tokens: int) -> None:
        """Make `owner`'s table hold `num_tokens` tokens; raises OutOfBlocks without side effects."""
        table = self.tables.get(owner)
        if table is None:
            table = self.tables[owner] = []
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return
        if need > self._nfree:
            if not table:
                del self.tables[owner]
            raise OutOfBlocks(need)
        table += self._take(need)

    def free(self, owner: object) -> int:
        """Drop all of `owner`'s references; blocks nobody references return to the pool (tail blocks first: they
        are evicted first). Returns how many references were dropped."""
        table = self.tables.pop(owner, None)
        if not table:
            return 0
        hash_of = self._hash_of
        if not self._shared:                        # every block has one owner: all of them go back
            back = table[::-1]
            if hash_of:
                _drain(map(self._ref.__setitem__, filter(hash_of.__contains__, back), repeat(0)))
        else:
            ref, back = self._ref, []
            for b in reversed(table):
                if b in hash_of:
                    r = ref[b]
                    if r == 2:
                        self._shared -= 1
                    ref[b] = r - 1
                    if r > 1:
                        continue
                back.append(b)
        self._fifo += back
        self._nfree += len(back)
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
        ref = self._ref
        for b in blocks:
            r = ref.get(b, 0)                       # 0: a block no count was kept for yet
            if r == 0:                              # a free block: its pool entry dies
                self._dead[b] = self._dead.get(b, 0) + 1
                self._stale += 1
                self._nfree -= 1
            elif r == 1:
                self._shared += 1
            ref[b] = r + 1
            table.append(b)

    def register(self, owner: object, index: int, h: int) -> None:
        """Record that block `index` of `owner`'s table now holds the complete content hashed `h`."""
        b = self.tables[owner][index]
        if h in self._by_hash or b in self._hash_of:
            return                                  # the same content is cached already (or this block is)
        self._by_hash[h] = b
        self._hash_of[b] = h
        self._ref[b] = 1                            # a block without content has exactly one owner
