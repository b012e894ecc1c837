"""Hostile local peers against the runtime's sockets.

2.2  the control plane is authenticated (CURVE, per-cluster keys made by the coordinator's Hub): a DEALER that
     claims worker 1's identity, without keys or with its own, gets nothing, and worker 1 stays alive and serves;
     a forged message from an identity that is not a spawned worker's is dropped and counted.
2.3  malformed frames (b'\\xc1', an empty frame, a KV header without its payload, oversized junk, a wrong type)
     sent to the hub, a link and a KV inbox are dropped and counted; the readers survive and the next real
     request completes at once (not after a 10 s KV-transfer timeout).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from echo_worker import CODEC, Echo, KvChunk
from tandem.runtime.launcher import Cluster, WorkerSpec
from tandem.runtime.transport import (BadMessage, Codec, Hub, Keys, Link, PeerInbox, PeerOutbox, PeerUnreachable,
                                      curve_available, identity)

ECHO = "echo_worker:main"
pytestmark = pytest.mark.skipif(not curve_available(), reason="libzmq without CURVE")


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _dealer(ident: bytes, address: str, server_public: bytes | None = None, keys: Keys | None = None):
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, ident)
    if server_public is not None and keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, keys.public, keys.secret
    sock.connect(address)
    return sock


async def _nothing_for(sock, seconds: float) -> bool:
    """True when `sock` receives nothing within `seconds`."""
    return await sock.poll(int(seconds * 1000), zmq.POLLIN) == 0


async def _wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# -- 2.2: authentication of the control plane -------------------------------------------------------
def test_a_dealer_claiming_a_worker_identity_gets_nothing_and_the_worker_keeps_serving():
    async def main():
        async with Hub(CODEC) as hub, Cluster(hub, startup_timeout_s=15.0) as cluster:
            await cluster.start([WorkerSpec(0, ECHO), WorkerSpec(1, ECHO)])
            assert hub.rejected_handshakes == 0
            # the original attack: connect as b'1' (no keys), then with fresh keys of its own, and send
            attackers = [_dealer(b"1", hub.address), _dealer(b"1", hub.address, hub.public_key, Keys.new())]
            try:
                for a in attackers:                 # queued on its pending connection; none once the hub refused
                    with contextlib.suppress(zmq.Again):    # it (a blocking send then waited for a peer for ever)
                        await a.send_multipart([CODEC.encode(Echo(666, "forged"))], flags=zmq.NOBLOCK)
                assert await _wait_for(lambda: hub.rejected_handshakes >= 2, 3.0)
                # the next user's request for worker 1 reaches worker 1 only
                for seq in range(5):
                    await hub.send(1, Echo(seq, f"user prompt {seq}"))
                    wid, msg, _ = await asyncio.wait_for(hub.recv(), 2.0)
                    assert (wid, msg) == (1, Echo(seq, f"user prompt {seq}"))
                for a in attackers:
                    assert await _nothing_for(a, 0.2)
                await asyncio.sleep(2.0)                            # > DEAD_AFTER_S: worker 1 still beats
                assert hub.alive(1) and cluster.workers[1].alive and cluster.deaths == []
                await hub.send(1, Echo(99, "still serving"))
                assert await asyncio.wait_for(hub.recv(), 2.0) == (1, Echo(99, "still serving"), [])
                assert hub._queue.empty()
                assert hub.rejected_frames == 0                     # they never got as far as a frame
            finally:
                for a in attackers:
                    a.close(linger=0)
    run(main())


@pytest.mark.serial            # waits on a handshake and a drop count with fixed timeouts: alone on the CPU
def test_a_forged_message_from_an_unknown_identity_is_dropped_and_counted():
    async def main():
        # secure hub: an unknown peer (own keys, identity b'9') is refused at the handshake
        async with Hub(CODEC) as hub, Link(CODEC, hub.address, 3, auth=hub.credentials(3)) as link:
            await link.ready({})
            await hub.wait_ready(3, 5.0)
            stranger = _dealer(b"9", hub.address, hub.public_key, Keys.new())
            # a real worker's keys used under another identity: authenticated, but not as b'8'
            stolen = hub.credentials(7)
            impostor = _dealer(b"8", hub.address, hub.public_key, stolen.client)
            try:
                await stranger.send_multipart([CODEC.encode(Echo(1, "forged stats"))])
                for i in range(3):
                    await impostor.send_multipart([CODEC.encode(Echo(i, "forged stats"))])
                assert await _wait_for(lambda: hub.rejected_handshakes >= 1 and hub.rejected_frames >= 3, 3.0)
                await asyncio.sleep(0.2)
                assert hub.rejected_frames == 3
                assert 8 not in hub.peers and 9 not in hub.peers and hub._queue.empty()
                await link.send(Echo(5, "real"))
                assert await asyncio.wait_for(hub.recv(), 2.0) == (3, Echo(5, "real"), [])
            finally:
                stranger.close(linger=0)
                impostor.close(linger=0)
        # without CURVE (secure=False, a trusted host) identities are still checked: only issued/watched ones count
        async with Hub(CODEC, secure=False) as hub:
            assert hub.credentials(2) is None and hub.public_key is None
            forger = _dealer(b"9", hub.address)
            link = await Link(CODEC, hub.address, 2).start()
            try:
                await forger.send_multipart([CODEC.encode(Echo(1, "forged stats"))])
                await link.send(Echo(2, "real"))
                assert await asyncio.wait_for(hub.recv(), 2.0) == (2, Echo(2, "real"), [])
                assert await _wait_for(lambda: hub.rejected_frames == 1, 2.0)
                assert 9 not in hub.peers and hub._queue.empty()
            finally:
                forger.close(linger=0)
                await link.close()
    run(main())


def test_kv_inbox_refuses_senders_without_the_cluster_keys():
    async def main():
        async with Hub(CODEC) as hub:
            auth = hub.credentials(1)
            inbox, good = PeerInbox(CODEC, auth=auth), PeerOutbox(CODEC, auth=auth)
            # a refused sender's PUSH loses its pipe when the handshake fails (libzmq does not reconnect after a
            # protocol error): its send is queued and dropped, or, if the refusal came first, PeerUnreachable
            plain = PeerOutbox(CODEC, send_timeout_s=1.0)
            own = PeerOutbox(CODEC, auth=type(auth)(5, auth.hub_public, Keys.new(), auth.kv_server, Keys.new()),
                             send_timeout_s=1.0)
            try:
                for i, o in enumerate((plain, own)):
                    with contextlib.suppress(PeerUnreachable):
                        await o.send(inbox.address, KvChunk(9, 1 + i), b"x" * 100)
                assert await _wait_for(lambda: inbox.rejected_handshakes >= 2, 3.0)
                await good.send(inbox.address, KvChunk(0, 3), b"kv")
                msg, bufs = await asyncio.wait_for(inbox.recv(), 2.0)
                assert (msg, [bytes(b) for b in bufs]) == (KvChunk(0, 3), [b"kv"])
                assert inbox.rejected_frames == 0
            finally:
                for o in (good, plain, own):
                    o.close(0.0)
                inbox.close()
    run(main())


def test_a_kv_send_to_a_peer_that_takes_nothing_raises_instead_of_hanging():
    """Protects a worker's KV flush loop: a send to an inbox that is gone (or refused our handshake) used to wait
    forever once the queue was full, stalling every later KV send of that worker. It now raises PeerUnreachable
    after send_timeout_s, forgets the socket, and the next send to a live inbox at that address goes through."""
    async def main():
        squatter = socket.socket()                             # a listener that accepts nothing: the peer is
        squatter.bind(("127.0.0.1", 0))                        # there and takes nothing, and while it holds the
        squatter.listen(0)                                     # port no other test's socket can bind it and
        address = "tcp://127.0.0.1:%d" % squatter.getsockname()[1]   # read our sends (an xdist flake)
        out = PeerOutbox(CODEC, sndhwm=1, send_timeout_s=0.2)
        try:
            raised_at = None
            for i in range(4):                                 # libzmq queues up to the high-water mark, then waits
                t0 = time.monotonic()
                try:
                    await out.send(address, KvChunk(0, i), b"kv")
                except PeerUnreachable as e:
                    raised_at, took = i, time.monotonic() - t0
                    assert address in str(e)
                    break
            assert raised_at is not None and 0.15 <= took < 2.0
            assert address not in out._socks                   # forgotten: the next send connects afresh
            squatter.close()
            back = PeerInbox(CODEC, address=address)           # a live inbox at that address again
            try:
                await out.send(address, KvChunk(0, 9), b"kv")
                msg, bufs = await asyncio.wait_for(back.recv(), 3.0)
                assert (msg, [bytes(b) for b in bufs]) == (KvChunk(0, 9), [b"kv"])
            finally:
                back.close()
        finally:
            squatter.close()
            out.close(0.0)
    run(main())


def test_a_curve_kv_inbox_delivers_large_payloads_from_another_context():
    """Protects the workers' authenticated KV plane: with CURVE, libzmq may report a PULL socket readable
    before a large message can be read (recv says EAGAIN); the reader must wait for it, not die. This is
    what kept CURVE off the workers' KV inboxes: every KV transfer between processes timed out."""
    async def main():
        async with Hub(CODEC) as hub:
            auth = hub.credentials(1)
            inbox = PeerInbox(CODEC, auth=auth)
            other = zmq.asyncio.Context()                         # as a peer process would: its own context
            out = PeerOutbox(CODEC, auth=auth, ctx=other)
            payloads = [bytes([i]) * (316 << 10) for i in range(3)]
            try:
                for i, p in enumerate(payloads):
                    await out.send(inbox.address, KvChunk(0, i), p)
                got = [await asyncio.wait_for(inbox.recv(), 3.0) for _ in payloads]
                assert [(msg, bytes(bufs[0])) for msg, bufs in got] == [
                    (KvChunk(0, i), p) for i, p in enumerate(payloads)]
                assert inbox.rejected_frames == 0
            finally:
                out.close(0.0)
                inbox.close()
                other.term()
    run(main())


# -- 2.3: malformed frames never kill a reader --------------------------------------------------------
JUNK = os.urandom(3 << 20)


def test_the_decode_functions_drop_garbage_and_count_it():
    kv_codec = Codec([KvChunk, Echo], frames={KvChunk: 1})
    with pytest.raises(BadMessage):
        kv_codec.unpack([])
    for bad in ([b"\xc1"], [b""], [kv_codec.encode(KvChunk(0, 1))], [JUNK], [b"\x81\xa4type\xa3Bad"]):
        with pytest.raises(BadMessage):
            kv_codec.unpack([zmq.Frame(f) for f in bad])
    inbox = PeerInbox(kv_codec, accept=(KvChunk,))
    try:
        garbage = [[], [b"\xc1"], [b""], [kv_codec.encode(KvChunk(0, 1))], [JUNK],
                   [kv_codec.encode(KvChunk(0, 1)), b"a", b"b"], [kv_codec.encode(Echo(1))]]
        assert [inbox.decode([zmq.Frame(f) for f in g]) for g in garbage] == [None] * len(garbage)
        assert inbox.rejected_frames == len(garbage)
        msg, bufs = inbox.decode([zmq.Frame(kv_codec.encode(KvChunk(0, 2))), zmq.Frame(b"ok")])
        assert (msg, bytes(bufs[0])) == (KvChunk(0, 2), b"ok")
    finally:
        inbox.close()
    assert isinstance(msgspec.msgpack.decode(CODEC.encode(Echo(1))), dict)


def test_hub_link_and_inbox_readers_survive_garbage():
    async def main():
        kv_codec = Codec([KvChunk, Echo], frames={KvChunk: 1})
        async with Hub(kv_codec) as hub, Link(kv_codec, hub.address, 3, auth=hub.credentials(3)) as link:
            await link.ready({})
            await hub.wait_ready(3, 5.0)
            # hub: an authenticated worker sending garbage
            auth = hub.credentials(4)
            w4 = _dealer(b"4", hub.address, hub.public_key, auth.client)
            inbox, out = PeerInbox(kv_codec, auth=auth, accept=(KvChunk,)), PeerOutbox(kv_codec, auth=auth)
            try:
                for bad in ([b"\xc1"], [b""], [JUNK], [b"\xc1", b"payload"]):
                    await w4.send_multipart(bad)
                await w4.send_multipart([kv_codec.encode(Echo(4, "after garbage"))])
                assert await asyncio.wait_for(hub.recv(), 2.0) == (4, Echo(4, "after garbage"), [])
                assert hub.rejected_frames == 4
                # link: the hub's socket sending garbage to worker 3
                for bad in ([b"\xc1"], [b""], [JUNK]):
                    await hub._sock.send_multipart([identity(3), *bad])
                await hub.send(3, Echo(7, "real"))
                msg, _ = await asyncio.wait_for(link.recv(), 2.0)
                assert msg == Echo(7, "real") and link.rejected_frames == 3
                # KV inbox: an authenticated peer sending garbage
                await out.send(inbox.address, KvChunk(0, 0), b"warm")   # opens the authenticated PUSH
                sock = out._socks[inbox.address]
                for bad in ([b"\xc1"], [b""], [kv_codec.encode(KvChunk(0, 1))], [JUNK],
                            [kv_codec.encode(Echo(1))]):
                    await sock.send_multipart(bad)
                await out.send(inbox.address, KvChunk(0, 2), b"real")
                got = [await asyncio.wait_for(inbox.recv(), 2.0) for _ in range(2)]
                assert [(m, bytes(b[0])) for m, b in got] == [(KvChunk(0, 0), b"warm"), (KvChunk(0, 2), b"real")]
                assert inbox.rejected_frames == 5
            finally:
                w4.close(linger=0)
                out.close(0.0)
                inbox.close()
    run(main())


# -- the real server: 1 prefill + 1 decode worker, every prefill remote (dynamo) --------------------------
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tandem.engine.tiny_model import make_tiny_model
    path = tmp_path_factory.mktemp("tiny-security")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    return str(path)


def test_serving_cluster_survives_hostile_peers_and_garbage(tiny):
    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime import messages as m
    from tandem.runtime.cluster import ClusterConfig, ServingCluster
    from tandem.runtime.state_store import WorkerState
    from tandem.runtime.worker_main import CODEC as WCODEC

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def one_round(c, rid: str, first: int):
        t0 = time.monotonic()
        last = None
        try:                                 # a round that hangs fails here, saying where it stood
            async with asyncio.timeout(30):
                async for o in c.generate(list(range(first, first + 80)), greedy, rid):
                    last = o
        except TimeoutError:
            req = c.shell.reqs.get(rid)
            where = req and {k: getattr(req, k) for k in ("worker", "prefill_worker", "sent_to_decode", "kv_arrived",
                                                           "transfers", "done")}
            pytest.fail(f"round {rid} hung: {where}, audits {c.shell._audits}, "
                        f"workers alive {c.hub.alive(0), c.hub.alive(1)}")
        return last, time.monotonic() - t0

    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 1, 1, 0, "dynamo",
                                                     engine_args=dict(max_model_len=1024, num_kv_blocks=256)))
        socks = []
        try:
            base, _ = await one_round(c, "warm", 10)
            assert base.error is None
            hub, kv_addr = c.hub, c.procs.workers[1].info["kv_address"]
            # 2.2: an attacker claiming the decode worker's identity, and a forged Stats from a stranger
            socks.append(_dealer(b"1", hub.address))
            socks.append(_dealer(b"1", hub.address, hub.public_key, Keys.new()))
            socks.append(_dealer(b"9", hub.address, hub.public_key, Keys.new()))
            forged = m.Stats(WorkerState(worker_id=1, role="decode", tp=1, capacity_tokens=0, free_tokens=0,
                                         num_waiting=10**6, published_s=time.time()))
            for s in socks:
                await s.send_multipart([WCODEC.encode(forged)])
            # 2.2 on the KV plane: a stranger's PUSH (no keys, or keys the cluster never issued) is refused at
            # the CURVE handshake, so nothing it sends reaches the decode worker
            head = WCODEC.encode(m.KVData("nope", "history", 0, 4, "float32", [4], time.time()))
            kv_server, kv_client = hub._kv
            for keys in (None, Keys.new()):
                push = zmq.asyncio.Context.instance().socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                if keys is not None:
                    push.curve_serverkey, push.curve_publickey, push.curve_secretkey = (
                        kv_server.public, keys.public, keys.secret)
                push.connect(kv_addr)
                socks.append(push)
                await push.send_multipart([head, b"\0" * 16])
            # 2.3: garbage from a holder of the cluster's KV keys (an insider, or a buggy peer) reaches the
            # worker's reader, which must drop and count it and keep going
            push = zmq.asyncio.Context.instance().socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.curve_serverkey, push.curve_publickey, push.curve_secretkey = (
                kv_server.public, kv_client.public, kv_client.secret)
            push.connect(kv_addr)
            socks.append(push)
            garbage = [[b"\xc1"], [b""], [head], [JUNK], [WCODEC.encode(m.RoundBegun("x", "s", 1))],
                       [head, b"\0" * 16, b"extra"]]
            for g in garbage:
                await push.send_multipart(g)
            # and garbage to each worker's link, from the hub's own socket
            for wid in (0, 1):
                for g in ([b"\xc1"], [b""], [JUNK]):
                    await hub._sock.send_multipart([identity(wid), *g])
            await asyncio.sleep(0.3)
            results = [await one_round(c, f"after{i}", 100 + i) for i in range(3)]
            await asyncio.sleep(2.0)                                  # > DEAD_AFTER_S: nobody was declared dead
            alive = (hub.alive(0), hub.alive(1), c.stats().workers_alive)
            stats = c.stats()
            for s in socks[:3]:
                assert await _nothing_for(s, 0.1)
            return results, alive, stats, hub.rejected_handshakes, hub.rejected_frames
        finally:
            for s in socks:
                s.close(linger=0)
            await asyncio.wait_for(c.shutdown(), 60)

    results, alive, stats, refused, dropped = asyncio.run(main())
    print(f"rounds after garbage: {[round(t, 3) for _, t in results]} s; hub refused {refused} handshakes")
    for out, took in results:
        assert out.error is None and out.finished and len(out.outputs[0].token_ids) == 6
        assert took < 3.0                                           # not the 10 s KV-transfer timeout
    assert alive == (True, True, 2)
    assert stats.remote_prefills == 4 and stats.kv_transfer_timeouts == 0
    assert refused >= 3 and dropped == 0
    # the decode worker reported what its KV inbox dropped (6 garbage messages) and refused (2 strangers), and
    # each worker's link the 3 garbage messages the hub's socket sent it: 6 + 2 x 3 frames, hub's 0 included
    assert stats.rejected_frames == 12
    assert stats.rejected_handshakes >= refused + 2
