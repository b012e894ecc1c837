"""Measures the KV path between two engines on this host (export, ZeroMQ wire, import; or a bare socket pair)."""
from __future__ import annotations

import random
import socket
import statistics
import threading
import time

from tandem.engine.model_runner import ModelRunner


def measure_kv_link(nbytes: int = 32 << 20, pings: int = 200) -> dict:
    """Bandwidth and one-way latency of a local socket pair (what KV between two engine processes on one
    host crosses at best): one bulk send timed to the last byte received, and half a small round trip."""
    a, b = socket.socketpair()
    try:
        payload = bytes(nbytes)
        done = threading.Event()
        buf = bytearray(1 << 20)

        def drain() -> None:
            got = 0
            while got < nbytes:
                k = b.recv_into(buf)
                if not k:
                    break
                got += k
            done.set()

        th = threading.Thread(target=drain, daemon=True)
        t0 = time.perf_counter()
        th.start()
        a.sendall(payload)
        done.wait(30)
        bw_s = time.perf_counter() - t0
        th.join(1)
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            a.sendall(b"x")
            b.recv(1)
            b.sendall(b"y")
            a.recv(1)
            rtts.append(time.perf_counter() - t)
    finally:
        a.close()
        b.close()
    return {"bandwidth_bytes_per_s": nbytes / max(bw_s, 1e-9), "latency_s": statistics.median(rtts) / 2,
            "source": "measured: local socket pair"}


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept >= 0, slope >= 0) of a least-squares line (a negative intercept is dropped)."""
    import numpy as np
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(set(xs)) < 2:
        return 0.0, float(max(y.mean() / max(x.mean(), 1e-12), 0.0))
    slope, icpt = np.polyfit(x, y, 1)
    if icpt < 0:
        slope, icpt = float((x @ y) / (x @ x)), 0.0
    return float(max(icpt, 0.0)), float(max(slope, 1e-15))


def _curve_pair(pull, push) -> None:
    """Make PULL a CURVE server and PUSH its client (fresh keys), as the runtime's KV inboxes and outboxes."""
    import zmq
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    pull.setsockopt(zmq.CURVE_SERVER, 1)
    pull.setsockopt(zmq.CURVE_PUBLICKEY, server_pub)
    pull.setsockopt(zmq.CURVE_SECRETKEY, server_sec)
    push.setsockopt(zmq.CURVE_SERVERKEY, server_pub)
    push.setsockopt(zmq.CURVE_PUBLICKEY, client_pub)
    push.setsockopt(zmq.CURVE_SECRETKEY, client_sec)


HANDSHAKE_MS = 3000      # as the runtime's sockets: a peer that does not finish its handshake is dropped after 3 s


def _cap(sock, max_bytes: int) -> None:
    """The profile's sockets take no frame larger than the largest payload they time, and no slow handshake (set
    before bind/connect, as libzmq copies them then; the runtime's sockets do the same)."""
    import zmq
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)


def _bare_wire_s_per_byte(secure: bool, sizes: list[int], repeats: int) -> float:
    """Seconds per byte of a bare PUSH/PULL pair on loopback (payloads of `sizes` bytes, median of `repeats`,
    fitted slope), with or without CURVE."""
    import zmq
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for sock in (pull, push):
            _cap(sock, max(sizes) + (64 << 10))
        if secure:
            _curve_pair(pull, push)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"warm")
        pull.recv()
        xs, ys = [], []
        for n in sizes:
            buf = bytes(n)
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                push.send(buf, copy=False)
                pull.recv(copy=False)
                ts.append(time.perf_counter() - t)
            xs.append(float(n))
            ys.append(statistics.median(ts))
        return _linear_fit(xs, ys)[1]
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def measure_kv_path(runner: ModelRunner, rng: random.Random, repeats: int = 7, max_tokens: int = 2048,
                    secure: bool | None = None) -> dict:
    """The KV path between two engines on this host, as the runtime takes it (docs/profiler.md):

    export: `export_kv` gathers a sequence's positions out of the paged cache into one payload (the source
    worker does this between its steps); wire: the payload's bytes over ZeroMQ PUSH/PULL on TCP loopback (the
    runtime's peer KV channel), from the send until the receiver holds the bytes, CURVE-encrypted as the
    runtime's KV inboxes are (`secure`; default: whenever this libzmq has CURVE); import: `KVPayload.from_buffer`
    and `import_kv` scatter it into the destination's blocks. Each side is fitted as a + bytes / bandwidth over
    payloads of 16 .. max_tokens tokens (median of `repeats`); the wire's intercept is its latency."""
    import zmq

    from tandem.engine.kv_transfer import KVPayload, export_kv, import_kv

    bs = runner.block_size
    cap = runner.num_blocks * bs
    sizes = [n for n in (16, 64, 256, 1024, 2048) if n <= min(max_tokens, cap // 2)] or [min(16, cap // 2)]
    blocks = list(range(runner.num_blocks))
    if secure is None:
        secure = bool(zmq.has("curve"))
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    per_token = max(1, runner.kv_pool_bytes // max(1, cap))
    for sock in (pull, push):
        _cap(sock, 2 * max(sizes) * per_token + (1 << 20))
    if secure:               # encryption costs about 3 ns a byte on each side: the wire's largest term on CPU hosts
        _curve_pair(pull, push)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    got: list = []
    ready = threading.Event()

    def receive() -> None:
        while True:
            frames = pull.recv_multipart(copy=True)
            got.append((time.perf_counter(), frames))
            ready.set()
            if frames[0] == b"stop":
                return

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    rows: dict[str, list[tuple[float, float]]] = {"export": [], "wire": [], "import": []}
    try:
        push.send_multipart([b"warm", b"x"])
        ready.wait(5)
        for _ in range(repeats):
            for n in sizes:
                nb = -(-n // bs)
                rng.shuffle(blocks)
                src, dst = blocks[:nb], blocks[nb:2 * nb]
                t0 = time.perf_counter()
                payload = export_kv(runner.kv_caches, src, bs, 0, n)
                buf = payload.buffer()
                t1 = time.perf_counter()
                ready.clear()
                push.send_multipart([b"kv", buf], copy=False)
                ready.wait(30)
                t2, frames = got[-1]
                t3 = time.perf_counter()
                back = KVPayload.from_buffer(frames[1], n, payload.dtype, payload.shape)
                import_kv(runner.kv_caches, dst, bs, 0, back)
                t4 = time.perf_counter()
                nbytes = float(payload.nbytes)
                rows["export"].append((nbytes, t1 - t0))
                rows["wire"].append((nbytes, t2 - t1))
                rows["import"].append((nbytes, t4 - t3))
        push.send_multipart([b"stop", b""])
        th.join(5)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
    fits = {}
    for side, pts in rows.items():
        by: dict[float, list[float]] = {}
        for b, t in pts:
            by.setdefault(b, []).append(t)
        xs = sorted(by)
        fits[side] = _linear_fit(xs, [statistics.median(by[x]) for x in xs])
    wire_lat, wire_slope = fits["wire"]
    crypto = 0.0
    if secure:               # the CPU the encryption takes on the two ends' I/O threads, beside the workers' steps
        probe = sorted({int(b) for b, _ in rows["wire"]})[-3:]           # the largest payloads measured above
        crypto = max(0.0, _bare_wire_s_per_byte(True, probe, 3) - _bare_wire_s_per_byte(False, probe, 3))
    return {"bandwidth_bytes_per_s": 1.0 / wire_slope, "latency_s": wire_lat,
            "export_s": fits["export"][0], "export_bytes_per_s": 1.0 / fits["export"][1],
            "import_s": fits["import"][0], "import_bytes_per_s": 1.0 / fits["import"][1],
            "sizes_tokens": sizes, "secure": secure, "crypto_s_per_byte": crypto,
            "source": "measured: engine export_kv -> ZeroMQ PUSH/PULL over TCP loopback"
                      f"{' (CURVE, as the runtime)' if secure else ''} -> import_kv"}
