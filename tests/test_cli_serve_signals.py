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
        # every child ends: the workers before serve exits, the fork server once it sees its parent gone (its
        # interpreter's teardown can take seconds on a loaded 2-core machine)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, [(p.pid, " ".join(p.cmdline())[:120]) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _wait_healthy(proc: subprocess.Popen, port: int, log) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "tandem serve did not become healthy"
        time.sleep(0.1)


def test_sigterm_drains_refuses_new_requests_and_ends_open_ones_with_well_formed_errors(tmp_path):
    """Protects the graceful drain: with a non-streaming and a streaming request open (4000 tokens each, far past a
    2 s grace period), SIGTERM to `tandem serve` 1P+1D → a new request gets 503 with an OpenAI error body and /health
    503 saying draining; after the grace period the non-streaming client gets a JSON 503 naming the shutdown, the
    stream ends with a `data: {"error": ...}` event then `data: [DONE]`; the log holds no traceback; exit code 0."""
    import json
    import threading

    make_tiny_model(tmp_path / "m", arch="qwen3", size="1m", seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logfile = tmp_path / "serve.log"
    with open(logfile, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--model", str(tmp_path / "m"),
                                 "--prefill-workers", "1", "--decode-workers", "1", "--served-model-name", "m",
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
                                 "--timeout-graceful-shutdown", "2"],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = lambda: logfile.read_text()[-3000:]  # noqa: E731
    try:
        _wait_healthy(proc, port, log)
        body = {"model": "m", "prompt": [11, 12, 13, 14, 15, 16], "max_tokens": 4000, "ignore_eos": True,
                "temperature": 0}
        results: dict = {}
        streaming = threading.Event()

        def plain() -> None:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            results["plain"] = (r.status_code, r.headers.get("content-type"), r.text)

        def stream() -> None:
            events = []
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        streaming.set()
            results["stream"] = (r.status_code, events)

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert streaming.wait(60), log()
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)                                   # inside the 2 s grace period: draining
        refused = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=10)
        health = httpx.get(url + "/health", timeout=10)
        assert proc.wait(30) == 0, log()
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert refused.status_code == 503 and refused.headers["content-type"] == "application/json", refused.text
    assert refused.json()["error"]["message"] == "the server is shutting down: it accepts no new requests"
    assert health.status_code == 503 and health.json()["error"]["message"] == "draining: the server is shutting down"
    status, ctype, text = results["plain"]
    assert (status, ctype) == (503, "application/json"), (status, ctype, text)
    err = json.loads(text)["error"]
    assert err["message"] == "the server shut down before this request finished (graceful shutdown timeout 2 s)"
    assert (err["type"], err["code"]) == ("server_error", "service_unavailable")
    status, events = results["stream"]
    assert status == 200 and len(events) >= 3, events[-3:]
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2][len("data: "):])
    assert last["error"]["message"] == err["message"] and last["error"]["code"] == "service_unavailable", events[-2]
    assert all("error" not in e for e in events[:-2])
    assert 2.0 <= took < 15, took
    text = logfile.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
