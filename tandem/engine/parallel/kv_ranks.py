"""KV between workers rank to rank: every rank of a worker (the driver included, and the one rank of a tp=1 worker)
has a KV endpoint of its own, given to the engine by the runtime (`EndpointFactory`: the runtime's authenticated
transport, tandem.runtime.rank_kv); engine code never opens a socket.

A transfer from a group at tp=a to a group at tp=b: the sending driver tells its ranks (one group command) which
positions and which destination endpoints; each sending rank exports its own heads and sends each receiving rank
exactly the heads `head_map.regroup_plan` gives it from this rank (a replicated head from one holder only; a < b: one
sender, several receivers; a > b: one receiver, several senders). Only a small control message (the transfer id, its
length, the first token) then goes driver to driver. Each receiving rank other than the driver tells its driver's
endpoint (a notice without payload, `report_to`) once it holds every cell of its heads; the receiving driver claims
the transfer when it and every other rank are complete, waiting a bounded time, without a group command; otherwise
the transfer fails on every rank (all-or-nothing: the caller reports a failed transfer). The staged heads are written
into the session's blocks later, on each rank, when the engine places the KV (`place`, one group command).

Byte counts: each rank counts what its endpoint sent and received; the driver learns them from each send's
all-gather and each notice."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from tandem.engine.kv_transfer import KVTransferError, export_kv, import_kv
from tandem.engine.parallel.head_map import KVMove, kv_head_spans, regroup_plan
from tandem.engine.parallel.kv_stage import HeadPart, KVStaging, StagedKV

log = logging.getLogger(__name__)
CLAIM_WAIT_S = 10.0         # a transfer's ranks have this long to hold their heads once its control message is in


class KVEndpoint(Protocol):
    """A rank's KV endpoint (the runtime's): it feeds received parts to the rank's staging from its own thread."""

    address: str

    def send(self, address: str, part: HeadPart, data: memoryview) -> None:
        """Queue one part for the endpoint at `address` (`data` is not copied and must stay unchanged)."""

    def flush(self) -> None:
        """Wait until every queued part went out; raises (one line) when one cannot."""

    def notify(self, address: str, transfer: str, rank: int, nbytes: int, counts: tuple[int, int]) -> None:
        """Tell the driver's endpoint at `address` that rank `rank` holds its heads of `transfer` (returns at once;
        its endpoint calls the driver staging's note_remote)."""

    def close(self) -> None: ...


EndpointFactory = Callable[[KVStaging], KVEndpoint]


class GroupLike(Protocol):
    """What this module needs of the driver's group (parallel/driver.py's RankGroup)."""

    size: int
    device: torch.device

    def send(self, *command: Any) -> None: ...

    def run(self, fn: Callable[[], Any]) -> Any: ...


def moves_from(total: int, src_tp: int, dst_tp: int, rank: int) -> list[KVMove]:
    """The moves rank `rank` of a src_tp group makes towards a dst_tp group."""
    return [mv for mv in regroup_plan(total, src_tp, dst_tp) if mv.src == rank]


@dataclass
class RankKV:
    """One rank's KV plane: its endpoint, its staging, and what it sent."""

    rank: int
    size: int
    total_heads: int
    staging: KVStaging
    endpoint: KVEndpoint | None = None
    sent_bytes: int = 0

    @classmethod
    def open(cls, factory: EndpointFactory, rank: int, size: int, total_heads: int, layers: int, head_dim: int,
             dtype: torch.dtype, max_tokens: int) -> RankKV:
        first, count = kv_head_spans(total_heads, size)[rank]
        plane = cls(rank, size, total_heads, KVStaging(layers, first, count, head_dim, dtype, max_tokens,
                                                       driver=rank == 0))
        plane.endpoint = factory(plane.staging)
        return plane

    def report_to(self, driver: str) -> None:
        """A rank other than the driver: tell the driver's endpoint each transfer it completes here."""
        endpoint = self.endpoint
        assert endpoint is not None
        self.staging.on_complete = lambda t, n: endpoint.notify(driver, t, self.rank, n, self.counts())

    def counts(self) -> tuple[int, int]:
        """(bytes sent, bytes received) by this rank's endpoint so far."""
        return self.sent_bytes, self.staging.received_bytes

    def send(self, kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int, end: int,
             transfer: str, dst: list[str], part_tokens: int) -> None:
        """This rank's heads of positions [start, end) to the receiving ranks that take them from here."""
        assert self.endpoint is not None
        local = export_kv(kv_caches, block_table, block_size, start, end)
        n, first = local.num_tokens, self.staging.first
        for mv in moves_from(self.total_heads, self.size, len(dst), self.rank):
            h0 = mv.first - first
            for off in range(0, n, part_tokens):
                chunk = local.data[:, :, off:off + part_tokens, h0:h0 + mv.count].contiguous()
                part = HeadPart(transfer, self.rank, mv.first, mv.count, off, int(chunk.shape[2]), n, local.dtype)
                self.endpoint.send(dst[mv.dst], part, memoryview(chunk.view(torch.uint8).numpy()).cast("B"))
                self.sent_bytes += chunk.numel() * chunk.element_size()
        self.endpoint.flush()

    def place(self, kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int,
              transfer: str) -> None:
        """Write this rank's staged heads of a claimed transfer into positions [start, start + tokens)."""
        import_kv(kv_caches, block_table, block_size, start, self.staging.take(transfer))

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def _gather(size: int, mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order (an all-gather within the group of `size` ranks; just `mine` alone)."""
    if size == 1:
        return [mine]
    import torch.distributed as dist
    out: list[Any] = [None] * size
    dist.all_gather_object(out, mine)
    return out


def _gather_ints(size: int, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's few integers, in rank order: one all-gather of a small tensor (no pickling)."""
    if size == 1:
        return [values]
    import torch.distributed as dist
    mine = torch.tensor(values, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _attempt(fn: Callable[[], Any]) -> str | None:
    """Run fn; the error as one line, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the transfer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


# ------------------------------------------------------------------ each rank's side of the group commands

def rank_open(factory: EndpointFactory, rank: int, size: int, total_heads: int, layers: int, head_dim: int,
              dtype: torch.dtype, max_tokens: int) -> RankKV | None:
    """Open this rank's plane and tell the driver its address (or why not): the "kv_plane" command."""
    plane: list[RankKV] = []
    err = _attempt(lambda: plane.append(RankKV.open(factory, rank, size, total_heads, layers, head_dim, dtype,
                                                     max_tokens)))
    _gather(size, plane[0].endpoint.address if plane and plane[0].endpoint else f"!{err}")
    return plane[0] if plane else None


def rank_send(plane: RankKV | None, size: int, device: torch.device, kv_caches: list[torch.Tensor],
              drops: list[str], *args: Any) -> None:
    """A rank's side of `DriverPlane.send`: its parts out, then everyone's outcome and byte counts to everyone (a
    failure's reason is in this rank's log)."""
    err = "no KV endpoint on this rank" if plane is None else _attempt(lambda: plane.send(kv_caches, *args))
    if err:
        log.warning("tensor-parallel rank %d: its KV heads could not go rank to rank: %s", 0 if plane is None
                    else plane.rank, err)
    if plane is not None:
        plane.staging.drop(drops)
    _gather_ints(size, [int(bool(err)), *(plane.counts() if plane else (0, 0))], device)


def rank_peers(plane: RankKV | None, addresses: list[str]) -> None:
    """The "kv_peers" command: every rank's endpoint is open; report completed transfers to the driver's."""
    if plane is not None:
        plane.report_to(addresses[0])


def rank_place(plane: RankKV | None, kv_caches: list[torch.Tensor], drops: list[str], *args: Any) -> None:
    """A rank's side of `DriverPlane.place`."""
    if plane is None:
        raise KVTransferError("no KV endpoint on this rank")
    plane.staging.drop(drops)
    try:
        plane.place(kv_caches, *args)
    except KVTransferError as e:             # the driver placed its heads: this rank's part of the session is stale
        log.error("tensor-parallel rank %d: could not place its KV heads: %s", plane.rank, e)
        raise


# ------------------------------------------------------------------ the driver

@dataclass
class DriverPlane:
    """The driver's view of its worker's rank-to-rank KV plane: every rank's endpoint address, the driver's own
    plane, the transfers to forget on the other ranks at the next command, every rank's byte counts."""

    group: GroupLike | None
    own: RankKV
    addresses: list[str]
    counts: list[tuple[int, int]] = field(default_factory=list)     # (sent, received) per rank, as last gathered
    drops: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, group: GroupLike | None, factory: EndpointFactory, total_heads: int, layers: int, head_dim: int,
             dtype: torch.dtype, max_tokens: int) -> DriverPlane:
        """Every rank's endpoint; KVTransferError (the planes opened so far stay, unused) when one cannot open."""
        size = 1 if group is None else group.size
        if group is not None:
            group.send("kv_plane", factory, max_tokens)
        box: list[RankKV] = []
        err = _attempt(lambda: box.append(RankKV.open(factory, 0, size, total_heads, layers, head_dim, dtype,
                                                       max_tokens)))
        addrs = box[0].endpoint.address if box and box[0].endpoint else f"!{err}"
        every = group.run(lambda: _gather(size, addrs)) if group is not None else [addrs]
        bad = [(r, a) for r, a in enumerate(every) if a.startswith("!")]
        if bad:
            if box:
                box[0].close()
            raise KVTransferError(f"rank {bad[0][0]} could not open its KV endpoint: {bad[0][1][1:]}")
        if group is not None:
            group.send("kv_peers", list(every))
        return cls(group, box[0], list(every), [(0, 0)] * size)

    @property
    def size(self) -> int:
        return len(self.addresses)

    def _take_drops(self) -> list[str]:
        drops, self.drops = self.drops + self.own.staging.take_expired(), []
        return drops

    def ready(self, transfer: str, tokens: int) -> bool:
        """Whether every rank holds its heads of the transfer now (a claim would not wait)."""
        return tokens == 0 or self.own.staging.ready(transfer, tokens, self.size - 1)

    def byte_counts(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) per rank's endpoint: the driver's now, the others' as last reported."""
        remote = self.own.staging.remote_counts
        return [self.own.counts()] + [tuple(max(a, b) for a, b in zip(self.counts[r], remote.get(r, (0, 0))))
                                      for r in range(1, self.size)]

    def send(self, kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int, end: int,
             transfer: str, dst: list[str], part_tokens: int) -> None:
        """Positions [start, end) of a sequence from every rank to the receiving group's ranks (endpoints `dst`, in
        rank order); KVTransferError naming the first rank whose parts could not go out."""
        if not dst or part_tokens < 1:
            raise KVTransferError("a rank-to-rank transfer needs the receiving ranks' endpoints")
        if end <= start:
            return
        args = (list(block_table), block_size, start, end, transfer, list(dst), part_tokens)
        if self.group is not None:
            self.group.send("kv_send", self._take_drops(), *args)
        err = _attempt(lambda: self.own.send(kv_caches, *args))
        mine = [int(bool(err)), *self.own.counts()]
        every = self.group.run(lambda: _gather_ints(self.size, mine, self.group.device)) \
            if self.group is not None else [mine]
        self.counts = [(sent, got) for _, sent, got in every]
        bad = [r for r, (failed, _, _) in enumerate(every) if failed]
        if bad:
            why = err if bad[0] == 0 else "see its log"
            raise KVTransferError(f"rank {bad[0]} could not send its KV heads ({why})")

    def claim(self, transfer: str, tokens: int, wait_s: float = CLAIM_WAIT_S) -> StagedKV:
        """Every rank holds its heads of the transfer (then kept until placed), or KVTransferError and no rank
        keeps any of it."""
        if tokens == 0:
            return StagedKV(transfer, 0, 0)
        got, missing = self.own.staging.claim_all(transfer, tokens, self.size - 1, wait_s)
        if got < 0:
            if self.group is not None:
                self.drops.append(transfer)
            raise KVTransferError(f"rank {missing[0]} did not receive its KV heads of a {tokens}-token transfer "
                                  f"({len(missing)} of {self.size} ranks incomplete)")
        return StagedKV(transfer, tokens, got)

    def place(self, kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int,
              staged: StagedKV) -> None:
        """Write a claimed transfer into positions [start, start + tokens) of a sequence, each rank its heads."""
        if staged.num_tokens == 0:
            return
        self.own.place(kv_caches, list(block_table), block_size, start, staged.transfer)
        if self.group is not None:
            self.group.send("kv_place", self._take_drops(), list(block_table), block_size, start, staged.transfer)

    def forget(self, staged: StagedKV) -> None:
        """A claimed transfer that will not be placed (its request ended): forgotten here now, on the other ranks
        with the next command."""
        if staged.num_tokens == 0:
            return
        self.own.staging.drop([staged.transfer])
        if self.group is not None:
            self.drops.append(staged.transfer)

    def close(self) -> None:
        self.own.close()

