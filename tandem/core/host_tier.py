"""A worker's host-memory KV tier: runs of blocks copied out of the GPU pool, content-addressed by the prefix
cache's chained block hashes (prefix runs) or owned by one session (its whole context), the copies that move them
(actions the shell carries out beside steps), and the KV events a worker publishes for cache-aware routing.

A run is the unit of eviction: a session's context is useless without its head, and a prefix run covers the
blocks one prefill registered. A run being written (its copy in flight) or read (a load in flight) is never
evicted, and only a written run is ever read.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

from tandem.policy.kv_tiers import EvictionKind


class Medium(Enum):
    """Where a block lives (vLLM's KV-event medium)."""

    GPU = "GPU"
    CPU = "CPU"


@dataclass(slots=True, frozen=True)
class BlockStored:
    """`worker` now holds the blocks of `hashes` in `medium` (vLLM's BlockStored)."""

    worker: int
    hashes: tuple[int, ...]
    medium: Medium


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """`worker` no longer holds the blocks of `hashes` in `medium` (vLLM's BlockRemoved)."""

    worker: int
    hashes: tuple[int, ...]
    medium: Medium


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """`worker` holds nothing any more (restarted; vLLM's AllBlocksCleared)."""

    worker: int


KV_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)


class CopyKind(Enum):
    """What a KV copy between a worker's GPU pool and its host tier is for."""

    OFFLOAD = "offload"          # an idle session's context, GPU -> host
    WRITE = "write"              # newly registered prefix blocks, GPU -> host (write-through)
    PREFETCH = "prefetch"        # an offloaded context, host -> GPU, ahead of its expected return
    LOAD = "load"                # host -> GPU because a round asks for it now (a context or a cached prefix)

    @property
    def to_host(self) -> bool:
        return self is CopyKind.OFFLOAD or self is CopyKind.WRITE


@dataclass(slots=True, frozen=True, eq=False)
class KVCopy:
    """Copy `tokens` positions between GPU `blocks` (block-table order) and host run `run`; the shell reports
    on_copy_done(id) or on_copy_failed(id). The GPU blocks hold a reference for the copy's whole life."""

    id: int
    kind: CopyKind
    session_id: str
    blocks: tuple[int, ...]
    tokens: int
    run: object
    est_s: float = 0.0           # what the core expects it to take (its backlog on the link included)
    first: int = 0               # the run's block the copy starts at (an offload adds to a run's tail)
    hashes: tuple[int, ...] = ()  # a prefix load: the block hashes it reads (run is None: they may span runs)


class RunState(Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True, eq=False)
class HostRun:
    """Blocks of one session's context or of one registered prefix, in host memory."""

    key: object
    nblocks: int
    hashes: tuple[int, ...] = ()
    state: RunState = RunState.WRITING
    readers: int = 0
    last_use: float = 0.0
    expect_s: float | None = None    # expected next use (a session's return); None: a prefix block run
    doomed: bool = False             # forget it once its copy lands (its session ended meanwhile)

    @property
    def busy(self) -> bool:
        return self.state is RunState.WRITING or self.readers > 0


class HostTier:
    """Host-memory KV of one worker: `capacity_blocks` blocks in runs; `eviction` picks the victim when full."""

    def __init__(self, capacity_blocks: int, eviction: EvictionKind = EvictionKind.LRU) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a host tier holds at least one block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.eviction = EvictionKind(eviction)
        self.used = 0
        self.prefix_runs: OrderedDict[object, HostRun] = OrderedDict()   # least recently used first
        self.session_runs: dict[str, HostRun] = {}
        self.by_hash: dict[int, HostRun] = {}
        self.removed: list[int] = []             # hashes evicted since the last take (BlockRemoved events)
        self.evictions = 0

    # ---------------------------------------------------------------- room and eviction
    def _candidates(self, now: float, keep: object) -> list[HostRun]:
        return [r for r in (*self.session_runs.values(), *self.prefix_runs.values()) if not r.busy and r is not keep]

    def _victim(self, now: float, keep: object) -> HostRun | None:
        """The run the rule evicts next (never a busy one, never `keep`)."""
        oldest_prefix = next((r for r in self.prefix_runs.values() if not r.busy and r is not keep), None)
        sessions = [r for r in self.session_runs.values() if not r.busy and r is not keep]
        if self.eviction is EvictionKind.LRU:
            best = min(sessions, key=lambda r: r.last_use, default=None)
            if oldest_prefix is not None and (best is None or oldest_prefix.last_use < best.last_use):
                return oldest_prefix
            return best
        # latest expected next use first; a prefix run is expected back after as long as it has been unused
        best = max(sessions, key=lambda r: r.expect_s if r.expect_s is not None else now, default=None)
        if oldest_prefix is not None and (best is None or 2 * now - oldest_prefix.last_use > (best.expect_s or now)):
            return oldest_prefix
        return best

    def room(self, nblocks: int, now: float, keep: object = None) -> bool:
        """Whether `nblocks` more fit, evicting idle runs if need be (nothing is evicted here)."""
        free = self.capacity_blocks - self.used
        if free >= nblocks:
            return True
        return free + sum(r.nblocks for r in self._candidates(now, keep)) >= nblocks

    def _make_room(self, nblocks: int, now: float, keep: object) -> bool:
        while self.capacity_blocks - self.used < nblocks:
            v = self._victim(now, keep)
            if v is None:
                return False
            self._remove(v)
            self.evictions += 1
        return True

    def _remove(self, run: HostRun) -> None:
        self.used -= run.nblocks
        if isinstance(run.key, str):
            self.session_runs.pop(run.key, None)
        else:
            self.prefix_runs.pop(run.key, None)
        for h in run.hashes:
            if self.by_hash.get(h) is run:
                del self.by_hash[h]
                self.removed.append(h)

    # ---------------------------------------------------------------- sessions
    def session(self, sid: str) -> HostRun | None:
        return self.session_runs.get(sid)

    def put_session(self, sid: str, nblocks: int, now: float, expect_s: float) -> HostRun | None:
        """Make (or grow) the run of session `sid` to `nblocks` blocks, WRITING; None when it cannot fit (a run
        being read or written cannot grow: None too)."""
        run = self.session_runs.get(sid)
        extra = nblocks - (run.nblocks if run is not None else 0)
        if run is not None and run.busy:
            return None
        if extra > 0 and not self._make_room(extra, now, run):
            return None
        if run is None:
            run = self.session_runs[sid] = HostRun(sid, 0)
        self.used += max(extra, 0)
        run.nblocks = max(run.nblocks, nblocks)
        run.state, run.last_use, run.expect_s = RunState.WRITING, now, expect_s
        return run

    def drop_session(self, sid: str) -> None:
        """The session ended: forget its run (once its copy lands, if one is in flight)."""
        run = self.session_runs.get(sid)
        if run is None:
            return
        if run.busy:
            run.doomed = True
        else:
            self._remove(run)

    # ---------------------------------------------------------------- prefix blocks
    def put_prefix(self, hashes: tuple[int, ...], now: float) -> HostRun | None:
        """A run for the prefix blocks of `hashes` the tier does not hold yet, WRITING; None when all are held or
        they cannot fit."""
        new = tuple(h for h in hashes if h not in self.by_hash)
        if not new or not self._make_room(len(new), now, None):
            return None
        run = HostRun(("p", new[0], len(new)), len(new), new, last_use=now)
        self.prefix_runs[run.key] = run
        self.used += len(new)
        for h in new:
            self.by_hash[h] = run
        return run

    def match(self, hashes) -> int:
        """How many leading blocks of `hashes` the tier holds, written."""
        n = 0
        by_hash = self.by_hash
        for h in hashes:
            r = by_hash.get(h)
            if r is None or r.state is not RunState.READY:
                break
            n += 1
        return n

    def runs_of(self, hashes) -> list[HostRun]:
        """The distinct runs holding `hashes`, in order."""
        out: list[HostRun] = []
        for h in hashes:
            r = self.by_hash[h]
            if not out or out[-1] is not r:
                out.append(r)
        return out

    # ---------------------------------------------------------------- copies
    def landed(self, run: HostRun, now: float) -> None:
        """A copy into `run` finished: it may be read."""
        run.state = RunState.READY
        run.last_use = now
        if not isinstance(run.key, str):
            self.prefix_runs.move_to_end(run.key)
        if run.doomed:
            self._remove(run)

    def abort(self, run: HostRun) -> None:
        """A copy into `run` failed: it is gone."""
        run.state = RunState.READY
        self._remove(run)

    def read(self, run: HostRun, now: float) -> None:
        """A load starts reading `run`: it cannot be evicted until `unread`."""
        run.readers += 1
        run.last_use = now
        if not isinstance(run.key, str):
            self.prefix_runs.move_to_end(run.key)

    def unread(self, run: HostRun) -> None:
        run.readers -= 1
        if run.doomed and not run.busy:
            self._remove(run)

    def take_removed(self) -> list[int]:
        out, self.removed = self.removed, []
        return out

    @property
    def usage(self) -> float:
        """Share of the host tier in use."""
        return self.used / self.capacity_blocks
