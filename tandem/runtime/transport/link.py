"""A worker's end: one DEALER to the coordinator's Hub, heartbeating while the worker lives."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tandem.runtime.transport.codec import Codec, Frames, Goodbye, Heartbeat, Ready, Shutdown, unpack_or_drop
from tandem.runtime.transport.security import WorkerAuth, curve_client
from tandem.runtime.transport.sockets import HUB_MAX_MSG_BYTES, Buffer, Rejects, identity, limit, recv_parts, \
    send_parts, zmq_context

HEARTBEAT_S = 0.5          # a Link sends a Heartbeat this often


@dataclass
class Link:
    """Worker end: a DEALER (identity = worker id) to the hub; sends a Heartbeat every `heartbeat_s`."""

    codec: Codec
    hub_address: str
    worker_id: int
    heartbeat_s: float = HEARTBEAT_S
    ctx: zmq.asyncio.Context | None = None
    auth: WorkerAuth | None = None   # from the hub's `credentials(worker_id)`; None only for a hub with secure=False
    max_msg_bytes: int = HUB_MAX_MSG_BYTES   # a larger message from the hub drops the connection
    stopping: bool = field(default=False, init=False)
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)
    _beat: asyncio.Task | None = field(default=None, init=False)
    _rejects: Rejects = field(default_factory=lambda: Rejects("link"), init=False)

    async def start(self) -> Link:
        """Connect and start heartbeating (the hub's timeout applies only after `ready`)."""
        sock = zmq_context(self.ctx).socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity(self.worker_id))
        sock.setsockopt(zmq.LINGER, 1000)  # let a Goodbye or last reply out on close
        try:
            limit(sock, self.max_msg_bytes)
            if self.auth is not None:
                curve_client(sock, self.auth.hub_public, self.auth.client)
        except BaseException:
            sock.close(linger=0)
            raise
        sock.connect(self.hub_address)
        self._sock = sock
        self._beat = asyncio.create_task(self._heartbeat())
        return self

    async def close(self, goodbye: bool = True) -> None:
        """Stop heartbeating; with `goodbye`, tell the hub this exit is not a death."""
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
            self._beat = None
        if self._sock is not None:
            if goodbye:
                await self.send(Goodbye())
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> Link:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close(goodbye=exc[0] is None)

    async def ready(self, info: dict[str, Any] | None = None) -> None:
        """Announce readiness with a free-form `info` dict (arms the hub's heartbeat timeout)."""
        await self.send(Ready(info or {}))

    async def send(self, msg: msgspec.Struct, *bufs: Buffer, wait_release: bool = False) -> None:
        """Send `msg` (+ payload frames, not copied) to the hub."""
        assert self._sock is not None, "Link.start() first"
        await send_parts(self._sock, self.codec.pack(msg, bufs), wait_release)

    @property
    def rejected_frames(self) -> int:
        """Messages from the hub that `recv` dropped as malformed."""
        return self._rejects.count

    async def recv(self) -> tuple[msgspec.Struct, Frames]:
        """The next (message, payload frames) from the hub; a Shutdown also sets `stopping`. Malformed messages
        are dropped (counted in `rejected_frames`, logged)."""
        assert self._sock is not None, "Link.start() first"
        while True:
            got = unpack_or_drop(self.codec, await recv_parts(self._sock), self._rejects)
            if got is not None:
                break
        msg, bufs = got
        if isinstance(msg, Shutdown):
            self.stopping = True
        return msg, bufs

    async def _heartbeat(self) -> None:
        while True:
            await self.send(Heartbeat(time.time()))
            await asyncio.sleep(self.heartbeat_s)
