"""One rank's landing area for KV sent to it rank to rank: the parts of each transfer (its own KV heads only, head_map's
share) copied into one host tensor per transfer, checked against this rank's heads and geometry before anything is
kept, until the driver claims the transfer (every rank complete, or the transfer fails on all) and places it in the
session's blocks. Thread-safe: the rank's endpoint adds from its own thread, the command loop waits and takes."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tandem.engine.kv_transfer import KVPayload, KVTransferError, dtype_name

STAGE_TTL_S = 60.0          # an unclaimed transfer (its manifest never came) is dropped after this long
MAX_STAGED = 64             # transfers a rank holds at once (the oldest unclaimed one goes first)


@dataclass(frozen=True, slots=True)
class HeadPart:
    """The header of one rank-to-rank KV message: KV heads [first_head, first_head + heads) of tokens
    [offset, offset + num_tokens) of transfer `transfer` (total_tokens long), from rank `src_rank` of the sender."""

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
    _entries: dict[str, _Entry] = field(default_factory=dict, init=False)
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
            self._cv.notify_all()

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, e in self._entries.items() if not e.claimed and now - e.started > STAGE_TTL_S]:
            del self._entries[key]
        unclaimed = [k for k, e in self._entries.items() if not e.claimed]
        while len(self._entries) >= MAX_STAGED and unclaimed:
            del self._entries[unclaimed.pop(0)]

    def claim(self, transfer: str, tokens: int, wait_s: float) -> int:
        """Wait up to wait_s for every cell of this rank's heads of a `tokens`-token transfer; on success mark it
        claimed (kept until taken) and return its bytes here, else drop what came and return -1."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while True:
                entry = self._entries.get(transfer)
                if entry is not None and entry.data.shape[2] == tokens and bool(entry.filled.all()):
                    entry.claimed = True
                    return entry.nbytes
                left = deadline - time.monotonic()
                if left <= 0:
                    self._entries.pop(transfer, None)
                    return -1
                self._cv.wait(left)

    def take(self, transfer: str) -> KVPayload:
        """A claimed transfer's heads as a payload (forgotten here); KVTransferError when none is claimed."""
        with self._cv:
            entry = self._entries.get(transfer)
            if entry is None or not entry.claimed:
                raise KVTransferError(f"no claimed KV transfer {transfer!r} on this rank")
            del self._entries[transfer]
        d = entry.data
        return KVPayload(int(d.shape[2]), dtype_name(d.dtype), tuple(d.shape), d)

    def drop(self, transfers: list[str]) -> None:
        """Forget these transfers (claimed or not)."""
        with self._cv:
            for t in transfers:
                self._entries.pop(t, None)

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)
