"""Authentication: ZeroMQ CURVE keys per cluster, a ZAP handler that admits only the keys issued, and the count
of handshakes a socket refused."""
from __future__ import annotations

import contextlib
import secrets
import threading
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from tandem.runtime.transport.errors import TransportError
from tandem.runtime.transport.sockets import Rejects

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


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


class Zap:
    """The ZAP handler of one zmq context (ZAP binds one fixed inproc endpoint per context), in a daemon thread.

    Per ZAP domain (one per secure socket) it holds the CURVE client keys allowed and the user id each one gets;
    a key not listed, or any other mechanism, is refused (the socket's monitor then counts the failure)."""

    _lock = threading.Lock()
    _by_ctx: dict[int, Zap] = {}

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
    def of(cls, ctx: zmq.Context) -> Zap:
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


def require_curve() -> None:
    """Raise TransportError when this libzmq cannot do CURVE."""
    if not curve_available():
        raise TransportError("this libzmq has no CURVE support: the authenticated transport cannot run "
                             "(install a pyzmq wheel with libsodium/CURVE, or pass secure=False on a trusted host)")


def serve_curve(sock: zmq.Socket, ctx: zmq.Context, server: Keys, prefix: str) -> tuple[Zap, bytes]:
    """Make `sock` a CURVE server whose clients the context's ZAP handler checks in a fresh domain."""
    require_curve()
    zap = Zap.of(ctx)
    domain = zap.domain(prefix)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, server.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    return zap, domain



def curve_client(sock: zmq.Socket, server_public: bytes, client: Keys) -> None:
    """Make `sock` a CURVE client with `client`'s keys of the server whose public key is `server_public`."""
    require_curve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)



class HandshakeWatch:
    """Counts connections whose handshake a socket refused (no/wrong CURVE keys, unknown key), via its monitor."""

    def __init__(self, sock: zmq.Socket, ctx: zmq.Context, where: str) -> None:
        addr = f"inproc://tandem-monitor-{secrets.token_hex(8)}"
        sock.monitor(addr, _HANDSHAKE_FAILED)
        self._sock = sock
        self._pair = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self._pair.setsockopt(zmq.LINGER, 0)
        self._pair.connect(addr)
        self.rejects = Rejects(where)

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
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._pair.close(linger=0)
            self._pair = None


def close_secured(sock: zmq.Socket | None, handshakes: HandshakeWatch | None, zap: tuple[Zap, bytes] | None) -> None:
    """Close a listening socket with its handshake watch and its ZAP domain (each may be None): queued messages
    are dropped."""
    if handshakes is not None:
        handshakes.close()
    if sock is not None:
        sock.close(linger=0)
    if zap is not None:
        zap[0].drop(zap[1])
