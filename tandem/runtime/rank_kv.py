"""A tensor-parallel rank's KV endpoint: the KV plane's inbox and outbox (transport/peers.py: ZeroMQ PULL/PUSH, CURVE
with the cluster's KV keys, frame caps, handshake watch) on an event loop of their own, so a rank's command loop,
which blocks on its group's collectives, can send and its staging can fill meanwhile. The engine's parallel/kv_ranks.py
says what travels; this module only carries it. `endpoint_factory` is what a worker gives its engine (picklable, so
the engine's rank processes open their own)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time

import msgspec
import zmq.asyncio

from tandem.engine.kv_transfer import KVTransferError
from tandem.engine.parallel.kv_stage import HeadPart, KVStaging
from tandem.runtime.transport import LOCAL_HOSTS, Codec, PeerInbox, PeerOutbox, PeerUnreachable, WorkerAuth

log = logging.getLogger("tandem.rank_kv")
# a part that cannot go out for this long fails its rank-to-rank send (the transfer then goes driver to driver); short,
# as the sending worker's step thread holds its shell meanwhile (its I/O loop must heartbeat within DEAD_AFTER_S)
SEND_TIMEOUT_S = 1.0


class RankKVHave(msgspec.Struct, tag=True):
    """A rank to its driver's endpoint: it holds every cell of its heads of `transfer` (`nbytes` there); `sent` and
    `received` are its endpoint's byte counts so far."""

    transfer: str
    rank: int
    nbytes: int
    sent: int
    received: int


CODEC = Codec([HeadPart, RankKVHave], frames={HeadPart: 1, RankKVHave: 0})


class RankEndpoint:
    """One rank's KV inbox (parts land in its staging) and outbox, on a daemon thread's event loop."""

    def __init__(self, staging: KVStaging, auth: WorkerAuth | None, bind_host: str, max_msg_bytes: int,
                 send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.staging, self.send_timeout_s = staging, send_timeout_s
        self.refused = 0                                   # parts the staging refused (not this rank's, malformed)
        self._notices: set[asyncio.Task] = set()           # notices to the driver on their way
        self._sending: list[tuple[str, concurrent.futures.Future]] = []   # parts queued since the last flush
        self._ctx = zmq.asyncio.Context()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-rank-kv", daemon=True)
        self._thread.start()

        async def start() -> None:
            self.inbox = PeerInbox(CODEC, address=f"tcp://{bind_host}:0", allow_remote=bind_host not in LOCAL_HOSTS,
                                   ctx=self._ctx, auth=auth, accept=(HeadPart, RankKVHave), max_msg_bytes=max_msg_bytes)
            self.outbox = PeerOutbox(CODEC, ctx=self._ctx, auth=auth, max_msg_bytes=max_msg_bytes,
                                     send_timeout_s=send_timeout_s, immediate=True)
            self._reader = asyncio.create_task(self._read())
        try:
            asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.address: str = self.inbox.address

    async def _read(self) -> None:
        while True:
            msg, frames = await self.inbox.recv()
            if isinstance(msg, RankKVHave):
                if self.staging.driver and msg.rank >= 1 and min(msg.nbytes, msg.sent, msg.received) >= 0:
                    self.staging.note_remote(msg.transfer, msg.rank, msg.nbytes, (msg.sent, msg.received))
                else:
                    self.refused += 1
                continue
            try:
                self.staging.add(msg, frames[0])
            except KVTransferError as e:
                self.refused += 1
                log.warning("rank KV endpoint %s: dropped a part of %s: %s", self.address, msg.transfer, e)

    def send(self, address: str, part: HeadPart, data: memoryview) -> None:
        """Queue one part for the endpoint at `address` (zero-copy: `data` stays referenced until it is out);
        `flush` waits for every queued part."""
        self._sending.append((address, asyncio.run_coroutine_threadsafe(self.outbox.send(address, part, data),
                                                                        self._loop)))

    def flush(self) -> None:
        """Wait until every queued part went out (queued only to completed connections: a receiver that is not
        there raises PeerUnreachable within the send timeout; MessageTooLarge: one line)."""
        sending, self._sending = self._sending, []
        deadline = time.monotonic() + self.send_timeout_s
        first: BaseException | None = None
        for address, fut in sending:
            try:
                fut.result(max(0.0, deadline - time.monotonic()) + 0.5)
            except concurrent.futures.TimeoutError:
                fut.cancel()                           # a peer that never took it: drop the socket
                self._loop.call_soon_threadsafe(self.outbox.forget, address)
                first = first or PeerUnreachable(f"the rank KV endpoint at {address} took no part for "
                                                 f"{self.send_timeout_s:g} s (gone, unreachable, or refusing this "
                                                 "cluster's keys)")
            except Exception as e:  # noqa: BLE001 - the first failure is raised once all are done
                first = first or e
        if first is not None:
            raise first

    def notify(self, address: str, transfer: str, rank: int, nbytes: int, counts: tuple[int, int]) -> None:
        """Tell the driver's endpoint that this rank holds its heads of `transfer` (returns at once; from any
        thread, this endpoint's own included)."""
        msg = RankKVHave(transfer, rank, nbytes, *counts)

        async def send() -> None:
            try:
                await self.outbox.send(address, msg)
            except Exception as e:  # noqa: BLE001 - the driver's claim then times out and fails the transfer
                log.warning("rank KV endpoint %s: could not tell the driver about %s: %s", self.address, transfer, e)
        def start() -> None:
            task = self._loop.create_task(send())
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)
        self._loop.call_soon_threadsafe(start)

    @property
    def rejected_handshakes(self) -> int:
        """Connections this endpoint refused at the CURVE handshake."""
        return self.inbox.rejected_handshakes

    def close(self) -> None:
        """Close the sockets and stop the loop (idempotent)."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            self._reader.cancel()
            self.outbox.close(linger_s=0.5)
            self.inbox.close()
        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        except Exception as e:  # noqa: BLE001 - closing must not fail the caller
            log.debug("rank KV endpoint %s: close: %s", self.address, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def open_endpoint(auth: WorkerAuth | None, bind_host: str, max_msg_bytes: int, send_timeout_s: float,
                  staging: KVStaging) -> RankEndpoint:
    """A rank's endpoint (the engine's EndpointFactory, with the first four arguments bound)."""
    return RankEndpoint(staging, auth, bind_host, max_msg_bytes, send_timeout_s)


def endpoint_factory(auth: WorkerAuth | None, bind_host: str, max_msg_bytes: int,
                     send_timeout_s: float = SEND_TIMEOUT_S) -> functools.partial:
    """The factory a worker gives its engine: every rank's endpoint with the cluster's KV keys, on `bind_host`."""
    return functools.partial(open_endpoint, auth, bind_host, max_msg_bytes, send_timeout_s)
