"""`tandem serve` stops cleanly on SIGTERM: the HTTP server closes, the workers are shut down and reaped,
and the exit code is 0."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("torch")

from tandem.engine.tiny_model import make_tiny_model  # noqa: E402

from live_server import free_port  # noqa: E402


def test_sigterm_stops_the_server_and_its_workers_with_exit_code_0(tmp_path):
    """Protects a clean stop: SIGTERM to `tandem serve` (1 co-located worker) → exit 0 within 15 s, no worker
    process left, even with a request still open (a body that never completes, under a 60 s body timeout: uvicorn
    would wait for it; --timeout-graceful-shutdown 1 cancels it)."""
    make_tiny_model(tmp_path / "m", arch="qwen3", size="1m", seed=0)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", str(tmp_path / "m"),
                             "--colocated", "1", "--prefill-workers", "0", "--decode-workers", "0", "--policy", "vllm",
                             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
                             "--body-timeout", "60", "--timeout-graceful-shutdown", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "tandem serve did not become healthy"
            time.sleep(0.1)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert workers
        pending = socket.create_connection(("127.0.0.1", port))
        pending.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() - t0 < 8
        pending.close()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
