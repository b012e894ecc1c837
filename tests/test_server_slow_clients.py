"""Hostile HTTP clients against a real uvicorn: a request head trickled in
byte by byte (slowloris) or garbage without a line end is closed after the head deadline; a refused large body
is read and dropped so the client sees its 413 instead of a connection reset; a client that leaves mid-body is
not logged as an internal error."""
from __future__ import annotations

import logging
import socket
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from tandem.server.app import build_app  # noqa: E402
from tandem.server.http_protocol import HeadTimeoutH11Protocol  # noqa: E402

from live_server import uvicorn_app  # noqa: E402

HEAD_S = 0.5


class _Client:
    """A backend that serves nothing: these requests never get past the HTTP layer and the body checks."""

    model_name = "m"
    max_model_len = 64
    tokenizer = None

    def is_healthy(self) -> bool:
        return True


class _Quick(HeadTimeoutH11Protocol):
    header_timeout_s = HEAD_S


@pytest.fixture(scope="module")
def port():
    with uvicorn_app(build_app(_Client(), max_body_bytes=1 << 20), http=_Quick, lifespan="off") as p:
        yield p


def _closed_within(s: socket.socket, limit: float) -> float | None:
    """Seconds until the server closed `s` (recv returns b""), None if still open after `limit`."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        while True:
            if s.recv(4096) == b"":
                return time.monotonic() - t0
    except (TimeoutError, socket.timeout):
        return None
    except ConnectionResetError:
        return time.monotonic() - t0


def test_a_trickled_request_head_or_endless_garbage_is_closed_after_the_deadline(port):
    """Protects against slowloris: a head sent one byte every 0.1 s, and 4 KB of bytes with no line end, are both
    closed within the head deadline (+ slack); a normal request on the same server still answers 200."""
    slow = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\n":
        try:
            slow.send(bytes([b]))
        except OSError:
            break
        if time.monotonic() - t0 > 2 * HEAD_S:
            break
        time.sleep(0.1)
    assert _closed_within(slow, 3 * HEAD_S) is not None
    junk = socket.create_connection(("127.0.0.1", port))
    junk.sendall(b"x" * 4096)
    assert _closed_within(junk, 3 * HEAD_S) is not None
    ok = socket.create_connection(("127.0.0.1", port))
    ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok.recv(100).startswith(b"HTTP/1.1 200")


def test_a_kept_alive_connection_gets_a_new_head_deadline_after_each_response(port):
    """Protects keep-alive: after a first request is answered, a second head that trickles is closed too."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(100).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /he")
    assert _closed_within(s, 3 * HEAD_S) is not None


def test_an_oversized_body_written_in_full_first_still_reads_its_413(port):
    """Protects the 413's delivery: a client that writes its whole 3 MB body before reading (as httpx and the
    OpenAI SDK do) reads the 413 JSON error, not a connection reset."""
    body = b'{"prompt": "' + b"a" * (3 << 20) + b'"}'
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    s.settimeout(10)
    got = s.recv(4096)
    while b"request_too_large" not in got:           # the head and the JSON body may come in two reads
        more = s.recv(4096)
        assert more, got
        got += more
    assert got.startswith(b"HTTP/1.1 413")


def test_a_client_leaving_mid_body_is_not_an_internal_error(port, caplog):
    """Protects the log: a truncated body whose client closes was a ClientDisconnect traceback logged as an
    internal error (any client could fill the log); now it is dropped quietly."""
    with caplog.at_level(logging.WARNING):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        s.shutdown(socket.SHUT_WR)
        _closed_within(s, 5)
        time.sleep(0.2)
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
