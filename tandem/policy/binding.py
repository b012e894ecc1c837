"""Which decode (or co-located) worker a new session is bound to for its whole life."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class LeastKVBinder:
    """Bind to the worker with the smallest fraction of its KV pool committed (AMPD step 1, Dynamo's KV router)."""

    def bind(self, workers: Sequence[int], committed_tokens: dict[int, int], capacity: dict[int, int],
             block_hashes: Sequence[int] = ()) -> int:
        return min(workers, key=lambda w: (committed_tokens.get(w, 0) / capacity[w], w))


class PrefixIndex:
    """Per worker, the chained block hashes of prompts it has served (bounded, least recently seen dropped):
    what the coordinator believes each worker may still have in its prefix cache."""

    def __init__(self, max_hashes_per_worker: int = 200_000) -> None:
        if max_hashes_per_worker < 1:
            raise ValueError("a prefix index keeps at least one hash per worker")
        self.cap = max_hashes_per_worker
        self._seen: dict[int, OrderedDict[int, None]] = {}

    def remember(self, worker: int, block_hashes: Sequence[int]) -> None:
        seen = self._seen.setdefault(worker, OrderedDict())
        for h in block_hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.cap:
            seen.popitem(last=False)

    def match(self, worker: int, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` `worker` has seen."""
        seen = self._seen.get(worker)
        if not seen:
            return 0
        n = 0
        for h in block_hashes:
            if h not in seen:
                break
            n += 1
        return n

    def forget(self, worker: int) -> None:
        self._seen.pop(worker, None)


class PrefixAffinityBinder:
    """Bind to the worker that has seen the longest prefix of the session's first prompt (its prefix cache
    likely holds it: vLLM's and SGLang's cache-aware routing); no prefix seen anywhere: least committed KV."""

    def __init__(self, index: PrefixIndex | None = None, fallback: LeastKVBinder | None = None) -> None:
        self.index = index or PrefixIndex()
        self.fallback = fallback or LeastKVBinder()

    def bind(self, workers: Sequence[int], committed_tokens: dict[int, int], capacity: dict[int, int],
             block_hashes: Sequence[int] = ()) -> int:
        best, best_n = None, 0
        if block_hashes:
            for w in workers:
                n = self.index.match(w, block_hashes)
                if n > best_n or (n == best_n and n > 0 and best is not None and w < best):
                    best, best_n = w, n
        if best is not None:
            return best
        return self.fallback.bind(workers, committed_tokens, capacity)
