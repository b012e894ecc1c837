"""The KV plane between workers: a worker's inbox (PULL) and the outbox (one PUSH per peer) that sends to them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from tandem.runtime.transport.codec import Codec, Frames, unpack_or_drop
from tandem.runtime.transport.errors import MessageTooLarge, PeerUnreachable
from tandem.runtime.transport.security import HandshakeWatch, WorkerAuth, Zap, close_secured, curve_client, serve_curve
from tandem.runtime.transport.sockets import HANDSHAKE_MAX_MSG_BYTES, PEER_MAX_MSG_BYTES, PEER_RCVHWM, Buffer, \
    Rejects, bind, limit, recv_parts, send_parts, zmq_context

@dataclass
class PeerInbox:
    """A worker's KV endpoint: one PULL socket that any peer's `PeerOutbox` pushes to."""

    codec: Codec
    address: str = "tcp://127.0.0.1:0"
    allow_remote: bool = False
    ctx: zmq.asyncio.Context | None = None
    auth: WorkerAuth | None = None   # CURVE: serve with the cluster's KV server keys, accept only its KV client key
    accept: tuple[type, ...] = ()    # if set, messages of other types are dropped (counted in rejected_frames)
    # a frame larger than this drops its connection unread, before or after the handshake; a worker passes the
    # largest KV message of its deployment (tandem.engine.kv_transfer.kv_message_max_bytes)
    max_msg_bytes: int = PEER_MAX_MSG_BYTES
    rcvhwm: int = PEER_RCVHWM
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)
    _rejects: Rejects = field(default_factory=lambda: Rejects("kv inbox"), init=False)
    _handshakes: HandshakeWatch | None = field(default=None, init=False)
    _zap: tuple[Zap, bytes] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        ctx = zmq_context(self.ctx)
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            limit(sock, self.max_msg_bytes)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            if self.auth is not None:
                self._zap = serve_curve(sock, ctx, self.auth.kv_server, "tandem-kv")
                self._zap[0].allow(self._zap[1], self.auth.kv_client.public, "kv")
            self._handshakes = HandshakeWatch(sock, ctx, "kv inbox")
        except BaseException:
            sock.close(linger=0)
            raise
        self.address = bind(sock, self.address, self.allow_remote)
        self._sock = sock

    @property
    def rejected_frames(self) -> int:
        """Messages `recv` dropped as malformed (undecodable, unknown type, wrong number of frames)."""
        return self._rejects.count

    @property
    def rejected_handshakes(self) -> int:
        """Connections refused during the handshake (a sender without the cluster's KV keys)."""
        return 0 if self._handshakes is None else self._handshakes.drain()

    def decode(self, frames: Sequence[zmq.Frame]) -> tuple[msgspec.Struct, Frames] | None:
        """Decode received frames, or None when they are dropped (counted in `rejected_frames`, logged)."""
        got = unpack_or_drop(self.codec, frames, self._rejects)
        if got is not None and self.accept and not isinstance(got[0], self.accept):
            self._rejects(f"a {type(got[0]).__name__}, which this inbox does not take")
            return None
        return got

    async def recv(self) -> tuple[msgspec.Struct, Frames]:
        """The next (message, payload frames) from any peer; per-sender order is kept; malformed ones dropped."""
        while True:
            assert self._sock is not None, "inbox closed"
            got = self.decode(await recv_parts(self._sock))
            if got is not None:
                return got

    def close(self) -> None:
        """Close the socket (queued messages are dropped)."""
        close_secured(self._sock, self._handshakes, self._zap)
        self._sock = self._handshakes = self._zap = None


@dataclass
class PeerOutbox:
    """Sends to peers' inboxes, one PUSH per peer address, connected on first use and cached."""

    codec: Codec
    ctx: zmq.asyncio.Context | None = None
    sndhwm: int = 64                 # messages queued per peer before send waits (bounds memory for KV)
    auth: WorkerAuth | None = None   # CURVE client with the cluster's KV keys (peers' inboxes need them)
    # a send that cannot go out for this long raises PeerUnreachable: a peer that refused our handshake leaves
    # the PUSH with no pipe (libzmq does not reconnect after a protocol error), and a dead one fills the queue
    send_timeout_s: float = 5.0
    # the peers' inbox cap: a larger frame raises MessageTooLarge here rather than be dropped there with its connection
    max_msg_bytes: int = PEER_MAX_MSG_BYTES
    # queue only to a peer whose connection (and CURVE handshake) is complete: a peer that is not there makes the
    # send wait and then raise PeerUnreachable, instead of queueing for a connection that may never come
    immediate: bool = False
    _socks: dict[str, zmq.asyncio.Socket] = field(default_factory=dict, init=False)

    async def send(self, address: str, msg: msgspec.Struct, *bufs: Buffer, wait_release: bool = False) -> None:
        """Send `msg` (+ payload frames, not copied) to the inbox at `address`; PeerUnreachable (and the socket
        is dropped, so the next send connects afresh) if it cannot go out within `send_timeout_s`; MessageTooLarge
        (nothing sent) if a frame exceeds `max_msg_bytes`."""
        parts = self.codec.pack(msg, bufs)
        for i, part in enumerate(parts):
            size = memoryview(part).nbytes
            if size > self.max_msg_bytes:
                raise MessageTooLarge(f"frame {i} of a {type(msg).__name__} is {size} bytes, over the inboxes' cap "
                                      f"of {self.max_msg_bytes}: split it")
        sock = self._socks.get(address)
        if sock is None:
            sock = zmq_context(self.ctx).socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.send_timeout_s * 1000)))
            sock.setsockopt(zmq.LINGER, 1000)
            if self.immediate:
                sock.setsockopt(zmq.IMMEDIATE, 1)
            try:
                limit(sock, HANDSHAKE_MAX_MSG_BYTES)
                if self.auth is not None:
                    curve_client(sock, self.auth.kv_server.public, self.auth.kv_client)
            except BaseException:
                sock.close(linger=0)
                raise
            sock.connect(address)
            self._socks[address] = sock
        try:
            await send_parts(sock, parts, wait_release)
        except zmq.Again:
            self.forget(address)
            raise PeerUnreachable(f"the inbox at {address} took no message for {self.send_timeout_s:g} s "
                                  "(gone, refusing this cluster's keys, or not reading)") from None

    def forget(self, address: str) -> None:
        """Drop the socket to a peer that is gone (its queued messages are discarded)."""
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self, linger_s: float = 1.0) -> None:
        """Close all sockets, letting queued messages out for up to `linger_s`."""
        for sock in self._socks.values():
            sock.close(linger=int(linger_s * 1000))
        self._socks.clear()
