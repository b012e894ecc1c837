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
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

import msgspec
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5          # a Link sends a Heartbeat this often
DEAD_AFTER_S = 1.5         # a ready worker silent this long is dead (3 missed heartbeats)
CHECK_S = 0.05             # how often the Hub checks processes and silences
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
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

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


class PeerUnreachable(TransportError):
    """A peer's inbox took no message for `send_timeout_s` (gone, refusing our keys, or full); it was not sent."""


class BadMessage(TransportError):
    """Received frames that are not a message of the codec (undecodable, unknown tag, wrong frame count)."""


class MessageTooLarge(TransportError):
    """A frame larger than the receiving socket's cap: it was not sent (the receiver would drop the connection)."""


# -- authentication (ZeroMQ CURVE + a ZAP handler) ------------------------------------------------------
def curve_available() -> bool:
    """Whether this libzmq was built with CURVE (the secure transport needs it)."""
    return bool(zmq.has("curve"))


@dataclass(frozen=True)
class Keys:
    """A CURVE key pair, z85-encoded (40 bytes each); `repr` never shows the secret."""

    public: bytes
    secret: bytes = field(repr=False)

    @staticmethod
    def new() -> Keys:
        public, secret = zmq.curve_keypair()
        return Keys(public, secret)


@dataclass(frozen=True)
class WorkerAuth:
    """A spawned worker's credentials, made by the coordinator's `Hub.credentials` and handed to the child at
    spawn inside its `WorkerEnv` (pickled through multiprocessing's spawn pipe: never on argv or in the env).

    `client` is this worker's own key pair: the hub accepts its public key for this worker id only. The KV
    plane uses two per-cluster pairs: every worker's inbox serves with `kv_server` and accepts only
    `kv_client`, which every outbox of the cluster uses."""

    worker_id: int
    hub_public: bytes                # the hub's server key: the Link checks it is talking to the real hub
    client: Keys
    kv_server: Keys
    kv_client: Keys


class _Zap:
    """The ZAP handler of one zmq context (ZAP binds one fixed inproc endpoint per context), in a daemon thread.

    Per ZAP domain (one per secure socket) it holds the CURVE client keys allowed and the user id each one gets;
    a key not listed, or any other mechanism, is refused (the socket's monitor then counts the failure)."""

    _lock = threading.Lock()
    _by_ctx: dict[int, _Zap] = {}

    def __init__(self, ctx: zmq.Context) -> None:
        self.domains: dict[bytes, dict[bytes, bytes]] = {}       # domain -> {client public key (z85): user id}
        self.refused = 0
        self._ctx = zmq.Context.shadow(ctx.underlying)
        started, self._error = threading.Event(), None
        threading.Thread(target=self._serve, args=(started,), name="tandem-zap", daemon=True).start()
        started.wait()
        if self._error is not None:
            raise TransportError(f"cannot start the ZAP authenticator: {self._error}")

    @classmethod
    def of(cls, ctx: zmq.Context) -> _Zap:
        with cls._lock:
            zap = cls._by_ctx.get(ctx.underlying)
            if zap is None:
                zap = cls._by_ctx[ctx.underlying] = cls(ctx)
            return zap

    def domain(self, prefix: str) -> bytes:
        """A fresh domain (no keys yet)."""
        name = f"{prefix}-{secrets.token_hex(8)}".encode()
        self.domains[name] = {}
        return name

    def allow(self, domain: bytes, public: bytes, user_id: str) -> None:
        self.domains.setdefault(domain, {})[bytes(public)] = user_id.encode()

    def revoke(self, domain: bytes, public: bytes) -> None:
        self.domains.get(domain, {}).pop(bytes(public), None)

    def drop(self, domain: bytes) -> None:
        self.domains.pop(domain, None)

    def _serve(self, started: threading.Event) -> None:
        try:
            sock = self._ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            started.set()
            return
        started.set()
        try:
            while True:
                sock.send_multipart(self._answer(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _answer(self, req: list[bytes]) -> list[bytes]:
        if len(req) < 6:                                        # not a ZAP request: still answer (REP must)
            return [b"1.0", req[1] if len(req) > 1 else b"", b"500", b"bad request", b"", b""]
        _, request_id, domain, _address, _identity, mechanism, *creds = req
        keys = self.domains.get(domain)
        user = None
        if mechanism == b"CURVE" and keys is not None and len(creds) == 1 and len(creds[0]) == 32:
            user = keys.get(z85.encode(creds[0]))
        if user is None:
            self.refused += 1
            return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", user, b""]


def _require_curve() -> None:
    if not curve_available():
        raise TransportError("this libzmq has no CURVE support: the authenticated transport cannot run "
                             "(install a pyzmq wheel with libsodium/CURVE, or pass secure=False on a trusted host)")


def _serve_curve(sock: zmq.Socket, ctx: zmq.Context, server: Keys, prefix: str) -> tuple[_Zap, bytes]:
    """Make `sock` a CURVE server whose clients the context's ZAP handler checks in a fresh domain."""
    _require_curve()
    zap = _Zap.of(ctx)
    domain = zap.domain(prefix)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, server.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    return zap, domain


def limit(sock: zmq.Socket, max_msg_bytes: int) -> None:
    """Cap the frames `sock` takes (a larger one drops its connection) and its handshakes at HANDSHAKE_S; call before
    bind/connect. Every tcp/ipc socket of tandem gets this."""
    if not isinstance(max_msg_bytes, int) or max_msg_bytes < 1:
        raise TransportError(f"max_msg_bytes must be a positive integer, got {max_msg_bytes!r}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))


def _curve_client(sock: zmq.Socket, server_public: bytes, client: Keys) -> None:
    _require_curve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)


class _Rejects:
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


class _HandshakeWatch:
    """Counts connections whose handshake a socket refused (no/wrong CURVE keys, unknown key), via its monitor."""

    def __init__(self, sock: zmq.Socket, ctx: zmq.Context, where: str) -> None:
        addr = f"inproc://tandem-monitor-{secrets.token_hex(8)}"
        sock.monitor(addr, _HANDSHAKE_FAILED)
        self._sock = sock
        self._pair = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self._pair.setsockopt(zmq.LINGER, 0)
        self._pair.connect(addr)
        self.rejects = _Rejects(where)

    def drain(self) -> int:
        """Count the failures reported so far (never blocks); the total."""
        while self._pair is not None:
            try:
                frames = self._pair.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                event = parse_monitor_message(frames)
                self.rejects(f"a connection from {event['endpoint']!r}: handshake refused (event "
                             f"{event['event']}, code {event['value']})")
            except Exception:  # noqa: BLE001 - a monitor frame we do not understand still counts
                self.rejects("a connection: handshake refused")
        return self.rejects.count

    def close(self) -> None:
        if self._pair is not None:
            self.drain()
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._pair.close(linger=0)
            self._pair = None


class Codec:
    """Encode/decode a tagged union of msgspec Structs (plus the plumbing messages) with msgpack."""

    def __init__(self, types: Sequence[type], frames: dict[type, int] | None = None) -> None:
        """`frames`: the exact number of payload frames a message type must come with (others: any)."""
        all_types = tuple(dict.fromkeys([*types, *PLUMBING]))
        for t in all_types:
            cfg = getattr(t, "__struct_config__", None)
            if cfg is None or cfg.tag is None:
                raise TransportError(f"{getattr(t, '__name__', t)!r} must be a msgspec.Struct with tag=True")
        self.types = all_types
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Union[all_types])  # type: ignore[valid-type]
        self.frames = dict(frames or {})

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
        """(message, payload views) from received frames; BadMessage if they are not a message of this codec."""
        if not frames:
            raise BadMessage("no frames")
        try:
            msg = self.decode(frames[0].buffer)
        except msgspec.DecodeError as e:                       # ValidationError included: unknown tag, bad field
            raise BadMessage(f"undecodable header ({len(frames[0].buffer)} bytes): {e}") from None
        want = self.frames.get(type(msg))
        if want is not None and len(frames) - 1 != want:
            raise BadMessage(f"{type(msg).__name__} with {len(frames) - 1} payload frames, expected {want}")
        return msg, [f.buffer for f in frames[1:]]


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


async def _recv_multipart(sock: zmq.asyncio.Socket) -> list[zmq.Frame]:
    """The next multipart message; rides out zmq's spurious readiness (EVENTS said POLLIN, recv said EAGAIN)."""
    while True:
        try:
            return await sock.recv_multipart(copy=False)
        except zmq.Again:                                      # seen with CURVE and messages of ~300 KB
            await asyncio.sleep(0.0005)


def _unpack_or_drop(codec: Codec, frames: Sequence[zmq.Frame], rejects: _Rejects
                    ) -> tuple[msgspec.Struct, Frames] | None:
    try:
        return codec.unpack(frames)
    except BadMessage as e:
        rejects(f"a malformed message: {e}")
    except Exception as e:  # noqa: BLE001 - a reader must outlive anything a peer sends
        rejects(f"a message that could not be decoded: {type(e).__name__}: {e}")
    return None


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
    secure: bool = True              # CURVE: only holders of keys from `credentials(id)` get in, as that id
    max_msg_bytes: int = HUB_MAX_MSG_BYTES
    peers: dict[int, _Peer] = field(default_factory=dict, init=False)
    _sock: zmq.asyncio.Socket | None = field(default=None, init=False)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, init=False)
    _tasks: list[asyncio.Task] = field(default_factory=list, init=False)
    _callbacks: list[DeadCallback] = field(default_factory=list, init=False)
    _issued: dict[int, bytes] = field(default_factory=dict, init=False)   # worker id -> its client public key
    _rejects: _Rejects = field(default_factory=lambda: _Rejects("hub"), init=False)
    _handshakes: _HandshakeWatch | None = field(default=None, init=False)
    _zap: tuple[_Zap, bytes] | None = field(default=None, init=False)
    _server: Keys | None = field(default=None, init=False, repr=False)
    _kv: tuple[Keys, Keys] | None = field(default=None, init=False, repr=False)

    async def start(self) -> Hub:
        """Make this cluster's keys (if `secure`), bind (sets `address`), start the reader and liveness monitor."""
        ctx = _context(self.ctx)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # sending to an absent worker raises, not drops
        # no ROUTER_HANDOVER: a second connection claiming a connected worker's identity must not take it over
        try:
            limit(sock, self.max_msg_bytes)
            if self.secure:
                self._server, self._kv = Keys.new(), (Keys.new(), Keys.new())
                self._zap = _serve_curve(sock, ctx, self._server, "tandem-hub")
            self._handshakes = _HandshakeWatch(sock, ctx, "hub")
        except BaseException:
            sock.close(linger=0)
            raise
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
        if self._handshakes is not None:
            self._handshakes.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._zap is not None:
            self._zap[0].drop(self._zap[1])
            self._zap = None

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
            await _send(self._sock, [identity(worker_id), *self.codec.pack(msg, bufs)], wait_release)
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
                frames = await _recv_multipart(self._sock)
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
    _rejects: _Rejects = field(default_factory=lambda: _Rejects("link"), init=False)

    async def start(self) -> Link:
        """Connect and start heartbeating (the hub's timeout applies only after `ready`)."""
        sock = _context(self.ctx).socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity(self.worker_id))
        sock.setsockopt(zmq.LINGER, 1000)  # let a Goodbye or last reply out on close
        try:
            limit(sock, self.max_msg_bytes)
            if self.auth is not None:
                _curve_client(sock, self.auth.hub_public, self.auth.client)
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
        await _send(self._sock, self.codec.pack(msg, bufs), wait_release)

    @property
    def rejected_frames(self) -> int:
        """Messages from the hub that `recv` dropped as malformed."""
        return self._rejects.count

    async def recv(self) -> tuple[msgspec.Struct, Frames]:
        """The next (message, payload frames) from the hub; a Shutdown also sets `stopping`. Malformed messages
        are dropped (counted in `rejected_frames`, logged)."""
        assert self._sock is not None, "Link.start() first"
        while True:
            got = _unpack_or_drop(self.codec, await _recv_multipart(self._sock), self._rejects)
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
    _rejects: _Rejects = field(default_factory=lambda: _Rejects("kv inbox"), init=False)
    _handshakes: _HandshakeWatch | None = field(default=None, init=False)
    _zap: tuple[_Zap, bytes] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        ctx = _context(self.ctx)
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            limit(sock, self.max_msg_bytes)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            if self.auth is not None:
                self._zap = _serve_curve(sock, ctx, self.auth.kv_server, "tandem-kv")
                self._zap[0].allow(self._zap[1], self.auth.kv_client.public, "kv")
            self._handshakes = _HandshakeWatch(sock, ctx, "kv inbox")
        except BaseException:
            sock.close(linger=0)
            raise
        self.address = _bind(sock, self.address, self.allow_remote)
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
        got = _unpack_or_drop(self.codec, frames, self._rejects)
        if got is not None and self.accept and not isinstance(got[0], self.accept):
            self._rejects(f"a {type(got[0]).__name__}, which this inbox does not take")
            return None
        return got

    async def recv(self) -> tuple[msgspec.Struct, Frames]:
        """The next (message, payload frames) from any peer; per-sender order is kept; malformed ones dropped."""
        while True:
            assert self._sock is not None, "inbox closed"
            got = self.decode(await _recv_multipart(self._sock))
            if got is not None:
                return got

    def close(self) -> None:
        """Close the socket (queued messages are dropped)."""
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._zap is not None:
            self._zap[0].drop(self._zap[1])
            self._zap = None


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
            sock = _context(self.ctx).socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.send_timeout_s * 1000)))
            sock.setsockopt(zmq.LINGER, 1000)
            try:
                limit(sock, HANDSHAKE_MAX_MSG_BYTES)
                if self.auth is not None:
                    _curve_client(sock, self.auth.kv_server.public, self.auth.kv_client)
            except BaseException:
                sock.close(linger=0)
                raise
            sock.connect(address)
            self._socks[address] = sock
        try:
            await _send(sock, parts, wait_release)
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
