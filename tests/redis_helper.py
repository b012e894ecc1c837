"""A private redis-server for tests (shared by the state-store and serve end-to-end tests)."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server():
    """A redis-server on a free 127.0.0.1 port, without persistence; yields its URL (skips without the binary)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server binary not found on PATH (`make test` installs it with apt-get)")
    redis = pytest.importorskip("redis")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client, deadline = redis.Redis(port=port, socket_connect_timeout=0.2), time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start (exit {proc.poll()})")
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
