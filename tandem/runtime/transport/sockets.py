"""Socket plumbing shared by every end of the transport: size and handshake caps (`limit`), binding, zero-copy
sends and receives, worker identities, and the rate-limited log of dropped frames."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from tandem.runtime.transport.errors import TransportError

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost")
# Size caps (ZMQ_MAXMSGSIZE: a frame declared larger drops its connection before any of it is buffered). They hold
# during the handshake too, before a key is checked, so a stranger can make a socket hold one frame of at most its
# cap, for at most HANDSHAKE_S. Set before bind/connect: libzmq copies a socket's options into each connection.
HUB_MAX_MSG_BYTES = 64 << 20   # control plane, both ways (a Delta with prompt logprobs of a long prompt is the largest)
PEER_MAX_MSG_BYTES = 32 << 20  # a PeerInbox's default cap; a worker gives its inbox the cap of its KV messages
HANDSHAKE_MAX_MSG_BYTES = 64 << 10   # a PUSH reads nothing but the handshake's commands (CURVE WELCOME, READY)
HANDSHAKE_S = 3.0          # a connection that has not finished its handshake (greeting, CURVE, ZAP) by then is closed
PEER_RCVHWM = 16           # messages a KV inbox queues per sender before the sender waits (bounds its memory)
REJECT_LOG_EVERY_S = 5.0   # dropped frames / refused handshakes are logged at most this often per socket

Buffer = Any               # anything exporting the buffer protocol: bytes, bytearray, memoryview, numpy array


def limit(sock: zmq.Socket, max_msg_bytes: int) -> None:
    """Cap the frames `sock` takes (a larger one drops its connection) and its handshakes at HANDSHAKE_S; call before
    bind/connect. Every tcp/ipc socket of tandem gets this."""
    if not isinstance(max_msg_bytes, int) or max_msg_bytes < 1:
        raise TransportError(f"max_msg_bytes must be a positive integer, got {max_msg_bytes!r}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))



class Rejects:
    """Counts messages a reader dropped and logs them, at most once per `REJECT_LOG_EVERY_S` (with a tally)."""

    def __init__(self, where: str) -> None:
        self.where, self.count, self._last, self._quiet = where, 0, -1e9, 0

    def __call__(self, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last < REJECT_LOG_EVERY_S:
            self._quiet += 1
            return
        more = f" (+{self._quiet} more since the last report)" if self._quiet else ""
        log.warning("%s: dropped %s%s; %d dropped in all", self.where, why, more, self.count)
        self._last, self._quiet = now, 0



def zmq_context(ctx: zmq.asyncio.Context | None) -> zmq.asyncio.Context:
    """`ctx`, or the process's shared asyncio context."""
    return ctx if ctx is not None else zmq.asyncio.Context.instance()


def bind(sock: zmq.Socket, address: str, allow_remote: bool) -> str:
    """Bind `sock` (tcp port 0 = any free port) and return the address peers connect to; closes it on failure."""
    try:
        return _bind_or_raise(sock, address, allow_remote)
    except BaseException:
        sock.close(linger=0)
        raise


def _bind_or_raise(sock: zmq.Socket, address: str, allow_remote: bool) -> str:
    if address.startswith("tcp://"):
        host, _, port = address[6:].rpartition(":")
        if not allow_remote and host not in LOCAL_HOSTS:
            raise TransportError(f"refusing to bind {address}: only 127.0.0.1 (pass allow_remote=True)")
        sock.bind(f"tcp://{host}:*" if port in ("0", "*") else address)
    elif address.startswith("ipc://"):
        sock.bind(address)
    else:
        raise TransportError(f"unsupported address {address!r}: use tcp://127.0.0.1:PORT or ipc://PATH")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def send_parts(sock: zmq.asyncio.Socket, parts: list[Buffer], wait_release: bool) -> None:
    """Send multipart without copying; with `wait_release`, return once zmq no longer reads the buffers."""
    if not wait_release:
        await sock.send_multipart(parts, copy=False)
        return
    tracker = await sock.send_multipart(parts, copy=False, track=True)
    while tracker is not None and not tracker.done:
        await asyncio.sleep(0.0005)


async def recv_parts(sock: zmq.asyncio.Socket) -> list[zmq.Frame]:
    """The next multipart message; rides out zmq's spurious readiness (EVENTS said POLLIN, recv said EAGAIN)."""
    while True:
        try:
            return await sock.recv_multipart(copy=False)
        except zmq.Again:                                      # seen with CURVE and messages of ~300 KB
            await asyncio.sleep(0.0005)



def identity(worker_id: int) -> bytes:
    """The zmq identity of worker `worker_id` (its decimal id)."""
    return str(int(worker_id)).encode()
