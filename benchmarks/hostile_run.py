"""Hostile-input run: a live `tandem serve` under bounded hostile input.

    python benchmarks/hostile_run.py [--out docs/results/hostile] [--duration-s 60] [--streams 200]
    python benchmarks/hostile_run.py --skip hostile,slow,frames      # one part alone: which part causes what
    python benchmarks/hostile_run.py --server-env MALLOC_MMAP_THRESHOLD_=131072   # an experiment on the server

What it checks: "a bounded hostile-input run (invalid and oversized bodies, out-of-range values,
malformed frames on every socket, 200 concurrent valid streams) leaves /health answering within 100 ms
throughout, every valid request answered, and coordinator memory back within 10% of its starting value".

What the run does (everything goes to 127.0.0.1 only, and every part is bounded in count and time):

1. writes a tiny random Qwen3 checkpoint (`tandem tiny-model --size 1m`) in a temporary directory and starts
   `tandem serve --prefill-workers 1 --decode-workers 1 --body-timeout S` on a free port (its output goes to
   <out>/server.log); waits for /health 200;
2. warms up with a few valid requests, lets the server settle and records the coordinator's RSS (psutil);
3. phase "baseline" (a few seconds, /health only), then phase "attack", in which these run at the same time:
   - a /health prober in its own process (a fresh TCP connection every ~20 ms, as a load balancer's probe; it
     runs for the whole run, so it sees every phase), each probe followed by one of a trivial HTTP server on a
     thread of the prober: the "control" latency is the machine's and the prober's own noise, so a slow /health
     probe with a fast control probe beside it is the server's doing;
   - hostile HTTP, in rounds until --duration-s: invalid JSON, non-object bodies, oversized bodies (a 12 MB chat
     body of 400k messages, 5M token ids, 1 MB of content, a 15 MB session id, ...), out-of-range values (seed
     2^70, top_k 2^64, stop_token_ids [2^64], negative max_tokens, temperature "NaN", ...), malformed HTTP. An
     application-level case passes when it gets its 4xx and an OpenAI error body {"error": {"message", "type",
     "param", "code"}} (the code named when the docs name one) of a few KB at most; an HTTP-level case (bytes
     that are not HTTP, a 15 MB header) passes on a 4xx or a closed connection. Anything else fails: a 5xx, a
     200, no answer within the case's timeout, a traceback in the body;
   - slow clients: --slowloris connections sending a header one byte every 0.5 s (pass: the server closes them
     within --slowloris-s), a body truncated and then left pending (pass: 408 after the body timeout), a body
     truncated and then half-closed (pass: a 4xx or a closed connection);
   - malformed frames on every TCP socket the coordinator and its workers listen on (found with psutil): raw
     garbage bytes, a ZeroMQ DEALER and a PUSH socket without CURVE keys sending b'\\xc1', random frames, a 1 MB
     frame and well-formed msgspec messages (a KVData with a wrong payload, a Shutdown, a Heartbeat) - in rounds
     until --duration-s. Pass: no worker process dies or restarts and the coordinator's control port never
     completes a handshake without keys;
   - --streams concurrent valid streaming chat requests (max_tokens 16; a third with a session_id body field, a
     third with an x-session-id header), in --max-waves waves spread over the attack. Each must answer 200 and
     end with a finish_reason and `data: [DONE]`;
4. phase "settle": once the attack is over and no request runs (/metrics), waits --settle-s and records the RSS
   again; then stops the server (SIGTERM, then SIGKILL) and checks that no process of it is left.

Output: a table on stdout (the conditions, then the sockets probed and every distinct failure: a slow /health
probe is listed with what was in flight then), <out>/results.json (the summary and each distinct failure),
<out>/raw.json (every probe, request and RSS sample), <out>/health.png (each probe's latency over time, phases
shaded, the 100 ms line, the coordinator's RSS on the right axis) and <out>/server.log. Acceptance conditions
(exit status 1 if one fails; each failing one is printed):

- every /health probe from the baseline on (the warm-up's first requests are shown, not counted) is a 200
  within 100 ms;
- every valid request (warm-up and streams) answered;
- the coordinator's RSS after the settle phase within 10% of the RSS before the baseline;
- every hostile input refused as above (slow clients included);
- every listening socket probed, no server process lost, tandem:workers_alive still 2, the coordinator's
  control port never accepting a keyless handshake;
- no "internal error" (a logged 500 with its traceback) in the server log;
- a clean stop: nothing of the server left once the coordinator exits after SIGTERM.

--skip leaves parts out and --server-env sets the server's environment: for finding causes, not for the
acceptance run (a skipped part's condition fails).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

import httpx
import psutil
import zmq
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from zmq.utils.monitor import recv_monitor_message

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tandem.server.http_protocol import HEADER_TIMEOUT_S  # noqa: E402
from tandem.bench.host import describe_host  # noqa: E402

HOST = "127.0.0.1"
PARTS = ("hostile", "slow", "frames", "streams")
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
HEALTH_LIMIT_S = 0.1
RSS_TOLERANCE = 0.10
MAX_ERROR_BODY = 4096          # an error body larger than this echoes the input
USER = [{"role": "user", "content": "hello"}]
console = Console()


# ---------------------------------------------------------------------------- configuration
@dataclass
class Config:
    """The run's bounds (all from the command line)."""

    out: Path
    duration_s: float = 60.0
    streams: int = 200
    max_waves: int = 3
    max_tokens: int = 16
    baseline_s: float = 3.0
    settle_s: float = 5.0
    probe_every_s: float = 0.02
    probe_timeout_s: float = 2.0
    body_timeout_s: float = 10.0
    slowloris: int = 16
    slowloris_s: float = 30.0
    hostile_concurrency: int = 4
    request_timeout_s: float = 30.0
    seed: int = 0
    client_nice: int = 0
    server_env: tuple[str, ...] = ()      # KEY=VALUE set for `tandem serve` (e.g. MALLOC_MMAP_THRESHOLD_=131072)
    skip: tuple[str, ...] = ()            # parts left out (to find which part causes what): PARTS


def parse_args(argv: list[str] | None) -> Config:
    """The Config from the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/hostile", help="output directory (default: reports/hostile)")
    p.add_argument("--duration-s", type=float, default=60.0, help="length of the attack phase (default: 60)")
    p.add_argument("--streams", type=int, default=200, help="concurrent valid streams per wave (default: 200)")
    p.add_argument("--max-waves", type=int, default=3, help="waves of streams, spread over the attack (default: 3)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each valid stream (default: 16)")
    p.add_argument("--settle-s", type=float, default=5.0, help="wait before the final RSS (default: 5)")
    p.add_argument("--body-timeout", type=float, default=10.0, help="the server's --body-timeout (default: 10)")
    p.add_argument("--slowloris", type=int, default=16, help="slowloris connections (default: 16)")
    p.add_argument("--slowloris-s", type=float, default=30.0,
                   help="a slowloris connection still open after this fails (default: 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for `tandem serve` (repeatable; for experiments)")
    p.add_argument("--client-nice", type=int, default=0,
                   help="lower this load generator's CPU priority by N once the server and the prober run (default: 0)")
    p.add_argument("--skip", default="", help=f"comma-separated parts to leave out, of {','.join(PARTS)} (to find "
                   "which part causes what; the conditions of a skipped part then fail)")
    a = p.parse_args(argv)
    skip = tuple(x for x in a.skip.split(",") if x)
    if set(skip) - set(PARTS):
        p.error(f"--skip: unknown part(s) {sorted(set(skip) - set(PARTS))}; parts: {', '.join(PARTS)}")
    return Config(out=Path(a.out), duration_s=a.duration_s, streams=a.streams, max_waves=a.max_waves,
                  max_tokens=a.max_tokens, settle_s=a.settle_s, body_timeout_s=a.body_timeout,
                  slowloris=a.slowloris, slowloris_s=a.slowloris_s, seed=a.seed, skip=skip,
                  client_nice=a.client_nice, server_env=tuple(a.server_env))


# ---------------------------------------------------------------------------- the server process
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when this benchmark dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def tandem_command() -> list[str]:
    """The `tandem` console script (its entry point is guarded, as multiprocessing's spawn needs)."""
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [shutil.which("tandem") or "tandem"]


def make_model(path: Path) -> None:
    """A tiny random Qwen3 checkpoint (about 1M parameters) at `path`."""
    subprocess.run([*tandem_command(), "tiny-model", "--arch", "qwen3", "--size", "1m", "--out", str(path)],
                   check=True, stdout=subprocess.DEVNULL)


class Server:
    """`tandem serve` 1P+1D as a subprocess: start, its processes, their sockets and memory, stop."""

    def __init__(self, model: Path, log: Path, body_timeout_s: float, env: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [*tandem_command(), "serve", "--model", str(model), "--prefill-workers", "1", "--decode-workers", "1",
               "--host", HOST, "--port", str(self.port), "--body-timeout", str(body_timeout_s)]
        self.command = " ".join([*env, "tandem", *cmd[1:]])
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **dict(kv.split("=", 1) for kv in env)},
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.ps = psutil.Process(self.proc.pid)
        self.known: dict[int, psutil.Process] = {self.proc.pid: self.ps}

    def wait_healthy(self, timeout_s: float = 180.0) -> float:
        """Poll /health until 200; the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode} (see the server log)")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.remember()
                    return time.monotonic() - t0
            time.sleep(0.25)
        raise RuntimeError(f"tandem serve did not answer /health within {timeout_s:.0f} s")

    def remember(self) -> dict[int, psutil.Process]:
        """The coordinator and its descendants now (also kept for the final clean-up)."""
        procs = {self.proc.pid: self.ps}
        with contextlib.suppress(psutil.Error):
            procs.update({c.pid: c for c in self.ps.children(recursive=True)})
        self.known.update(procs)
        return procs

    def rss(self) -> int:
        """The coordinator process's resident set size in bytes."""
        return self.ps.memory_info().rss

    def listeners(self) -> list[dict]:
        """Every TCP socket in LISTEN state of the coordinator and its descendants."""
        found = []
        for pid, p in sorted(self.remember().items()):
            with contextlib.suppress(psutil.Error):
                for c in p.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN:
                        role = "http" if c.laddr.port == self.port else (
                            "coordinator" if pid == self.proc.pid else "worker")
                        found.append({"pid": pid, "ip": c.laddr.ip, "port": c.laddr.port, "role": role})
        return found

    def alive_pids(self) -> set[int]:
        """Processes of the server (as first seen) still running."""
        alive = set()
        for pid, p in self.known.items():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
        return alive

    def stop(self, term_s: float = 10.0) -> dict:
        """SIGTERM the coordinator, SIGKILL it after `term_s`, then kill any of its processes still left."""
        self.remember()
        t0, how = time.monotonic(), "SIGTERM"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(term_s)
            except subprocess.TimeoutExpired:
                how = "SIGKILL"
                self.proc.kill()
                self.proc.wait(10)
        rest = [p for pid, p in self.known.items() if pid != self.proc.pid]
        _, alive = psutil.wait_procs(rest, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self._log.close()
        return {"signal": how, "exit_code": self.proc.returncode, "seconds": round(time.monotonic() - t0, 2),
                "left_over_killed": [p.pid for p in alive]}


# ---------------------------------------------------------------------------- the /health prober (own process)
def _probe_once(port: int, timeout_s: float) -> int:
    """One GET /health on a fresh connection; its HTTP status (0: no answer)."""
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        head = s.recv(64)
    m = re.match(rb"HTTP/1\.1 (\d{3})", head)
    return int(m.group(1)) if m else 0


def _control_server() -> int:
    """A trivial HTTP server on a thread of the prober: its latency is the machine's and the prober's own noise."""
    srv = socket.create_server((HOST, 0))

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def _timed_probe(port: int, timeout_s: float) -> tuple[float, float, int]:
    """(monotonic start, seconds, status) of one probe."""
    t = time.monotonic()
    try:
        status = _probe_once(port, timeout_s)
    except OSError:
        status = 0
    return t, time.monotonic() - t, status


def probe_health(port: int, every_s: float, timeout_s: float, stop, path: str) -> None:
    """Probe /health every `every_s` until `stop` is set, each followed by a probe of the control server; write
    [(monotonic start, seconds, status, control seconds)] to `path`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control, rows = _control_server(), []
    while not stop.is_set():
        t, took, status = _timed_probe(port, timeout_s)
        rows.append((t, took, status, _timed_probe(control, timeout_s)[1]))
        time.sleep(max(0.0, every_s - (time.monotonic() - t)))
    Path(path).write_text(json.dumps(rows))


class Prober:
    """The prober process: start, stop, its probes."""

    def __init__(self, cfg: Config, port: int, path: Path) -> None:
        ctx = mp.get_context("spawn")
        self.stop_event, self.path = ctx.Event(), path
        self.proc = ctx.Process(target=probe_health, daemon=True,
                                args=(port, cfg.probe_every_s, cfg.probe_timeout_s, self.stop_event, str(path)))
        self.proc.start()

    def stop(self) -> list[tuple[float, float, int, float]]:
        """Stop probing; every probe as (monotonic start, latency s, status, control latency s)."""
        self.stop_event.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        return [tuple(r) for r in json.loads(self.path.read_text())] if self.path.exists() else []


# ---------------------------------------------------------------------------- raw HTTP
@dataclass
class Reply:
    """What came back on one raw HTTP connection."""

    status: int | None
    body: bytes
    seconds: float
    closed: bool          # the server closed (or reset) the connection
    note: str = ""        # client-side errors (a reset while sending, a timeout)


def request_head(method: str, path: str, length: int | None, extra: bytes = b"") -> bytes:
    """An HTTP/1.1 request head (Connection: close)."""
    cl = b"" if length is None else b"Content-Length: %d\r\n" % length
    return (f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            "Connection: close\r\n").encode() + extra + cl + b"\r\n"


def parse_response(raw: bytes) -> tuple[int | None, bytes]:
    """(status, de-chunked body) of a raw HTTP/1.1 response; (None, b'') if there is none."""
    m = re.match(rb"HTTP/1\.[01] (\d{3})", raw)
    if not m:
        return None, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    if re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return int(m.group(1)), body


def _pump(s: socket.socket, data: bytes, deadline: float, half_close: bool) -> tuple[bytes, bool, list[str]]:
    """Send `data` while reading whatever comes back until EOF, a reset or `deadline`; (bytes, closed, notes)."""
    got, sent, sending, notes = bytearray(), 0, True, []
    while (left := deadline - time.monotonic()) > 0:
        readable, writable, _ = select.select([s], [s] if sending else [], [], min(left, 0.5))
        if readable:
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                chunk = None
            except ConnectionError as e:
                notes.append(f"{type(e).__name__} while reading")
                return bytes(got), True, notes
            if chunk == b"":
                return bytes(got), True, notes
            got += chunk or b""
            if len(got) > 1 << 20:
                return bytes(got), False, notes + ["response over 1 MB"]
        if writable:
            try:
                sent += s.send(data[sent:sent + (256 << 10)])
            except BlockingIOError:
                pass
            except ConnectionError as e:          # the server answered and closed early: read what it sent
                sending = False
                notes.append(f"{type(e).__name__} while sending")
            if sending and sent >= len(data):
                sending = False
                if half_close:
                    s.shutdown(socket.SHUT_WR)
    return bytes(got), False, notes + ["no answer within the timeout"]


def exchange_sync(port: int, data: bytes, timeout_s: float, half_close: bool = False) -> Reply:
    """Send `data` on a fresh connection while reading the answer (a server may answer before the body ends)."""
    t0 = time.monotonic()
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.setblocking(False)
        raw, closed, notes = _pump(s, data, t0 + timeout_s, half_close)
    status, body = parse_response(raw)
    return Reply(status, body, time.monotonic() - t0, closed, "; ".join(notes))


async def exchange(port: int, data: bytes, timeout_s: float, half_close: bool = False) -> Reply:
    """exchange_sync on a thread (blocking sockets read what a server sent before it reset the connection)."""
    return await asyncio.to_thread(exchange_sync, port, data, timeout_s, half_close)


# ---------------------------------------------------------------------------- hostile cases
@dataclass
class Case:
    """One hostile request and what must come back."""

    name: str
    build: Callable[[], bytes]              # the whole request (head + body), made once
    status: tuple[int, ...]                 # accepted statuses
    code: str | None = None                 # the error code the docs give (None: any)
    param: str | None = "-"                 # the error param the docs give ("-": any)
    http_level: bool = False                # refused below the app: a 4xx of any body or a closed connection
    half_close: bool = False
    timeout_s: float | None = None          # None: Config.request_timeout_s


def post(path: str, body: bytes | dict, extra: bytes = b"", length: int | None = None) -> bytes:
    """A whole POST request: head + JSON body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request_head("POST", path, len(data) if length is None else length, extra) + data


def chat(**fields) -> dict:
    """A small chat body with `fields` added."""
    return {"messages": USER, "max_tokens": 2, **fields}


def comp(**fields) -> dict:
    """A small completions body with `fields` added."""
    return {"prompt": "hello", "max_tokens": 2, **fields}


@cache
def big_text(n: int) -> str:
    """About `n` characters of prose."""
    unit = "hello world, this is text "
    return unit * (n // len(unit) + 1)


def _out_of_range() -> list[Case]:
    """Out-of-range and wrong-typed values on both endpoints (docs/server.md, Errors)."""
    values = [("seed", 2 ** 70, "invalid_value"), ("seed", -(2 ** 70), "invalid_value"),
              ("top_k", 2 ** 64, "invalid_value"), ("stop_token_ids", [2 ** 64], "invalid_value"),
              ("min_tokens", 2 ** 70, "invalid_value"), ("max_tokens", 2 ** 70, "context_length_exceeded"),
              ("max_tokens", -1, "invalid_value"), ("temperature", "NaN", "invalid_value"),
              ("temperature", 10 ** 400, "invalid_value"), ("top_p", 2 ** 70, "invalid_value"),
              ("top_p", -0.5, "invalid_value"), ("presence_penalty", "Infinity", "invalid_value"),
              ("n", 2 ** 70, "invalid_value"), ("logprobs", 2 ** 70, None)]
    cases = []
    for path, make in ((CHAT, chat), (COMP, comp)):
        short = "chat" if path == CHAT else "comp"
        for name, value, code in values:
            body = make(**{name: value})
            cases.append(Case(f"{short} {name}={str(value)[:12]}", lambda p=path, b=body: post(p, b), (400,), code,
                              name))
    cases += [
        Case("chat max_completion_tokens=2^70", lambda: post(CHAT, {"messages": USER, "max_completion_tokens": 2 ** 70}),
             (400,), None, "max_completion_tokens"),
        Case("chat top_logprobs=2^70", lambda: post(CHAT, chat(logprobs=True, top_logprobs=2 ** 70)), (400,), None,
             "top_logprobs"),
        Case("comp best_of=2^70", lambda: post(COMP, comp(best_of=2 ** 70)), (400,), None, "best_of"),
        Case("chat temperature NaN literal", lambda: post(CHAT, b'{"messages": [{"role": "user", "content": "hi"}],'
                                                               b' "temperature": NaN}'), (400,)),
        Case("chat max_tokens of 100k digits", lambda: post(CHAT, b'{"messages": [], "max_tokens": ' + b"9" * 100_000
                                                          + b"}"), (400,)),
        Case("chat role robot", lambda: post(CHAT, {"messages": [{"role": "robot", "content": "x"}]}), (400,)),
        Case("chat messages a string", lambda: post(CHAT, {"messages": "hello"}), (400,), "invalid_value"),
        Case("chat content a number", lambda: post(CHAT, {"messages": [{"role": "user", "content": 42}]}), (400,)),
        Case("chat stop a number", lambda: post(CHAT, chat(stop=7)), (400,)),
        Case("chat unknown model", lambda: post(CHAT, chat(model="no-such-model")), (404,), "model_not_found", "model"),
    ]
    return cases


def _bodies() -> list[Case]:
    """Invalid, non-object and oversized bodies."""
    many = [{"role": "user", "content": "x"}]
    return [
        Case("invalid JSON", lambda: post(CHAT, b'{"messages": ['), (400,), "invalid_json"),
        Case("empty body", lambda: post(CHAT, b""), (400,), "invalid_json"),
        Case("not UTF-8", lambda: post(CHAT, b'\xff\xfe{"a": 1}'), (400,), "invalid_json"),
        Case("body an array", lambda: post(CHAT, b"[1, 2, 3]"), (400,)),
        Case("body a string", lambda: post(COMP, b'"hello"'), (400,)),
        Case("body a number", lambda: post(CHAT, b"42"), (400,)),
        Case("body null", lambda: post(COMP, b"null"), (400,)),
        Case("deep nesting 30k (on loop)", lambda: post(CHAT, b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"),
             (400,)),
        Case("deep nesting 200k (off loop)", lambda: post(CHAT, b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000
                                                          + b"}"), (400,)),
        Case("chat 400k messages, 12 MB", lambda: post(CHAT, {"messages": many * 400_000}), (413,),
             "request_too_large"),
        Case("chat 240k messages, under the cap", lambda: post(CHAT, {"messages": many * 240_000}), (400,),
             "invalid_value"),
        Case("comp 5M token ids", lambda: post(COMP, b'{"prompt": [' + b",".join([b"1"] * 5_000_000) + b"]}"),
             (413,), "request_too_large"),
        Case("comp 2M token ids, under the cap", lambda: post(COMP, b'{"prompt": [' + b",".join([b"1"] * 2_000_000)
                                                              + b"]}"), (400,), "invalid_value"),
        Case("chat 1 MB of content", lambda: post(CHAT, chat(messages=[{"role": "user", "content": big_text(1 << 20)}])),
             (400,), "context_length_exceeded", "messages"),
        Case("comp 1 MB prompt", lambda: post(COMP, comp(prompt=big_text(1 << 20))), (400,),
             "context_length_exceeded", "prompt"),
        Case("session_id 15 MB", lambda: post(CHAT, chat(session_id="s" * (15 << 20))), (413,), "request_too_large"),
        Case("session_id 100 kB", lambda: post(COMP, comp(session_id="s" * 100_000)), (400,), "invalid_value",
             "session_id"),
        Case("x-session-id 300 chars", lambda: post(COMP, comp(), b"x-session-id: " + b"h" * 300 + b"\r\n"), (400,),
             "invalid_value", "session_id"),
        Case("session_id not printable", lambda: post(CHAT, chat(session_id="a\x01b")), (400,), "invalid_value",
             "session_id"),
        Case("Content-Length 100 GB", lambda: post(CHAT, b"{}", length=100 << 30), (413,), "request_too_large"),
        Case("GET on a POST route", lambda: request_head("GET", CHAT, None), (405,), "method_not_allowed"),
        Case("unknown route", lambda: post("/v1/nothing-here", chat()), (404,), "not_found"),
        Case("truncated body, then EOF", lambda: post(CHAT, b'{"messages": [', length=1000), (400, 408),
             half_close=True, http_level=True, timeout_s=10.0),
    ]


def _http_level() -> list[Case]:
    """Bytes below the app: uvicorn refuses them (a 4xx of its own, or a close)."""
    rng = random.Random(7)
    return [
        Case("garbage bytes on the HTTP port", lambda: bytes(rng.randrange(256) for _ in range(4096)), (400,),
             http_level=True, timeout_s=HEADER_TIMEOUT_S + 5.0),     # no line end: closed at the head deadline
        Case("garbage lines on the HTTP port", lambda: b"\x00\xff garbage\r\n" * 200 + b"\r\n", (400,),
             http_level=True, timeout_s=10.0),
        Case("x-session-id header 15 MB", lambda: post(COMP, comp(), b"x-session-id: " + b"s" * (15 << 20) + b"\r\n"),
             (400, 413, 431), http_level=True),
        Case("Content-Length -1", lambda: post(CHAT, b"{}", length=-1), (400,), http_level=True),
    ]


def hostile_cases() -> list[Case]:
    """Every case of a round."""
    return _bodies() + _out_of_range() + _http_level()


def judge(case: Case, r: Reply) -> str:
    """'' if `r` is what `case` must get, else why not."""
    if r.status is None:
        ok = case.http_level and r.closed
        return "" if ok else f"no HTTP response ({r.note or 'connection open'})"
    if r.status not in case.status:
        return f"status {r.status}, expected {'/'.join(map(str, case.status))}: {r.body[:200]!r}"
    if b"Traceback" in r.body:
        return "traceback in the body"
    if case.http_level:
        return ""
    return _judge_error_body(case, r.body)


def _judge_error_body(case: Case, body: bytes) -> str:
    """'' if `body` is a small OpenAI error body with the case's code and param."""
    if len(body) > MAX_ERROR_BODY:
        return f"error body of {len(body)} bytes (echoes the input?)"
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {body[:200]!r}"
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err) if isinstance(err, dict) else type(err).__name__}"
    if err["type"] != "invalid_request_error":
        return f"type {err['type']!r}"
    if case.code is not None and err["code"] != case.code:
        return f"code {err['code']!r}, expected {case.code!r}"
    if case.param != "-" and err["param"] != case.param:
        return f"param {err['param']!r}, expected {case.param!r}"
    return ""


# ---------------------------------------------------------------------------- results collected while running
@dataclass
class Results:
    """Everything the attack records."""

    hostile: list[dict] = field(default_factory=list)       # {case, status, seconds, failure}
    slow: list[dict] = field(default_factory=list)          # slowloris and pending-body outcomes
    frames: list[dict] = field(default_factory=list)        # {port, role, probe, outcome}
    streams: list[dict] = field(default_factory=list)       # {wave, ok, failure, seconds}
    rss: list[tuple[float, int]] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    warmup_failures: list[str] = field(default_factory=list)


def build_cases() -> list[tuple[Case, bytes]]:
    """Every hostile case with its request bytes (made before the run: 70 MB of bodies take seconds of CPU)."""
    return [(c, c.build()) for c in hostile_cases()]


async def run_hostile(cfg: Config, port: int, cases: list[tuple[Case, bytes]], res: Results, deadline: float,
                      tick: Callable[[], None]) -> None:
    """Rounds of every hostile case (`hostile_concurrency` at a time) until `deadline`, at least one round."""
    gate = asyncio.Semaphore(cfg.hostile_concurrency)

    async def one(c: Case, data: bytes, rnd: int) -> None:
        async with gate:
            t = time.monotonic()
            try:
                r = await exchange(port, data, c.timeout_s or cfg.request_timeout_s, c.half_close)
                why = judge(c, r)
            except OSError as e:
                r, why = Reply(None, b"", 0.0, False, repr(e)), f"could not connect: {e!r}"
            res.hostile.append({"case": c.name, "round": rnd, "status": r.status, "seconds": round(r.seconds, 4),
                                "start": t, "end": time.monotonic(), "note": r.note, "failure": why})
            tick()

    rnd = 0
    while rnd == 0 or time.monotonic() < deadline:
        order = cases[:]
        random.Random(cfg.seed + rnd).shuffle(order)
        await asyncio.gather(*(one(c, data, rnd) for c, data in order))
        rnd += 1


async def slowloris(cfg: Config, port: int, i: int) -> dict:
    """One connection sending a never-ending header one byte every 0.5 s; closed by the server in time?"""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as e:
        return {"client": f"slowloris {i}", "outcome": repr(e), "seconds": 0.0, "failure": f"could not connect: {e!r}"}
    writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}\r\nX-Slow-{i}: ".encode())
    outcome = f"still open after {cfg.slowloris_s:.0f} s"
    try:
        while time.monotonic() - t0 < cfg.slowloris_s:
            writer.write(b"a")
            await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(reader.read(4096), 0.5) == b"":
                    outcome = "closed by the server"
                    break
                outcome = "answered"
                break
    except ConnectionError:
        outcome = "closed by the server"
    finally:
        writer.close()
    secs = time.monotonic() - t0
    ok = outcome == "closed by the server"
    return {"client": f"slowloris {i}", "outcome": outcome, "seconds": round(secs, 2),
            "failure": "" if ok else f"slowloris connection {outcome} (no header timeout)"}


async def pending_body(cfg: Config, port: int) -> dict:
    """A body that stops half way and stays pending: a 408 after the server's body timeout."""
    case = Case("truncated body, left pending", lambda: b"", (408,), "request_timeout")
    try:
        r = await exchange(port, post(CHAT, b'{"messages": [', length=1000), cfg.body_timeout_s + 10)
    except OSError as e:
        r = Reply(None, b"", 0.0, False, f"could not connect: {e!r}")
    return {"client": case.name, "outcome": f"{r.status} after {r.seconds:.1f} s" if r.status else r.note,
            "seconds": round(r.seconds, 2), "failure": judge(case, r)}


async def run_slow(cfg: Config, port: int, res: Results) -> None:
    """The slowloris connections and the pending body, all at once."""
    jobs = [slowloris(cfg, port, i) for i in range(cfg.slowloris)] + [pending_body(cfg, port)]
    res.slow.extend(await asyncio.gather(*jobs))


# ---------------------------------------------------------------------------- malformed frames
def valid_looking_frames() -> list[list[bytes]]:
    """Well-formed msgspec messages of the runtime's codec that no one should accept from a stranger."""
    import msgspec

    from tandem.runtime import messages as m
    from tandem.runtime.transport import Heartbeat, Ready, Shutdown
    enc = msgspec.msgpack.encode
    kv = m.KVData(request_id="hostile-run", purpose="incremental", src_worker=0, num_tokens=4, dtype="float32",
                  shape=[2, 4, 2, 48], sent_s=0.0)
    return [[enc(kv), b"\x00" * 100], [enc(kv)], [enc(Shutdown(reason="hostile run"))], [enc(Heartbeat())],
            [enc(Ready(info={"kv_address": "tcp://127.0.0.1:1"}))]]


def fuzz_frames(rng: random.Random) -> list[list[bytes]]:
    """b'\\xc1', random frames, a 1 MB frame, and the valid-looking ones."""
    rand = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(4)]
    return [[b"\xc1"], [rand[0]], rand[1:], [os.urandom(1 << 20)], *valid_looking_frames()]


def _wait_handshake(mon: zmq.Socket, timeout_s: float) -> str:
    """Watch a socket monitor until the handshake succeeds or fails; an outcome word."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if mon.poll(50):
            ev = zmq.Event(recv_monitor_message(mon)["event"])
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "accepted"
            if ev.name.startswith("HANDSHAKE_FAILED"):
                return f"handshake refused ({ev.name.lower()})"
            if ev == zmq.EVENT_DISCONNECTED:
                return "disconnected (socket types do not match)"
    return f"no handshake within {timeout_s:.0f} s"


def zmq_probe(ctx: zmq.Context, port: int, kind: int, frames: list[list[bytes]]) -> str:
    """Connect a keyless ZeroMQ socket of `kind`, send `frames` if it gets through; the outcome."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 500)
    s.setsockopt(zmq.RECONNECT_IVL, -1)
    mon = s.get_monitor_socket()
    try:
        s.connect(f"tcp://{HOST}:{port}")
        outcome = _wait_handshake(mon, 2.0)
        if outcome == "accepted":
            sent = 0
            for f in frames:
                with contextlib.suppress(zmq.Again):
                    s.send_multipart(f, flags=zmq.NOBLOCK)
                    sent += 1
            outcome = f"accepted; {sent} messages sent"
    finally:
        s.disable_monitor()
        mon.close()
        s.close()
    return outcome


def garbage_probe(port: int, rng: random.Random) -> str:
    """4 KB of random bytes on a raw TCP connection; what the peer did within 2 s."""
    got, end = b"", "closed by the server"
    try:
        with socket.create_connection((HOST, port), timeout=2) as s:
            s.sendall(bytes(rng.randrange(256) for _ in range(4096)))
            while chunk := s.recv(4096):
                got += chunk
    except socket.timeout:
        end = "left open"
    except ConnectionError:
        end = "reset by the server"
    except OSError as e:
        return f"refused ({e.strerror})"
    if got.startswith(b"\xff") and len(got) >= 10 and got[9] == 0x7F:
        return f"ZMTP greeting, then {end}"
    return f"{'HTTP ' + got[9:12].decode() if got.startswith(b'HTTP/1.1 ') else 'no answer' if not got else 'bytes'}, {end}"


def probe_port(ctx: zmq.Context, sock: dict, rng: random.Random) -> list[dict]:
    """Every malformed-frame probe on one listening socket."""
    frames = fuzz_frames(rng)
    out = [{"probe": "raw garbage", "outcome": garbage_probe(sock["port"], rng)}]
    for name, kind in (("zmq DEALER", zmq.DEALER), ("zmq PUSH", zmq.PUSH)):
        out.append({"probe": name, "outcome": zmq_probe(ctx, sock["port"], kind, frames)})
    return [{**sock, **o} for o in out]


async def run_frames(sockets: list[dict], res: Results, deadline: float, seed: int,
                     tick: Callable[[], None]) -> None:
    """Rounds of probes on every socket until `deadline` (at least one), each round 1 s apart."""
    ctx, rng, rnd = zmq.Context(), random.Random(seed), 0
    try:
        while rnd == 0 or time.monotonic() < deadline:
            for sock in sockets:
                t = time.monotonic()
                rows = await asyncio.to_thread(probe_port, ctx, sock, rng)
                for row in rows:
                    res.frames.append({**row, "round": rnd, "start": t, "end": time.monotonic()})
                    tick()
            rnd += 1
            await asyncio.sleep(1.0)
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------------- valid streams
def stream_request(i: int, wave: int, model: str, max_tokens: int) -> tuple[dict, dict]:
    """Body and headers of valid stream `i`: a third with session_id, a third with x-session-id, a third none."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "messages": [{"role": "user", "content": f"stream {i} of wave {wave}: tell me something"}]}
    headers = {}
    if i % 3 == 0:
        body["session_id"] = f"hostile-run-w{wave}-s{i}"
    elif i % 3 == 1:
        headers["x-session-id"] = f"hostile-run-w{wave}-h{i}"
    return body, headers


async def one_stream(client: httpx.AsyncClient, body: dict, headers: dict) -> str:
    """Run one valid stream; '' if it ended with a finish_reason and [DONE], else why not."""
    finish, done = None, False
    async with client.stream("POST", CHAT, json=body, headers=headers) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"error event: {json.dumps(chunk)[:200]}"
            finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
    return "" if finish and done else f"ended without {'a finish_reason' if not finish else '[DONE]'}"


async def run_wave(url: str, cfg: Config, model: str, wave: int, res: Results, tick: Callable[[], None]) -> None:
    """`cfg.streams` valid streams at once."""
    limits = httpx.Limits(max_connections=cfg.streams + 8, max_keepalive_connections=cfg.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def go(i: int) -> None:
            t0 = time.monotonic()
            try:
                why = await one_stream(client, *stream_request(i, wave, model, cfg.max_tokens))
            except (httpx.HTTPError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            res.streams.append({"wave": wave, "i": i, "seconds": round(time.monotonic() - t0, 3), "start": t0,
                                "end": time.monotonic(), "failure": why})
            tick()
        await asyncio.gather(*(go(i) for i in range(cfg.streams)))


async def run_streams(url: str, cfg: Config, model: str, res: Results, deadline: float,
                      tick: Callable[[], None]) -> None:
    """`max_waves` waves of valid streams spread over the attack (wave k starts at k/max_waves of it, or when
    wave k-1 ends if later); at least one, none started after `deadline`."""
    start = time.monotonic()
    for wave in range(cfg.max_waves):
        slot = start + wave * (deadline - start) / cfg.max_waves
        await asyncio.sleep(max(0.0, slot - time.monotonic()))
        if wave and time.monotonic() >= deadline:
            break
        await run_wave(url, cfg, model, wave, res, tick)


# ---------------------------------------------------------------------------- the run
async def warm_up(url: str, model: str, res: Results) -> None:
    """A few valid requests, streaming and not, with and without a session."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for i in range(6):
            body, headers = stream_request(i, -1, model, 8)
            if i % 2:
                why = await one_stream(c, body, headers)
            else:
                r = await c.post(CHAT, json={**body, "stream": False}, headers=headers)
                why = "" if r.status_code == 200 else f"status {r.status_code}"
            if why:
                res.warmup_failures.append(why)


async def sample_rss(server: Server, res: Results, stop: asyncio.Event) -> None:
    """The coordinator's RSS every 0.5 s until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            res.rss.append((time.monotonic(), server.rss()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until /metrics shows no running or waiting request."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        while time.monotonic() - t0 < timeout_s:
            text = (await c.get("/metrics")).text
            busy = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", text, re.M)
            if busy and all(float(v) == 0 for v in busy):
                return
            await asyncio.sleep(0.25)


def progress_bar() -> Progress:
    """The live progress display."""
    return Progress(TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), console=console, transient=False)


async def attack(server: Server, cfg: Config, model: str, sockets: list[dict], cases: list[tuple[Case, bytes]],
                 res: Results) -> None:
    """Phase "attack": hostile HTTP, slow clients, frames and valid streams together, with a progress bar."""
    deadline = time.monotonic() + cfg.duration_s
    with progress_bar() as bar:
        t_time = bar.add_task("attack", total=cfg.duration_s, info="")
        t_http = bar.add_task("hostile HTTP", total=None, info="0")
        t_frames = bar.add_task("malformed frames", total=None, info="0")
        t_streams = bar.add_task("valid streams", total=None, info="0")

        def ticker(task, rows: list) -> Callable[[], None]:
            def tick() -> None:
                bad = sum(bool(r.get("failure")) for r in rows)
                bar.update(task, advance=1, info=f"{len(rows)}" + (f" ({bad} failed)" if bad else ""))
            return tick

        async def clock() -> None:
            while time.monotonic() < deadline:
                bar.update(t_time, completed=cfg.duration_s - (deadline - time.monotonic()))
                await asyncio.sleep(0.25)
            bar.update(t_time, completed=cfg.duration_s)

        parts = {"hostile": lambda: run_hostile(cfg, server.port, cases, res, deadline, ticker(t_http, res.hostile)),
                 "slow": lambda: run_slow(cfg, server.port, res),
                 "frames": lambda: run_frames(sockets, res, deadline, cfg.seed, ticker(t_frames, res.frames)),
                 "streams": lambda: run_streams(server.url, cfg, model, res, deadline, ticker(t_streams, res.streams))}
        await asyncio.gather(clock(), *(run() for name, run in parts.items() if name not in cfg.skip))


async def session(server: Server, cfg: Config, cases: list[tuple[Case, bytes]], res: Results,
                  prober_pid: int) -> dict:
    """Warm-up, start RSS, baseline, attack, settle, end RSS; the facts measured around the phases."""
    t = time.monotonic()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    await warm_up(server.url, model, res)
    await wait_idle(server.url)
    await asyncio.sleep(2.0)
    res.phases.append(("warm-up", t, time.monotonic()))
    facts = {"rss_start": server.rss(), "model": model}
    sockets = server.listeners()
    pids_before = server.alive_pids()
    watched = cpu_watch(server, prober_pid)
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_rss(server, res, stop))
    t = time.monotonic()
    await asyncio.sleep(cfg.baseline_s)
    res.phases.append(("baseline", t, time.monotonic()))
    t, cpu0 = time.monotonic(), cpu_seconds(watched)
    await attack(server, cfg, model, sockets, cases, res)
    res.phases.append(("attack", t, time.monotonic()))
    facts["cpu_during_attack"] = cpu_share(cpu0, cpu_seconds(watched), time.monotonic() - t)
    facts["load_avg_after_attack"] = os.getloadavg()
    t = time.monotonic()
    await wait_idle(server.url)
    await asyncio.sleep(cfg.settle_s)
    facts["rss_end"] = server.rss()
    res.phases.append(("settle", t, time.monotonic()))
    stop.set()
    await sampler
    facts.update(sockets=sockets, pids_before=sorted(pids_before), pids_after=sorted(server.alive_pids()),
                 workers_alive=await workers_alive(server.url))
    return facts


def cpu_watch(server: Server, prober_pid: int) -> dict[str, psutil.Process]:
    """The processes whose CPU time the run reports: the server's, this load generator and the prober."""
    procs = {"coordinator": server.ps}
    for pid, p in sorted(server.remember().items()):
        with contextlib.suppress(psutil.Error):
            if pid != server.proc.pid and "resource_tracker" not in " ".join(p.cmdline()):
                procs[f"worker {pid}"] = p
    return {**procs, "load generator (this script)": psutil.Process(), "/health prober": psutil.Process(prober_pid)}


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """User + system CPU seconds of each process so far."""
    out = {}
    for name, p in procs.items():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[name] = t.user + t.system
    return out


def cpu_share(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores used by each process between two readings."""
    return {k: round((after[k] - before[k]) / wall_s, 3) for k in after if k in before}


async def workers_alive(url: str) -> float | None:
    """tandem:workers_alive from /metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        m = re.search(r"^tandem:workers_alive\{[^}]*\} (\S+)", (await c.get("/metrics")).text, re.M)
    return float(m.group(1)) if m else None


# ---------------------------------------------------------------------------- summary and conditions
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))] if s else float("nan")


def in_flight(res: Results, a: float, b: float) -> str:
    """What the attack had in flight between monotonic times a and b (hostile cases by name, streams by count)."""
    cases = Counter(h["case"] for h in res.hostile if h["start"] <= b and h["end"] >= a)
    streams = sum(1 for r in res.streams if r["start"] <= b and r["end"] >= a)
    ports = sorted({f"{r['role']} {r['port']}" for r in res.frames if r["start"] <= b and r["end"] >= a})
    return ", ".join([f"{n} x{k}" if k > 1 else n for n, k in cases.most_common(6)] + [f"{streams} valid streams"]
                     + [f"frames on {p}" for p in ports])


def health_summary(probes: list[tuple[float, float, int, float]], res: Results, t0: float) -> dict:
    """Latency figures of the /health probes from the baseline on (the warm-up apart), the slow or failed ones
    with what was in flight."""
    start = next((a for name, a, _ in res.phases if name == "baseline"), t0)
    warm = [p[1] for p in probes if p[0] < start]
    probes = [p for p in probes if p[0] >= start]
    lat = [p[1] for p in probes]
    bad = [p for p in probes if p[2] != 200 or p[1] >= HEALTH_LIMIT_S]
    return {"probes": len(probes), "max_ms": round(max(lat) * 1e3, 2) if lat else None,
            "p50_ms": round(percentile(lat, 50) * 1e3, 2), "p99_ms": round(percentile(lat, 99) * 1e3, 2),
            "over_100ms": sum(p[1] >= HEALTH_LIMIT_S for p in probes), "not_200": sum(p[2] != 200 for p in probes),
            "warmup": {"probes": len(warm), "max_ms": round(max(warm, default=0.0) * 1e3, 2),
                       "over_100ms": sum(x >= HEALTH_LIMIT_S for x in warm)},
            "control": {"max_ms": round(max((p[3] for p in probes), default=0.0) * 1e3, 2),
                        "p99_ms": round(percentile([p[3] for p in probes], 99) * 1e3, 2),
                        "over_100ms": sum(p[3] >= HEALTH_LIMIT_S for p in probes)},
            "bad": [{"t_s": round(p[0] - t0, 3), "ms": round(p[1] * 1e3, 1), "status": p[2],
                     "control_ms": round(p[3] * 1e3, 1), "in_flight": in_flight(res, p[0], p[0] + p[1])}
                    for p in bad][:50]}


def server_log_summary(log: Path) -> dict:
    """Tracebacks, internal errors and the readers' drop tallies in the server log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    drops: dict[str, int] = {}
    for where, n in re.findall(r"^(.+?): dropped .*; (\d+) dropped in all$", text, re.M):
        drops[where] = max(drops.get(where, 0), int(n))
    errors = Counter(re.findall(r"^(\w[\w.]*(?:Error|Exception|Disconnect)\b.*)$", text, re.M))
    return {"tracebacks": text.count("Traceback (most recent call last)"),
            "internal_errors": Counter(re.findall(r"^internal error on (.+)$", text, re.M)),
            "exceptions": dict(errors.most_common(10)), "drops_at_least": drops}


def frames_summary(rows: list[dict]) -> list[dict]:
    """Per socket and probe: the outcomes seen and how often."""
    out: dict[tuple, Counter] = {}
    for r in rows:
        out.setdefault((r["port"], r["role"], r["pid"], r["probe"]), Counter())[r["outcome"]] += 1
    return [{"port": k[0], "role": k[1], "pid": k[2], "probe": k[3], "outcomes": dict(v)} for k, v in out.items()]


def frame_failures(rows: list[dict]) -> list[str]:
    """The coordinator's control port must never accept a keyless ZeroMQ handshake."""
    return sorted({f"port {r['port']} ({r['role']}): {r['probe']} {r['outcome']}" for r in rows
                   if r["role"] == "coordinator" and r["outcome"].startswith("accepted")})


def summarize(cfg: Config, res: Results, probes: list, facts: dict, stop: dict, log: dict, t0: float) -> dict:
    """Everything that results.json holds."""
    statuses = Counter(str(h["status"]) for h in res.hostile)
    hostile_bad = [h for h in res.hostile if h["failure"]] + [s for s in res.slow if s["failure"]]
    valid_bad = [s for s in res.streams if s["failure"]]
    rss0, rss1 = facts["rss_start"], facts["rss_end"]
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "health": health_summary(probes, res, t0),
        "valid": {"answered": len(res.streams) - len(valid_bad), "sent": len(res.streams),
                  "waves": len({s["wave"] for s in res.streams}), "warmup_failures": res.warmup_failures,
                  "failures": valid_bad[:50], "p50_s": round(percentile([s["seconds"] for s in res.streams], 50), 3),
                  "max_s": round(max((s["seconds"] for s in res.streams), default=0.0), 3)},
        "hostile": {"requests": len(res.hostile), "rounds": len({h["round"] for h in res.hostile}),
                    "by_status": dict(sorted(statuses.items())), "failed": len(hostile_bad),
                    "failures": _dedupe(hostile_bad), "slow_clients": res.slow,
                    "reset_while_sending": dict(Counter(h["case"] for h in res.hostile if "while sending" in h["note"]))},
        "sockets": {"listening": facts["sockets"], "probes": len(res.frames), "by_probe": frames_summary(res.frames),
                    "failures": frame_failures(res.frames), "pids_before": facts["pids_before"],
                    "pids_after": facts["pids_after"], "workers_alive": facts["workers_alive"]},
        "rss": {"start_mb": round(rss0 / 2 ** 20, 1), "end_mb": round(rss1 / 2 ** 20, 1),
                "peak_mb": round(max((r[1] for r in res.rss), default=rss1) / 2 ** 20, 1), "ratio": round(rss1 / rss0, 4)},
        "shutdown": stop, "server_log": log, "cpu_cores_during_attack": facts["cpu_during_attack"],
        "load_avg_after_attack": facts["load_avg_after_attack"],
        "phases": [{"name": n, "from_s": round(a - t0, 2), "to_s": round(b - t0, 2)} for n, a, b in res.phases],
    }


def _dedupe(rows: list[dict]) -> list[dict]:
    """Failures grouped by case (or client) and reason, with a count (monotonic times left out)."""
    seen: Counter = Counter()
    first: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("case") or r.get("client", "").split(" ")[0], r["failure"][:160])
        seen[key] += 1
        first.setdefault(key, r)
    drop = ("start", "end", "round")
    return [{**{k2: v for k2, v in first[k].items() if k2 not in drop}, "count": n} for k, n in seen.items()]


def conditions(s: dict) -> list[tuple[str, bool, str]]:
    """(condition, met, detail) for each acceptance condition."""
    h, v, hs, so, r, st = s["health"], s["valid"], s["hostile"], s["sockets"], s["rss"], s["shutdown"]
    lost = sorted(set(so["pids_before"]) - set(so["pids_after"]))
    return [
        ("/health within 100 ms throughout", h["over_100ms"] == 0 and h["not_200"] == 0 and h["probes"] > 0,
         f"{h['probes']} probes, max {h['max_ms']} ms, {h['over_100ms']} over 100 ms, {h['not_200']} not 200"),
        ("every valid request answered", v["answered"] == v["sent"] and v["sent"] > 0 and not v["warmup_failures"],
         f"{v['answered']}/{v['sent']} streams in {v['waves']} wave(s)"),
        ("coordinator RSS back within 10%", abs(r["ratio"] - 1) <= RSS_TOLERANCE,
         f"{r['start_mb']} -> {r['end_mb']} MB (x{r['ratio']}, peak {r['peak_mb']} MB)"),
        ("every hostile input refused properly", hs["failed"] == 0,
         f"{hs['requests']} requests + {len(hs['slow_clients'])} slow clients, {hs['failed']} wrong"),
        ("every socket probed, cluster intact", not so["failures"] and not lost and so["probes"] > 0
         and so["workers_alive"] == 2, f"{len(so['listening'])} sockets, {so['probes']} probes, "
         f"lost pids {lost or 'none'}, workers_alive {so['workers_alive']}" +
         (f"; {'; '.join(so['failures'])}" if so["failures"] else "")),
        ("no internal error in the server log", not s["server_log"]["internal_errors"],
         f"{s['server_log']['tracebacks']} tracebacks, internal errors "
         f"{dict(s['server_log']['internal_errors']) or 'none'}"),
        ("clean stop, nothing left over", not st["left_over_killed"],
         f"{st['signal']}, exit {st['exit_code']} in {st['seconds']} s, left over {st['left_over_killed'] or 'none'}"),
    ]


# ---------------------------------------------------------------------------- output
def print_report(s: dict, conds: list[tuple[str, bool, str]]) -> None:
    """The rich tables: acceptance conditions, hostile statuses, sockets, failures."""
    t = Table(title="Hostile-input run")
    for col in ("condition", "result", "measured"):
        t.add_column(col)
    for name, ok, detail in conds:
        t.add_row(name, "[green]pass[/]" if ok else "[red]FAIL[/]", detail)
    h = s["health"]
    t.add_row("  /health latency", "", f"p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, max {h['max_ms']} ms; "
              f"warm-up (not counted): max {h['warmup']['max_ms']} ms, {h['warmup']['over_100ms']} over 100 ms")
    c = h["control"]
    t.add_row("  control probe (no server)", "", f"p99 {c['p99_ms']} ms, max {c['max_ms']} ms, {c['over_100ms']} over "
              "100 ms: the machine's and the prober's own noise")
    t.add_row("  hostile by status", "", ", ".join(f"{k}: {v}" for k, v in s["hostile"]["by_status"].items()))
    console.print(t)
    sockets = Table(title="Sockets probed (outcomes over all rounds)")
    for col in ("port", "role", "probe", "outcomes"):
        sockets.add_column(col)
    for row in s["sockets"]["by_probe"]:
        sockets.add_row(str(row["port"]), row["role"], row["probe"],
                        ", ".join(f"{k} x{n}" for k, n in row["outcomes"].items()))
    console.print(sockets)
    _print_failures(s)


def _print_failures(s: dict) -> None:
    """Each distinct failure, once."""
    rows = [(f.get("case") or f.get("client"), f["failure"], f.get("count", 1)) for f in s["hostile"]["failures"]]
    rows += [(f"stream w{f['wave']} #{f['i']}", f["failure"], 1) for f in s["valid"]["failures"][:10]]
    rows += [(f"/health at {b['t_s']} s", f"{b['ms']} ms, status {b['status']} (control probe {b['control_ms']} ms); "
              f"in flight: {b['in_flight']}", 1)
             for b in s["health"]["bad"][:10]]
    if not rows:
        return
    t = Table(title="Failures")
    for col in ("what", "why", "count"):
        t.add_column(col)
    for what, why, n in rows:
        t.add_row(str(what), why[:300], str(n))
    console.print(t)
    log = s["server_log"]
    if log["tracebacks"]:
        console.print(f"server log: {log['tracebacks']} tracebacks; internal errors {dict(log['internal_errors'])}; "
                      f"exceptions {log['exceptions']}")


PHASE_COLOURS = {"warm-up": "#f4f4f4", "baseline": "#dddddd", "attack": "#ffd8b0", "settle": "#d0e8ff"}


def plot(path: Path, probes: list, res: Results, t0: float) -> None:
    """Health-probe latency over time, phases shaded, the 100 ms limit, coordinator RSS on a second axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for k, (name, a, b) in enumerate(res.phases):
        ax.axvspan(a - t0, b - t0, color=PHASE_COLOURS.get(name, "#eeeeee"), alpha=0.6, lw=0)
        ax.text((a + b) / 2 - t0, 0.97 - 0.06 * (k % 2), name, transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=9)
    for wave in sorted({r["wave"] for r in res.streams}):
        first = min(r["start"] for r in res.streams if r["wave"] == wave)
        n = sum(r["wave"] == wave for r in res.streams)
        ax.axvline(first - t0, color="#9467bd", ls=":", lw=1)
        ax.text(first - t0, 0.80, f" {n} streams", transform=ax.get_xaxis_transform(), color="#9467bd", fontsize=8)
    ok = [(p[0] - t0, p[1] * 1e3) for p in probes if p[2] == 200]
    bad = [(p[0] - t0, p[1] * 1e3) for p in probes if p[2] != 200]
    ax.plot([p[0] - t0 for p in probes], [p[3] * 1e3 for p in probes], ".", ms=1.5, color="#999999",
            label="control probe (trivial server)")
    ax.plot([x for x, _ in ok], [y for _, y in ok], ".", ms=2, color="#1f77b4", label="/health latency (200)")
    if bad:
        ax.plot([x for x, _ in bad], [y for _, y in bad], "x", color="red", label="/health not 200")
    ax.axhline(HEALTH_LIMIT_S * 1e3, color="red", ls="--", lw=1, label="100 ms")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the prober started")
    ax.set_ylabel("/health latency (ms)")
    if res.rss:
        ax2 = ax.twinx()
        ax2.plot([r[0] - t0 for r in res.rss], [r[1] / 2 ** 20 for r in res.rss], color="#2ca02c", lw=1.2,
                 label="coordinator RSS")
        ax2.set_ylabel("coordinator RSS (MB)")
        ax2.legend(loc="lower right", fontsize=8)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("tandem serve 1P+1D under hostile input: /health probes and coordinator memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_raw(path: Path, probes: list, res: Results, t0: float) -> None:
    """Every probe, request and sample, times in seconds since the prober started (for a closer look)."""
    def rel(rows: list[dict]) -> list[dict]:
        return [{**r, **{k: round(r[k] - t0, 4) for k in ("start", "end") if k in r}} for r in rows]
    raw = {"probes": [(round(t - t0, 4), round(lat * 1e3, 2), st, round(c * 1e3, 2)) for t, lat, st, c in probes],
           "hostile": rel(res.hostile), "streams": rel(res.streams), "frames": rel(res.frames), "slow": res.slow,
           "rss": [(round(t - t0, 2), r) for t, r in res.rss]}
    path.write_text(json.dumps(raw, default=str))


def machine() -> dict:
    """Where the run ran."""
    return {"cpu": describe_host().cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# ---------------------------------------------------------------------------- main
def run(cfg: Config) -> int:
    """The whole run; 0 if every acceptance condition holds, else 1."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    res, log_path = Results(), cfg.out / "server.log"
    with tempfile.TemporaryDirectory(prefix="tandem-hostile-") as tmp:
        console.print("making a tiny model and starting tandem serve 1P+1D ...")
        make_model(Path(tmp) / "model")
        cases = build_cases()
        server = Server(Path(tmp) / "model", log_path, cfg.body_timeout_s, cfg.server_env)
        prober, stop_info, facts, probes = None, {}, None, []
        try:
            console.print(f"server healthy after {server.wait_healthy():.1f} s: {server.url}")
            prober = Prober(cfg, server.port, Path(tmp) / "probes.json")
            t0 = time.monotonic()
            if cfg.client_nice:
                os.nice(cfg.client_nice)          # after the server and the prober started: they keep theirs
            facts = asyncio.run(session(server, cfg, cases, res, prober.proc.pid))
        finally:
            probes = prober.stop() if prober else []
            stop_info = server.stop()
    if facts is None:
        return 1
    s = summarize(cfg, res, probes, facts, stop_info, server_log_summary(log_path), t0)
    s.update(machine=machine(), command=" ".join(["python", "benchmarks/hostile_run.py", *sys.argv[1:]]),
             server_command=server.command)
    conds = conditions(s)
    s["conditions"] = [{"condition": n, "met": ok, "measured": d} for n, ok, d in conds]
    (cfg.out / "results.json").write_text(json.dumps(s, indent=1, default=str))
    write_raw(cfg.out / "raw.json", probes, res, t0)
    plot(cfg.out / "health.png", probes, res, t0)
    print_report(s, conds)
    console.print(f"results: {cfg.out / 'results.json'}, plot: {cfg.out / 'health.png'}, server log: {log_path}")
    failed = [n for n, ok, _ in conds if not ok]
    for n in failed:
        console.print(f"[red]FAILED[/]: {n}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    try:
        return run(parse_args(argv))
    except KeyboardInterrupt:
        console.print("interrupted; the server was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
