"""Where sessions live: the workers that can hold them, the KV committed on each, and the binder that picks one for
a new session, or again for a bound one between rounds (cache-aware rebinding)."""
from __future__ import annotations

from typing import Protocol, Sequence

from tandem.core.host_tier import BlockStored, Medium
from tandem.policy.binding import CacheAwareBinder, LeastKVBinder, PrefixAffinityBinder


class HomesView(Protocol):
    """What the homes need of the cluster: live session hosts, their KV capacity, what they hold of a session."""

    def home_workers(self) -> Sequence[int]: ...
    def capacity(self, worker: int) -> int: ...
    def kv_loading(self, worker: int, session_id: str) -> bool: ...
    def held(self, worker: int, session_id: str) -> tuple[int, int]: ...


class Homes:
    """Committed KV tokens and capacity per live home worker, and the binder (with its prefix index, if any)."""

    def __init__(self, view: HomesView, binder: LeastKVBinder | PrefixAffinityBinder | CacheAwareBinder,
                 block_size: int) -> None:
        self.view, self.binder, self.block_size = view, binder, block_size
        self.prefixes = getattr(binder, "index", None)   # what each worker may hold in its prefix cache
        self.rebinding = isinstance(binder, CacheAwareBinder)
        self.committed: dict[int, int] = dict.fromkeys(view.home_workers(), 0)
        self.capacity = {w: view.capacity(w) for w in view.home_workers()}

    def live(self) -> list[int]:
        """Workers that can host sessions and are not lost."""
        return [w for w in self.view.home_workers() if w in self.capacity]

    def bind(self, hashes: Sequence[int] = ()) -> int | None:
        """The worker a new session with these prompt block hashes goes to (None: no live home)."""
        homes = self.live()
        return self.binder.bind(homes, self.committed, self.capacity, tuple(hashes)) if homes else None

    def rebind(self, own: int, sid: str, need: int, mine: int, hashes: Sequence[int]) -> int:
        """Where a bound session's next round of `need` tokens goes: `own` unless another worker scores higher by the
        cache-aware rule; a context on its way back from `own`'s host tier stays. Moves its `mine` committed tokens."""
        if self.view.kv_loading(own, sid):
            return own
        gpu, host = self.view.held(own, sid)
        bs = self.block_size
        new = self.binder.rebind(own, gpu // bs, (gpu + host) // bs, -(-need // bs), mine, self.live(),
                                 self.committed, self.capacity, hashes)
        if new != own:
            self.committed[own] -= mine
            self.committed[new] += mine
        return new

    def lost(self, worker: int) -> None:
        self.committed.pop(worker, None)
        self.capacity.pop(worker, None)
        if self.prefixes is not None:
            self.prefixes.forget(worker)

    def joined(self, worker: int) -> None:
        """A (re)started worker: empty, with no cached prefix; a home again if the view lists it as one."""
        if worker in self.view.home_workers():
            self.capacity[worker] = self.view.capacity(worker)
            self.committed[worker] = 0
        if self.prefixes is not None:
            self.prefixes.forget(worker)

    def observe(self, ev) -> None:
        """A worker's KV event (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) for the tiered prefix index."""
        if hasattr(self.prefixes, "observe"):
            self.prefixes.observe(ev.worker, getattr(ev, "hashes", None), isinstance(ev, BlockStored),
                                  getattr(ev, "medium", None) is Medium.GPU)
