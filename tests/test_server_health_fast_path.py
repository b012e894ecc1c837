"""/health answered in the HTTP protocol's read callback: the same answers as the app's
/health route (200 empty, 503 with the OpenAI error body), on kept-alive connections too, while anything that is
not a plain `GET /health` head (a body, another path, a partial head, pipelined requests) takes the normal path."""
from __future__ import annotations

import socket
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
h11 = pytest.importorskip("h11")

from tandem.server.app import build_app  # noqa: E402
from tandem.server.http_protocol import HeadTimeoutH11Protocol  # noqa: E402

from live_server import uvicorn_app  # noqa: E402


class _Client:
    """A backend whose health the test sets; it serves nothing else."""

    model_name = "m"
    max_model_len = 64
    tokenizer = None
    healthy = True

    def is_healthy(self) -> bool:
        return self.healthy


FAST: list[int] = []          # one entry per /health the protocol answered itself


def _fast_check(client: _Client) -> bool:
    FAST.append(1)
    return client.is_healthy()


@pytest.fixture(scope="module")
def served():
    client = _Client()
    with uvicorn_app(build_app(client), lifespan="off",
                     http=HeadTimeoutH11Protocol.answering_health(lambda: _fast_check(client))) as port:
        yield port, client


def _responses(sock: socket.socket, n: int) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Read `n` responses from `sock` with an h11 client."""
    conn, out = h11.Connection(h11.CLIENT), []
    sock.settimeout(5)
    while len(out) < n:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(ev, h11.Response):
            status, headers, body = ev.status_code, dict(ev.headers), b""
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage) or ev is h11.PAUSED:
            if ev is not h11.PAUSED:
                out.append((status, headers, body))
            # the next response starts on a fresh client connection, fed what this one received past the end of
            # the last one (both pipelined responses can arrive in one recv: h11 then answers PAUSED until a new
            # cycle, and this loop spun forever on it, hanging the whole test run)
            leftover, _ = conn.trailing_data
            conn = h11.Connection(h11.CLIENT)
            if leftover:
                conn.receive_data(leftover)
    return out


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_health_is_answered_on_arrival_on_a_kept_alive_connection(served):
    """Three probes on one connection, each answered 200 with an empty body from the backend's check."""
    port, client = served
    before = len(FAST)
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = []
        for _ in range(3):
            s.sendall(GET_HEALTH)
            got += _responses(s, 1)
    assert [(st, b) for st, _, b in got] == [(200, b"")] * 3
    assert all(h[b"content-length"] == b"0" for _, h, _ in got)
    assert len(FAST) - before == 3                        # answered by the protocol, not the app's route


def test_an_unhealthy_backend_gives_the_same_503_body_as_the_app_route(served):
    """The fast path and the app's route (reached with a query string, which the fast path leaves alone) answer an
    unhealthy backend identically."""
    port, client = served
    _Client.healthy = False
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(GET_HEALTH)
            fast = _responses(s, 1)[0]
        before = len(FAST)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            routed = _responses(s, 1)[0]
        assert len(FAST) == before                            # the route answered this one
    finally:
        _Client.healthy = True
    assert fast[0] == routed[0] == 503
    assert fast[2] == routed[2]
    assert b'"code":"service_unavailable"' in fast[2].replace(b" ", b"")


def test_anything_but_a_plain_health_head_takes_the_normal_path(served):
    """A GET /health with a body goes to the app (its body read, the next request on the connection answered), a
    head split over two sends is still answered, and pipelined requests (two heads in one send) are answered in
    order by the normal path."""
    port, _ = served
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert _responses(s, 1)[0][0] == 200
        s.sendall(GET_HEALTH)
        assert _responses(s, 1)[0][0] == 200
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(GET_HEALTH[:15])
        time.sleep(0.05)
        s.sendall(GET_HEALTH[15:])
        assert _responses(s, 1)[0][:1] == (200,)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(GET_HEALTH + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        got = _responses(s, 2)
        assert [st for st, _, _ in got] == [200, 200]
        assert b'"id":"m"' in got[1][2].replace(b" ", b"")


def test_connection_close_is_honoured(served):
    """A probe asking to close gets its answer and then the connection closes."""
    port, _ = served
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _responses(s, 1)[0][0] == 200
        s.settimeout(2)
        assert s.recv(100) == b""
