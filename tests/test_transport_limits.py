"""Size caps on the runtime's ZeroMQ sockets, and the KV plane that fits under them.

Every tcp socket the transport builds caps the frames it takes (ZMQ_MAXMSGSIZE) and its handshakes (HANDSHAKE_S).
The caps hold before any key is checked: a stranger who greets a KV inbox with CURVE and declares a 1 GiB frame is
cut off at the frame's header, and one who declares a frame just under the cap holds at most that until the
handshake timeout. A worker's inbox cap is its deployment's largest KV message (whole blocks up to KV_PART_BYTES,
plus framing); a longer transfer goes in parts and arrives whole; a sender never sends what the inbox would drop."""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import torch
import zmq
import zmq.asyncio

from tandem.bench.chaos.zmq_inbox import SLACK, Stranger
from tandem.engine.kv_transfer import (KV_FRAMING_BYTES, KV_PART_BYTES, KVAssembly, KVPayload, KVTransferError,
                                       export_kv, import_kv, kv_bytes_per_token, kv_message_max_bytes,
                                       kv_part_tokens, split_kv)
from tandem.runtime import messages as m
from tandem.runtime.transport import (HANDSHAKE_MAX_MSG_BYTES, HANDSHAKE_S, HUB_MAX_MSG_BYTES, PEER_RCVHWM, Codec,
                                      Hub, Keys, Link, MessageTooLarge, PeerInbox, PeerOutbox, WorkerAuth,
                                      curve_available)

MiB = 1 << 20
KV_CODEC = Codec(m.KV, frames={m.KVData: 1})
# a small model's KV: 2 layers, 2 KV heads of 16, float32 -> 512 bytes a token; 4096 tokens -> 2 MiB
GEOMETRY = (2, 2, 16, "float32")
BLOCK, MAX_LEN = 16, 4096
CAP = kv_message_max_bytes(BLOCK, *GEOMETRY, MAX_LEN)

pytestmark = pytest.mark.skipif(not curve_available(), reason="libzmq without CURVE")


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _auth() -> WorkerAuth:
    return WorkerAuth(1, Keys.new().public, Keys.new(), Keys.new(), Keys.new())


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _head(n: int, **kw) -> m.KVData:
    layers, heads, dim, dtype = GEOMETRY
    return m.KVData("r1", "history", 0, n, dtype, [layers, 2, n, heads, dim], time.time(), **kw)


# -- the cap a deployment computes ------------------------------------------------------------------------------
def test_the_kv_cap_of_a_model_config_is_its_largest_kv_message_plus_framing():
    """Protects the inbox cap's arithmetic: whole blocks up to KV_PART_BYTES (at least one block, at most the
    longest sequence) times the KV bytes of a token, plus framing headroom, for real model configs."""
    assert KV_PART_BYTES == 16 * MiB and KV_FRAMING_BYTES == 64 << 10
    # Llama-3-8B (32 layers, 8 KV heads of 128, bf16): 128 KiB a token, 2 MiB a block of 16 -> 8 blocks a message
    assert kv_bytes_per_token(32, 8, 128, "bfloat16") == 131072
    assert kv_part_tokens(16, 131072, 8192) == 128
    assert kv_message_max_bytes(16, 32, 8, 128, "bfloat16", 8192) == 128 * 131072 + 65536 == 16842752
    # Llama-3-70B (80 layers, 8 KV heads of 128, bf16): 320 KiB a token, 5 MiB a block -> 3 blocks a message
    assert kv_message_max_bytes(16, 80, 8, 128, "bfloat16", 131072) == 48 * 327680 + 65536 == 15794176
    # one block larger than a part: a message carries that one block
    assert kv_message_max_bytes(128, 80, 8, 128, "float32", 131072) == 128 * 655360 + 65536 == 83951616
    # the tiny test model (qwen3 1m: 4 layers, 2 KV heads of 48, float32), max_model_len 1024: the whole sequence
    assert kv_message_max_bytes(16, 4, 2, 48, "float32", 1024) == 1024 * 3072 + 65536 == 3211264
    assert CAP == 4096 * 512 + 65536
    for bad in ((16, 0, 2, 48, "float32", 1024), (16, 4, 2, 48, "int8", 1024), (0, 4, 2, 48, "float32", 1024)):
        with pytest.raises(KVTransferError):
            kv_message_max_bytes(*bad)


# -- every socket is capped -------------------------------------------------------------------------------------
def test_every_transport_socket_caps_its_frames_and_its_handshake():
    """Protects the options on each socket kind the transport builds (hub ROUTER, link DEALER, inbox PULL, outbox
    PUSH): a frame cap, a handshake timeout of HANDSHAKE_S, and the inbox's bounded queue."""
    async def main():
        async with Hub(KV_CODEC) as hub, Link(KV_CODEC, hub.address, 3, auth=hub.credentials(3)) as link:
            auth = hub.credentials(4)
            inbox = PeerInbox(KV_CODEC, auth=auth, max_msg_bytes=CAP)
            out = PeerOutbox(KV_CODEC, auth=auth, max_msg_bytes=CAP)
            try:
                await out.send(inbox.address, _head(0), b"")
                await asyncio.wait_for(inbox.recv(), 5.0)
                push = out._socks[inbox.address]
                got = {name: (s.getsockopt(zmq.MAXMSGSIZE), s.getsockopt(zmq.HANDSHAKE_IVL))
                       for name, s in (("hub", hub._sock), ("link", link._sock), ("inbox", inbox._sock),
                                       ("outbox", push))}
                return got, inbox._sock.getsockopt(zmq.RCVHWM)
            finally:
                out.close(0.0)
                inbox.close()
    got, rcvhwm = run(main())
    ms = int(HANDSHAKE_S * 1000)
    assert HANDSHAKE_S == 3.0 and PEER_RCVHWM == 16
    assert got == {"hub": (HUB_MAX_MSG_BYTES, ms), "link": (HUB_MAX_MSG_BYTES, ms), "inbox": (CAP, ms),
                   "outbox": (HANDSHAKE_MAX_MSG_BYTES, ms)}
    assert rcvhwm == 16


# -- strangers before the handshake -----------------------------------------------------------------------------
def _hold(strangers: list[Stranger], seconds: float) -> int:
    """Pump the strangers for up to `seconds` (until all are closed); the peak RSS of this process meanwhile."""
    peak = _rss()
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end and any(s.open for s in strangers):
        for s in strangers:
            s.pump()
        peak = max(peak, _rss())
        time.sleep(0.01)
    return max(peak, _rss())


def test_a_stranger_declaring_a_1_gib_frame_is_cut_off_before_it_is_buffered():
    """Protects a worker's memory from unauthenticated peers: 3 raw ZMTP connections greet the inbox with CURVE,
    declare a 1 GiB frame and stream 64 MiB of it; the inbox closes each at once and this process (whose libzmq
    thread would buffer the frame) does not grow by the frames, as it did by 1 GiB a connection without a cap."""
    async def main():
        inbox = PeerInbox(KV_CODEC, auth=_auth(), max_msg_bytes=CAP)
        try:
            before = _rss()
            strangers = [Stranger(_port(inbox.address), 1 << 30, 64 * MiB) for _ in range(3)]
            peak = await asyncio.to_thread(_hold, strangers, 3.0)
            for s in strangers:
                s.close()
            held = [s.closed_s and s.closed_s - s.opened_s for s in strangers]
            return before, peak, held, [s.sent for s in strangers]
        finally:
            inbox.close()
    before, peak, held, sent = run(main())
    print(f"RSS {before >> 20} -> {peak >> 20} MiB; connections closed after {held} s having sent {sent} bytes")
    assert all(h is not None and h < 1.0 for h in held)
    assert peak - before < 16 * MiB


def test_a_stranger_declaring_a_frame_of_the_cap_holds_at_most_the_cap_until_the_handshake_timeout():
    """Protects the bound on the worst a stranger can do: a declared frame of exactly the cap, sent but for its last
    KiB, then trickled, is held (never more than the cap a connection) and cut at HANDSHAKE_S; the memory comes
    back."""
    async def main():
        inbox = PeerInbox(KV_CODEC, auth=_auth(), max_msg_bytes=CAP)
        try:
            before = _rss()
            strangers = [Stranger(_port(inbox.address), CAP, CAP - 1024) for _ in range(3)]
            peak = await asyncio.to_thread(_hold, strangers, HANDSHAKE_S + 3.0)
            for s in strangers:
                s.close()
            await asyncio.sleep(1.0)
            return before, peak, _rss(), [s.closed_s and s.closed_s - s.opened_s for s in strangers]
        finally:
            inbox.close()
    before, peak, after, held = run(main())
    print(f"RSS {before >> 20} -> {peak >> 20} -> {after >> 20} MiB; connections closed after {held} s")
    assert all(h is not None and HANDSHAKE_S - 0.5 < h < HANDSHAKE_S + 2.5 for h in held)
    assert peak - before < 3 * (CAP + 2 * MiB)
    assert after - before < SLACK      # back, up to the allocator's and the other tests' noise in this process


# -- legitimate KV under the cap --------------------------------------------------------------------------------
def test_the_largest_kv_message_passes_and_a_larger_one_is_refused_by_the_sender():
    """Protects the KV plane under its cap: a message of the largest part the deployment sends arrives intact; one
    byte more is refused by the sender with MessageTooLarge (not silently dropped by the inbox with its connection);
    and an insider who bypasses the sender's check loses only that message."""
    part = kv_part_tokens(BLOCK, kv_bytes_per_token(*GEOMETRY), MAX_LEN)
    big = torch.randn(GEOMETRY[0], 2, part, GEOMETRY[1], GEOMETRY[2])
    payload = KVPayload(part, "float32", tuple(big.shape), big)

    async def main():
        auth = _auth()
        inbox = PeerInbox(KV_CODEC, auth=auth, max_msg_bytes=CAP, accept=(m.KVData,))
        out = PeerOutbox(KV_CODEC, auth=auth, max_msg_bytes=CAP)
        try:
            await out.send(inbox.address, _head(part), payload.buffer())
            msg, bufs = await asyncio.wait_for(inbox.recv(), 5.0)
            got = KVPayload.from_buffer(bufs[0], msg.num_tokens, msg.dtype, tuple(msg.shape))
            with pytest.raises(MessageTooLarge):
                await out.send(inbox.address, _head(part), b"\0" * (CAP + 1))
            raw = out._socks[inbox.address]                   # the outbox's own authenticated PUSH, check bypassed
            await raw.send_multipart([KV_CODEC.encode(_head(1)), b"\0" * (CAP + 1)])
            await out.send(inbox.address, _head(1, first_token=7), b"\0" * 512)
            after, _ = await asyncio.wait_for(inbox.recv(), 5.0)
            return payload.nbytes, got, after, inbox.rejected_frames
        finally:
            out.close(0.0)
            inbox.close()
    nbytes, got, after, rejected = run(main())
    assert nbytes == CAP - KV_FRAMING_BYTES == 2 * MiB
    assert torch.equal(got.data, big)
    assert after.first_token == 7 and rejected == 0


def _paged(seed: int, blocks: int = 40) -> list[torch.Tensor]:
    layers, heads, dim, _ = GEOMETRY
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, BLOCK, heads, dim, generator=g) for _ in range(layers)]


def test_a_transfer_longer_than_one_message_goes_in_parts_and_arrives_whole():
    """Protects splitting: a 150-token transfer over messages of 2 blocks (32 tokens) goes as 5 parts, each under
    the cap those parts imply, and the receiver's assembly scatters into its cache exactly what the sender had."""
    src, dst = _paged(1), _paged(2)
    table_src, table_dst = list(range(3, 13)), list(range(20, 30))
    payload = export_kv(src, table_src, BLOCK, 0, 150)
    part_bytes = 32 * kv_bytes_per_token(*GEOMETRY)
    part = kv_part_tokens(BLOCK, kv_bytes_per_token(*GEOMETRY), MAX_LEN, part_bytes)
    cap = kv_message_max_bytes(BLOCK, *GEOMETRY, MAX_LEN, part_bytes)
    parts = split_kv(payload, part)
    assert part == 32 and [(o, p.num_tokens) for o, p in parts] == [(0, 32), (32, 32), (64, 32), (96, 32), (128, 22)]

    async def main():
        auth = _auth()
        inbox = PeerInbox(KV_CODEC, auth=auth, max_msg_bytes=cap)
        out = PeerOutbox(KV_CODEC, auth=auth, max_msg_bytes=cap)
        try:
            for offset, p in parts:
                await out.send(inbox.address, _head(p.num_tokens, offset=offset, total_tokens=150), p.buffer())
            assembly, whole = KVAssembly(150, GEOMETRY, MAX_LEN), None
            for _ in parts:
                msg, bufs = await asyncio.wait_for(inbox.recv(), 5.0)
                assert whole is None
                got = KVPayload.from_buffer(bufs[0], msg.num_tokens, msg.dtype, tuple(msg.shape))
                whole = assembly.add(msg.offset, got)
            return whole
        finally:
            out.close(0.0)
            inbox.close()
    whole = run(main())
    assert whole is not None and whole.num_tokens == 150 and torch.equal(whole.data, payload.data)
    import_kv(dst, table_dst, BLOCK, 0, whole)
    assert torch.equal(export_kv(dst, table_dst, BLOCK, 0, 150).data, payload.data)


def test_an_assembly_takes_only_parts_that_fit_the_receiving_cache():
    """Protects the receiver from a peer's headers: a transfer longer than max_model_len allocates nothing, and a
    part out of order, of another geometry, or past the transfer's end is refused."""
    with pytest.raises(KVTransferError, match="at most 4096"):
        KVAssembly(10**9, GEOMETRY, MAX_LEN)
    with pytest.raises(KVTransferError):
        KVAssembly(0, GEOMETRY, MAX_LEN)
    a = KVAssembly(40, GEOMETRY, MAX_LEN)
    ok = KVPayload(16, "float32", (2, 2, 16, 2, 16), torch.zeros(2, 2, 16, 2, 16))
    with pytest.raises(KVTransferError, match="expected 0"):
        a.add(16, ok)
    with pytest.raises(KVTransferError, match="does not fit"):
        a.add(0, KVPayload(16, "float32", (3, 2, 16, 2, 16), torch.zeros(3, 2, 16, 2, 16)))
    assert a.add(0, ok) is None and a.add(16, ok) is None
    with pytest.raises(KVTransferError, match="overruns"):
        a.add(32, ok)
    last = KVPayload(8, "float32", (2, 2, 8, 2, 16), torch.ones(2, 2, 8, 2, 16))
    whole = a.add(32, last)
    assert whole is not None and whole.shape == (2, 2, 40, 2, 16)
    assert float(whole.data[:, :, 32:].sum()) == 2 * 2 * 8 * 2 * 16 and float(whole.data[:, :, :32].sum()) == 0.0


# -- the real workers -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tandem.engine.tiny_model import make_tiny_model
    path = tmp_path_factory.mktemp("tiny-limits")
    make_tiny_model(path, arch="qwen3", size="1m", seed=5)
    return str(path)


def test_workers_cap_their_inbox_at_their_kv_message_and_move_kv_in_parts(tiny):
    """Protects the deployment's wiring: each worker's inbox cap is computed from its model (qwen3 1m, float32,
    block 16, max_model_len 1024) and published; with messages of one block, a remote round's history and new KV
    travel in parts and the session's outputs equal the offline engine's."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime.cluster import ClusterConfig, ServingCluster

    engine = dict(max_model_len=1024, num_kv_blocks=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one_block = 16 * kv_bytes_per_token(4, 2, 48, "float32")
    new = [list(range(10, 90)), list(range(200, 230)), []]

    async def main():
        c = await ServingCluster.start(ClusterConfig(tiny, 1, 1, 0, "dynamo", engine_args=engine,
                                                     worker_kwargs={0: {"kv_part_bytes": one_block},
                                                                    1: {"kv_part_bytes": one_block}}))
        try:
            infos = [c.procs.workers[i].info for i in (0, 1)]
            outs, conv = [], list(new[0])
            for k in range(2):
                last = None
                async for o in c.generate(conv, greedy, f"r{k}", session_id="agent"):
                    last = o
                outs.append(last)
                conv = conv + last.outputs[0].token_ids + new[k + 1]
            return infos, outs, c.stats()
        finally:
            await c.shutdown()

    infos, outs, stats = run(main(), 120.0)
    assert [i["kv_max_msg_bytes"] for i in infos] == [16 * 3072 + 65536] * 2
    assert [i["kv_part_tokens"] for i in infos] == [16, 16]
    assert kv_message_max_bytes(16, 4, 2, 48, "float32", 1024, one_block) == 16 * 3072 + 65536
    llm = LLM(tiny, **engine)
    conv, ref = list(new[0]), []
    for k in range(2):
        r = llm.generate([conv], greedy)[0].outputs[0]
        ref.append(r.token_ids)
        conv = conv + r.token_ids + new[k + 1]
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.error is None for o in outs)
    assert stats.remote_prefills == 2 and stats.kv_transfer_timeouts == 0
    assert len(stats.kv_transfer_seconds) == 3               # 2 incremental write-backs + 1 history read, each whole
