"""The hostile-input run's raw HTTP exchanges, hostile cases and their judging, and the slow clients."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache


from tandem.server.http_protocol import HEADER_TIMEOUT_S
# benchmarks/ is the script's directory (benchmarks/hostile_run.py)
from hostile_config import CHAT, COMP, HOST, MAX_ERROR_BODY, USER, Config, Results


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
