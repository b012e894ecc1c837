"""Framing: msgspec-tagged messages as msgpack headers with payload frames, the plumbing messages every link
speaks, and decode-and-drop of frames that are not a message."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec
import zmq

from tandem.runtime.transport.errors import BadMessage, TransportError
from tandem.runtime.transport.sockets import Buffer, Rejects

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



def unpack_or_drop(codec: Codec, frames: Sequence[zmq.Frame], rejects: Rejects
                    ) -> tuple[msgspec.Struct, Frames] | None:
    """`codec.unpack(frames)`, or None when they are not a message (counted and logged by `rejects`)."""
    try:
        return codec.unpack(frames)
    except BadMessage as e:
        rejects(f"a malformed message: {e}")
    except Exception as e:  # noqa: BLE001 - a reader must outlive anything a peer sends
        rejects(f"a message that could not be decoded: {type(e).__name__}: {e}")
    return None
