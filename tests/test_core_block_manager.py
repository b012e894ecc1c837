"""The block manager's bulk allocation and release hand out exactly the blocks a block-at-a-time pool would: the
same ids in the same order, the same cached content forgotten, the same free order (prefix caching depends on it)."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from tandem.core import block_manager
from tandem.core.block_manager import BlockManager, OutOfBlocks


class OneAtATime:
    """Reference pool: least recently freed first, one block per operation, ref-counted, with a prefix cache."""

    def __init__(self, n: int, bs: int) -> None:
        self.bs, self.free = bs, OrderedDict.fromkeys(range(n))
        self.ref, self.hash_of, self.by_hash, self.tables = [0] * n, {}, {}, {}

    def grow(self, owner, tokens: int) -> None:
        table = self.tables.setdefault(owner, [])
        need = -(-tokens // self.bs) - len(table)
        if need > len(self.free):
            if not table:
                del self.tables[owner]
            raise OutOfBlocks(need)
        for _ in range(max(need, 0)):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.by_hash[h]
            self.ref[b] = 1
            table.append(b)

    def free_owner(self, owner) -> int:
        table = self.tables.pop(owner, None) or []
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        return len(table)

    def share(self, owner, hashes) -> None:
        table = self.tables.setdefault(owner, [])
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            table.append(b)

    def register(self, owner, i: int, h: int) -> None:
        b = self.tables[owner][i]
        if h not in self.by_hash and b not in self.hash_of:
            self.by_hash[h], self.hash_of[b] = b, h


@pytest.mark.parametrize("seed,compact", [(s, c) for s in range(4) for c in (8, 4096)])
def test_bulk_pool_matches_block_at_a_time(seed: int, compact: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random grows, frees, shared prefixes and registrations: every table, the free order and the cache agree with
    the reference after every operation, with the free list compacted often or never (protects prefix-cache hits
    and block identities in the simulator)."""
    monkeypatch.setattr(block_manager, "COMPACT_ENTRIES", compact)
    rng = random.Random(seed)
    bm, ref = BlockManager(64, block_size=4), OneAtATime(64, 4)
    owners = [f"o{i}" for i in range(8)]
    for _ in range(3000):
        op, o = rng.random(), rng.choice(owners)
        if op < 0.45:
            tokens = len(ref.tables.get(o, ())) * 4 + rng.choice([1, 3, 4, 9, 40, 120])
            raised = []
            for pool in (bm, ref):
                try:
                    pool.grow(o, tokens)
                except OutOfBlocks as e:
                    raised.append(e.args)
            assert len(raised) in (0, 2) and (not raised or raised[0] == raised[1])
        elif op < 0.7:
            assert bm.free(o) == ref.free_owner(o)
        elif op < 0.85:
            if o not in ref.tables:
                hashes = [rng.randrange(12) for _ in range(rng.randrange(1, 5))]
                ref.share(o, hashes)
                bm.share(o, bm.match_prefix(hashes))
        elif ref.tables.get(o):
            i, h = rng.randrange(len(ref.tables[o])), rng.randrange(12)
            ref.register(o, i, h)
            bm.register(o, i, h)
        assert bm.tables == {k: v for k, v in ref.tables.items()}
        assert bm.free_blocks() == list(ref.free)
        assert bm._by_hash == ref.by_hash and bm._hash_of == ref.hash_of
        assert {b: bm._ref[b] for b in ref.hash_of} == {b: ref.ref[b] for b in ref.hash_of}   # the shareable ones
        assert bm.num_free == len(ref.free)
