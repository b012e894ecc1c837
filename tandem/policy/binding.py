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


HOST_BLOCK_WEIGHT = 0.8   # a block in a worker's host tier is worth this much of one on its GPU (it costs a copy)
LOAD_WEIGHT = 1.0         # a fully committed worker loses this share of the prompt's blocks from its score


class TieredPrefixIndex:
    """Per worker, which block hashes it holds on its GPU and in its host tier, learnt from the KV events workers
    publish (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, with their medium)."""

    def __init__(self) -> None:
        self._gpu: dict[int, set[int]] = {}
        self._cpu: dict[int, set[int]] = {}

    def stored(self, worker: int, hashes: Sequence[int], on_gpu: bool) -> None:
        """The worker now holds these blocks in that tier."""
        (self._gpu if on_gpu else self._cpu).setdefault(worker, set()).update(hashes)

    def removed(self, worker: int, hashes: Sequence[int], on_gpu: bool) -> None:
        """The worker no longer holds these blocks in that tier."""
        held = (self._gpu if on_gpu else self._cpu).get(worker)
        if held:
            held.difference_update(hashes)

    def observe(self, worker: int, hashes: Sequence[int] | None, stored: bool, on_gpu: bool) -> None:
        """One KV event of `worker`: blocks stored or removed in a tier; no hashes: it holds nothing any more."""
        if hashes is None:
            self.forget(worker)
        elif stored:
            self.stored(worker, hashes, on_gpu)
        else:
            self.removed(worker, hashes, on_gpu)

    def forget(self, worker: int) -> None:
        """The worker holds nothing (AllBlocksCleared, lost, restarted)."""
        self._gpu.pop(worker, None)
        self._cpu.pop(worker, None)

    def remember(self, worker: int, block_hashes: Sequence[int]) -> None:
        """Events, not served prompts, say what a worker holds: nothing to do."""

    def match(self, worker: int, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks of `block_hashes` the worker holds on its GPU, and in either tier."""
        gpu, cpu = self._gpu.get(worker, ()), self._cpu.get(worker, ())
        n_gpu = n = 0
        for h in block_hashes:
            if h in gpu:
                n += 1
                if n_gpu == n - 1:
                    n_gpu = n
            elif h in cpu:
                n += 1
            else:
                break
        return n_gpu, n


def tier_score(gpu_blocks: float, held_blocks: float, need_blocks: float, committed_share: float) -> float:
    """A worker's worth for a prompt: the leading blocks it holds (GPU ones fully, host ones HOST_BLOCK_WEIGHT each),
    less LOAD_WEIGHT x the blocks asked x its committed share of KV."""
    return gpu_blocks + HOST_BLOCK_WEIGHT * (held_blocks - gpu_blocks) - LOAD_WEIGHT * need_blocks * committed_share


class CacheAwareBinder:
    """Bind a new session to the worker whose tiers hold the longest prefix of its first prompt, GPU blocks counting
    fully and host blocks HOST_BLOCK_WEIGHT each, less LOAD_WEIGHT x the prompt's blocks x the worker's committed
    share; nothing held anywhere: least committed KV. A bound session's next round moves (`rebind`) only when
    another worker scores higher than its own does with what it holds of the session's context."""

    def __init__(self, index: TieredPrefixIndex | None = None, fallback: LeastKVBinder | None = None) -> None:
        self.index = index or TieredPrefixIndex()
        self.fallback = fallback or LeastKVBinder()

    def bind(self, workers: Sequence[int], committed_tokens: dict[int, int], capacity: dict[int, int],
             block_hashes: Sequence[int] = ()) -> int:
        if block_hashes:
            best, best_score, any_held = None, 0.0, False
            for w in workers:
                n_gpu, n = self.index.match(w, block_hashes)
                any_held |= n > 0
                score = tier_score(n_gpu, n, len(block_hashes), committed_tokens.get(w, 0) / capacity[w])
                if best is None or score > best_score:
                    best, best_score = w, score
            if any_held and best is not None:
                return best
        return self.fallback.bind(workers, committed_tokens, capacity)

    def rebind(self, own: int, own_gpu_blocks: int, own_held_blocks: int, need_blocks: int, mine: int,
               workers: Sequence[int], committed_tokens: dict[int, int], capacity: dict[int, int],
               block_hashes: Sequence[int] = ()) -> int:
        """Where a bound session's next round runs: `own` worker scores the blocks of its context it holds
        (`own_gpu_blocks` on its GPU, `own_held_blocks` in either tier) against its load without the session's own
        `mine` committed tokens; any other worker scores its held prefix of `block_hashes` against its load, both for
        the `need_blocks` of the whole round. The highest wins; ties stay home (moving drops what home holds)."""
        best = own
        best_score = tier_score(own_gpu_blocks, own_held_blocks, need_blocks,
                                (committed_tokens.get(own, 0) - mine) / capacity[own])
        for w in workers:
            if w == own:
                continue
            n_gpu, n = self.index.match(w, block_hashes) if block_hashes else (0, 0)
            score = tier_score(n_gpu, n, need_blocks, committed_tokens.get(w, 0) / capacity[w])
            if score > best_score:
                best, best_score = w, score
        return best
