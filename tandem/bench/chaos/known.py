"""The attacks a live `tandem serve` already withstands, replayed so that none comes back: oversized bodies, integers
out of range, bad session ids, streams nobody reads, keyless ZeroMQ peers at the hub and at the KV inboxes, a dead
and a stopped worker, and a Redis blip under the state store. One 1P+1D server on a tiny model serves all of them
(127.0.0.1 only); each attack is bounded in count and time, and after each the server must still answer a request."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import zmq

from tandem.bench.chaos import ChaosContext, Outcome
from tandem.bench.chaos.lifecycle import HOST, Served, serve_tiny
from tandem.bench.chaos.zmq_inbox import worker_inboxes
from tandem.bench.ports import free_port

WORKER_TIMEOUT_S = 2.0        # the server's --worker-timeout here: a stopped worker is declared dead after this
BACK_WITHIN_S = 8.0           # a killed or stopped worker's replacement must serve within this long
REDIS_DOWN_S = 2.0            # how long Redis is away in the blip
UNREAD_STREAMS = 8            # streams opened and never read


def _error_body(r: httpx.Response) -> str:
    """'' when `r` carries an OpenAI-style error body, else what is wrong with it."""
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return f"not JSON ({r.headers.get('content-type')})"
    if not isinstance(err, dict) or not {"message", "type", "code"} <= set(err):
        return f"error body {str(err)[:80]}"
    return ""


def _serves(c: httpx.Client, model: str, timeout_s: float = 15.0) -> bool:
    """Whether a small greedy completion is answered 200 within `timeout_s`."""
    try:
        r = c.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0},
                   timeout=timeout_s)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def _wait(pred: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> float | None:
    """Seconds until `pred()` holds (None: not within `timeout_s`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


# ---------------------------------------------------------------------------- HTTP input
def _http_cases(c: httpx.Client, model: str) -> list[Outcome]:
    out = []
    big = {"model": model, "messages": [{"role": "user", "content": "x" * (12 << 20)}]}
    r = c.post("/v1/chat/completions", content=json.dumps(big), headers={"content-type": "application/json"})
    bad = _error_body(r)
    out.append(Outcome("a 12 MiB chat body", "413 with an OpenAI error body",
                       f"{r.status_code} {bad or 'error body'}", r.status_code == 413 and not bad))
    for field, value in (("seed", 2 ** 70), ("max_tokens", -1), ("top_k", 2 ** 64)):
        r = c.post("/v1/completions", json={"model": model, "prompt": "hi", field: value})
        bad = _error_body(r)
        named = field in (r.json().get("error", {}).get("param") or "") + r.text[:400] if not bad else False
        out.append(Outcome(f"{field} = {value}", "400 naming the field",
                           f"{r.status_code}{'' if named else ', field not named'} {bad}".strip(),
                           r.status_code == 400 and named and not bad))
    for what, sid in (("a 1,000-character session id", "s" * 1000), ("a session id with control bytes", "a\x01b")):
        r = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "session_id": sid})
        bad = _error_body(r)
        out.append(Outcome(what, "400 with an OpenAI error body", f"{r.status_code} {bad}".strip(),
                           r.status_code == 400 and not bad))
    return out


def _unread_streams(served: Served, c: httpx.Client, model: str) -> Outcome:
    """Streams opened with a long output and never read: /health stays fast and the server still serves."""
    port = int(served.url.rsplit(":", 1)[1])
    body = json.dumps({"model": model, "prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    socks = []
    try:
        for _ in range(UNREAD_STREAMS):
            s = socket.create_connection((HOST, port), timeout=5)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(head)
            socks.append(s)
        worst = 0.0
        for _ in range(40):                                # ~2 s of /health while nobody reads the streams
            t0 = time.monotonic()
            code = served.health()
            worst = max(worst, time.monotonic() - t0)
            if code != 200:
                worst = float("inf")
            time.sleep(0.05)
        ok = _serves(c, model)
    finally:
        for s in socks:
            s.close()
    return Outcome(f"{UNREAD_STREAMS} streams opened and never read", "/health under 100 ms, requests served",
                   f"/health worst {worst * 1e3:.0f} ms, {'served' if ok else 'NOT served'}", worst < 0.1 and ok)


# ---------------------------------------------------------------------------- keyless ZeroMQ peers
def _coordinator_listeners(served: Served) -> list[int]:
    """The server process's own TCP listeners other than HTTP (its hub)."""
    http = int(served.url.rsplit(":", 1)[1])
    ports = []
    with contextlib.suppress(psutil.Error):
        ports += [conn.laddr.port for conn in psutil.Process(served.proc.pid).net_connections(kind="tcp")
                  if conn.status == psutil.CONN_LISTEN and conn.laddr.port != http]
    return sorted(ports)


def _keyless(port: int, kind: int, frames: list[list[bytes]]) -> None:
    """A ZeroMQ socket without the cluster's keys sends `frames` to `port` (they must be refused or dropped)."""
    ctx = zmq.Context()
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 200)
    try:
        s.connect(f"tcp://{HOST}:{port}")
        for f in frames:
            with contextlib.suppress(zmq.ZMQError):
                s.send_multipart(f)
        time.sleep(0.3)
    finally:
        s.close(0)
        ctx.term()


def _peers(served: Served, c: httpx.Client, model: str) -> list[Outcome]:
    garbage = [[b"\xc1"], [os.urandom(64), os.urandom(64)], [b"{}"], [os.urandom(1 << 20)]]
    out = []
    hub = _coordinator_listeners(served)
    for port in hub:
        _keyless(port, zmq.DEALER, garbage)
    out.append(Outcome(f"keyless DEALER with garbage at the coordinator's hub ({len(hub)} port(s))",
                       "dropped; the server still serves", "served" if _serves(c, model) else "NOT served",
                       bool(hub) and _serves(c, model)))
    inboxes = worker_inboxes(served.proc.pid)
    for _, port in inboxes:
        _keyless(port, zmq.PUSH, garbage)
    ok = bool(inboxes) and _serves(c, model)
    out.append(Outcome(f"keyless PUSH with bad KV frames at the workers' inboxes ({len(inboxes)})",
                       "dropped; the server still serves", "served" if ok else "NOT served", ok))
    return out


# ---------------------------------------------------------------------------- workers
def _worker(served: Served, role: str) -> int | None:
    return next((pid for _, (r, pid) in sorted(served.workers().items()) if r == role), None)


def _dead_and_stopped(served: Served, c: httpx.Client, model: str) -> list[Outcome]:
    out = []
    pid = _worker(served, "prefill")
    if pid is None:
        return [Outcome("SIGKILL the prefill worker", "replaced", "no prefill worker found", False)]
    os.kill(pid, signal.SIGKILL)
    back = _wait(lambda: _worker(served, "prefill") not in (None, pid) and _serves(c, model, 5.0), BACK_WITHIN_S + 5)
    out.append(Outcome("SIGKILL the prefill worker", f"replaced and serving within {BACK_WITHIN_S:g} s",
                       "not back" if back is None else f"serving after {back:.1f} s",
                       back is not None and back <= BACK_WITHIN_S))
    pid = _worker(served, "decode")
    if pid is None:
        return out + [Outcome("SIGSTOP the decode worker", "declared dead, replaced", "no decode worker", False)]
    os.kill(pid, signal.SIGSTOP)
    try:
        back = _wait(lambda: _worker(served, "decode") not in (None, pid) and served.health() == 200,
                     WORKER_TIMEOUT_S + BACK_WITHIN_S + 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)              # fenced already (SIGKILL) when the server did its job
    ok = back is not None and back <= WORKER_TIMEOUT_S + BACK_WITHIN_S and _serves(c, model)
    out.append(Outcome(f"SIGSTOP the decode worker (--worker-timeout {WORKER_TIMEOUT_S:g} s)",
                       "declared dead after the timeout, fenced, replaced, serving",
                       "not back" if back is None else f"healthy after {back:.1f} s", ok))
    return out


# ---------------------------------------------------------------------------- Redis
@contextlib.contextmanager
def _redis(workdir: Path) -> Iterator[tuple[str, Callable[[], None], Callable[[], None]] | None]:
    """A private redis-server on a free port: (url, stop, start), or None when redis-server is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    procs: list[subprocess.Popen] = []

    def start() -> None:
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: _port_open(port), 5.0)

    def stop() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    start()
    try:
        yield f"redis://{HOST}:{port}/0", stop, start
    finally:
        stop()


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.2):
        return True
    return False


def _redis_blip(c: httpx.Client, model: str, stop: Callable[[], None], start: Callable[[], None]) -> Outcome:
    """Redis, the server's state store, goes away for a while under requests, then comes back."""
    stop()
    t0 = time.monotonic()
    answered = hung = 0
    while time.monotonic() - t0 < REDIS_DOWN_S:
        try:
            c.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=10)
            answered += 1
        except httpx.TimeoutException:
            hung += 1
    start()
    ok = hung == 0 and _wait(lambda: _serves(c, model, 5.0), 15.0) is not None
    return Outcome(f"Redis away for {REDIS_DOWN_S:g} s under requests", "every request answered; serving after",
                   f"{answered} answered, {hung} hung; {'serving' if ok else 'NOT serving'} after", ok)


def probe_known(ctx: ChaosContext) -> list[Outcome]:
    """Every known attack on one 1P+1D server whose state store is a private Redis."""
    out: list[Outcome] = []
    with _redis(ctx.workdir) as redis:
        state = ["--state", redis[0]] if redis is not None else []
        with serve_tiny(ctx.ar_model, ctx.workdir, ["--worker-timeout", str(WORKER_TIMEOUT_S), *state],
                        name="known") as served, httpx.Client(base_url=served.url, timeout=30) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            out += _http_cases(c, model)
            out.append(_unread_streams(served, c, model))
            out += _peers(served, c, model)
            out += _dead_and_stopped(served, c, model)
            out.append(_redis_blip(c, model, *redis[1:]) if redis is not None else
                       Outcome("Redis away under requests", "every request answered", "redis-server is not installed",
                               False))
    return out


PROBES = [probe_known]
