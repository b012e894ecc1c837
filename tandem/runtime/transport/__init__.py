"""The runtime's transport: msgspec-tagged messages over ZeroMQ, big payloads as zero-copy frames.

`Hub` (coordinator, one ROUTER; hub.py) talks to every worker's `Link` (a DEALER whose identity is its worker id;
link.py) and declares workers dead when their process exits or they fall silent. `PeerInbox`/`PeerOutbox` (peers.py)
carry KV directly between workers (PULL/PUSH), so many-MB payloads never pass through the coordinator. Keys and
authentication: security.py; framing: codec.py; socket caps and helpers: sockets.py. Sockets, frames, liveness
timings and lifecycle: docs/runtime-transport.md.
"""
from tandem.runtime.transport.codec import Codec, Heartbeat, Ready, Shutdown
from tandem.runtime.transport.errors import BadMessage, MessageTooLarge, PeerUnreachable, TransportError, \
    WorkerUnreachable
from tandem.runtime.transport.hub import Hub, WorkerDead, WorkerDied
from tandem.runtime.transport.link import HEARTBEAT_S, Link
from tandem.runtime.transport.peers import PeerInbox, PeerOutbox
from tandem.runtime.transport.security import Keys, WorkerAuth, curve_available
from tandem.runtime.transport.sockets import HANDSHAKE_MAX_MSG_BYTES, HANDSHAKE_S, HUB_MAX_MSG_BYTES, LOCAL_HOSTS, \
    PEER_RCVHWM, identity

__all__ = [
    "BadMessage", "Codec", "HANDSHAKE_MAX_MSG_BYTES", "HANDSHAKE_S", "HEARTBEAT_S", "HUB_MAX_MSG_BYTES", "Heartbeat",
    "Hub", "Keys", "LOCAL_HOSTS", "Link", "MessageTooLarge", "PEER_RCVHWM", "PeerInbox", "PeerOutbox",
    "PeerUnreachable", "Ready", "Shutdown", "TransportError", "WorkerAuth", "WorkerDead", "WorkerDied",
    "WorkerUnreachable", "curve_available", "identity",
]
