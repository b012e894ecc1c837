"""One rank's landing area for KV sent to it rank to rank: the parts of each transfer (its own KV heads only, head_map's
share) copied into one host tensor per transfer, checked against this rank's heads and geometry before anything is
kept. A rank other than the driver tells its driver when it holds every cell of a transfer (`on_complete`); the
driver's staging keeps those notices (`note_remote`), so the driver claims a transfer (every rank complete, or it
fails on all) without a group command, and the heads are placed in the session's blocks later. Thread-safe: the
rank's endpoint adds from its own thread, the command loop or the worker's threads check, claim and take."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import torch

from tandem.engine.kv_transfer import KVPayload, KVTransferError, dtype_name

log = logging.getLogger(__name__)

STAGE_TTL_S = 60.0          # an incomplete transfer, or one the driver never claimed, is dropped after this long
MAX_STAGED = 256            # transfers a rank holds at once (beyond: the oldest unclaimed one goes, with a warning)


class HeadPart(msgspec.Struct, tag=True, frozen=True):
    """The header of one rank-to-rank KV message, as it goes on the wire (the bytes follow as one frame): KV heads
    [first_head, first_head + heads) of tokens [offset, offset + num_tokens) of transfer `transfer` (total_tokens
    long), from rank `src_rank` of the sender."""

    transfer: str
    src_rank: int
    first_head: int
    heads: int
    offset: int
    num_tokens: int
    total_tokens: int
    dtype: str


@dataclass(frozen=True, slots=True)
class StagedKV:
    """A transfer every rank of this worker holds its heads of (claimed): what the session's inbox keeps in place of a
    payload until the KV is placed in its blocks."""

    transfer: str
    num_tokens: int
    nbytes: int                 # bytes of the transfer over all this worker's ranks (every KV head once)


@dataclass
class _Entry:
    data: torch.Tensor          # [layers, 2, total, this rank's heads, head_dim]
    filled: torch.Tensor        # [total, this rank's heads] bool: which (token, head) cells arrived
    started: float
    claimed: bool = False
    nbytes: int = 0


@dataclass
class KVStaging:
    """This rank's staged transfers, keyed by transfer id."""

    layers: int
    first: int                  # this rank's first KV head (global index) and how many it holds
    count: int
    head_dim: int
    dtype: torch.dtype
    max_tokens: int             # the longest sequence: no transfer may be longer
    clock: Callable[[], float] = time.monotonic
    received_bytes: int = 0     # payload bytes accepted so far (this rank's endpoint counter)
    driver: bool = True         # the driver's staging: it claims; another rank's holds complete transfers until told
    # another rank: called (transfer, its bytes here) once a transfer is complete here, outside the lock
    on_complete: Callable[[str, int], None] | None = None
    on_change: Callable[[], None] | None = None      # driver: called (outside the lock) when a transfer may be ready
    _entries: dict[str, _Entry] = field(default_factory=dict, init=False)
    _remote: dict[str, dict[int, int]] = field(default_factory=dict, init=False)   # driver: transfer -> rank -> bytes
    # driver: each other rank's endpoint (bytes sent, bytes received), as its last notice said
    remote_counts: dict[int, tuple[int, int]] = field(default_factory=dict, init=False)
    _expired: list[str] = field(default_factory=list, init=False)                  # driver: dropped unclaimed
    _cv: threading.Condition = field(default_factory=threading.Condition, init=False)

    def add(self, part: HeadPart, buf) -> None:
        """Copy one part in; KVTransferError (nothing kept) when it is not one of this rank's heads, not this
        geometry, overruns its transfer or repeats cells already received."""
        p = part
        if p.dtype != dtype_name(self.dtype):
            raise KVTransferError(f"a KV part of {p.dtype}, this rank holds {dtype_name(self.dtype)}")
        if p.heads < 1 or p.first_head < self.first or p.first_head + p.heads > self.first + self.count:
            raise KVTransferError(f"KV heads [{p.first_head}, {p.first_head + p.heads}) are not this rank's "
                                  f"[{self.first}, {self.first + self.count})")
        if not 0 < p.total_tokens <= self.max_tokens or p.num_tokens < 1 or p.offset < 0 \
                or p.offset + p.num_tokens > p.total_tokens:
            raise KVTransferError(f"a KV part of {p.num_tokens} tokens at {p.offset} of a {p.total_tokens}-token "
                                  f"transfer (at most {self.max_tokens} here)")
        shape = (self.layers, 2, p.num_tokens, p.heads, self.head_dim)
        raw = torch.frombuffer(buf, dtype=torch.uint8) if len(memoryview(buf)) else torch.empty(0, dtype=torch.uint8)
        width = torch.empty(0, dtype=self.dtype).element_size()
        if raw.numel() != width * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]:
            raise KVTransferError(f"a KV part of {raw.numel()} bytes, its header says {shape} of {p.dtype}")
        h0, t0 = p.first_head - self.first, p.offset
        with self._cv:
            entry = self._entries.get(p.transfer)
            if entry is None:
                self._expire()
                entry = self._entries[p.transfer] = _Entry(
                    torch.empty((self.layers, 2, p.total_tokens, self.count, self.head_dim), dtype=self.dtype),
                    torch.zeros((p.total_tokens, self.count), dtype=torch.bool), self.clock())
            if entry.claimed or entry.data.shape[2] != p.total_tokens:
                raise KVTransferError(f"a KV part of a {p.total_tokens}-token transfer {p.transfer!r} that is "
                                      f"{entry.data.shape[2]} tokens long here (or already claimed)")
            cells = entry.filled[t0:t0 + p.num_tokens, h0:h0 + p.heads]
            if bool(cells.any()):
                raise KVTransferError(f"a KV part repeating cells of transfer {p.transfer!r}")
            entry.data[:, :, t0:t0 + p.num_tokens, h0:h0 + p.heads].copy_(raw.view(self.dtype).view(shape))
            cells.fill_(True)
            entry.nbytes += raw.numel()
            self.received_bytes += raw.numel()
            done = bool(entry.filled.all())
            self._cv.notify_all()
        if done and self.on_complete is not None:
            self.on_complete(p.transfer, entry.nbytes)
        if done and self.on_change is not None:
            self.on_change()

    def _expire(self) -> None:
        """Drop what waits too long: on the driver an unclaimed transfer, on another rank an incomplete one (a
        complete one waits for the driver, which drops it when it drops its own); then the oldest beyond MAX_STAGED."""
        now = self.clock()
        for key in [k for k, e in self._entries.items() if now - e.started > STAGE_TTL_S and not e.claimed
                    and (self.driver or not bool(e.filled.all()))]:
            self._drop(key)
        for key in list(self._entries)[:max(0, len(self._entries) - MAX_STAGED + 1)]:
            log.warning("KV staging full (%d transfers): dropped %s", MAX_STAGED, key)
            self._drop(key)

    def _drop(self, key: str) -> None:
        del self._entries[key]
        if self.driver:
            self._expired.append(key)
            self._remote.pop(key, None)

    def take_expired(self) -> list[str]:
        """Driver: the transfers it dropped unclaimed since the last call (the other ranks drop them too)."""
        with self._cv:
            out, self._expired = self._expired, []
            return out

    def note_remote(self, transfer: str, rank: int, nbytes: int, counts: tuple[int, int]) -> None:
        """Driver: rank `rank` holds every cell of its heads of `transfer` (`nbytes` there); `counts` are its
        endpoint's (bytes sent, bytes received) so far."""
        with self._cv:
            old = self.remote_counts.get(rank, (0, 0))
            self.remote_counts[rank] = (max(old[0], counts[0]), max(old[1], counts[1]))
            if len(self._remote) >= MAX_STAGED and transfer not in self._remote:
                self._remote.pop(next(iter(self._remote)))
            self._remote.setdefault(transfer, {})[rank] = nbytes
            self._cv.notify_all()
        if self.on_change is not None:
            self.on_change()

    def _complete(self, transfer: str, tokens: int, others: int) -> bool:
        entry = self._entries.get(transfer)
        return entry is not None and entry.data.shape[2] == tokens and bool(entry.filled.all()) \
            and len(self._remote.get(transfer, ())) == others

    def ready(self, transfer: str, tokens: int, others: int) -> bool:
        """Driver: whether this rank and the `others` other ranks all hold their heads of the transfer now."""
        with self._cv:
            return self._complete(transfer, tokens, others)

    def claim_all(self, transfer: str, tokens: int, others: int, wait_s: float) -> tuple[int, list[int]]:
        """Driver: wait up to wait_s until this rank and the `others` other ranks all hold their heads of a
        `tokens`-token transfer; then mark it claimed here and return (its bytes over every rank, []), else drop it
        here and return (-1, the ranks that were incomplete) (the caller has the other ranks drop it)."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while not self._complete(transfer, tokens, others):
                left = deadline - time.monotonic()
                if left <= 0:
                    entry = self._entries.pop(transfer, None)
                    remote = self._remote.pop(transfer, {})
                    own_ok = entry is not None and entry.data.shape[2] == tokens and bool(entry.filled.all())
                    return -1, [0] * (not own_ok) + [r for r in range(1, others + 1) if r not in remote]
                self._cv.wait(left)
            entry = self._entries[transfer]
            entry.claimed = True
            return entry.nbytes + sum(self._remote.pop(transfer, {}).values()), []

    def take(self, transfer: str) -> KVPayload:
        """A claimed (driver) or complete (another rank) transfer's heads as a payload, forgotten here;
        KVTransferError when there is none."""
        with self._cv:
            entry = self._entries.get(transfer)
            if entry is None or not (entry.claimed or (not self.driver and bool(entry.filled.all()))):
                raise KVTransferError(f"no claimed KV transfer {transfer!r} on this rank")
            del self._entries[transfer]
        d = entry.data
        return KVPayload(int(d.shape[2]), dtype_name(d.dtype), tuple(d.shape), d)

    def drop(self, transfers: list[str]) -> None:
        """Forget these transfers (claimed or not)."""
        with self._cv:
            for t in transfers:
                self._entries.pop(t, None)
                self._remote.pop(t, None)

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)
