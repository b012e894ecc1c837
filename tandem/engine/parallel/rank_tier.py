"""A tensor-parallel rank's share of the host KV tier: its own heads' host pool and two copy threads (one per
direction, in order, as on the driver) that carry out the driver's copies beside this rank's steps. The driver starts
them with one small group command that does not wait ("tier_copies"); each copy's end (done, or failed and why) goes
back to the driver over this rank's notice pipe (driver.RankGroup.listen), so the rank's command loop never waits
for a copy. The driver reports a copy to its core only once every rank has ended it (engine/tier_copies.py).

A copy reads or writes blocks no step touches meanwhile (the driver's core guarantees it and its TierRunner asserts
it): the copy thread's index_copy_ into other blocks of the KV tensors is what a tp=1 worker's copy threads do too."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from tandem.engine.host_pool import CopyFault, CopyLanes, HostKVPool

log = logging.getLogger(__name__)
HOLD_LIMIT_S = 120.0        # a held copy (a test hook) goes on by itself after this long
NOTICE = "tier"             # the first field of a copy's end on the notice pipe: (NOTICE, copy id, "" or why)

CopyOrder = tuple[int, bool, list[int], list[int]]     # (copy id, to host, GPU blocks, host slots)


class RankTier:
    """One rank's host pool (None: it could not be allocated, every copy fails) and its copy threads."""

    def __init__(self, rank: int, pool: HostKVPool | None, kv_caches: Callable[[], list[torch.Tensor]],
                 notices: Any, device: torch.device, why: str = "") -> None:
        self.rank, self.pool, self.kv_caches, self.notices, self.device = rank, pool, kv_caches, notices, device
        self.why = why                                   # why there is no pool
        self.fail_copies = 0                             # test hook: this many next copies raise
        self.released = threading.Event()                # test hook: cleared, copies wait before they start
        self.released.set()
        self._lock = threading.Lock()                    # the notice pipe and fail_copies, shared by both threads
        self._lanes = CopyLanes(f"tandem-kv-copy-rank{rank}", self._run_one, device)

    @classmethod
    def open(cls, rank: int, capacity: int, block_size: int, kv_caches: Callable[[], list[torch.Tensor]],
             notices: Any, device: torch.device) -> RankTier:
        """The "tier_alloc" command: this rank's pool of `capacity` blocks of its heads, or a tier whose copies
        fail (the reason logged and reported with each) when it cannot be allocated."""
        try:
            if capacity < 1:
                raise ValueError("the driver allocated no host pool here")
            return cls(rank, HostKVPool(kv_caches(), capacity, block_size), kv_caches, notices, device)
        except Exception as e:  # noqa: BLE001 - every copy of this rank then fails: the driver's core recomputes
            why = f"no host pool on rank {rank}: {type(e).__name__}: {e}"
            log.error("%s", why)
            return cls(rank, None, kv_caches, notices, device, why)

    def start(self, orders: list[CopyOrder]) -> None:
        """The "tier_copies" command: queue each copy on its direction's thread and return at once."""
        for order in orders:
            self._lanes.put(order[1], order)

    def hooks(self, fail: int, hold: bool | None) -> None:
        """Test hooks: the next `fail` copies raise; hold=True holds copies before they start until hold=False."""
        with self._lock:
            self.fail_copies += max(0, fail)
        if hold is True:
            self.released.clear()
        elif hold is False:
            self.released.set()

    def close(self) -> None:
        self.released.set()
        self._lanes.close()

    # ---------------------------------------------------------------- copy threads
    def _run_one(self, order: CopyOrder) -> bool:
        """One copy, then its end on the notice pipe; False (this lane ends) once the driver is gone."""
        why = self._copy(*order)
        with self._lock:
            try:
                self.notices.send((NOTICE, order[0], why))
            except (OSError, ValueError):                # the driver is gone: this rank exits by itself soon
                return False
        return True

    def _copy(self, cid: int, to_host: bool, blocks: list[int], slots: list[int]) -> str:
        """Carry out one copy; "" when done, else why it failed (logged here)."""
        self.released.wait(HOLD_LIMIT_S)
        try:
            with self._lock:
                fail, self.fail_copies = self.fail_copies > 0, max(0, self.fail_copies - 1)
            if fail:
                raise CopyFault(f"injected failure of host-tier copy {cid} on rank {self.rank}")
            if self.pool is None:
                raise RuntimeError(self.why)
            with torch.inference_mode():
                self.pool.copy(self.kv_caches(), to_host, blocks, slots)
        except Exception as e:  # noqa: BLE001 - reported to the driver, whose core recomputes
            log.warning("tensor-parallel rank %d: host-tier copy %d failed: %s", self.rank, cid, e)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return ""


def gather_objects(size: int, mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order (one all-gather within the group)."""
    import torch.distributed as dist
    out: list[Any] = [None] * size
    dist.all_gather_object(out, mine)
    return out


def compare(pool: HostKVPool | None, kv_caches: list[torch.Tensor], blocks: list[int],
            slots: list[int]) -> tuple[bool, float]:
    """(whether host slots[i] equal GPU blocks[i] bit for bit in every layer, the sum of those slots' values): this
    rank's answer to "tier_compare", a check for tests and debugging."""
    if pool is None:
        return False, 0.0
    try:
        bi, si = torch.tensor(blocks, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
        same, total = True, 0.0
        for host, kv in zip(pool.data, kv_caches):
            h = host.index_select(1, si)
            same = same and torch.equal(h, kv.index_select(1, bi.to(kv.device)).cpu())
            total += float(h.double().sum())
    except Exception as e:  # noqa: BLE001 - every rank must answer the gather: a bad request compares unequal
        log.warning("tensor-parallel rank: host-tier comparison failed: %s", e)
        return False, 0.0
    return same, total
