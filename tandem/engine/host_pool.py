"""A worker's host-memory KV pool: the slots behind the core's host tier (tandem.core.host_tier), one block of this
rank's KV heads each, and the copies between them and the paged GPU (or CPU) KV pool.

The core decides which runs exist and which copies run; this pool only maps its runs to slots (a session run by its
run blocks, a prefix run by its block hashes) and moves the bytes. On CUDA the pool is pinned and the copies run on a
stream of their own, beside the steps' stream; on CPU it is a separate tensor, copied with index_select/index_copy_.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import numpy as np
import torch

from tandem.core.host_tier import CopyKind, HostRun, HostTier, KVCopy

GIB = 1 << 30
PROBE_BLOCKS = 8                 # the start-up bandwidth probe copies 1 and then this many blocks out and back
PROBE_REPEATS = 3                # ... this many times each, keeping the fastest


class CopyFault(RuntimeError):
    """An injected copy failure (a test hook, on a copy thread)."""


class HostPoolError(RuntimeError):
    """A copy the pool cannot map to its slots (a shell bug: the core's tier and the pool disagree)."""


def host_memory_available(device: torch.device) -> int:
    """Bytes a host tier may take now: psutil's available memory (on CUDA the same: pinned pages come from it)."""
    import psutil
    return int(psutil.virtual_memory().available)


class CopyLanes:
    """Two copy threads, one per direction (out to host memory, back in), each carrying out its items in order with
    `run_one(item)`; a False from it ends that thread. A worker's driver and each of its TP ranks run one."""

    def __init__(self, name: str, run_one: Callable[[object], bool | None], device: torch.device | None = None) -> None:
        self.run_one, self.device = run_one, device
        self._queues: tuple[queue.SimpleQueue, queue.SimpleQueue] = (queue.SimpleQueue(), queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name}-{d}", daemon=True)
                         for d, q in zip(("out", "in"), self._queues)]
        for t in self._threads:
            t.start()

    def put(self, to_host: bool, item) -> None:
        """Queue `item` behind the copies already going the same way."""
        self._queues[0 if to_host else 1].put(item)

    def close(self) -> None:
        """End both threads once their queued items are done."""
        for q in self._queues:
            q.put(None)

    def _run(self, q: queue.SimpleQueue) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)           # a new thread's current device is the first
        while True:
            item = q.get()
            if item is None or self.run_one(item) is False:
                return


class HostKVPool:
    """`capacity` host blocks shaped as one rank's GPU blocks, per layer [2, capacity, block_size, heads, head_dim]."""

    def __init__(self, kv_caches: list[torch.Tensor], capacity: int, block_size: int) -> None:
        c0 = kv_caches[0]
        self.device = c0.device
        self.block_size = block_size
        self.capacity = capacity
        shape = (2, capacity, block_size, c0.shape[-2], c0.shape[-1])
        self.pinned = self.device.type == "cuda"
        if self.pinned:                                  # pinned: DMA copies that do not block the step's stream
            self.data = [torch.empty(shape, dtype=c0.dtype, pin_memory=True) for _ in kv_caches]
            self.stream = torch.cuda.Stream(self.device)
        else:                                            # calloc'd: pages are mapped when a copy first writes them
            nbytes = int(np.prod(shape)) * c0.element_size()
            self.data = [torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(c0.dtype).view(shape)
                         for _ in kv_caches]
            self.stream = None
        self.block_bytes = int(np.prod(shape[2:])) * 2 * c0.element_size() * len(kv_caches)
        self._free = list(range(capacity - 1, -1, -1))
        self._runs: dict[int, tuple[HostRun, list[int]]] = {}   # id(run) -> (run, its slots by run block)
        self._by_hash: dict[int, int] = {}                       # prefix block hash -> slot
        self.link_one_s = self.link_block_s = 0.0                # the start-up probe's figures (probe)

    # ---------------------------------------------------------------- slots (step thread only)
    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def collect(self, tier: HostTier) -> None:
        """Free the slots of runs the core's tier no longer holds (evicted, aborted, ended): none has a copy in
        flight (the core never drops a run being written or read)."""
        for key, (run, slots) in list(self._runs.items()):
            live = tier.session_runs if isinstance(run.key, str) else tier.prefix_runs
            if live.get(run.key) is run:
                continue
            del self._runs[key]
            self._free.extend(slots)
            for h in run.hashes:
                if self._by_hash.get(h) in slots:
                    del self._by_hash[h]

    def slots(self, run: HostRun) -> list[int]:
        """The slots holding `run`'s blocks, in run order (none yet: empty)."""
        entry = self._runs.get(id(run))
        return list(entry[1]) if entry is not None else []

    def _slots_of(self, run: HostRun, tier: HostTier) -> list[int]:
        """The run's slots, grown to its size (freeing dropped runs' slots first when short)."""
        entry = self._runs.get(id(run))
        slots = entry[1] if entry is not None else []
        need = run.nblocks - len(slots)
        if need > len(self._free):
            self.collect(tier)
        if need > len(self._free):
            raise HostPoolError(f"the host pool has {len(self._free)} free slots, a run needs {need} more")
        for _ in range(max(0, need)):
            slots.append(self._free.pop())
        if entry is None:
            self._runs[id(run)] = (run, slots)
            for h, s in zip(run.hashes, slots):
                self._by_hash[h] = s
        return slots

    def plan(self, c: KVCopy, tier: HostTier) -> tuple[list[int], list[int]]:
        """(GPU blocks, host slots) the copy moves, pairwise: whole blocks holding its `tokens` positions."""
        n = -(-c.tokens // self.block_size)
        blocks = list(c.blocks[:n])
        if c.kind is CopyKind.LOAD and c.run is None:    # a cached prefix: slots by block hash
            try:
                return blocks, [self._by_hash[h] for h in c.hashes[:n]]
            except KeyError:
                raise HostPoolError(f"copy {c.id}: a prefix block the host pool does not hold") from None
        slots = self._slots_of(c.run, tier)
        first = c.first if c.kind.to_host else 0
        if first + len(blocks) > len(slots):
            raise HostPoolError(f"copy {c.id}: {len(blocks)} blocks from run block {first}, the run has {len(slots)}")
        return blocks, slots[first:first + len(blocks)]

    # ---------------------------------------------------------------- bytes (the copy thread)
    def copy(self, kv_caches: list[torch.Tensor], to_host: bool, blocks: list[int], slots: list[int]) -> None:
        """Move whole blocks between the paged pool and the host slots, bit for bit (blocks[i] <-> slots[i])."""
        if not blocks:
            return
        dev = self.device
        bi = torch.tensor(blocks, dtype=torch.long, device=dev)
        si = torch.tensor(slots, dtype=torch.long)
        if self.stream is None:
            for host, kv in zip(self.data, kv_caches):
                if to_host:
                    host.index_copy_(1, si, kv.index_select(1, bi))
                else:
                    kv.index_copy_(1, bi, host.index_select(1, si))
            return
        self.stream.wait_stream(torch.cuda.current_stream(dev))    # the steps that wrote the blocks come first
        with torch.cuda.stream(self.stream):
            for host, kv in zip(self.data, kv_caches):
                if to_host:
                    staged = torch.empty((2, len(blocks), *kv.shape[2:]), dtype=kv.dtype, pin_memory=True)
                    staged.copy_(kv.index_select(1, bi), non_blocking=True)
                    self.stream.synchronize()
                    host.index_copy_(1, si, staged)
                else:
                    staged = host.index_select(1, si).pin_memory()
                    kv.index_copy_(1, bi, staged.to(dev, non_blocking=True))
        self.stream.synchronize()

    def probe(self, kv_caches: list[torch.Tensor], clock=time.perf_counter) -> tuple[float, float]:
        """Time copies of 1 and of PROBE_BLOCKS blocks out and back (GPU blocks and host slots from the start of each
        pool, restored as they were): (seconds of a one-block copy, seconds per further block), each way's mean."""
        k = max(1, min(PROBE_BLOCKS, self.capacity, kv_caches[0].shape[1]))
        first = self._free[-k:][::-1]

        def timed(n: int) -> float:
            best = float("inf")
            blocks, slots = list(range(n)), first[:n]
            for _ in range(PROBE_REPEATS):
                t0 = clock()
                self.copy(kv_caches, True, blocks, slots)
                self.copy(kv_caches, False, blocks, slots)
                best = min(best, (clock() - t0) / 2)
            return best
        one = timed(1)
        many = timed(k) if k > 1 else one
        per_block = max((many - one) / (k - 1), 1e-12) if k > 1 else max(one, 1e-12)
        return one, per_block
