"""A tiny worker target for transport tests and examples: echoes, bursts, peer sends, hangs, exits.

Importable by spawned children as "echo_worker:main" while tests/ is on sys.path (pytest puts it there;
a spawned child inherits its parent's sys.path). Not part of the package: the server never uses it.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import time

import msgspec

from tandem.runtime.launcher import WorkerEnv
from tandem.runtime.transport import Codec, Link, PeerInbox, PeerOutbox


class Echo(msgspec.Struct, tag=True):
    """Both ways: the worker answers with the same message and the same payload frames."""

    seq: int
    text: str = ""


class Burst(msgspec.Struct, tag=True):
    """Hub -> worker: send back Echo(seq=0..n-1) as fast as possible, all sends in flight at once."""

    n: int


class PeerSend(msgspec.Struct, tag=True):
    """Hub -> worker: push `nbytes` random bytes as KvChunk to the inbox at `address`, reply Sent."""

    address: str
    seq: int
    nbytes: int


class KvChunk(msgspec.Struct, tag=True):
    """Worker -> worker (peer channel): one payload frame."""

    src: int
    seq: int


class Sent(msgspec.Struct, tag=True):
    """Worker -> hub: what was pushed to the peer."""

    seq: int
    nbytes: int
    sha256: str


class Got(msgspec.Struct, tag=True):
    """Worker -> hub: what arrived from a peer (digest only; the bytes stay on the worker)."""

    src: int
    seq: int
    nbytes: int
    sha256: str


class Hang(msgspec.Struct, tag=True):
    """Hub -> worker: block the event loop for `seconds` (no heartbeats; the process stays alive)."""

    seconds: float


class Exit(msgspec.Struct, tag=True):
    """Hub -> worker: exit immediately with `code` (a crash, no Goodbye)."""

    code: int


CODEC = Codec([Echo, Burst, PeerSend, KvChunk, Sent, Got, Hang, Exit])


def _digest(bufs: list) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    for b in bufs:
        h.update(b)
        n += memoryview(b).nbytes
    return n, h.hexdigest()


async def _pump_inbox(inbox: PeerInbox, link: Link) -> None:
    while True:
        msg, bufs = await inbox.recv()
        if isinstance(msg, KvChunk):
            n, d = _digest(bufs)
            await link.send(Got(msg.src, msg.seq, n, d))


async def main(env: WorkerEnv, *, fail_on_start: str | None = None, hang_on_start: bool = False) -> None:
    """Serve the hub until Shutdown; `fail_on_start`/`hang_on_start` simulate broken startups."""
    if fail_on_start:
        raise RuntimeError(fail_on_start)
    if hang_on_start:
        time.sleep(3600)
    inbox, outbox = PeerInbox(CODEC), PeerOutbox(CODEC)
    async with env.link(CODEC) as link:
        await link.ready({"kv_address": inbox.address, "pid": os.getpid()})
        pump = asyncio.create_task(_pump_inbox(inbox, link))
        while not link.stopping:
            msg, bufs = await link.recv()
            if isinstance(msg, Echo):
                await link.send(msg, *bufs)
            elif isinstance(msg, Burst):
                await asyncio.gather(*(link.send(Echo(i)) for i in range(msg.n)))
            elif isinstance(msg, PeerSend):
                payload = os.urandom(msg.nbytes)
                await outbox.send(msg.address, KvChunk(env.worker_id, msg.seq), payload)
                n, d = _digest([payload])
                await link.send(Sent(msg.seq, n, d))
            elif isinstance(msg, Hang):
                time.sleep(msg.seconds)
            elif isinstance(msg, Exit):
                os._exit(msg.code)
        pump.cancel()
    outbox.close()
    inbox.close()
