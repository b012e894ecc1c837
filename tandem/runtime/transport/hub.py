"""The coordinator's end: one ROUTER that every worker's Link connects to, with liveness (heartbeats, processes)."""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from tandem.runtime.transport.codec import Codec, Frames, Goodbye, Heartbeat, Ready
from tandem.runtime.transport.errors import BadMessage, TransportError, WorkerUnreachable
from tandem.runtime.transport.security import HandshakeWatch, Keys, WorkerAuth, Zap, close_secured, serve_curve
from tandem.runtime.transport.sockets import HUB_MAX_MSG_BYTES, Buffer, Rejects, bind, identity, limit, recv_parts, \
    send_parts, zmq_context

log = logging.getLogger(__name__)

DEAD_AFTER_S = 1.5         # a ready worker silent this long is dead (3 missed heartbeats)
CHECK_S = 0.05             # how often the Hub checks processes and silences


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
    secure: bool = True              # CURVE: only holders of keys from `credentials(id)` get in, as that id
    max_msg_bytes: int = HUB_MAX_MSG_BYTES
    peers: dict[int, _Peer] = field(default_factory=dict, init=False)
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, init=False)
    _tasks: list[asyncio.Task] = field(default_factory=list, init=False)
    _callbacks: list[DeadCallback] = field(default_factory=list, init=False)
    _issued: dict[int, bytes] = field(default_factory=dict, init=False)   # worker id -> its client public key
    _rejects: Rejects = field(default_factory=lambda: Rejects("hub"), init=False)
    _handshakes: HandshakeWatch | None = field(default=None, init=False)
    _zap: tuple[Zap, bytes] | None = field(default=None, init=False)
    _server: Keys | None = field(default=None, init=False, repr=False)
    _kv: tuple[Keys, Keys] | None = field(default=None, init=False, repr=False)

    async def start(self) -> Hub:
        """Make this cluster's keys (if `secure`), bind (sets `address`), start the reader and liveness monitor."""
        ctx = zmq_context(self.ctx)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to an absent worker raises, not drops
        # no ROUTER_HANDOVER: a second connection claiming a connected worker's identity must not take it over
        try:
            limit(sock, self.max_msg_bytes)
            if self.secure:
                self._server, self._kv = Keys.new(), (Keys.new(), Keys.new())
                self._zap = serve_curve(sock, ctx, self._server, "tandem-hub")
            self._handshakes = HandshakeWatch(sock, ctx, "hub")
        except BaseException:
            sock.close(linger=0)
            raise
        self.address = bind(sock, self.address, self.allow_remote)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._monitor())]
        return self

    async def close(self) -> None:
        """Stop the background tasks and close the socket."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        close_secured(self._sock, self._handshakes, self._zap)
        self._sock = self._zap = None

    # -- authentication -------------------------------------------------------------------------
    @property
    def public_key(self) -> bytes | None:
        """The hub's CURVE server key (z85), or None when not `secure`."""
        return None if self._server is None else self._server.public

    def credentials(self, worker_id: int) -> WorkerAuth | None:
        """Fresh keys for worker `worker_id` (None when not `secure`): only they can speak as that id from now on
        (an earlier key of that id is revoked). Also makes the id known: the hub drops messages from others."""
        self._issued.setdefault(worker_id, b"")
        if not self.secure:
            return None
        assert self._zap is not None and self._server is not None and self._kv is not None, "Hub.start() first"
        zap, domain = self._zap
        client = Keys.new()
        zap.revoke(domain, self._issued[worker_id])
        zap.allow(domain, client.public, str(int(worker_id)))
        self._issued[worker_id] = client.public
        return WorkerAuth(int(worker_id), self._server.public, client, *self._kv)

    def revoke(self, worker_id: int) -> None:
        """Refuse new connections with `worker_id`'s keys (existing connections stay until closed)."""
        public = self._issued.get(worker_id)
        if self._zap is not None and public:
            self._zap[0].revoke(self._zap[1], public)

    @property
    def rejected_frames(self) -> int:
        """Messages the reader dropped: malformed, from an identity that is not a known worker's, or not from the
        identity its key was issued to."""
        return self._rejects.count

    @property
    def rejected_handshakes(self) -> int:
        """Connections refused during the handshake: no CURVE, a wrong server key, or a client key not issued."""
        return 0 if self._handshakes is None else self._handshakes.drain()

    async def __aenter__(self) -> Hub:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sending and receiving ------------------------------------------------------------------
    async def send(self, worker_id: int, msg: msgspec.Struct, *bufs: Buffer, wait_release: bool = False) -> None:
        """Send `msg` (+ payload frames, not copied) to one worker; WorkerUnreachable if not connected."""
        assert self._sock is not None, "Hub.start() first"
        self._check_alive(worker_id)
        try:
            await send_parts(self._sock, [identity(worker_id), *self.codec.pack(msg, bufs)], wait_release)
        except zmq.ZMQError as e:
            raise self.send_error(worker_id, e) from None

    def post(self, worker_id: int, msg: msgspec.Struct) -> asyncio.Future:
        """Send `msg` to one worker without awaiting: the future is done at once unless the socket is at its
        high-water mark (then zmq sends it in order later). A failure is the future's exception (map it with
        `send_error`); one raised here means the message cannot be encoded or the worker is known dead."""
        assert self._sock is not None, "Hub.start() first"
        self._check_alive(worker_id)
        return self._sock.send_multipart([identity(worker_id), self.codec.encode(msg)], copy=False)

    @staticmethod
    def send_error(worker_id: int, e: BaseException) -> BaseException:
        """The error a failed send to `worker_id` means (WorkerUnreachable when it is not connected)."""
        if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH:
            return WorkerUnreachable(f"worker {worker_id} is not connected")
        return e

    def _check_alive(self, worker_id: int) -> None:
        peer = self.peers.get(worker_id)
        if peer is not None and peer.dead is not None:
            raise WorkerUnreachable(f"worker {worker_id} is dead ({peer.dead.reason})")

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
        self.revoke(worker_id)     # its keys open no new connection (a restart gets new ones)
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
            if self._handshakes is not None:
                self._handshakes.drain()            # counts and logs refused connections
            now = time.monotonic()
            for wid, peer in list(self.peers.items()):
                if peer.dead is not None:
                    continue
                if peer.process is not None and not peer.process.alive:
                    self._declare_dead(wid, peer, "exited", peer.process.exitcode)
                elif peer.armed and now - peer.last_seen > self.dead_after_s:
                    self._declare_dead(wid, peer, "heartbeat", None)

    def _accept(self, frames: Sequence[zmq.Frame]) -> tuple[int, msgspec.Struct, Frames] | None:
        """(worker id, message, payload) from a ROUTER message, or None (counted, logged) if it must be dropped."""
        if len(frames) < 2:
            self._rejects(f"a message of {len(frames)} frame(s) without a header")
            return None
        ident = frames[0].bytes
        try:
            worker_id = int(ident)
        except ValueError:
            worker_id = -1
        if worker_id < 0 or identity(worker_id) != ident or worker_id not in self._issued and worker_id not in self.peers:
            self._rejects(f"a message from unknown identity {ident[:32]!r}")
            return None
        if self.secure:
            try:
                user = frames[1].get("User-Id")
            except zmq.ZMQError:
                user = None
            if user != str(worker_id):
                self._rejects(f"a message from identity {ident[:32]!r} sent with the keys of {user!r}")
                return None
        try:
            msg, bufs = self.codec.unpack(frames[1:])
        except BadMessage as e:
            self._rejects(f"a malformed message from worker {worker_id}: {e}")
            return None
        return worker_id, msg, bufs

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await recv_parts(self._sock)
                got = self._accept(frames)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the reader must outlive anything a peer sends
                self._rejects(f"a message the reader could not handle: {type(e).__name__}: {e}")
                continue
            if got is None:
                continue
            worker_id, msg, bufs = got
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
