"""Runtime transport and process plumbing: codec, hub/link, peer KV channel, liveness, startup, orphans."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from echo_worker import CODEC, Burst, Echo, Exit, Got, Hang, KvChunk, PeerSend, Sent
from tandem.runtime.launcher import Cluster, WorkerSpec, WorkerStartupError, resolve_target
from tandem.runtime.transport import (Codec, Heartbeat, Hub, Link, PeerInbox, PeerOutbox, Ready, TransportError,
                                      WorkerUnreachable)

ECHO = "echo_worker:main"          # tests/echo_worker.py: tests/ is on sys.path, children inherit it
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MB = 1 << 20


def run(coro, timeout_s: float = 20.0):
    """Run a test coroutine with a hard timeout so a broken transport fails instead of hanging."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (reaped, or a zombie left to a non-reaping init)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def pattern(n: int, seed: int) -> bytes:
    """`n` deterministic, non-repeating-looking bytes."""
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + bytes(n % 32)


# -- codec -----------------------------------------------------------------------------------------
class Big(msgspec.Struct, tag=True):
    name: str
    shape: list[int]
    meta: dict[str, float] = {}


def test_codec_round_trips_tagged_structs_and_rejects_bad_input():
    codec = Codec([Big, Echo])
    for msg in (Big("kv", [2, 3], {"a": 1.5}), Echo(7, "x"), Heartbeat(1.25), Ready({"kv_address": "tcp://x"})):
        assert codec.decode(codec.encode(msg)) == msg
    assert type(codec.decode(codec.encode(Echo(1)))) is Echo
    with pytest.raises(msgspec.ValidationError):
        Codec([Big]).decode(codec.encode(Echo(1)))          # a tag the other side does not know

    class Untagged(msgspec.Struct):
        x: int

    with pytest.raises(TransportError, match="tag=True"):
        Codec([Untagged])


# -- hub <-> link, in one process --------------------------------------------------------------------
def test_hub_link_request_response_with_multi_megabyte_frames():
    async def main():
        async with Hub(CODEC) as hub, Link(CODEC, hub.address, 3, auth=hub.credentials(3)) as link:
            assert hub.address.startswith("tcp://127.0.0.1:")
            await link.ready({"kv_address": "tcp://127.0.0.1:1", "capacity": 4096})
            assert await hub.wait_ready(3, 5.0) == {"kv_address": "tcp://127.0.0.1:1", "capacity": 4096}
            payloads = [pattern(4 * MB, 1), pattern(6 * MB + 5, 2), b"", bytearray(pattern(3 * MB, 3))]
            await hub.send(3, Echo(1, "req"), *payloads)
            msg, bufs = await link.recv()
            assert msg == Echo(1, "req")
            assert [bytes(b) for b in bufs] == [bytes(p) for p in payloads]
            await link.send(Echo(2, "resp"), *bufs)               # received views go back out uncopied
            wid, msg, back = await hub.recv()
            assert (wid, msg) == (3, Echo(2, "resp"))
            assert [bytes(b) for b in back] == [bytes(p) for p in payloads]
            assert not back[0].readonly                           # writable: torch.frombuffer without a copy
            with pytest.raises(WorkerUnreachable):
                await hub.send(99, Echo(0))
    run(main())


def test_concurrent_senders_keep_per_sender_order():
    n = 3000

    async def main():
        async with Hub(CODEC) as hub, Link(CODEC, hub.address, 1, auth=hub.credentials(1)) as a, Link(CODEC, hub.address, 2, auth=hub.credentials(2)) as b:
            await asyncio.gather(*(lk.send(Echo(i)) for i in range(n) for lk in (a, b)))
            seen: dict[int, list[int]] = {1: [], 2: []}
            for _ in range(2 * n):
                wid, msg, _ = await hub.recv()
                seen[wid].append(msg.seq)
            assert seen == {1: list(range(n)), 2: list(range(n))}
            await asyncio.gather(*(hub.send(1, Echo(i)) for i in range(n)))     # and the other way
            assert [(await a.recv())[0].seq for _ in range(n)] == list(range(n))
    run(main())


def test_peer_outbox_to_inboxes_bytes_equal_and_sockets_cached():
    async def main():
        in1, in2, out = PeerInbox(CODEC), PeerInbox(CODEC), PeerOutbox(CODEC)
        try:
            blobs = {seq: pattern(5 * MB + seq, seq) for seq in range(4)}
            for seq, blob in blobs.items():
                await out.send(in1.address if seq % 2 else in2.address, KvChunk(0, seq), memoryview(blob))
            got = {}
            for inbox in (in2, in2, in1, in1):
                msg, bufs = await inbox.recv()
                got[msg.seq] = bytes(bufs[0])
            assert got == blobs
            assert len(out._socks) == 2                         # one PUSH per peer, reused
            buf = bytearray(pattern(8 * MB, 9))
            await out.send(in1.address, KvChunk(0, 9), buf, wait_release=True)
            buf[:4] = b"XXXX"                                     # safe: zmq released the buffer
            msg, bufs = await in1.recv()
            assert bytes(bufs[0]) == pattern(8 * MB, 9)
        finally:
            out.close(0.0)
            in1.close()
            in2.close()
    run(main())


def test_bind_is_local_only():
    async def main():
        with pytest.raises(TransportError, match="127.0.0.1"):
            await Hub(CODEC, "tcp://0.0.0.0:0").start()
    run(main())


# -- worker processes ----------------------------------------------------------------------------------
def test_cluster_request_response_peer_kv_and_graceful_stop():
    async def main():
        async with Hub(CODEC) as hub:
            cluster = Cluster(hub, startup_timeout_s=15.0)
            ws = await cluster.start([WorkerSpec(0, ECHO), WorkerSpec(1, ECHO)])
            pids = [w.pid for w in ws.values()]
            assert {w: ws[w].info["pid"] for w in ws} == {0: pids[0], 1: pids[1]}
            await hub.send(0, Echo(1, "ping"), pattern(3 * MB, 4))
            wid, msg, bufs = await hub.recv()
            assert (wid, msg, bytes(bufs[0])) == (0, Echo(1, "ping"), pattern(3 * MB, 4))
            # KV goes worker 0 -> worker 1 directly; the hub only sees the two small receipts
            frames_before = {w: hub.peers[w].frames_in for w in (0, 1)}
            await hub.send(0, PeerSend(ws[1].info["kv_address"], 5, 12 * MB))
            replies = {type(m): (w, m) for w, m, _ in [await hub.recv(), await hub.recv()]}
            (w_s, sent), (w_g, got) = replies[Sent], replies[Got]
            assert (w_s, w_g, got.src, got.seq) == (0, 1, 0, 5)
            assert (got.nbytes, got.sha256) == (sent.nbytes, sent.sha256) == (12 * MB, sent.sha256)
            assert {w: hub.peers[w].frames_in for w in (0, 1)} == frames_before
            # both workers burst at once: each worker's messages arrive in its own order
            await asyncio.gather(hub.send(0, Burst(1500)), hub.send(1, Burst(1500)))
            seen: dict[int, list[int]] = {0: [], 1: []}
            for _ in range(3000):
                wid, msg, _ = await hub.recv()
                seen[wid].append(msg.seq)
            assert seen == {0: list(range(1500)), 1: list(range(1500))}
            procs = list(ws.values())
            await cluster.stop()
            assert [p.exitcode for p in procs] == [0, 0]          # left on Shutdown, not by signal
            assert cluster.deaths == [] and cluster.workers == {}
            assert all(gone(pid) for pid in pids)
    run(main())


def test_killed_and_hung_workers_are_declared_dead_within_two_seconds():
    async def main():
        async with Hub(CODEC) as hub, Cluster(hub, startup_timeout_s=15.0) as cluster:
            ws = await cluster.start([WorkerSpec(0, ECHO), WorkerSpec(1, ECHO)])
            events = []
            hub.on_worker_dead(events.append)
            t0 = time.monotonic()
            ws[0].kill()
            while hub.alive(0):
                await asyncio.sleep(0.005)
            killed_s = time.monotonic() - t0
            await hub.send(1, Hang(30.0))                          # alive process, silent event loop
            t1 = time.monotonic()
            while hub.alive(1):
                await asyncio.sleep(0.005)
            hung_s = time.monotonic() - t1
            print(f"kill noticed after {killed_s * 1000:.0f} ms, hang after {hung_s * 1000:.0f} ms")
            assert killed_s < 1.0
            assert 0.9 < hung_s < 2.0                              # 1.5 s of silence, last beat <= 0.5 s old
            assert [(e.worker_id, e.reason, e.exitcode) for e in events] == [(0, "exited", -signal.SIGKILL),
                                                                           (1, "heartbeat", None)]
            assert events[1].silent_s >= 1.5
            assert await ws[1].wait(2.0) and ws[1].exitcode == -signal.SIGKILL   # fenced by the cluster
            with pytest.raises(WorkerUnreachable):
                await hub.send(1, Echo(0))
        assert gone(ws[0].pid) and gone(ws[1].pid)
    run(main())


def test_crash_after_ready_reports_the_exit_code():
    async def main():
        async with Hub(CODEC) as hub, Cluster(hub, startup_timeout_s=15.0) as cluster:
            ws = await cluster.start([WorkerSpec(4, ECHO)])
            await hub.send(4, Exit(3))
            while hub.alive(4):
                await asyncio.sleep(0.005)
            assert [(e.worker_id, e.reason, e.exitcode) for e in cluster.deaths] == [(4, "exited", 3)]
        assert gone(ws[4].pid)
    run(main())


def test_startup_failure_names_the_worker_exit_code_and_exception():
    async def main():
        async with Hub(CODEC) as hub:
            cluster = Cluster(hub, startup_timeout_s=15.0)
            with pytest.raises(WorkerStartupError) as err:
                await cluster.start([WorkerSpec(0, ECHO), WorkerSpec(7, ECHO, {"fail_on_start": "no weights in /x"})])
            text = str(err.value)
            assert "worker 7 (echo_worker:main" in text
            assert "exited with code 1 during startup: RuntimeError: no weights in /x" in text
            assert "worker 0" not in text                          # the healthy one was just stopped
            assert cluster.workers == {}
            with pytest.raises(WorkerStartupError, match="AttributeError: .*'nope'"):
                await cluster.start([WorkerSpec(8, "echo_worker:nope")])
    run(main())


def test_startup_timeout_kills_the_worker():
    async def main():
        async with Hub(CODEC) as hub:
            cluster = Cluster(hub, startup_timeout_s=1.0)
            t0 = time.monotonic()
            with pytest.raises(WorkerStartupError, match=r"worker 2 .* was not ready within 1 s \(killed\)"):
                await cluster.start([WorkerSpec(2, ECHO, {"hang_on_start": True})])
            assert time.monotonic() - t0 < 3.0
            assert cluster.workers == {}
    run(main())


def test_resolve_target():
    assert resolve_target("os.path:join") is os.path.join
    with pytest.raises(ValueError, match="module:function"):
        resolve_target("os.path.join")


_PARENT = f"""
import asyncio, json, sys
sys.path.insert(0, {TESTS_DIR!r})
from tandem.runtime.transport import Hub
from tandem.runtime.launcher import Cluster, WorkerSpec
from echo_worker import CODEC

async def main():
    hub = await Hub(CODEC).start()
    ws = await Cluster(hub, startup_timeout_s=15.0).start([WorkerSpec(0, {ECHO!r}), WorkerSpec(1, {ECHO!r})])
    print(json.dumps([w.pid for w in ws.values()]), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_workers_exit_when_the_coordinator_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 20.0)
        assert ready, "the coordinator did not start its workers"
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        parent.send_signal(signal.SIGKILL)                       # no atexit, no cleanup: a crash
        parent.wait(5.0)
        t0 = time.monotonic()
        while not all(gone(p) for p in pids) and time.monotonic() - t0 < 5.0:
            time.sleep(0.02)
        assert all(gone(p) for p in pids), "orphaned workers still running"
        assert time.monotonic() - t0 < 1.0                       # the parent watch polls every 0.2 s
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def test_the_worker_start_method_follows_tandem_worker_multiproc_method_and_refuses_others():
    """Protects TANDEM_WORKER_MULTIPROC_METHOD (docs/runtime-transport.md): the fork server by default, spawn when
    asked, and a clear error for anything else."""
    import subprocess
    import sys
    code = "import tandem.runtime.launcher as L; print(L._SPAWN.get_start_method())"
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_WORKER_MULTIPROC_METHOD"}
    for method, want in ((None, "forkserver"), ("spawn", "spawn"), ("forkserver", "forkserver")):
        e = env if method is None else {**env, "TANDEM_WORKER_MULTIPROC_METHOD": method}
        r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == want, r.stderr[-500:]
    r = subprocess.run([sys.executable, "-c", code], env={**env, "TANDEM_WORKER_MULTIPROC_METHOD": "fork"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "TANDEM_WORKER_MULTIPROC_METHOD is one of forkserver, spawn, got 'fork'" in r.stderr


@pytest.mark.serial
def test_a_stalled_coordinator_loop_declares_no_live_worker_dead():
    """Liveness counts only silence the hub could hear: after its own event loop was blocked past the heartbeat
    limit (a long GC pause, a CPU-starved coordinator), heartbeats still queued in the socket are read before any
    worker is judged, so live workers stay alive and a worker hung during the stall is still found."""
    async def main():
        async with Hub(CODEC) as hub, Cluster(hub, startup_timeout_s=15.0) as cluster:
            ws = await cluster.start([WorkerSpec(0, ECHO), WorkerSpec(1, ECHO)])
            events = []
            hub.on_worker_dead(events.append)
            await hub.send(1, Hang(30.0))                          # worker 1 goes silent as the hub stalls
            await asyncio.sleep(0.05)
            time.sleep(2.0)                                        # the hub's own loop blocked past 1.5 s
            t0 = time.monotonic()
            while hub.alive(1):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.6)                               # worker 0 goes on beating: never judged dead
            assert hub.alive(0)
            assert [(e.worker_id, e.reason) for e in events] == [(1, "heartbeat")]
            assert time.monotonic() - t0 < 2.0                     # the hung one is still found promptly
            await hub.send(0, Echo(7, "after"))
            wid, msg, _ = await hub.recv()
            assert (wid, msg) == (0, Echo(7, "after"))
        assert gone(ws[0].pid) and gone(ws[1].pid)
    run(main())
