"""The runtime's transport: msgspec-tagged messages over ZeroMQ, big payloads as zero-copy frames.

`Hub` (coordinator, one ROUTER) talks to every worker's `Link` (a DEALER whose identity is its worker
id) and declares workers dead when their process exits or they fall silent. `PeerInbox`/`PeerOutbox`
carry KV directly between workers (PULL/PUSH), so many-MB payloads never pass through the coordinator.
Sockets, frames, liveness timings and lifecycle: docs/runtime-transport.md.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5          # a Link sends a Heartbeat this often
DEAD_AFTER_S = 1.5         # a ready worker silent this long is dead (3 missed heartbeats)
CHECK_S = 0.05             # how often the Hub checks processes and silences
LOCAL_HOSTS = ("127.0.0.1", "localhost")

Buffer = Any               # anything exporting the buffer protocol: bytes, bytearray, memoryview, numpy array
Frames = list[memoryview]  # received payload frames: writable views of the zmq frames (no copy)


class Heartbeat(msgspec.Struct, tag="_heartbeat"):
    """Worker -> hub, every `heartbeat_s`: the worker's event loop is alive."""

    sent_s: float = 0.0


class Ready(msgspec.Struct, tag="_ready"):
    """Worker -> hub, once: started; `info` is free-form (KV address, capacity, ...)."""

    info: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag="_shutdown"):
    """Hub -> worker: finish and exit (delivered by `Link.recv`, which then sets `link.stopping`)."""

    reason: str = ""


class Goodbye(msgspec.Struct, tag="_goodbye"):
    """Worker -> hub, on a clean `Link.close`: forget me, I am not dead."""


PLUMBING: tuple[type, ...] = (Heartbeat, Ready, Shutdown, Goodbye)


class TransportError(Exception):
    """A message or address the transport cannot handle."""


class WorkerUnreachable(TransportError):
    """The hub has no connection to this worker (never connected, gone, or declared dead)."""


class Codec:
    """Encode/decode a tagged union of msgspec Structs (plus the plumbing messages) with msgpack."""

    def __init__(self, types: Sequence[type]) -> None:
        all_types = tuple(dict.fromkeys([*types, *PLUMBING]))
        for t in all_types:
            cfg = getattr(t, "__struct_config__", None)
            if cfg is None or cfg.tag is None:
                raise TransportError(f"{getattr(t, '__name__', t)!r} must be a msgspec.Struct with tag=True")
        self.types = all_types
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Union[all_types])  # type: ignore[valid-type]

    def encode(self, msg: msgspec.Struct) -> bytes:
        """The msgpack header of `msg` (payload buffers travel as separate frames)."""
        return self._enc.encode(msg)

    def decode(self, data: Buffer) -> msgspec.Struct:
        """A message from its msgpack header; raises msgspec.ValidationError on unknown tags/fields."""
        return self._dec.decode(data)

    def pack(self, msg: msgspec.Struct, bufs: Sequence[Buffer]) -> list[Buffer]:
        """Frames to send: [header, *bufs]; the buffers are not copied."""
        return [self.encode(msg), *bufs]

    def unpack(self, frames: Sequence[zmq.Frame]) -> tuple[msgspec.Struct, Frames]:
        """(message, payload views) from received frames."""
        return self.decode(frames[0].buffer), [f.buffer for f in frames[1:]]


def _context(ctx: zmq.asyncio.Context | None) -> zmq.asyncio.Context:
    return ctx if ctx is not None else zmq.asyncio.Context.instance()


def _bind(sock: zmq.Socket, address: str, allow_remote: bool) -> str:
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


async def _send(sock: zmq.asyncio.Socket, parts: list[Buffer], wait_release: bool) -> None:
    """Send multipart without copying; with `wait_release`, return once zmq no longer reads the buffers."""
    if not wait_release:
        await sock.send_multipart(parts, copy=False)
        return
    tracker = await sock.send_multipart(parts, copy=False, track=True)
    while tracker is not None and not tracker.done:
        await asyncio.sleep(0.0005)


def identity(worker_id: int) -> bytes:
    """The zmq identity of worker `worker_id` (its decimal id)."""
    return str(int(worker_id)).encode()


class Watched(Protocol):
    """A process the hub watches: `alive` False means it exited (with `exitcode`)."""

    @property
    def alive(self) -> bool: ...

    @property
    def exitcode(self) -> int | None: ...


@dataclass(frozen=True)
class WorkerDead:
    """A worker the hub gave up on: its process exited, or it was silent past `dead_after_s`."""

    worker_id: int
    reason: str                  # "exited" | "heartbeat"
    exitcode: int | None         # for "exited"
    silent_s: float              # seconds since its last message
    at_s: float                  # time.monotonic() of the declaration


class WorkerDied(TransportError):
    """Raised by `Hub.wait_ready` when the worker dies before it is ready."""

    def __init__(self, event: WorkerDead) -> None:
        super().__init__(f"worker {event.worker_id} died ({event.reason}, exit code {event.exitcode})")
        self.event = event


@dataclass
class _Peer:
    last_seen: float
    process: Watched | None = None
    ready: asyncio.Future | None = None
    info: dict[str, Any] | None = None
    armed: bool = False          # heartbeat timeout applies (from its Ready on)
    dead: WorkerDead | None = None
    frames_in: int = 0           # payload frames received from it (the coordinator should see few)


DeadCallback = Callable[[WorkerDead], Awaitable[None] | None]


@dataclass
class Hub:
    """Coordinator end: one ROUTER; messages in via `recv`/`async for`, deaths via `on_worker_dead`."""

    codec: Codec
    address: str = "tcp://127.0.0.1:0"
    dead_after_s: float = DEAD_AFTER_S
    check_s: float = CHECK_S
    allow_remote: bool = False
    ctx: zmq.asyncio.Context | None = None
    peers: dict[int, _Peer] = field(default_factory=dict, init=False)
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, init=False)
    _tasks: list[asyncio.Task] = field(default_factory=list, init=False)
    _callbacks: list[DeadCallback] = field(default_factory=list, init=False)

    async def start(self) -> Hub:
        """Bind (sets `address` to the real endpoint) and start the reader and liveness monitor."""
        sock = _context(self.ctx).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to an absent worker raises, not drops
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)    # a restarted worker with the same id takes over
        self.address = _bind(sock, self.address, self.allow_remote)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._monitor())]
        return self

    async def close(self) -> None:
        """Stop the background tasks and close the socket."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> Hub:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sending and receiving ------------------------------------------------------------------
    async def send(self, worker_id: int, msg: msgspec.Struct, *bufs: Buffer, wait_release: bool = False) -> None:
        """Send `msg` (+ payload frames, not copied) to one worker; WorkerUnreachable if not connected."""
        assert self._sock is not None, "Hub.start() first"
        peer = self.peers.get(worker_id)
        if peer is not None and peer.dead is not None:
            raise WorkerUnreachable(f"worker {worker_id} is dead ({peer.dead.reason})")
        try:
            await _send(self._sock, [identity(worker_id), *self.codec.pack(msg, bufs)], wait_release)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise WorkerUnreachable(f"worker {worker_id} is not connected") from None
            raise

    async def recv(self) -> tuple[int, msgspec.Struct, Frames]:
        """The next (worker_id, message, payload frames) from any live worker, in arrival order."""
        return await self._queue.get()

    def __aiter__(self) -> AsyncIterator[tuple[int, msgspec.Struct, Frames]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[int, msgspec.Struct, Frames]]:
        while True:
            yield await self._queue.get()

    # -- liveness -------------------------------------------------------------------------------
    def watch(self, worker_id: int, process: Watched | None = None) -> None:
        """Expect `worker_id` (optionally backed by `process`); resets any earlier death of that id."""
        self.peers[worker_id] = _Peer(last_seen=time.monotonic(), process=process)

    def forget(self, worker_id: int) -> None:
        """Stop tracking `worker_id` (graceful stop: its exit is not a death)."""
        peer = self.peers.pop(worker_id, None)
        if peer is not None and peer.ready is not None and not peer.ready.done():
            peer.ready.cancel()

    def on_worker_dead(self, callback: DeadCallback) -> None:
        """Call `callback(WorkerDead)` (sync or async) once per worker declared dead."""
        self._callbacks.append(callback)

    def alive(self, worker_id: int) -> bool:
        """Whether `worker_id` is tracked and not declared dead."""
        peer = self.peers.get(worker_id)
        return peer is not None and peer.dead is None

    def info(self, worker_id: int) -> dict[str, Any] | None:
        """The `Ready.info` of `worker_id`, or None before it is ready."""
        peer = self.peers.get(worker_id)
        return None if peer is None else peer.info

    async def wait_ready(self, worker_id: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Its `Ready.info`; WorkerDied if it dies first, asyncio.TimeoutError after `timeout_s`."""
        peer = self.peers.get(worker_id)
        if peer is None:
            self.watch(worker_id)
            peer = self.peers[worker_id]
        if peer.dead is not None:
            raise WorkerDied(peer.dead)
        if peer.info is not None:
            return peer.info
        if peer.ready is None:
            peer.ready = asyncio.get_running_loop().create_future()
        return await asyncio.wait_for(asyncio.shield(peer.ready), timeout_s)

    def _declare_dead(self, worker_id: int, peer: _Peer, reason: str, exitcode: int | None) -> None:
        now = time.monotonic()
        peer.dead = WorkerDead(worker_id, reason, exitcode, now - peer.last_seen, now)
        log.warning("worker %d declared dead: %s (exit code %s, silent %.2f s)", worker_id, reason, exitcode,
                    peer.dead.silent_s)
        if peer.ready is not None and not peer.ready.done():
            peer.ready.set_exception(WorkerDied(peer.dead))
            peer.ready.exception()   # mark retrieved: nobody may be waiting any more
        for cb in list(self._callbacks):
            try:
                res = cb(peer.dead)
                if inspect.isawaitable(res):
                    self._tasks.append(asyncio.ensure_future(res))
            except Exception:  # a broken callback must not stop liveness tracking
                log.exception("on_worker_dead callback failed")

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            now = time.monotonic()
            for wid, peer in list(self.peers.items()):
                if peer.dead is not None:
                    continue
                if peer.process is not None and not peer.process.alive:
                    self._declare_dead(wid, peer, "exited", peer.process.exitcode)
                elif peer.armed and now - peer.last_seen > self.dead_after_s:
                    self._declare_dead(wid, peer, "heartbeat", None)

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                worker_id = int(frames[0].bytes)
                msg, bufs = self.codec.unpack(frames[1:])
            except (ValueError, msgspec.DecodeError) as e:
                log.warning("hub: dropping a malformed message: %s", e)
                continue
            peer = self.peers.get(worker_id)
            if peer is None:
                peer = self.peers[worker_id] = _Peer(last_seen=time.monotonic())
            if peer.dead is not None:
                continue  # a worker declared dead stays dead until watch() again (fencing)
            peer.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Ready):
                peer.info, peer.armed = dict(msg.info), True
                if peer.ready is not None and not peer.ready.done():
                    peer.ready.set_result(peer.info)
                continue
            if isinstance(msg, Goodbye):
                self.forget(worker_id)
                continue
            peer.frames_in += len(bufs)
            self._queue.put_nowait((worker_id, msg, bufs))


@dataclass
class Link:
    """Worker end: a DEALER (identity = worker id) to the hub; sends a Heartbeat every `heartbeat_s`."""

    codec: Codec
    hub_address: str
    worker_id: int
    heartbeat_s: float = HEARTBEAT_S
    ctx: zmq.asyncio.Context | None = None
    stopping: bool = field(default=False, init=False)
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)
    _beat: asyncio.Task | None = field(default=None, init=False)

    async def start(self) -> Link:
        """Connect and start heartbeating (the hub's timeout applies only after `ready`)."""
        sock = _context(self.ctx).socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity(self.worker_id))
        sock.setsockopt(zmq.LINGER, 1000)  # let a Goodbye or last reply out on close
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
        await _send(self._sock, self.codec.pack(msg, bufs), wait_release)

    async def recv(self) -> tuple[msgspec.Struct, Frames]:
        """The next (message, payload frames) from the hub; a Shutdown also sets `stopping`."""
        assert self._sock is not None, "Link.start() first"
        msg, bufs = self.codec.unpack(await self._sock.recv_multipart(copy=False))
        if isinstance(msg, Shutdown):
            self.stopping = True
        return msg, bufs

    async def _heartbeat(self) -> None:
        while True:
            await self.send(Heartbeat(time.time()))
            await asyncio.sleep(self.heartbeat_s)


@dataclass
class PeerInbox:
    """A worker's KV endpoint: one PULL socket that any peer's `PeerOutbox` pushes to."""

    codec: Codec
    address: str = "tcp://127.0.0.1:0"
    allow_remote: bool = False
    ctx: zmq.asyncio.Context | None = None
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        sock = _context(self.ctx).socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        self.address = _bind(sock, self.address, self.allow_remote)
        self._sock = sock

    async def recv(self) -> tuple[msgspec.Struct, Frames]:
        """The next (message, payload frames) from any peer; per-sender order is kept."""
        assert self._sock is not None, "inbox closed"
        return self.codec.unpack(await self._sock.recv_multipart(copy=False))

    def close(self) -> None:
        """Close the socket (queued messages are dropped)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


@dataclass
class PeerOutbox:
    """Sends to peers' inboxes, one PUSH per peer address, connected on first use and cached."""

    codec: Codec
    ctx: zmq.asyncio.Context | None = None
    sndhwm: int = 64                 # messages queued per peer before send waits (bounds memory for KV)
    _socks: dict[str, zmq.asyncio.Socket] = field(default_factory=dict, init=False)

    async def send(self, address: str, msg: msgspec.Struct, *bufs: Buffer, wait_release: bool = False) -> None:
        """Send `msg` (+ payload frames, not copied) to the inbox at `address`."""
        sock = self._socks.get(address)
        if sock is None:
            sock = _context(self.ctx).socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self._socks[address] = sock
        await _send(sock, self.codec.pack(msg, bufs), wait_release)

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
