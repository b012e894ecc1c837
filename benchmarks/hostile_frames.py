"""The hostile-input run's malformed-frame probes on every listening socket (raw garbage, keyless ZeroMQ)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message
# benchmarks/ is the script's directory (benchmarks/hostile_run.py)
from hostile_config import HOST, Results


# ---------------------------------------------------------------------------- malformed frames
def valid_looking_frames() -> list[list[bytes]]:
    """Well-formed msgspec messages of the runtime's codec that no one should accept from a stranger."""
    import msgspec

    from tandem.runtime import messages as m
    from tandem.runtime.transport import Heartbeat, Ready, Shutdown
    enc = msgspec.msgpack.encode
    kv = m.KVData(request_id="hostile-run", purpose="incremental", src_worker=0, num_tokens=4, dtype="float32",
                  shape=[2, 4, 2, 48], sent_s=0.0)
    return [[enc(kv), b"\x00" * 100], [enc(kv)], [enc(Shutdown(reason="hostile run"))], [enc(Heartbeat())],
            [enc(Ready(info={"kv_address": "tcp://127.0.0.1:1"}))]]


def fuzz_frames(rng: random.Random) -> list[list[bytes]]:
    """b'\\xc1', random frames, a 1 MB frame, and the valid-looking ones."""
    rand = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(4)]
    return [[b"\xc1"], [rand[0]], rand[1:], [os.urandom(1 << 20)], *valid_looking_frames()]


def _wait_handshake(mon: zmq.Socket, timeout_s: float) -> str:
    """Watch a socket monitor until the handshake succeeds or fails; an outcome word."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if mon.poll(50):
            ev = zmq.Event(recv_monitor_message(mon)["event"])
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "accepted"
            if ev.name.startswith("HANDSHAKE_FAILED"):
                return f"handshake refused ({ev.name.lower()})"
            if ev == zmq.EVENT_DISCONNECTED:
                return "disconnected (socket types do not match)"
    return f"no handshake within {timeout_s:.0f} s"


def zmq_probe(ctx: zmq.Context, port: int, kind: int, frames: list[list[bytes]]) -> str:
    """Connect a keyless ZeroMQ socket of `kind`, send `frames` if it gets through; the outcome."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 500)
    s.setsockopt(zmq.RECONNECT_IVL, -1)
    mon = s.get_monitor_socket()
    try:
        s.connect(f"tcp://{HOST}:{port}")
        outcome = _wait_handshake(mon, 2.0)
        if outcome == "accepted":
            sent = 0
            for f in frames:
                with contextlib.suppress(zmq.Again):
                    s.send_multipart(f, flags=zmq.NOBLOCK)
                    sent += 1
            outcome = f"accepted; {sent} messages sent"
    finally:
        s.disable_monitor()
        mon.close()
        s.close()
    return outcome


def garbage_probe(port: int, rng: random.Random) -> str:
    """4 KB of random bytes on a raw TCP connection; what the peer did within 2 s."""
    got, end = b"", "closed by the server"
    try:
        with socket.create_connection((HOST, port), timeout=2) as s:
            s.sendall(bytes(rng.randrange(256) for _ in range(4096)))
            while chunk := s.recv(4096):
                got += chunk
    except socket.timeout:
        end = "left open"
    except ConnectionError:
        end = "reset by the server"
    except OSError as e:
        return f"refused ({e.strerror})"
    if got.startswith(b"\xff") and len(got) >= 10 and got[9] == 0x7F:
        return f"ZMTP greeting, then {end}"
    return f"{'HTTP ' + got[9:12].decode() if got.startswith(b'HTTP/1.1 ') else 'no answer' if not got else 'bytes'}, {end}"


def probe_port(ctx: zmq.Context, sock: dict, rng: random.Random) -> list[dict]:
    """Every malformed-frame probe on one listening socket."""
    frames = fuzz_frames(rng)
    out = [{"probe": "raw garbage", "outcome": garbage_probe(sock["port"], rng)}]
    for name, kind in (("zmq DEALER", zmq.DEALER), ("zmq PUSH", zmq.PUSH)):
        out.append({"probe": name, "outcome": zmq_probe(ctx, sock["port"], kind, frames)})
    return [{**sock, **o} for o in out]


async def run_frames(sockets: list[dict], res: Results, deadline: float, seed: int,
                     tick: Callable[[], None]) -> None:
    """Rounds of probes on every socket until `deadline` (at least one), each round 1 s apart."""
    ctx, rng, rnd = zmq.Context(), random.Random(seed), 0
    try:
        while rnd == 0 or time.monotonic() < deadline:
            for sock in sockets:
                t = time.monotonic()
                rows = await asyncio.to_thread(probe_port, ctx, sock, rng)
                for row in rows:
                    res.frames.append({**row, "round": rnd, "start": t, "end": time.monotonic()})
                    tick()
            rnd += 1
            await asyncio.sleep(1.0)
    finally:
        ctx.destroy(linger=0)
