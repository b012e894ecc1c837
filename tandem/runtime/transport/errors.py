"""The transport's errors: what a send, a receive or an address can fail with."""
from __future__ import annotations


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
